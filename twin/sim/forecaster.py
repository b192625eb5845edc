"""The simulator's `Forecaster`: fork an instance exactly, give its requests their *predicted* lengths, run forward.

Block-style routers ask "what would this instance do with this request added?" A fork (twin.engine.fork)
copies the engine state; each request in it is then given the length the world predicted for it at arrival
(`RequestView.predicted_output_tokens`; the client's cap or the recent mean when no predictor is set), never
its true length unless the predictor is the oracle. Policies reach this only through the `Forecaster`
protocol in twin.policy.views.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from typing import Callable, Mapping

import numpy as np

from twin.sim.api_server import ApiServer
from twin.engine.fork import EngineFork, _fork_request, fork_instance
from twin.engine.request import Request
from twin.perf.base import StepBatch
from twin.perf.roofline import RooflineModel
from twin.policy.views import Forecast, RequestView

# a fork's clock adds durations to the time it resumed from, so it can land an ulp or so off the ends a lower
# bound reads; a forecast is cut off only when the bound passes its horizon by more than this (relative)
_BOUND_MARGIN = 1e-9


def _predicted(view: RequestView | None, fallback: float) -> float:
    if view is not None and view.predicted_output_tokens is not None:
        return view.predicted_output_tokens
    if view is not None and view.max_tokens is not None:
        return view.max_tokens
    return fallback


def apply_predicted_lengths(f: EngineFork, lengths: Mapping[int, float] | Callable[[int], float | None]) -> None:
    """Replace each forked request's stop length by its prediction (never below what it already produced).

    `lengths` maps a request index to its predicted output length, or is a function of the index giving it
    (None: no prediction, the request keeps its length)."""
    s = f.scheduler
    g = s.group
    predict = lengths if callable(lengths) else lengths.get
    member_output = g.member_output
    heap = []  # the decode group's finish heap is keyed by each member's stop length: rebuilt
    seq = g.heap_seq
    for r in s.running:
        x = predict(r.idx)
        if r.in_decode:
            if x is not None:
                done = member_output(r)
                r.stop_at_tokens = max(int(math.ceil(x)), done + 1)
            seq += 1
            r.heap_seq = seq
            heap.append((r.d_base + r.stop_at_tokens - r.out_base, seq, r))
        elif x is not None:
            r.stop_at_tokens = max(int(math.ceil(x)), r.num_output_tokens + 1)
    for r in s.waiting:
        x = predict(r.idx)
        if x is not None:
            done = member_output(r) if r.in_decode else r.num_output_tokens
            r.stop_at_tokens = max(int(math.ceil(x)), done + 1)
    for r, _t in s.inbox:  # async: reached the engine, not yet seen by a decision; its true length stays hidden too
        x = predict(r.idx)
        if x is not None:
            r.stop_at_tokens = max(int(math.ceil(x)), r.num_output_tokens + 1)
    g.heap_seq = seq
    heapq.heapify(heap)
    g.finish_heap = heap


class SimForecaster:
    """Per-candidate look-ahead over the cluster's instances, for routers and scalers."""

    EXTRA = -1  # the index the extra request gets inside a fork

    def __init__(self, cluster, default_output_tokens: float = 256.0, horizon_s: float = 60.0) -> None:
        self._cluster = cluster
        self.default_output_tokens = default_output_tokens
        self.horizon_s = horizon_s
        self.calls = 0
        self.cut_short = 0  # forecasts answered from the lower bound, without a fork
        self._fallback_at: tuple = (None, None, 0.0)  # (now, completions seen, the mean then)
        self._prefill_s: dict[int, float] = {}  # id(step model) -> seconds per prompt token in a long prefill
        self._min_step: dict[int, float] = {}  # id(step model) -> the least time a step can take (0: unknown)
        self._bounds: tuple = (None, None, {})  # (now, the extra request, instance -> first-token bound)
        self._entries: dict[str, float] = {}  # instance -> when the extra request would reach it, same key

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

    def _fork(self, instance_id: str) -> tuple[EngineFork, list]:
        """An exact fork with predicted lengths in place of true ones, and the requests still on their way
        to it (in the API server) as (engine time, request) to arrive in the fork."""
        inst = self._cluster.by_id[instance_id]
        f = fork_instance(inst, self._cluster.env.now, finish_heap=False)  # rebuilt by apply_predicted_lengths
        transit = sorted(((t, _fork_request(r, {})) for r, t in self._cluster.in_transit.get(instance_id, {}).values()),
                         key=lambda x: x[0])
        fallback = self._fallback()
        get = self._cluster.dispatcher.inflight.get

        def predict(idx: int) -> float | None:
            """This instance's requests only, looked up as the fork meets them (the fleet's map holds all);
            `_predicted` written out (a call per forked request)."""
            rec = get(idx)
            if rec is None:
                return None
            view = rec[0]
            if view is None:
                return fallback
            x = view.predicted_output_tokens
            if x is not None:
                return x
            x = view.max_tokens
            return x if x is not None else fallback

        for _, r in transit:
            x = predict(r.idx)
            if x is not None:
                r.stop_at_tokens = max(1, int(math.ceil(x)))
        apply_predicted_lengths(f, predict)
        return f, transit

    def first_token_bound(self, instance_id: str, extra_request: RequestView) -> float:
        """An engine time the extra request's first token cannot come before, read without forking: the later
        of when it reaches the engine (`api_entry_s`) and the end of the work in progress that an arrival
        cannot join (the step in flight; a decode run is cut as `EngineCore.add_request` cuts it at the first
        arrival, the request's own or one still in the API server, so what is decided runs on first), plus
        the shortest step the step model can take (`_min_step_s`). `estimates`
        keeps what it read for the decision's forecasts (same clock, same request: nothing moves in between)."""
        at, req, memo = self._bounds
        if at == self._cluster.env.now and req is extra_request:
            b = memo.get(instance_id)
            if b is not None:
                return b
        return self._first_token_bound(instance_id, extra_request)

    def _min_step_s(self, perf) -> float:
        """A time no step with a token in it takes less than, or 0 where the step model does not say.

        Only for the roofline (`RooflineModel.step_time`, read as written): a step's time is its GPU groups
        plus the CPU term `host_time_s(requests)`, and async scheduling hides at most that CPU term
        (`AsyncScheduler.step_duration`), so a step lasts at least its GPU groups; each group grows with the
        batch, so no step's are below those of one decode token over an empty context (its KV read is one
        token's; a prefill reads at least two)."""
        v = self._min_step.get(id(perf))
        if v is None:
            v = 0.0
            if type(perf) is RooflineModel:
                v = perf.step_time(StepBatch(num_decode_tokens=1, decode_context_tokens=0)) - perf.host_time_s(1)
                v = max(0.0, v * (1 - 1e-6))  # a hair under: the engine's sums round
            self._min_step[id(perf)] = v
        return v

    def _entry_s(self, instance_id: str, extra_request: RequestView) -> float:
        """`api_entry_s` for the extra request, as `estimates` read it for this decision when it did."""
        at, req, _memo = self._bounds
        if at == self._cluster.env.now and req is extra_request:
            t = self._entries.get(instance_id)
            if t is not None:
                return t
        return self._cluster.api_entry_s(instance_id, extra_request.num_prompt_tokens)

    def _first_token_bound(self, instance_id: str, extra_request: RequestView) -> float:
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
        if tail is not None and tail[2][tail[0] - 1] > end:
            end = tail[2][tail[0] - 1]
        run = core.pending_run
        if run is not None:
            k, _d, ends, _t0 = run
            j = min(bisect_left(ends, t_first) + (2 if core.scheduler.async_scheduling else 1), k)
            if ends[j - 1] > end:
                end = ends[j - 1]
        # the request's own step starts no earlier (a later decision) and produces its first token at its end
        return end + self._min_step_s(inst.perf)

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

    def estimates(self, instance_ids, extra_request: RequestView) -> dict[str, float]:
        """A cheap guess (seconds from now) at when the extra request's first token would come on each
        instance, without forking: the lower bound (`first_token_bound`) plus the prompt tokens queued ahead
        of it (waiting, part-prefilled, in the inbox or the API server) at the step model's prefill rate.
        Block forecasts candidates in this order, so the best is found early and later forks stop sooner."""
        cl = self._cluster
        now = cl.env.now
        out = {}
        bounds = {}
        self._entries = {}
        for iid in instance_ids:
            inst = cl.by_id[iid]
            ahead = inst.scheduler.inflight_prefill_tokens()
            for r, _t in cl.in_transit.get(iid, {}).values():
                ahead += r.num_prompt_tokens
            b = bounds[iid] = self._first_token_bound(iid, extra_request)
            out[iid] = b - now + ahead * self._prefill_per_token(inst.perf)
        self._bounds = (now, extra_request, bounds)
        return out

    def _engine_request(self, view: RequestView) -> Request:
        out = max(1, int(math.ceil(_predicted(view, self._fallback()))))
        return Request(self.EXTRA, self._cluster.env.now, view.num_prompt_tokens, out, list(view.prefix), -1)

    def forecast(self, instance_id: str, extra_request: RequestView | None = None,
                 horizon_s: float | None = None, until: str = "finish") -> Forecast:
        self.calls += 1
        if extra_request is not None and horizon_s is not None and until in ("first_token", "finish"):
            # the first token (so the finish) cannot come before this: past the horizon, the fork would
            # report it censored, so it is not made (no steps, no KV peak to report)
            now = self._cluster.env.now
            horizon = now + horizon_s
            if self.first_token_bound(instance_id, extra_request) > horizon + _BOUND_MARGIN * max(1.0, abs(horizon)):
                self.cut_short += 1
                return Forecast(instance_id, censored=True)
        f, transit = self._fork(instance_id)
        now = f.now
        horizon = now + (self.horizon_s if horizon_s is None else horizon_s)
        x = self.EXTRA
        log = f.sink
        cl = self._cluster
        arrivals = list(transit)
        if extra_request is not None:
            # the engine sees the request after the API server's work, as in the cluster
            # (behind the requests queued in its API server: twin.sim.api_server)
            arrivals.append((self._entry_s(instance_id, extra_request),
                             self._engine_request(extra_request)))
        arrivals.sort(key=lambda a: a[0])  # stable: the extra request after any in transit at the same time
        for t_in, r in arrivals:
            f.arrive(r, t_in)
        if until == "first_token" and extra_request is not None:
            stop = lambda: x in log.first_token_s  # noqa: E731
        elif until == "finish" and extra_request is not None:
            stop = lambda: x in log.finish_s  # noqa: E731
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
    receiving an equal share of the forecast arrivals (a balanced-router ASSUMPTION that keeps the decision
    cheap: the cost grows with the representatives' share of arrivals, not the fleet). Forecast arrivals are
    Poisson at the given rate with (prompt, output) pairs resampled from recent completions, or, with
    `oracle=True`, the workload's own future arrivals (an oracle: reports say so).
    """

    def __init__(self, cluster, representatives: int = 2, seed: int = 0) -> None:
        self._cluster = cluster
        self.representatives = representatives
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def _arrivals(self, now: float, horizon_s: float, rate: float, oracle: bool):
        cl = self._cluster
        if oracle:
            s = cl.stream
            lo, hi = np.searchsorted(s.arrival_s, [now, now + horizon_s])
            return s.arrival_s[lo:hi], s.prompt_tokens[lo:hi], s.output_tokens[lo:hi]
        recent = cl.dispatcher.signals.recent(now, 600.0)
        if not recent or rate <= 0:
            return np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64)
        n = self.rng.poisson(rate * horizon_s)
        t = np.sort(self.rng.uniform(now, now + horizon_s, n))
        pick = self.rng.integers(0, len(recent), n)
        return (t, np.array([recent[k].prompt_tokens for k in pick], dtype=np.int64),
                np.array([max(1, recent[k].output_tokens) for k in pick], dtype=np.int64))

    def attainment(self, n_instances: int, horizon_s: float, rate: float, slo, oracle: bool = False) -> float:
        """Share of forecast requests meeting every SLO bound if the fleet had `n_instances` active."""
        self.calls += 1
        cl = self._cluster
        now = cl.env.now
        t, p, o = self._arrivals(now, horizon_s, rate, oracle)
        if len(t) == 0 or n_instances <= 0:
            return 1.0 if len(t) == 0 else 0.0
        serving = [i for i in cl.instances if i.state in ("serving", "starting")]
        books = cl.dispatcher.bookkeeping
        serving.sort(key=lambda i: -books.load(i.id).requests)
        reps: list[tuple[EngineFork, list, float]] = []  # fork, its transit, when it can take requests
        sim = SimForecaster(cl)
        # each rep's API server as a FIFO queue from its backlog now (an approximation of processor sharing
        # for the forecast's arrivals), and its token rate now
        queues: list[tuple[ApiServer | None, float]] = []
        for inst in serving[:min(self.representatives, n_instances)]:
            f, transit = sim._fork(inst.id)
            ready = now if inst.state == "serving" else now + cl.fleet.startup_delay_s
            reps.append((f, transit, ready))
            srv = cl.api_servers.get(inst.id)
            queues.append((ApiServer(srv.rho_cap, "fifo", free_at=srv.backlog_end()[0]) if srv is not None else None,
                           inst.token_rate()))
        if n_instances > len(serving):  # a new instance: empty, serving after the start-up delay
            proto = cl.instances[0]
            fresh = EngineFork(_empty_like(proto.scheduler), proto.perf, now, proto.fast_forward,
                               proto.max_run_steps)
            reps.append((fresh, [], now + cl.fleet.startup_delay_s))
            queues.append((None, 0.0))
        share = [k for k in range(len(t)) if k % n_instances < len(reps)]  # round-robin share of the reps
        ok = total = 0
        api_tok = cl.api_token_s()
        for j, (f, transit, ready) in enumerate(reps):
            mine = [k for k in share if k % n_instances == j]
            arrivals = [(tt, r) for tt, r in transit]
            srv, rate = queues[j]
            if srv is None and cl.api_cap is not None:
                srv = ApiServer(cl.api_cap, "fifo")
            for k in mine:  # in arrival order: FIFO through the rep's API server (at today's token rate)
                t_send, raw = max(float(t[k]), ready), cl._api_request_s(int(p[k]))
                t_in = cl.api_handoff_s + (t_send + raw if srv is None or raw <= 0
                                           else srv.preprocess(t_send, raw, int(p[k]), api_tok, rate))
                arrivals.append((t_in, Request(-1 - k, float(t[k]), int(p[k]), int(o[k]), [], -1)))
            arrivals.sort(key=lambda a: a[0])
            for t_in, r in arrivals:
                f.arrive(r, t_in)
            f.advance(until=now + 4 * horizon_s)
            for k in mine:
                idx = -1 - k
                total += 1
                ft, fin = f.sink.first_token_s.get(idx), f.sink.finish_s.get(idx)
                if ft is None or fin is None:
                    continue
                ttft, e2e = ft + api_tok - t[k], fin + api_tok - t[k]
                tpot = (fin - ft) / (o[k] - 1) if o[k] > 1 else 0.0
                if ((slo.ttft_s is None or ttft <= slo.ttft_s) and (slo.e2e_s is None or e2e <= slo.e2e_s)
                        and (slo.tpot_s is None or tpot <= slo.tpot_s)):
                    ok += 1
        return ok / total if total else 1.0


def _empty_like(sched):
    """A scheduler of the same configuration with an empty pool and no requests."""
    from twin.engine.block_pool import BlockPool
    from twin.engine.fork import ForkLog
    from twin.engine.async_scheduler import make_scheduler

    pool = sched.pool
    return make_scheduler(sched.config, BlockPool(pool.num_gpu_blocks, pool.block_size, pool.enable_caching), sched.perf,
                     ForkLog())
