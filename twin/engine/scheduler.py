"""One engine's scheduler, modelled on vLLM V1 (`vllm/v1/core/sched/scheduler.py`), FCFS or priority policy.

Each step gives every running request tokens so its computed tokens catch up with its tokens: running
requests first in admission order (decodes 1 token, a partial prefill its next chunk), then waiting
requests are admitted while the token budget, `max_num_seqs` and KV blocks allow. When blocks run out,
the most recently admitted request is preempted (recompute) and goes back to the front of the queue.

The waiting queue is a deque, as vLLM's `FCFSRequestQueue` (`vllm/v1/core/sched/request_queue.py`) is one;
preempted requests go back to its front. Under vLLM's priority policy (`--scheduling-policy priority`,
`SchedulerConfig.policy`) the deque is kept sorted as `PriorityRequestQueue` pops (`_queue`), and the victim
is the running request with the largest (priority, arrival time), wherever it stands (`_priority_victim`).

Decoding requests advance in lockstep, so they form one decode group (twin/engine/decode_group.py): a step
costs O(1) for all decodes, and `plan_decode_run` can advance k homogeneous decode steps at once (the
fast-forward; it stays here because it asks admission's questions without changing state). Output blocks are
cached as they fill, as vLLM's `allocate_slots` caches every block full within the tokens it schedules.

Async scheduling is `AsyncScheduler` (twin/engine/async_scheduler.py), a subclass, as in vLLM; `make_scheduler`
picks the class from the config. The methods it overrides are the points where the two differ.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Callable


from twin.engine.block_pool import BlockPool
from twin.engine.decode_group import DecodeGroup, _by_run_seq
from twin.engine.kv_cache_manager import KVCacheManager, kv_cache_manager
from twin.engine.request import Request, RequestStatus
from twin.perf.base import StepTimeModel
from twin.perf.fitted import closed_form_decode
from twin.engine.output import SchedulerOutput
from twin.engine.sink import EngineSink
from twin.engine.stats import EngineStats


@dataclass
class SchedulerConfig:
    """vLLM's scheduler knobs, by their vLLM names."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    # vLLM 0.32: the threshold floored at the budget's fair share, max_num_batched_tokens // requests
    long_prefill_token_threshold_adaptive: bool = False
    enable_chunked_prefill: bool = True
    scheduler_reserve_full_isl: bool = True  # vLLM 0.32 admission gate: room for the whole sequence
    watermark: float = 0.0
    async_scheduling: bool = False  # vLLM's AsyncScheduler + batch queue (see `Scheduler` docstring)
    policy: str = "fcfs"  # vLLM's `SchedulerConfig.policy` (`--scheduling-policy`): "fcfs" or "priority"
    # vLLM 0.32's admission limit into RUNNING (`--max-num-active-seqs`, <= max_num_seqs); None: max_num_seqs
    max_num_active_seqs: int | None = None


def _priority_key(r: Request) -> tuple[int, float, int]:
    """vLLM's priority order (`Request.__lt__`): lower priority value first, then earlier arrival, then id."""
    return (r.priority, r.arrival_time, r.idx)


def _priority_victim(running: list[Request]) -> int:
    """Index of the request vLLM preempts under the priority policy: the first with the largest (priority,
    arrival time) in running order (`max(self.running, key=...)` in `Scheduler.schedule`)."""
    best = 0
    r = running[0]
    bp = r.priority
    ba = r.arrival_time
    for j in range(1, len(running)):
        q = running[j]
        if q.priority > bp or (q.priority == bp and q.arrival_time > ba):
            best = j
            bp = q.priority
            ba = q.arrival_time
    return best


class RefusedHead:
    """The queue head when admission last refused it, and the engine state then: while none of it changed
    (free blocks only fell), it stays refused, so a decode run may go on without asking again."""

    def __init__(self, request: Request, num_running: int, num_decode: int, free_blocks: int,
                 num_registrations: int) -> None:
        self.request = request
        self.num_running = num_running
        self.num_decode = num_decode
        self.free_blocks = free_blocks
        self.num_registrations = num_registrations


class Scheduler:
    """Waiting queue, running list, decode group and KV cache of one engine; vLLM's synchronous scheduler."""


    def __init__(self, config: SchedulerConfig, pool: BlockPool, perf: StepTimeModel,
                 sink: EngineSink) -> None:
        self.config = config
        self.pool = pool
        # lookups, caching and frees, for either pool (twin/engine/kv_cache_manager.py): the per-block
        # `BlockPool` (the reference) or the range pool `SegmentPool` (same schedules, tested)
        self.kv: KVCacheManager = kv_cache_manager(pool)
        self.perf = perf
        self.sink = sink  # told every request and step event (twin.engine.sink); never written to here
        self.wants_steps: bool = bool(getattr(sink, "wants_steps", False))
        self.block_size = pool.block_size
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        if config.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy {config.policy!r}: vLLM's are fcfs and priority")
        self.priority_policy: bool = config.policy == "priority"
        # admission into the running list (vLLM's `max_num_active_reqs`): max_num_active_seqs, else max_num_seqs
        self.max_active: int = config.max_num_active_seqs or config.max_num_seqs
        self.prefilling: list[Request] = []  # running requests not in the decode group, running order
        self.group = DecodeGroup(self.block_size, pool.enable_caching)  # the decoding requests, in lockstep
        self._run_seq = 0
        self.stats = EngineStats()
        self._watermark_blocks = int(config.watermark * pool.num_gpu_blocks)
        self.refused_head: RefusedHead | None = None  # the queue head as it was last refused (the fast-forward)
        # async scheduling (see the module docstring)
        self.async_scheduling: bool = self._is_async()
        if config.async_scheduling and not self.async_scheduling:
            raise ValueError("async_scheduling: build the scheduler with make_scheduler (an AsyncScheduler)")
        self._reg_lag: int = 1 if self.async_scheduling else 0  # decode steps output caching lags by
        self.inbox: list[tuple[Request, float]] = []  # (request, time it reached the engine), not yet visible
        self.finishing: list[Request] = []  # finished in the last step, blocks held through the next schedule
        self.next_decision_t: float = 0.0  # start of the step in flight: when the next decision is made
        self.prev_gpu_s: float = 0.0  # GPU time of the step in flight, which the next step's CPU hides behind
        # the planned decode run's step-model times and host time: step s's GPU time is run_x[s] - run_c; with a
        # closed-form step model (`closed_form_decode`) run_x stays empty and the times come from run_params
        self.run_x: list[float] = []
        self.run_c: float = 0.0
        self._closed_form: bool = closed_form_decode(perf)
        self.run_params: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        # `perf.decode_params` by number of decodes: a generic call into the step model once per size, not per run
        # (the closed-form models are fixed once built; a fork starts its own)
        self.decode_params_memo: dict[int, tuple[float, float, float, float]] = {}
        # async: blocks the planned run's first step took at its decision, before the last step's finishers were
        # freed (-1: none taken; the commit takes every step's blocks)
        self.run_first_taken: int = -1
        self._host_s: Callable[[int], float] | None = getattr(perf, "host_time_s", None)

    # ---------------------------------------------------------------------------------------------
    def add_request(self, r: Request, now: float = 0.0) -> None:
        """The request reaches the engine at `now`; under async scheduling it waits in `inbox` until a
        decision made after `now` (vLLM drains its input queue only before `schedule()`)."""
        r.status = RequestStatus.WAITING
        self.kv.prepare(r)
        self._enqueue(r, now)
        self.sink.request_queued(r, now)

    def _enqueue(self, r: Request, now: float) -> None:
        self._queue(r)

    def _queue(self, r: Request, preempted: bool = False) -> None:
        """Into the waiting queue where vLLM's request queue (`vllm/v1/core/sched/request_queue.py`) puts it: FCFS
        at the back, a preempted request at the front (`prepend_request`); priority where `PriorityRequestQueue`
        pops it, by (priority, arrival time, request id) (`Request.__lt__`, `vllm/v1/request.py`), preempted or not."""
        w = self.waiting
        if self.priority_policy:
            w.insert(bisect_left(w, _priority_key(r), key=_priority_key), r)
        elif preempted:
            w.appendleft(r)
        else:
            w.append(r)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting) or bool(self.inbox)

    def _is_async(self) -> bool:
        return False

    # -- the step loop's boundary (twin.engine.core calls these; AsyncScheduler does the batch queue's work) --
    def begin_step(self, now: float) -> None:
        """At a step boundary, before the decision (the batch queue's: an idle engine starts afresh, and
        requests that reached the engine by the decision's time become visible)."""

    def after_schedule(self, out: SchedulerOutput) -> bool:
        """Right after `schedule()`; True if an empty decision should be made again now (something changed)."""
        return False

    def is_idle(self) -> bool:
        """Nothing running or queued: the next arrival starts the engine afresh."""
        return not self.running and not self.waiting

    def step_duration(self, out: SchedulerOutput) -> float:
        """The step's wall time: the step model's, less (async) the CPU hidden behind the step before it."""
        return self.perf.step_time(out.batch())

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_usable_blocks - self.pool.get_num_free_blocks()

    def inflight_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: queued requests plus the rest of partial prefills."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting) + sum(
            r.num_tokens - r.num_computed_tokens for r in self.prefilling) + sum(
            r.num_tokens for r, _ in self.inbox)

    # -- the decode group --------------------------------------------------------------------------
    def _register_member(self, r: Request, d: int) -> None:
        """A member's decode at group counter `d` fills a block: cache it (vLLM caches up to num_tokens)."""
        self.kv.cache_blocks(r, r.num_prompt_tokens + r.out_base + d - r.d_base)
        if r.next_reg >= len(r.block_keys):
            self.group.drop_reg(r)

    # -- admission helpers -------------------------------------------------------------------------
    def _admission_plan(self, r: Request, budget: int, thr: int) -> tuple[int, int, int] | None:
        """(hit keyed blocks, hit own-run blocks, chunk tokens) if Phase B would admit `r` now, else None.

        No state changes: the fast-forward asks this too.
        """
        cfg = self.config
        bs = self.block_size
        hk, own, free_hits = self.kv.lookup(r)
        hit_blocks = hk + own
        n = r.num_tokens - hit_blocks * bs
        if 0 < thr < n:
            n = thr
        if not cfg.enable_chunked_prefill and n > budget:
            return None
        n = budget if budget < n else n  # min(n, budget), without a builtin call (pure Python)
        if cfg.scheduler_reserve_full_isl:  # vLLM 0.32: room for the whole current sequence
            total = -(-r.num_tokens // bs)
        else:
            total = -(-(hit_blocks * bs + n) // bs)
        required = total - hit_blocks + free_hits + (self._watermark_blocks if self.running else 0)
        if required > self.pool.get_num_free_blocks():
            return None
        return hk, own, n

    def _can_admit_head(self, budget: int, thr: int) -> bool:
        """Would Phase B admit the head of the queue now? (No state changes.)"""
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_active:
            return False
        return self._admission_plan(self.waiting[0], budget, thr) is not None

    # -- preemption --------------------------------------------------------------------------------
    def _preempt(self, r: Request, out: SchedulerOutput, scheduled: bool = False) -> None:
        """Recompute preemption; `scheduled`: a decode member given its token earlier in this step, whose slot's
        block (and the block that token completes, cached) it holds, as vLLM's `allocate_slots` left them."""
        in_flight = 0
        if r.status is RequestStatus.FINISHED:  # async: finished in the step in flight, not yet freed
            self.finishing.remove(r)
            self.kv.free(r, preempted=False)
            r.num_preemptions += 1
            self.stats.num_preemptions += 1
            self.sink.request_preempted(r)
            out.preempted.append(r)
            return
        if r.in_decode:
            in_flight = self._tokens_in_flight(r)
            self.group.leave(r)
            if scheduled:
                r.num_computed_tokens += 1
                r.num_blocks = -(-r.num_computed_tokens // self.block_size)
        else:
            self.prefilling.remove(r)
            if r.num_output_tokens > 0 and r.last_output_time < 0:
                r.last_output_time = self.group.group_last_out
        self.kv.free(r, preempted=True, in_flight=in_flight)
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.sink.request_preempted(r)
        self._queue(r, preempted=True)
        out.preempted.append(r)

    def _unschedule(self, r: Request, out: SchedulerOutput) -> int:
        """Preempt `r`, scheduled earlier in this step (priority policy); returns the tokens it had been given.

        vLLM's `Scheduler.schedule` gives them back to the budget and frees every block `allocate_slots` gave it,
        this step's too; the blocks that allocation cached stay cached, as there."""
        if r.status is RequestStatus.FINISHED:  # async: finished in the step in flight, it got nothing
            self._preempt(r, out)
            return 0
        if r.in_decode:
            self._preempt(r, out, True)
            return 1
        for j, (q, n, _c) in enumerate(out.prefills):
            if q is r:
                del out.prefills[j]
                self._preempt(r, out)
                return n
        raise AssertionError(f"{r} was not scheduled in this step")

    def _tokens_in_flight(self, r: Request) -> int:
        """A decode member's computed tokens whose output is not known yet (async: the step in flight's)."""
        return 0

    # -- one step ----------------------------------------------------------------------------------
    def _decision_time(self, now: float) -> float:
        """When vLLM made the decision for the step starting now (its SCHEDULED time)."""
        return now

    def schedule(self, now: float) -> SchedulerOutput:
        """vLLM's `schedule()`: Phase A over running, Phase B over waiting if nobody was preempted.

        `now` is when the step starts; under async scheduling vLLM decided it at `next_decision_t`, the start
        of the step before (its SCHEDULED time), and the next decision is made now."""
        cfg = self.config
        out = SchedulerOutput(t_start=now)
        out.t_decided = self._decision_time(now)
        budget = cfg.max_num_batched_tokens
        thr = self._long_prefill_threshold()

        # Phase A, fast path: no preemption needed, so the running list need not be walked.
        if not self._schedule_running_fast(budget, thr, out):
            budget = self._schedule_running_exact(budget, thr, out)
        else:
            budget -= out.num_decode + sum(n for _, n, _ in out.prefills)

        # Phase B: admit waiting requests, only if nobody was preempted.
        if not out.preempted:
            self._admit(budget, thr, now, out)
        return out

    def _long_prefill_threshold(self) -> int:
        """This step's cap on a prompt chunk (`Scheduler.schedule`): none for a lone request, which has nobody to
        starve; with `long_prefill_token_threshold_adaptive`, at least the budget's fair share per request."""
        cfg = self.config
        n = len(self.running) + len(self.waiting)
        thr = cfg.long_prefill_token_threshold if n > 1 else 0
        if thr > 0 and cfg.long_prefill_token_threshold_adaptive:
            share = cfg.max_num_batched_tokens // n
            if share > thr:
                thr = share
        return thr

    def _schedule_running_fast(self, budget: int, thr: int, out: SchedulerOutput) -> bool:
        """Schedule Phase A at group level when the outcome provably equals the exact walk.

        That holds when every request gets its full want within the budget, or when the partial
        prefills are the tail of the running list (always so without a long-prefill threshold), so the
        decodes go first and the prefills split what is left in order; and in both cases only if the
        free blocks cover it all, so nobody is preempted. Returns False to fall back to the exact walk.
        """
        bs = self.block_size
        nd = self.group.num_decode
        need = self.group.phase_count[(-self.group.group_step) % bs] if nd else 0
        pre = self.prefilling
        wants = []
        tot = nd
        for r in pre:
            n = r.num_tokens - r.num_computed_tokens
            if 0 < thr < n:
                n = thr
            wants.append(n)
            tot += n
        if tot > budget:
            if not pre or self.running[-len(pre):] != pre:
                return False
            left = budget - nd
            for i, n in enumerate(wants):
                n = min(n, left)
                wants[i] = n
                left -= n
        for r, n in zip(pre, wants):
            if n:
                need += -(-(r.num_computed_tokens + n) // bs) - r.num_blocks
        if need > self.pool.get_num_free_blocks():
            return False
        self.pool.allocate(need)
        out.num_decode = nd
        out.decode_context = self.group.decode_context
        group_step = self.group.group_step - self._reg_lag  # the group counter whose output blocks are cached now
        cross = self.group.crossing(group_step) if self.group.num_reg_members else []
        ci = 0
        for r, n in zip(pre, wants):
            if n:
                while ci < len(cross) and cross[ci].run_seq < r.run_seq:  # registrations in running order
                    self._register_member(cross[ci], group_step)
                    ci += 1
                self._schedule_chunk(r, n, out)
        for m in cross[ci:]:
            self._register_member(m, group_step)
        return True

    def _schedule_chunk(self, r: Request, n: int, out: SchedulerOutput) -> None:
        c = r.num_computed_tokens
        r.num_blocks = -(-(c + n) // self.block_size)
        r.num_computed_tokens = c + n
        if r.next_reg < len(r.block_keys):
            self.kv.cache_blocks(r, c + n)
        out.prefills.append((r, n, c))

    def _schedule_running_exact(self, budget: int, thr: int, out: SchedulerOutput) -> int:
        """Phase A request by request, in running order, preempting from the back when blocks run out.

        Allocations are batched (`pending`) but flushed before any preemption frees blocks, so the
        pool sees allocations and releases in vLLM's order. Decode members cost one comparison each.
        """
        bs = self.block_size
        pool = self.pool
        running = self.running
        target = (-self.group.group_step) % bs  # a member needs a new block this step iff its phase equals this
        reg_d = self.group.group_step - self._reg_lag  # async: the block a member's known tokens fill lags one step
        fills = (-reg_d - 1) % bs  # ... and caches a filled one iff its phase equals this
        free = pool.get_num_free_blocks()
        pending = 0
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            if r.status is RequestStatus.FINISHED:  # async: finished in the step in flight, gets nothing
                i += 1
                continue
            if r.in_decode:
                n = 1
                nb = 1 if r.phase == target else 0
            else:
                n = r.num_tokens - r.num_computed_tokens
                if 0 < thr < n:
                    n = thr
                if n > budget:
                    n = budget
                nb = -(-(r.num_computed_tokens + n) // bs) - r.num_blocks
            if nb > free - pending:
                pool.allocate(pending)
                pending = 0
                self_preempted = False
                while nb > pool.get_num_free_blocks():
                    if self.priority_policy:
                        v = _priority_victim(running)
                        victim = running[v]
                        del running[v]
                        if v < i:  # scheduled earlier in this step: its tokens go back to the budget
                            i -= 1
                            budget += self._unschedule(victim, out)
                            continue
                    else:
                        victim = running.pop()
                    self._preempt(victim, out)
                    if victim is r:
                        self_preempted = True
                        break
                free = pool.get_num_free_blocks()
                if self_preempted:
                    break
            pending += nb
            if r.reg_pending and r.phase == fills:
                self._register_member(r, reg_d)
            if not r.in_decode:
                pool.allocate(pending)
                free -= pending
                pending = 0
                self._schedule_chunk(r, n, out)
            budget -= n
            i += 1
        pool.allocate(pending)
        skipped_ctx = 0
        left = [r for r in running[i:] if r.in_decode]
        if len(left) < self.group.num_decode:
            for r in left:  # each falls one step behind the group
                skipped_ctx += r.num_prompt_tokens + self.group.member_output(r)
                self.group.skip(r)
        else:  # no member got a token (a preemption stopped the walk first): the group, counter and all, waits
            skipped_ctx = self.group.decode_context
        out.skipped.extend(left)
        out.num_decode = self.group.num_decode - len(out.skipped)
        out.decode_context = self.group.decode_context - skipped_ctx
        return budget

    def _admit(self, budget: int, thr: int, now: float, out: SchedulerOutput) -> None:
        cfg = self.config
        bs = self.block_size
        pool = self.pool
        sink = self.sink
        while budget > 0 and self.waiting:
            if len(self.running) >= self.max_active:
                break
            r = self.waiting[0]
            plan = self._admission_plan(r, budget, thr)
            if plan is None:
                break  # head-of-line blocking, as in vLLM: no skipping ahead
            hk, own, n = plan
            hit_blocks = hk + own
            hit_tokens = hit_blocks * bs
            self.waiting.popleft()
            if hk:
                self.kv.touch_prefix(r, hk)
            if r.own_run is not None:
                if own:
                    pool.touch_run(r.own_run, own)
                r.own_run = None
            r.num_blocks = hit_blocks
            r.next_reg = hk
            new = -(-(hit_tokens + n) // bs) - hit_blocks
            pool.allocate(new)
            r.num_computed_tokens = hit_tokens
            if r.num_cached_tokens < 0:  # first admission: vLLM records SCHEDULED and prefix stats
                r.num_cached_tokens = hit_tokens
                sink.request_scheduled(r, out.t_decided, hit_tokens)
                self.stats.prefix_cache_queries += r.num_prompt_tokens
                self.stats.prefix_cache_hits += hit_tokens
            r.status = RequestStatus.RUNNING
            sink.request_running(r)
            self._run_seq += 1
            r.run_seq = self._run_seq
            self.running.append(r)
            self.prefilling.append(r)
            self._schedule_chunk(r, n, out)
            budget -= n

    def update_from_output(self, out: SchedulerOutput, t_end: float) -> list[Request]:
        """After the step ran: tokens out, stops checked, finished requests freed. Returns the finished."""
        stats = self.stats
        dt = t_end - out.t_start
        stats.num_steps += 1
        stats.busy_time_s += dt
        used = self.num_used_blocks
        stats.kv_used_block_seconds += used * dt
        if used > stats.kv_peak_used_blocks:
            stats.kv_peak_used_blocks = used
        if self.wants_steps:
            self.sink.step(out, t_end, used)
        finished: list[Request] = []

        if out.num_decode:
            n_stale_out = 0
            if self.group.stale:
                skipped = set(out.skipped)
                for r, last in list(self.group.stale.items()):
                    if r not in skipped:
                        stats.itl.add(t_end - last, 1)
                        del self.group.stale[r]
                        n_stale_out += 1
            stats.itl.add(t_end - self.group.group_last_out, out.num_decode - n_stale_out)
            stats.generated_tokens += out.num_decode
            self.group.group_last_out = t_end
            self.group.group_step += 1
            self.group.decode_context += out.num_decode
            finished = self.group.pop_finished()

        for r, n, c in out.prefills:
            if r.status is not RequestStatus.RUNNING or r.num_computed_tokens != r.num_tokens:
                continue
            r.num_output_tokens += 1
            stats.generated_tokens += 1
            if r.first_token_time < 0:
                r.first_token_time = t_end
                self.sink.first_token(r, t_end)
            else:
                stats.itl.add(t_end - r.last_output_time, 1)
            self.prefilling.remove(r)
            if r.num_output_tokens >= r.stop_at_tokens:
                r.num_computed_tokens = r.num_tokens - 1
                r.last_output_time = t_end
                finished.append(r)
            else:
                self.group.join(r, t_end)

        if len(finished) > 1:  # vLLM's order, not the finish heap's (see `_finish`)
            finished.sort(key=_by_run_seq)
        for r in finished:
            self._finish(r, t_end)
        return finished

    def _finish(self, r: Request, t_end: float) -> None:
        """Free a finished request; same-step finishers come here in running order, as in vLLM.

        vLLM's `Scheduler.update_from_output` (`vllm/v1/core/sched/scheduler.py`) walks the step's
        `num_scheduled_tokens`, which `schedule()` filled in running order (admission order, `run_seq`), and
        calls `_free_request` for each stopped request in that walk; `KVCacheManager.free` hands each request's
        blocks over tail first (`SingleTypeKVCacheManager.free`) and `BlockPool.free_blocks` appends the hashed
        ones to the free queue's tail. So the first finisher in running order is evicted first, whatever
        order the decode group's finish heap (join order) pops them in.
        """
        self._retire(r)
        r.status = RequestStatus.FINISHED
        self.sink.request_finished(r, t_end)

    def _retire(self, r: Request) -> None:
        """A finished request's blocks and seat are released now (async: after the next decision)."""
        self.kv.free(r, preempted=False)
        self.running.remove(r)

    # -- the fast-forward --------------------------------------------------------------------------
    def plan_decode_run(self, max_steps: int) -> int:
        """How many homogeneous decode-only steps can run from now without any decision changing.

        k < 2 means: take a normal step instead.
        """
        if self.prefilling or self.group.stale or not self.group.num_decode or self.inbox:
            return 0
        if self.finishing and not self._run_frees_finishers():
            return 0
        free = self.pool.get_num_free_blocks()
        if self.waiting and not self._head_stays_blocked(free):
            budget_left = self.config.max_num_batched_tokens - self.group.num_decode
            thr = self._long_prefill_threshold()
            if self._can_admit_head(budget_left, thr):
                return 0
            self.refused_head = RefusedHead(self.waiting[0], len(self.running), self.group.num_decode, free,
                                            self.kv.num_registrations)
        d_fin = self.group.next_finish()
        assert d_fin is not None  # every member has a live heap entry
        k = d_fin - self.group.group_step
        if max_steps < k:  # min(...): conditionals, not builtin calls, on this per-wake-up path (pure Python)
            k = max_steps
        if self.waiting and self.group.num_reg_members:
            h = self._steps_until_head_may_hit_more()
            if h < k:
                k = h
        bs = self.block_size
        if free < self.group.num_decode * -(-k // bs):  # some member may run out of blocks within k steps
            b = self.group.steps_until_blocks_run_out(free)
            if b < k:
                k = b
        return k if k >= 2 else 0

    def _run_frees_finishers(self) -> bool:
        """Async: may a decode run start while the last step's finishers still hold their blocks?

        Yes when nobody waits for a seat: their blocks and seats are freed right after the run's first decision
        (`release_finished`, as after any schedule), and that changes nothing the run's decisions read. The
        first step takes its blocks and caches its output blocks at the decision, before the frees
        (`AsyncScheduler.decode_run_plan`), so the same cached blocks are evicted as step by step. The run's
        block limit is reckoned on the free blocks before the frees: safe after."""
        return not self.waiting

    def _head_stays_blocked(self, free: int) -> bool:
        """The queue head was refused with at least as many free blocks and the same batch: still refused.

        Free blocks only shrink while the batch decodes, and evictions only shrink the head's hit; a
        registration since could have grown it.
        """
        b = self.refused_head
        return (b is not None and b.request is self.waiting[0] and b.num_running == len(self.running)
                and b.num_decode == self.group.num_decode and free <= b.free_blocks
                and b.num_registrations == self.kv.num_registrations)

    def _steps_until_head_may_hit_more(self) -> int:
        """Steps before a decode member caches the block the queue head misses first (its hit would grow).

        Keys are chained, so the head's hit grows only when its first uncached key is registered, and a
        member holding that key registers it at the same block index.
        """
        head = self.waiting[0]
        keys = head.block_keys
        if not keys or keys[0] not in self.group.reg_by_first_key:  # it shares no block with any such member
            return 1 << 30
        hk = self.pool.num_cached_hits(keys, len(keys))
        if hk >= len(keys):
            return 1 << 30
        key = keys[hk]
        bs = self.block_size
        best = 1 << 30
        for r in self.group.reg_by_first_key[keys[0]]:
            if r.next_reg <= hk < len(r.block_keys) and r.block_keys[hk] == key:
                # it caches block hk in the step where prompt + outputs reaches (hk + 1) * bs
                s = (hk + 1) * bs - r.num_prompt_tokens - self.group.member_output(r) + self._reg_lag
                best = min(best, max(s, 0))
        return best

    def decode_blocks_needed(self, j: int) -> int:
        """New blocks the decode group takes over the next j steps (the instance's KV gauges read this)."""
        n = self.group.blocks_needed(j)
        return n - self.run_first_taken if self.run_first_taken > 0 else n

    @property
    def num_decode(self) -> int:
        """Requests decoding now (the decode group's members)."""
        return self.group.num_decode

    @property
    def decode_context(self) -> int:
        """Tokens the decode group's members attend to in the next step, summed."""
        return self.group.decode_context

    def decode_run_plan(self, k: int, t0: float) -> list[float]:
        """The run's step end times from t0, each step's duration as `step_duration` would give it step by step,
        summed as the clock adds them (so equal to the bit to a step-by-step run's). A step's duration is
        ends[s] - ends[s-1] (ends[0] - t0), as a stepped engine's `t_end - out.t_start`; nothing else per step is
        kept, and with a closed-form step model (`closed_form_decode`) nothing else per step is made."""
        g = self.group
        nd = g.num_decode
        t = t0
        if self._closed_form and nd > 0:  # `FittedModel.decode_run_times`, inlined: the same floats
            # typed (`Scheduler.decode_params`), so the compiled loop below runs on C doubles
            params = self.decode_params(nd)
            attn_s, kv_s, cd, rest = params
            ctx = float(g.decode_context)  # exact (an integer below 2**53): the same products, no int-to-float per step
            ndf = float(nd)
            ends: list[float] = [0.0] * k  # filled in place: no append, no regrowth of the list
            for s in range(k):
                a = attn_s * ctx
                c = kv_s * (ctx + ndf)
                t += (0.0 + cd * (a if a > c else c)) + rest
                ends[s] = t
                ctx += ndf
            return ends
        ends = []
        for x in self.perf.decode_run_times(nd, g.decode_context, k):
            t += x
            ends.append(t)
        return ends

    def decode_params(self, nd: int) -> tuple[float, float, float, float]:
        """The closed-form step model's `decode_params(nd)` (`closed_form_decode`), computed once per nd."""
        memo = self.decode_params_memo
        params = memo.get(nd)
        if params is None:
            params = memo[nd] = self.perf.decode_params(nd)  # type: ignore[attr-defined]
        return params

    def commit_decode_run(self, j: int, ends: list[float], t0: float) -> list[Request]:
        """Apply the first j steps of a run planned from t0 (`decode_run_plan`) that ended at ends[j-1]."""
        stats = self.stats
        bs = self.block_size
        pc = self.group.phase_count
        group_step = self.group.group_step
        first = self.run_first_taken  # the first step's blocks (and registrations), taken at the decision
        self.run_first_taken = -1
        pre = first if first > 0 else 0
        used0 = used = self.num_used_blocks - pre
        block_seconds = 0.0
        prev = t0
        for s in range(j):  # allocation happens at each step's start, then the step runs
            used += pc[(-(group_step + s)) % bs]
            e = ends[s]
            block_seconds += used * (e - prev)
            prev = e
        self.pool.allocate(used - used0 - pre)
        if self.group.num_reg_members:  # output blocks filled during the run, step by step in running order
            lag = self._reg_lag
            for s in range(0 if first < 0 else 1, j):
                for r in self.group.crossing(group_step + s - lag):
                    self._register_member(r, group_step + s - lag)
        stats.kv_used_block_seconds += block_seconds
        if used > stats.kv_peak_used_blocks:
            stats.kv_peak_used_blocks = used
        nd = self.group.num_decode
        t_end = ends[j - 1]
        stats.itl.add(ends[0] - self.group.group_last_out, nd)
        if j > 1:
            stats.itl.add_steps(ends, j, nd)
        stats.num_steps += j
        stats.busy_time_s += t_end - t0
        stats.generated_tokens += nd * j
        if self.wants_steps:
            self.sink.decode_run(nd, self.group.decode_context, t0, ends[:j], used)
        self._after_run(j, ends, t0)
        self.group.group_step += j
        self.group.decode_context += nd * j
        self.group.group_last_out = t_end
        finished = self.group.pop_finished()
        if len(finished) > 1:  # vLLM's order, not the finish heap's (see `_finish`)
            finished.sort(key=_by_run_seq)
        for r in finished:
            self._finish(r, t_end)
        return finished

    def _after_run(self, j: int, ends: list[float], t0: float) -> None:
        """The first j steps of a decode run were applied (async: where the next decision stands)."""
