"""The simulator's `Forecaster`: fork an instance exactly, give its requests their *predicted* lengths, run forward.

Block-style routers ask "what would this instance do with this request added?" A fork (twin.engine.fork)
copies the engine state; each request in it is then given the length the world predicted for it at arrival
(`RequestView.predicted_output_tokens`), or without one or once past it the mean recent length above what it
made, within the client's cap (`twin.policy.predictors.expected_stop`), never its true length unless the
predictor is the oracle. Policies reach this only through the `Forecaster`
protocol in twin.policy.views.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left
from typing import Callable

import numpy as np

from twin.sim.api_server import ApiServer
from twin.engine.fork import EngineFork, _fork_request, fork_instance
from twin.engine.request import Request
from twin.perf.base import StepBatch
from twin.policy.predictors import ResidualLengths, expected_stop, within_context
from twin.policy.views import Forecast, RequestView
from twin.sim.floors import (_exact_model, decode_gpu_s, decode_steps_floor_s, fork_finish_floor, is_dense,
                             least_prompt_work, least_step_gpu_s, prefill_floor_s, prompt_pairs)

# a fork's clock adds durations to the time it resumed from, so it can land an ulp or so off the ends a lower
# bound reads; a forecast is cut off only when the bound passes its horizon by more than this (relative)
_BOUND_MARGIN = 1e-9


def apply_stop_lengths(f: EngineFork, stop: Callable[[int, int], int | None]) -> None:
    """Replace each forked request's stop length by `stop(index, tokens it made)` (None: it keeps its length)."""
    s = f.scheduler
    g = s.group
    member_output = g.member_output
    heap = []  # the decode group's finish heap is keyed by each member's stop length: rebuilt
    seq = g.heap_seq
    for r in s.running:
        if r.in_decode:
            x = stop(r.idx, member_output(r))
            if x is not None:
                r.stop_at_tokens = x
            seq += 1
            r.heap_seq = seq
            heap.append((r.d_base + r.stop_at_tokens - r.out_base, seq, r))
        else:
            x = stop(r.idx, r.num_output_tokens)
            if x is not None:
                r.stop_at_tokens = x
    for r in s.waiting:
        x = stop(r.idx, member_output(r) if r.in_decode else r.num_output_tokens)
        if x is not None:
            r.stop_at_tokens = x
    for r, _t in s.inbox:  # async: reached the engine, not yet seen by a decision; its true length stays hidden too
        x = stop(r.idx, r.num_output_tokens)
        if x is not None:
            r.stop_at_tokens = x
    g.heap_seq = seq
    heapq.heapify(heap)
    g.finish_heap = heap


def _queued_behind(s, queued: list, priority: int) -> bool:
    """Under vLLM's priority policy, does a request queued for the engine (waiting, in its inbox, or in transit
    before the extra one) have a larger priority value than the extra request, which would then be served first?"""
    inbox = (r for r, _t in s.inbox)
    return any(r.priority > priority for r in itertools.chain(s.waiting, inbox, queued))


def _queued_share(r: Request, stop: int, block_size: int) -> tuple[int, int, tuple[int, int], int, float]:
    """What a request queued for the engine (waiting, in its inbox or in the API server) adds to a finish bound, at
    its predicted `stop`: the blocks it may take at most, the most context it attends to, (its tokens, its decodes
    after its prompt), and the prompt tokens it computes at least with their attention pairs."""
    t = r.num_tokens
    w, pp = least_prompt_work(t, len(r.block_keys), block_size)
    return (r.num_prompt_tokens + stop) // block_size + 2, r.num_prompt_tokens + stop, \
        (t, stop - r.num_output_tokens - 1), w, pp


class SimForecaster:
    """Per-candidate look-ahead over the cluster's instances, for routers and scalers."""

    EXTRA = -1  # the index the extra request gets inside a fork

    def __init__(self, cluster, default_output_tokens: float = 256.0, horizon_s: float = 60.0) -> None:
        self._cluster = cluster
        self.default_output_tokens = default_output_tokens
        self.horizon_s = horizon_s
        self.calls = 0
        self.cut_short = 0  # forecasts answered from the lower bound, without a fork
        self.cut_in_fork = 0  # forks stopped once a floor on the extra request's finish passed the horizon
        self._fallback_at: tuple = (None, None, 0.0)  # (now, completions seen, the mean then)
        self._lengths_at: tuple = (None, None, 0)  # (the grid time, its ResidualLengths, builds)
        self._prefill_s: dict[int, float] = {}  # id(step model) -> seconds per prompt token in a long prefill
        self._bounds: tuple = (None, None, {})  # (now, the extra request, instance -> first-token bound)
        self._entries: dict[str, float] = {}  # instance -> when the extra request would reach it, same key
        self._ends: dict[str, float] = {}  # instance -> `_work_end` for the extra request, same key
        self._fbounds: tuple = (None, None, {})  # (now, the extra request, instance -> finish bound)
        self._least_step_s: dict[int, float] = {}  # id(step model) -> least_step_gpu_s
        self._held_memo: dict[str, tuple] = {}  # instance -> (its state's signature, `_held`)
        self._request_memo: tuple = (None, None, {})  # (now, the extra request, `_per_request`)
        # vLLM ends a request at max_model_len (`check_stop`: FINISHED_LENGTH_CAPPED): so do the lengths a fork runs to
        self._max_model_len = int(cluster.scenario.cluster.max_model_len())

    def _fallback(self) -> float:
        """The recent mean output length; kept while the clock and the completions are unchanged (a decision
        forks every candidate at one time, and the mean is over a 600 s window of completions)."""
        sig = self._cluster.dispatcher.signals
        now = self._cluster.env.now
        at, seen, value = self._fallback_at
        if at == now and seen == sig.total_completions:
            return value
        _, osl = sig.mean_lengths(now, 600.0)
        value = osl if osl is not None else self.default_output_tokens
        self._fallback_at = (now, sig.total_completions, value)
        return value

    LENGTHS_WINDOW_S = 600.0  # the recent completions whose lengths predict those of the requests in flight
    LENGTHS_EVERY_S = 10.0  # ... as of the last multiple of this: one sort per 10 s, the same for every forecaster
    LENGTHS_MAX = 4096  # ... at most this many, the latest (a bounded sort however long the window at any rate)

    def _lengths(self) -> ResidualLengths | None:
        """The lengths of the completions in the `LENGTHS_WINDOW_S` up to the last multiple of `LENGTHS_EVERY_S`
        (the latest `LENGTHS_MAX`; `ResidualLengths`; None when there are none), for the requests in flight with no
        prediction of their own, or past it. A snapshot on a fixed grid: sorting the window at every decision
        would cost a Block decision more than its forks, and any forecaster reads the same lengths at the same
        time."""
        now = self._cluster.env.now
        grid = math.floor(now / self.LENGTHS_EVERY_S) * self.LENGTHS_EVERY_S
        at, lengths, builds = self._lengths_at
        if at == grid:
            return lengths
        cut = grid - self.LENGTHS_WINDOW_S
        out = []
        for c in reversed(self._cluster.dispatcher.signals.completions):
            if c.t > grid:
                continue
            if c.t < cut or len(out) >= self.LENGTHS_MAX:
                break
            out.append(c.output_tokens)
        lengths = ResidualLengths(out) if out else None
        self._lengths_at = (grid, lengths, builds + 1)
        return lengths

    def _fork(self, instance_id: str) -> tuple[EngineFork, list]:
        """An exact fork with predicted lengths in place of true ones, and the requests still on their way
        to it (in the API server) as (engine time, request) to arrive in the fork."""
        inst = self._cluster.by_id[instance_id]
        f = fork_instance(inst, self._cluster.env.now, finish_heap=False)  # rebuilt by apply_stop_lengths
        transit = sorted(((t, _fork_request(r, {})) for r, t in self._cluster.in_transit.get(instance_id, {}).values()),
                         key=lambda x: x[0])
        stop = self._predictor()
        for _, r in transit:
            x = stop(r.idx, 0)
            if x is not None:
                r.stop_at_tokens = x
        apply_stop_lengths(f, stop)
        return f, transit

    def _predictor(self) -> Callable[[int, int], int | None]:
        """The stop length a fork gives a request in flight, by index and the tokens it made (None: no record,
        the request keeps its own length): `expected_stop`, its length predictor's prediction while that is
        ahead, else the mean recent length above what it made (`ResidualLengths`), within the client's cap.
        Until 2026-12-06 a request without a prediction ran to its cap, or without one to the recent mean, and
        one past the mean stopped at its next token: on steady Poisson load (`benchmarks/forecast_accuracy.py`,
        oracle arrivals) the fleet forecast read 3.6 points optimistic; the live shadow twin took the smaller of
        the cap and the mean."""
        fallback = self._fallback()
        get = self._cluster.dispatcher.inflight.get
        lengths = self._lengths()

        def stop(idx: int, done: int) -> int | None:
            """This instance's requests only, looked up as the fork meets them (the fleet's map holds all)."""
            rec = get(idx)
            if rec is None:
                return None
            view = rec[0]
            if view is None:
                return expected_stop(None, None, done, lengths, fallback)
            x = expected_stop(view.predicted_output_tokens, view.max_tokens, done, lengths, fallback)
            room = mml - view.num_prompt_tokens  # (conditionals: a builtin call each, per request per fork)
            return x if x <= room else (room if room > done else done + 1)

        mml = self._max_model_len
        return stop

    def first_token_bound(self, instance_id: str, extra_request: RequestView) -> float:
        """An engine time the extra request's first token cannot come before, read without forking: the later
        of when it reaches the engine (`api_entry_s`) and the end of the work in progress that an arrival
        cannot join (the step in flight; a decode run is cut as `EngineCore.add_request` cuts it at the first
        arrival, the request's own or one still in the API server, so what is decided runs on first), plus
        the least time the steps computing its prompt can take (`_prefill_floor_s`). `estimates`
        keeps what it read for the decision's forecasts (same clock, same request: nothing moves in between)."""
        b = self._kept(self._bounds, instance_id, extra_request)
        return b if b is not None else self._first_token_bound(instance_id, extra_request)

    def _kept(self, kept: tuple, instance_id: str, extra_request: RequestView, memo: dict | None = None) -> float | None:
        """A value read for this decision (`kept`: the clock and the request it was read for, and the values by
        instance, or those of `memo` under the same key), or None."""
        at, req, values = kept
        if at == self._cluster.env.now and req is extra_request:
            return (values if memo is None else memo).get(instance_id)
        return None

    def finish_bound(self, instance_id: str, extra_request: RequestView) -> float:
        """An engine time the extra request's last token cannot come before, read without forking (see
        `_finish_bound`); `estimates(..., until="finish")` keeps what it read for the decision's forecasts."""
        b = self._kept(self._fbounds, instance_id, extra_request)
        return b if b is not None else self._finish_bound(instance_id, extra_request)

    def _finish_bound(self, instance_id: str, extra_request: RequestView) -> float:
        """The later of two floors under the extra request's finish in the fork (its predicted length L, the
        instance's requests at their predicted lengths, as `_fork` gives them):

        - its first-token bound, then L - 1 decode steps of its own, each at least a lone decode's GPU time;
        - from the end of the work it cannot join (`_work_end`), the first L steps that start after it, each at
          least the GPU time of the decodes it must hold. That needs the schedule to keep every running decode
          in every step until it finishes, which holds when nothing can be preempted (the free blocks cover every
          request's growth to its predicted end, the queued, in-transit and extra ones whole) and the token
          budget covers the running decodes and the rest of the partial prefills (vLLM schedules the running
          list first, in order, and admits newcomers behind it: `Scheduler.schedule`). A decode with r tokens
          to go holds at least the first r - s of those steps, s counting the steps that may start before the
          end (the pending work's, and what the least step time leaves room for after it); its context grows
          by one a step. When the extra request and the requests queued ahead of it have seats, the prompt work
          ahead of it and its own is done within P steps (each step computes at least the budget the decodes
          leave, or one request's long-prefill share); it decodes in every later one, and those P steps add at
          least the prompts' least time (`prefill_floor_s`) less what the decodes in them can take (a step
          lasts at least as long as its prompt chunks alone and as its decodes alone).

        Only on the roofline and the fitted model (`decode_steps_floor_s`); elsewhere the first-token bound."""
        cl = self._cluster
        inst = cl.by_id[instance_id]
        perf = inst.perf
        first = self.first_token_bound(instance_id, extra_request)
        if not _exact_model(perf):
            return first
        n = extra_request.num_prompt_tokens
        out = self._output_tokens(extra_request)
        if out == 1:
            return first
        dense = is_dense(perf)
        s = inst.scheduler
        sync = not s.async_scheduling  # a step lasts its whole step_time (Scheduler.step_duration)
        # its own decodes alone: contexts n + 1 .. n + out - 1
        key = (id(perf), sync)
        memo = self._per_request(extra_request)
        alone = memo.get(key)
        if alone is None:
            alone = memo[key] = decode_steps_floor_s(
                perf, out - 1, out - 1, (out - 1) * n + out * (out - 1) / 2, dense, sync)
        own = first + alone
        cfg = s.config
        bs = s.block_size
        running = s.running
        budget = cfg.max_num_batched_tokens
        held = self._held(inst)
        if held is None:
            return own  # a partial prefill may leave a decode without budget for a step
        if cfg.long_prefill_token_threshold_adaptive and cfg.long_prefill_token_threshold > 0:
            return own  # the chunk cap moves with the queue: the step counts below read a fixed one
        left, partial, demand, most, work, pairs, most_work, waits = held
        waits = list(waits)
        stop = self._predictor()
        end = self._end_s(instance_id, extra_request)
        t_in = self._entry_s(instance_id, extra_request)
        # blocks the requests may still take, at most, and the most context all can attend to in one step (see
        # `_held`), with the extra request's and those in transit
        demand += (n + out) // bs + 2
        most += n + out
        ahead = len(waits)  # requests queued ahead of the extra one
        transit = cl.in_transit.get(instance_id, {})
        queued = [r for r, t in sorted(transit.values(), key=lambda x: x[1]) if t <= t_in]  # ties: ahead
        behind = [r for r, t in transit.values() if t > t_in]
        if s.priority_policy and _queued_behind(s, queued, extra_request.priority):
            return own  # it would be queued ahead of some: the reasoning below takes them as ahead of it
        for r in queued:
            x = stop(r.idx, 0)
            blocks, reach, wait, w, pp = _queued_share(r, r.stop_at_tokens if x is None else x, bs)
            demand += blocks
            most += reach
            waits.append(wait)
            ahead += 1
            most_work += r.num_tokens
            work += w
            pairs += pp
        for r in behind:
            x = stop(r.idx, 0)
            to = r.stop_at_tokens if x is None else x
            demand += (r.num_prompt_tokens + to) // bs + 2
            most += r.num_prompt_tokens + to
        if demand > s.pool.get_num_free_blocks() - s._watermark_blocks:
            return own  # something might be preempted
        # steps that may start before `end`, at most, and the decode steps done by then, at least. A decode run
        # in progress runs on to where the first arrival cuts it (`EngineCore.add_request`, as `_work_end` reads
        # it), every one of its steps holding every decode (its members are the group's, none finishes before its
        # end); steps off its plan (after it, or after the step in flight) start later, each lasting at least the
        # least step time.
        core = inst.core
        now = cl.env.now
        started = done_by_end = 0
        t_ref = now
        if core.pending_step is not None:
            started += 1
            t_ref = max(t_ref, core.pending_step[1])
        tail = core.pending_tail
        if tail is not None:
            started += tail[0]
            t_ref = max(t_ref, tail[1][tail[0] - 1])
        run = core.pending_run
        if run is not None:
            k, ends, _t0 = run
            t_first = t_in
            for _r, t in transit.values():
                if t < t_first:
                    t_first = t
            j = min(bisect_left(ends, t_first) + (2 if s.async_scheduling else 1), k)
            started += j
            done_by_end = j
            t_ref = max(t_ref, ends[j - 1])
        # Steps off the plan may start before the end; when prompts are queued or part-computed they may compute
        # some of them, so the steps are then counted from `t_ref` instead, the extra request seen `lead` later.
        origin, lead = end, 0
        if end > t_ref:
            least = self._least_step_s.get(id(perf))
            if least is None:
                least = self._least_step_s[id(perf)] = least_step_gpu_s(perf)
            if least <= 0.0:
                return own
            gap = math.ceil((end - t_ref) / least)
            if most_work:
                origin, lead = t_ref, gap
            else:
                started += gap
        # the first `out` steps after the origin: the running decodes' share (steps 1 .. k of each)
        each: list[tuple[int, int]] = []  # every decode's span (an MoE model's floor counts decodes a step)
        head = tokens = 0
        ctx = 0.0
        for go, c in left:
            k = go - started
            if k <= 0:
                continue
            if k > out:
                k = out
            tokens += k
            ctx += k * (c + done_by_end) + k * (k - 1) / 2
            if k > head:
                head = k
            if not dense:
                each.append((1, k))
        spans = [(1, head)] if head else []
        prefill = 0.0
        thr = cfg.long_prefill_token_threshold
        late = 3 if s.async_scheduling else 2  # a request seen, or its prompt done, by step i decodes by i + late
        if cfg.enable_chunked_prefill:
            # a partial prefill's prompt is done within the steps its share of the budget (what the running
            # decodes leave, the partials before it taken first) needs, then it decodes every step
            room = budget - len(running)
            w = 0
            for i, (rest, t, d) in enumerate(partial):
                w += rest
                p_i = 0 if not rest else (-(-w // room) if thr <= 0 or thr >= room else -(-w // thr) + i + 1)
                a, b = p_i + late, min(d, out)
                if b >= a:
                    k = b - a + 1
                    tokens += k
                    ctx += k * (t + 1) + k * (k - 1) / 2
                    spans.append((a, b))
            # so does a queued one, seen by step `lead` + `late`, once it has a seat (those before it in the queue
            # decode then too, and leave less budget)
            for q, (t, d) in enumerate(waits):
                if len(running) + q >= s.max_active or room - q < 1:
                    break
                w += t
                p_q = -(-w // (room - q)) if thr <= 0 or thr >= room - q else -(-w // thr) + len(partial) + q + 1
                a, b = lead + p_q + late, min(d, out)
                if b >= a:
                    k = b - a + 1
                    tokens += k
                    ctx += k * (t + 1) + k * (k - 1) / 2
                    spans.append((a, b))
        if cfg.enable_chunked_prefill and len(running) + ahead < s.max_active:
            chunk = budget - len(running) - ahead  # what the decodes ahead of the extra one leave, every step
            if chunk >= 1:
                total = most_work + n
                if 0 < thr < chunk:  # a step finishes a request's prompt or computes at least `thr` tokens
                    p_steps = -(-total // thr) + len(s.prefilling) + ahead + 1
                else:
                    p_steps = -(-total // chunk)
                u = late + lead + p_steps - 1  # its prefill is done by step u
                k = out - u
                if k > 0:  # it decodes in steps u + 1 .. out, contexts n + 1 ..
                    tokens += k
                    ctx += k * n + k * (k + 1) / 2
                    spans.append((u + 1, out))
                    # its prompt's steps last at least its chunks alone, and hold at most the others' decodes;
                    # without a long-prefill share a step gives it budget only once the prompts ahead are done, so
                    # it has at most one step more than its chunks (the first, shared); and the prompts ahead and
                    # its own are all in steps 1 .. u (none is computed before the origin)
                    w, pp = least_prompt_work(n, len(extra_request.prefix), extra_request.prefix_block_size)
                    others = len(running) + ahead + len(behind)
                    if thr <= 0 or most_work == 0:
                        x_steps = -(-n // (chunk if thr <= 0 or thr >= chunk else thr)) + (1 if most_work else 0)
                        top = decode_gpu_s(perf, others, most - n - out) if others else 0.0
                        prefill = self._prefill_floor_s(perf, extra_request) - x_steps * top
                    if most_work:
                        top = decode_gpu_s(perf, others + 1, most)
                        prefill = max(prefill, prefill_floor_s(perf, w + int(work), pp + pairs) - u * top)
        # the steps holding at least one of those decodes
        steps = 0
        reach = 0
        for a, b in sorted(spans):
            if b > reach:
                steps += b - max(a - 1, reach)
                reach = b
        return max(own, origin + decode_steps_floor_s(perf, steps, tokens, ctx, dense, sync, each + (spans[1:] if head else spans))
                   + max(0.0, prefill))

    def _held(self, inst) -> tuple | None:
        """What `_finish_bound` reads of an instance's own requests, whatever the extra one: each running decode's
        (tokens to go, context now), each partial prefill's (prompt to go, tokens, decodes after it), each queued
        request's (tokens, decodes after its prompt) in queue order, the blocks they may still take at most (each
        decode's growth, the rest whole), the most context they can attend to in one step (each at its predicted
        end), and the prompt tokens ahead (least, with the most prefix hits, with their attention pairs, and at
        most); None when a partial prefill may leave a decode without budget for a step (below). Kept while the engine
        and the predictions are unchanged (the engine's clock, steps, queues, decode group and free blocks, the
        fallback length)."""
        s = inst.scheduler
        core = inst.core
        g = s.group
        fallback = self._fallback()
        self._lengths()  # (its build count below: the predictions change when it is rebuilt)
        sig = (core.now, s.stats.num_steps, g.group_step, g.num_decode, len(s.running), len(s.waiting), len(s.inbox),
               len(s.prefilling), s.pool.get_num_free_blocks(), fallback, self._lengths_at[0], core.pending_step,
               core.pending_run, core.pending_tail)
        hit = self._held_memo.get(inst.id)
        if hit is not None and hit[0] == sig:
            return hit[1]
        bs = s.block_size
        running = s.running
        work = pairs = 0.0
        most_work = 0
        for r in s.prefilling:
            c0, t = r.num_computed_tokens, r.num_tokens
            most_work += t - c0
            work += t - c0
            pairs += prompt_pairs(t, c0)
        out: tuple | None = None
        cfg = s.config
        pre = s.prefilling
        # Every running decode gets its token each step when the budget covers them and the partial prefills (a
        # decode behind one may be left without budget), or, without a long-prefill threshold, when the partial
        # prefills are the tail of the running list: a prompt is left partial only when it took the step's whole
        # budget, so whatever is admitted after it is admitted behind it (`Scheduler._schedule_running_fast`), and
        # the decodes ahead of them are served first.
        if len(running) + most_work <= cfg.max_num_batched_tokens or (
                len(running) <= cfg.max_num_batched_tokens and cfg.long_prefill_token_threshold <= 0
                and running[len(running) - len(pre):] == pre):
            predict = self._predictor()
            member_output = g.member_output
            demand = most = 0
            left: list[tuple[int, int]] = []
            partial: list[tuple[int, int, int]] = []
            for r in running:
                if r.in_decode:
                    done = member_output(r)
                    x = predict(r.idx, done)
                    stop = r.stop_at_tokens if x is None else x
                    go = stop - done
                    demand += go // bs + 2
                    left.append((go, r.num_prompt_tokens + done))
                else:
                    x = predict(r.idx, r.num_output_tokens)
                    stop = r.stop_at_tokens if x is None else x
                    demand += (r.num_prompt_tokens + stop) // bs + 2
                    partial.append((r.num_tokens - r.num_computed_tokens, r.num_tokens,
                                    stop - r.num_output_tokens - 1))
                most += r.num_prompt_tokens + stop
            waits: list[tuple[int, int]] = []
            for q in (s.waiting, [r for r, _t in s.inbox]):
                for r in q:
                    x = predict(r.idx, r.num_output_tokens)
                    blocks, reach, wait, w, pp = _queued_share(r, r.stop_at_tokens if x is None else x, bs)
                    demand += blocks
                    most += reach
                    waits.append(wait)
                    most_work += r.num_tokens
                    work += w
                    pairs += pp
            out = (left, partial, demand, most, work, pairs, most_work, tuple(waits))
        self._held_memo[inst.id] = (sig, out)
        return out

    def _prefill_floor_s(self, perf, extra_request: RequestView) -> float:
        """A time the extra request's own steps take at least, from when the first of them starts to its first
        token, or 0 where the step model does not say (`prefill_floor_s`), of the least prompt work the prefix
        cache leaves it (`least_prompt_work`); kept for the decision."""
        key = (id(perf), "prefill")
        memo = self._per_request(extra_request)
        v = memo.get(key)
        if v is None:
            w, pp = least_prompt_work(extra_request.num_prompt_tokens, len(extra_request.prefix),
                                      extra_request.prefix_block_size)
            v = memo[key] = prefill_floor_s(perf, w, pp)
        return v

    def _per_request(self, extra_request: RequestView) -> dict:
        """Values that depend on the extra request and the step model only, kept for one decision (same clock,
        same request): every candidate of one step model shares them."""
        now = self._cluster.env.now
        at, req, memo = self._request_memo
        if at != now or req is not extra_request:
            memo = {}
            self._request_memo = (now, extra_request, memo)
        return memo

    def _entry_s(self, instance_id: str, extra_request: RequestView) -> float:
        """`api_entry_s` for the extra request, as `estimates` read it for this decision when it did."""
        t = self._kept(self._bounds, instance_id, extra_request, self._entries)
        return t if t is not None else self._cluster.api_entry_s(instance_id, extra_request.num_prompt_tokens)

    def _first_token_bound(self, instance_id: str, extra_request: RequestView) -> float:
        inst = self._cluster.by_id[instance_id]
        end = self._ends[instance_id] = self._work_end(instance_id, extra_request)
        return end + self._prefill_floor_s(inst.perf, extra_request)

    def _end_s(self, instance_id: str, extra_request: RequestView) -> float:
        """`_work_end` for the extra request, as `estimates` read it for this decision when it did."""
        t = self._kept(self._bounds, instance_id, extra_request, self._ends)
        return t if t is not None else self._work_end(instance_id, extra_request)

    def _work_end(self, instance_id: str, extra_request: RequestView) -> float:
        """The end of the work in progress that the extra request cannot join, and not before it reaches the
        engine: its own steps start no earlier (`first_token_bound`). Keeps its entry time in `_entries`."""
        cl = self._cluster
        inst = cl.by_id[instance_id]
        core = inst.core
        t_in = self._entries[instance_id] = cl.api_entry_s(instance_id, extra_request.num_prompt_tokens)
        t_first = t_in
        for _r, t in cl.in_transit.get(instance_id, {}).values():
            if t < t_first:
                t_first = t
        end = t_in
        step = core.pending_step
        if step is not None and step[1] > end:
            end = step[1]
        tail = core.pending_tail
        if tail is not None and tail[1][tail[0] - 1] > end:
            end = tail[1][tail[0] - 1]
        run = core.pending_run
        if run is not None:
            k, ends, _t0 = run
            j = min(bisect_left(ends, t_first) + (2 if core.scheduler.async_scheduling else 1), k)
            if ends[j - 1] > end:
                end = ends[j - 1]
        # the request's own steps start no earlier (a later decision); its first token comes at the last one's end
        return end

    def _prefill_per_token(self, perf) -> float:
        """Seconds per prompt token of a 2,048-token prefill step, from the instance's step model (0 if it
        cannot say): the rate at which queued prompts hold a newcomer back."""
        v = self._prefill_s.get(id(perf))
        if v is None:
            n = 2048
            try:
                v = float(perf.step_time(StepBatch(num_prefill_tokens=n, prefill_attn_tokens=n * (n + 1) / 2,
                                                   prefill_kv_read_tokens=n, num_prefill_sampled=1,
                                                   num_prefill_reqs=1))) / n
            except Exception:  # noqa: BLE001 - a step model without prefill batches: no queue term
                v = 0.0
            self._prefill_s[id(perf)] = v
        return v

    def estimates(self, instance_ids, extra_request: RequestView, until: str = "first_token") -> dict[str, float]:
        """A cheap guess (seconds from now) at when the extra request's first token (`until="finish"`: its
        last) would come on each instance, without forking: the lower bound (`first_token_bound`,
        `finish_bound`) plus the prompt tokens queued ahead of it (waiting, part-prefilled, in the inbox or the
        API server) at the step model's prefill rate. Block forecasts candidates in this order, so the best is
        found early and later forks stop sooner."""
        cl = self._cluster
        now = cl.env.now
        out = {}
        bounds = {}
        finish = {}
        self._entries = {}
        self._ends = {}
        self._bounds = (now, extra_request, bounds)
        for iid in instance_ids:
            inst = cl.by_id[iid]
            ahead = inst.scheduler.inflight_prefill_tokens()
            for r, _t in cl.in_transit.get(iid, {}).values():
                ahead += r.num_prompt_tokens
            b = bounds[iid] = self._first_token_bound(iid, extra_request)
            if until == "finish":
                b = finish[iid] = self._finish_bound(iid, extra_request)
            out[iid] = b - now + ahead * self._prefill_per_token(inst.perf)
        self._fbounds = (now, extra_request, finish)
        return out

    def _output_tokens(self, view: RequestView) -> int:
        """The output length the extra request runs to in a fork: as a request in flight that made nothing yet
        (`expected_stop`: its prediction, else the recent mean within its cap), at least one token, and no further
        than the context. Past it, a cache sized for max_model_len could not hold the request, and Block's fork
        raised "scheduler made no progress" (a live fuzzing pass: 5 blocks of 128 at max_model_len 512)."""
        x = expected_stop(view.predicted_output_tokens, view.max_tokens, 0, self._lengths(), self._fallback())
        room = self._max_model_len - view.num_prompt_tokens
        return x if x <= room else (room if room > 1 else 1)

    def _engine_request(self, view: RequestView) -> Request:
        return Request(self.EXTRA, self._cluster.env.now, view.num_prompt_tokens, self._output_tokens(view),
                       list(view.prefix), -1, view.priority)

    def _finish_stop(self, f: EngineFork, extra: Request, horizon: float) -> Callable[[], bool]:
        """`advance`'s stop test for a forecast to the extra request's finish with a horizon: its finish, or (looked
        at a few times, once it decodes) a floor on its finish past the horizon (`fork_finish_floor`), where the
        fork would run on only to report it censored."""
        log = f.sink
        x = self.EXTRA
        perf = f.perf
        dense = is_dense(perf)
        limit = horizon + _BOUND_MARGIN * max(1.0, abs(horizon))
        looks = [3]

        def stop() -> bool:
            if x in log.finish_s:
                return True
            if looks[0] and extra.in_decode:
                looks[0] -= 1
                floor = fork_finish_floor(f, extra, perf, dense)
                if floor is not None:
                    looks[0] = 0
                    if floor > limit:
                        self.cut_in_fork += 1
                        return True
            return False

        return stop

    def forecast(self, instance_id: str, extra_request: RequestView | None = None,
                 horizon_s: float | None = None, until: str = "finish") -> Forecast:
        self.calls += 1
        if extra_request is not None and horizon_s is not None and until in ("first_token", "finish"):
            # the first token (so the finish) cannot come before this: past the horizon, the fork would
            # report it censored, so it is not made (no steps, no KV peak to report)
            now = self._cluster.env.now
            horizon = now + horizon_s
            bound = (self.first_token_bound if until == "first_token" else self.finish_bound)(instance_id, extra_request)
            if bound > horizon + _BOUND_MARGIN * max(1.0, abs(horizon)):
                self.cut_short += 1
                return Forecast(instance_id, censored=True)
        f, transit = self._fork(instance_id)
        now = f.now
        horizon = now + (self.horizon_s if horizon_s is None else horizon_s)
        x = self.EXTRA
        log = f.sink
        cl = self._cluster
        arrivals = list(transit)
        extra = None
        if extra_request is not None:
            # the engine sees the request after the API server's work, as in the cluster
            # (behind the requests queued in its API server: twin.sim.api_server)
            extra = self._engine_request(extra_request)
            arrivals.append((self._entry_s(instance_id, extra_request), extra))
        arrivals.sort(key=lambda a: a[0])  # stable: the extra request after any in transit at the same time
        for t_in, r in arrivals:
            f.arrive(r, t_in)
        if until == "first_token" and extra is not None:
            stop = lambda: x in log.first_token_s  # noqa: E731
        elif until == "finish" and extra is not None:
            stop = self._finish_stop(f, extra, horizon) if horizon_s is not None else (lambda: x in log.finish_s)
        else:
            stop = None
        end = f.advance(until=horizon, stop=stop)
        shift = cl.api_token_s()  # tokens reach the client this much later
        ttft = log.first_token_s.get(x)
        fin = log.finish_s.get(x)
        ttft = None if ttft is None else ttft + shift
        fin = None if fin is None else fin + shift
        idle = not f.scheduler.has_unfinished_requests()
        # the drain time is when the last request ended, not the horizon the fork's clock idles on to
        drained = (f.drained_at if f.drained_at is not None else end) if idle else None
        wanted = {"first_token": ttft, "finish": fin, "drain": drained}.get(until)
        return Forecast(instance_id, None if ttft is None else ttft - now, None if fin is None else fin - now,
                        None if drained is None else drained - now, f.scheduler.stats.kv_peak_used_blocks,
                        wanted is None and (extra_request is not None or until == "drain"), f.steps)


class FleetForecaster:
    """Runs the fleet forward over a horizon with N instances: what the `twin` scaler asks before it acts.

    Each candidate fleet size is judged on a few representative instances (the most loaded existing ones,
    forked exactly, and a fresh one that serves after the start-up delay when the fleet would grow), each
    receiving an equal share of the forecast arrivals once it takes requests (a balanced-router ASSUMPTION that
    keeps the decision cheap: the cost grows with the representatives' share of arrivals, not the fleet; one with
    a backlog takes none until it has drained, `_backlog_free_at`). Forecast arrivals are
    Poisson at the given rate with (prompt, output) pairs resampled from recent completions, or (`arrivals=
    "pattern"`) the last horizon's observed arrivals stretched to the rate and repeated, as the live shadow twin
    forecasts; or, with `oracle=True`, the workload's own future arrivals (an oracle: reports say so).

    Every candidate of one decision sees the same forecast arrivals (common random numbers: drawn once per
    decision time, horizon and rate), so candidates differ by their fleet size only, not by their draw; each
    used to draw its own. With `target`, a candidate's run stops once its verdict against the target is known;
    with or without, a rep's run stops once each of its forecast requests is judged (an overloaded rep used to run
    its backlog on for four horizons: the `gain` rule's decisions at overload cost 0.85 -> 0.70 s, same answers).
    """

    CHECK_EVERY = 32  # arrivals (or engine steps while draining) between two looks at the verdict

    ARRIVALS = ("poisson", "pattern")

    def __init__(self, cluster, representatives: int = 2, seed: int = 0, arrivals: str = "poisson") -> None:
        if arrivals not in self.ARRIVALS:
            raise ValueError(f"arrivals must be poisson or pattern, got {arrivals!r}")
        self._cluster = cluster
        self.representatives = representatives
        self.arrivals = arrivals
        self.rng = np.random.default_rng(seed)
        self.calls = 0
        self.stopped_early = 0  # candidates whose run stopped once the verdict was known
        self._drawn: tuple | None = None  # (key, arrivals): this decision's forecast arrivals
        self._sim = SimForecaster(cluster)  # forks the reps; one for every call (its length snapshot is kept)

    def _arrivals(self, now: float, horizon_s: float, rate: float, oracle: bool):
        """The forecast arrivals (times, prompts, outputs) over the horizon: drawn once for every candidate
        of a decision (common random numbers)."""
        key = (now, horizon_s, rate, oracle, self._cluster.dispatcher.signals.total_completions)
        if self._drawn is not None and self._drawn[0] == key:
            return self._drawn[1]
        t, p, o = self._draw(now, horizon_s, rate, oracle)  # a recent prompt drawn with another's output:
        out = (t, p, within_context(p, o, self._cluster.scenario.cluster.max_model_len()))  # it ends at the context
        self._drawn = (key, out)
        return out

    def _draw(self, now: float, horizon_s: float, rate: float, oracle: bool):
        cl = self._cluster
        if oracle:
            s = cl.stream
            lo, hi = np.searchsorted(s.arrival_s, [now, now + horizon_s])
            return s.arrival_s[lo:hi], s.prompt_tokens[lo:hi], s.output_tokens[lo:hi]
        sig = cl.dispatcher.signals
        recent = sig.recent(now, 600.0)
        if not recent or rate <= 0:
            return np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64)
        if self.arrivals == "pattern":
            return self._pattern(sig, recent, now, horizon_s, rate)
        n = self.rng.poisson(rate * horizon_s)
        t = np.sort(self.rng.uniform(now, now + horizon_s, n))
        pick = self.rng.integers(0, len(recent), n)
        return (t, np.array([recent[k].prompt_tokens for k in pick], dtype=np.int64),
                np.array([max(1, recent[k].output_tokens) for k in pick], dtype=np.int64))

    def _pattern(self, sig, recent, now: float, horizon_s: float, rate: float):
        """The last horizon's observed arrivals (their times and prompts; the part observed, at the start),
        stretched to `rate` and repeated over the next horizon, outputs resampled from recent completions: the
        live shadow twin's `reshape`. Bursts stay bursts: Poisson arrivals at a bursty trace's mean rate
        forecast a queue it never has (a 15 s mean of 2.9 req/s hid 30 requests within 0.3 s)."""
        first = sig.observed_from()
        lo = max(now - horizon_s, first if first is not None else now)
        obs = []
        for t, p in reversed(sig.arrivals):
            if t < lo:
                break
            if t <= now:
                obs.append((t, p))
        span = now - lo
        if not obs or span <= 0:
            return np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64)
        obs.reverse()
        offs = np.array([t - lo for t, _ in obs])
        prompts = np.array([p for _, p in obs], dtype=np.int64)
        scale = (len(obs) / span) / rate  # times stretched: the pattern's mean rate becomes `rate`
        period = span * scale
        reps = max(1, math.ceil(horizon_s / period))
        t = np.concatenate([offs * scale + k * period for k in range(reps)])
        keep = np.flatnonzero(t < horizon_s)
        t, p = now + t[keep], np.tile(prompts, reps)[keep]
        pick = self.rng.integers(0, len(recent), len(t))
        return t, p, np.array([max(1, recent[k].output_tokens) for k in pick], dtype=np.int64)

    def attainment(self, n_instances: int, horizon_s: float, rate: float, slo, oracle: bool = False,
                   target: float | None = None) -> float:
        """Share of forecast requests meeting every SLO bound if the fleet had `n_instances` active.

        With `target`, the run stops as soon as the answer's side of `target` is known, and the value is a
        bound on that side: at least `target` (the share already met) once enough requests met the SLO, or
        under it (the share not yet missed) once too many missed it (a first token later than the TTFT
        bound, or a finished request over a bound). `value >= target` is then the exact verdict."""
        self.calls += 1
        cl = self._cluster
        now = cl.env.now
        t, p, o = self._arrivals(now, horizon_s, rate, oracle)
        if len(t) == 0 or n_instances <= 0:
            return 1.0 if len(t) == 0 else 0.0
        # the candidate fleet in the order the planner keeps it: serving instances by load (the least loaded
        # drain first), then starting ones by when they serve (cancelled first), then new ones
        books = cl.dispatcher.bookkeeping
        delay = cl.fleet.startup_delay_s
        lifetimes = cl.fleet.lifetimes
        serving = sorted((i for i in cl.instances if i.state == "serving"), key=lambda i: -books.load(i.id).requests)
        starting = sorted(((max(now, lifetimes[i.id].created_s + delay) if i.id in lifetimes else now + delay, i)
                           for i in cl.instances if i.state == "starting"), key=lambda x: x[0])
        existing = [(now, i) for i in serving] + starting
        ready = [r for r, _ in existing[:n_instances]] + [now + delay] * max(0, n_instances - len(existing))
        reps: list[tuple[EngineFork, list, float]] = []  # fork, its transit, when it can take requests
        rep_pos: list[int] = []  # each rep's place in the fleet's order
        sim = self._sim
        # each rep's API server as a FIFO queue from its backlog now (an approximation of processor sharing
        # for the forecast's arrivals), and its token rate now
        queues: list[tuple[ApiServer | None, float]] = []
        for pos, (at, inst) in enumerate(existing[:min(self.representatives, n_instances)]):
            f, transit = sim._fork(inst.id)
            reps.append((f, transit, at))
            rep_pos.append(pos)
            srv = cl.api_servers.get(inst.id)
            queues.append((ApiServer(srv.rho_cap, "fifo", free_at=srv.backlog_end()[0]) if srv is not None else None,
                           inst.token_rate()))
        if n_instances > len(existing):  # a new instance: empty, serving after the start-up delay
            proto = cl.instances[0]
            fresh = EngineFork(_empty_like(proto.scheduler), proto.perf, now, proto.fast_forward,
                               proto.max_run_steps)
            reps.append((fresh, [], now + delay))
            rep_pos.append(len(existing))
            queues.append((None, 0.0))
        nr = len(reps)
        # round-robin over the instances taking requests when one arrives: none goes to one still starting (the
        # router sees only serving ones) unless none serves yet (then all wait for their instance), nor to one
        # still working off a backlog (`_backlog_free_at`)
        k_all = np.arange(len(t))
        rate_each = cl.dispatcher.signals.completion_rate(now, 60.0) / max(1, len(serving))
        takes = np.asarray(_backlog_free_at(ready, [books.load(i.id).requests for i in serving][:n_instances],
                                            rate_each, now))
        order = np.argsort(takes, kind="stable")
        avail = np.searchsorted(takes[order], t, side="right")
        where = order[np.where(avail > 0, k_all % np.maximum(avail, 1), k_all % n_instances)]
        shares = [np.flatnonzero(where == pos).tolist() for pos in rep_pos]
        total = sum(len(m) for m in shares)
        api_tok = cl.api_token_s()
        ttft_b, e2e_b, tpot_b = slo.ttft_s, slo.e2e_s, slo.tpot_s
        tt, oo = t.tolist(), o.tolist()

        def meets(k: int, ft: float, fin: float) -> bool:
            ttft, e2e = ft + api_tok - tt[k], fin + api_tok - tt[k]
            tpot = (fin - ft) / (oo[k] - 1) if oo[k] > 1 else 0.0
            return ((ttft_b is None or ttft <= ttft_b) and (e2e_b is None or e2e <= e2e_b)
                    and (tpot_b is None or tpot <= tpot_b))

        ok = missed = 0  # judged so far, over the reps run so far
        for j, (f, transit, ready) in enumerate(reps):
            mine = shares[j]
            arrivals = [(tt_, r) for tt_, r in transit]
            srv, tok_rate = queues[j]
            if srv is None and cl.api_cap is not None:
                srv = ApiServer(cl.api_cap, "fifo")
            for k in mine:  # in arrival order: FIFO through the rep's API server (at today's token rate)
                t_send, raw = max(tt[k], ready), cl._api_request_s(int(p[k]))
                t_in = cl.api_handoff_s + (t_send + raw if srv is None or raw <= 0
                                           else srv.preprocess(t_send, raw, int(p[k]), api_tok, tok_rate))
                arrivals.append((t_in, Request(-1 - k, tt[k], int(p[k]), int(o[k]), [], -1)))
            arrivals.sort(key=lambda a: a[0])
            # the rep's run stops once the answer is known, or once each of its requests is judged (a judgement
            # is final: what the fork does after it changes no count)
            verdict = _Verdict(f, mine, tt, meets, ttft_b, api_tok, ok, missed, total, target)
            for m, (t_in, r) in enumerate(arrivals):
                f.arrive(r, t_in)
                if m % self.CHECK_EVERY == self.CHECK_EVERY - 1 and verdict.decided():
                    break
            if not verdict.done:
                f.advance(until=now + 4 * horizon_s, stop=verdict.every(self.CHECK_EVERY))
            stopped = verdict.known  # before the rep's run ended
            ok, missed = verdict.finish()
            if verdict.known:
                if stopped or j < nr - 1:
                    self.stopped_early += 1
                return verdict.value()
        return ok / total if total else 1.0


def _backlog_free_at(ready: list[float], loads: list[int], rate_each: float, now: float) -> list[float]:
    """When each instance of a forecast fleet takes requests: `ready` (now, or when a starting or new one serves),
    later for a serving one (the first `len(loads)`, requests in flight in `loads`) with a backlog.

    A balanced router (least-outstanding, the shipped default) sends an instance nothing while it has more requests
    in flight than the others; with the others near the serving fleet's mean, it rejoins once its surplus over
    that mean has drained at `rate_each`, the fleet's completions per second per serving instance over the last
    minute. Before this, the forecast gave every serving instance an equal share from now on: a backlog kept
    missing its share of forecast requests, so every added instance looked like a gain and a fleet behind a backlog
    saw its target out of reach. On the runs of `benchmarks/scaler_short.py` the twin scaler then paid 8-53 % more
    GPU-seconds for the same SLO attainment. No completions yet (nothing to measure a rate from): `ready` as it
    is."""
    if not loads or rate_each <= 0:
        return list(ready)
    mean = sum(loads) / len(loads)
    out = list(ready)
    for pos, load in enumerate(loads):
        if load > mean:
            out[pos] = max(out[pos], now + (load - mean) / rate_each)
    return out


class _Verdict:
    """A rep's forecast requests judged while its fork runs: met (finished within every bound) or missed (a
    first token after the TTFT bound, a finished request over a bound), and whether the candidate's answer
    against the target is already known from the counts over all reps."""

    def __init__(self, f: EngineFork, mine: list[int], tt: list[float], meets, ttft_b: float | None,
                 api_tok: float, ok: int, missed: int, total: int, target: float | None) -> None:
        self.f = f
        self.mine = mine  # this rep's requests, in arrival order
        self.next = 0  # mine[:next] have arrived at the API server (judged or pending)
        self.pending: list[int] = []  # arrived, not judged yet
        self.tt = tt
        self.meets = meets
        self.ttft_b, self.api_tok = ttft_b, api_tok
        self.ok, self.missed, self.total, self.target = ok, missed, total, target
        self.known = False

    def _judge(self) -> None:
        f = self.f
        fts, fins = f.sink.first_token_s, f.sink.finish_s
        # first tokens still to come are recorded at the clock or later, unless a decode run or its cut tail
        # is pending (its tokens are committed later, at their earlier times): only then is `now` a bound
        clock = f.now if f.pending_run is None and f.pending_tail is None else None
        bound, api_tok, tt, meets = self.ttft_b, self.api_tok, self.tt, self.meets
        mine, j, now = self.mine, self.next, f.now
        while j < len(mine) and tt[mine[j]] <= now:  # none later has a record yet (nor a late first token)
            j += 1
        todo = self.pending + mine[self.next:j]
        self.next = j
        keep = []
        ok = missed = 0
        for k in todo:
            idx = -1 - k
            fin = fins.get(idx)
            ft = fts.get(idx)
            if fin is not None:
                if ft is not None and meets(k, ft, fin):
                    ok += 1
                else:
                    missed += 1
                continue
            # the TTFT as `meets` computes it; a first token still to come is at `clock` or later
            if bound is not None and ((ft is not None and ft + api_tok - tt[k] > bound)
                                      or (ft is None and clock is not None and clock + api_tok - tt[k] > bound)):
                missed += 1
                continue
            keep.append(k)
        self.pending = keep
        self.ok += ok
        self.missed += missed

    def _side(self) -> bool:
        self.known = self.target is not None and side_bound(self.ok, self.missed, self.total, self.target) is not None
        return self.known

    @property
    def done(self) -> bool:
        """Nothing left to learn from this rep's run: the answer is known, or each of its requests is judged."""
        return self.known or (self.next == len(self.mine) and not self.pending)

    def decided(self) -> bool:
        """Judges what the fork has recorded; True once the rep's run may stop (`done`)."""
        self._judge()
        self._side()
        return self.done

    def every(self, n: int):
        """A stop test for `advance` that looks every `n` steps."""
        count = [0]

        def stop() -> bool:
            count[0] += 1
            return count[0] % n == 0 and self.decided()

        return stop

    def finish(self) -> tuple[int, int]:
        """The counts with this rep done: at the end of its run every pending request is judged (unfinished
        ones miss)."""
        if not self.known:
            self._judge()
            self.missed += len(self.pending) + len(self.mine) - self.next
            self.pending, self.next = [], len(self.mine)
            self._side()
        return self.ok, self.missed

    def value(self) -> float:
        """A bound on the side of the target the answer is on (see FleetForecaster.attainment)."""
        bound = side_bound(self.ok, self.missed, self.total, self.target)
        assert bound is not None, "value() of a verdict not known"
        return bound


def side_bound(ok: int, missed: int, total: int, target: float) -> float | None:
    """Attainment's bound once its side of `target` is known from `ok` met and `missed` of `total` requests: the
    share met (at least `target`), or the share not yet missed (under it); None while either side is possible. The
    simulator's and the live twin scaler's verdicts (`live.shadow.WindowVerdict`). Compared as shares, as the
    scaler compares the value: counts against target x total round (0.55 x 100 = 55.000000000000007, so 55 not yet
    missed read as under 0.55 and came back as 0.55)."""
    if total <= 0:
        return None
    if ok / total >= target:
        return ok / total
    if (total - missed) / total < target:
        return (total - missed) / total
    return None


def _empty_like(sched):
    """A scheduler of the same configuration with an empty pool and no requests."""
    from twin.engine.block_pool import BlockPool
    from twin.engine.fork import ForkLog
    from twin.engine.async_scheduler import make_scheduler

    pool = sched.pool
    return make_scheduler(sched.config, BlockPool(pool.num_gpu_blocks, pool.block_size, pool.enable_caching), sched.perf,
                     ForkLog())
