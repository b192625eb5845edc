"""One engine's scheduler, modelled on vLLM V1 (`vllm/v1/core/sched/scheduler.py`), FCFS policy.

Each step gives every running request tokens so its computed tokens catch up with its tokens: running
requests first in admission order (decodes 1 token, a partial prefill its next chunk), then waiting
requests are admitted while the token budget, `max_num_seqs` and KV blocks allow. When blocks run out,
the most recently admitted request is preempted (recompute) and goes back to the front of the queue.

Decoding requests advance in lockstep, so they form one *decode group* driven by a shared step
counter `D`: a member's output count is `out_base + D - d_base`. A step then costs O(1) for all
decodes, and `plan_decode_run` can advance k homogeneous decode steps at once (the fast-forward).
Blocks a decode needs follow from its position modulo the block size (`phase_count`), finishes from
a heap keyed by the value of `D` at which each member reaches its `max_tokens`. Output blocks are cached
as they fill, as vLLM's `allocate_slots` caches every block full within the tokens it schedules: members
whose block keys cover their output sit in per-phase buckets (`reg_buckets`), so a step touches only the
members that cross a block boundary in it.

Async scheduling (`async_scheduling`, vLLM's `AsyncScheduler` driven by `EngineCore.step_with_batch_queue`
with a batch queue of depth 2, `vllm/v1/core/sched/async_scheduler.py`, `vllm/v1/engine/core.py`): the
engine loop calls `schedule(k+1)` while step k runs on the GPU, then `update_from_output(k)`. The twin keeps
its own call order (update(k), then schedule(k+1)) and reproduces what that reordering changes:

- *The decision is made one step earlier*: schedule(k+1) sees only requests that reached the engine by the
  start of step k (`inbox` holds later ones until `admit_inbox`), and its SCHEDULED time is that start.
- *Outputs are processed one step later*: a request that finished in step k still holds its blocks and its
  seat in `running` during schedule(k+1), getting no token (vLLM's max_tokens check on
  `num_output_placeholders` in `Scheduler.schedule`), and is freed after it (`finishing`, `release_finished`):
  its blocks serve schedule(k+2). It can still be taken as a preemption victim in schedule(k+1), as in vLLM.
- *Output blocks are cached one step later*: `allocate_slots` caches only tokens already known, and the token
  sampled in step k is known only after schedule(k+1), so a decode caches the block its last token filled
  one step after the synchronous engine would (`_reg_lag`). A member preempted with a token in flight has
  that block uncached (`update_from_output` skips caching for preempted requests).
- *Decode tokens are optimistic*: a request whose final prefill chunk ran in step k is scheduled a decode in
  k+1 from a placeholder; its blocks and budget are those of the synchronous decode, so nothing changes there.
- *Timing*: schedule(k+1) and its input preparation run on the CPU while the GPU runs step k, so the CPU part
  of a step (`host_time_s` of the step model) is hidden up to the previous step's GPU time: a step lasts
  step_time - min(cpu, previous step's GPU time). After an idle engine (or an empty schedule) nothing was
  running to hide behind, so the first step pays its CPU in full.

Not modelled: a decode member skipped for budget under async caches its blocks on the synchronous lag
afterwards (vLLM: no placeholder for the skipped step); such skips need a long-prefill threshold.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from twin.engine.block_pool import BlockPool
from twin.engine.segment_pool import SegmentPool
from twin.policy.kv_events import BlockStored
from twin.engine.request import BlockKeys, Request, RequestStatus
from twin.perf.base import StepBatch, StepTimeModel
from twin.engine.records import RequestLog


@dataclass
class SchedulerConfig:
    """vLLM's scheduler knobs, by their vLLM names."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    scheduler_reserve_full_isl: bool = True  # vLLM 0.32 admission gate: room for the whole sequence
    watermark: float = 0.0
    async_scheduling: bool = False  # vLLM's AsyncScheduler + batch queue (see `Scheduler` docstring)


@dataclass
class SchedulerOutput:
    """What one `schedule()` decided."""

    t_start: float
    prefills: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, tokens, computed before)
    num_decode: int = 0  # decode-group members scheduled (1 token each)
    decode_context: int = 0
    skipped: list[Request] = field(default_factory=list)  # decode members that got no token
    preempted: list[Request] = field(default_factory=list)

    t_decided: float = -1.0  # when vLLM made this decision (async: the start of the step before)

    def __init__(self, t_start: float, prefills: list[tuple[Request, int, int]] | None = None, num_decode: int = 0,
                 decode_context: int = 0, skipped: list[Request] | None = None,
                 preempted: list[Request] | None = None, t_decided: float = -1.0) -> None:
        # written out (dataclass keeps it): one per step, a native constructor when compiled
        self.t_start = t_start
        self.prefills = [] if prefills is None else prefills
        self.num_decode = num_decode
        self.decode_context = decode_context
        self.skipped = [] if skipped is None else skipped
        self.preempted = [] if preempted is None else preempted
        self.t_decided = t_decided

    def batch(self) -> StepBatch:
        b = StepBatch(num_decode_tokens=self.num_decode, decode_context_tokens=self.decode_context,
                      num_prefill_reqs=len(self.prefills))
        for r, n, c in self.prefills:
            b.num_prefill_tokens += n
            b.prefill_attn_tokens += n * c + n * (n + 1) / 2
            b.prefill_kv_read_tokens += c + n
            if c + n == r.num_tokens:
                b.num_prefill_sampled += 1
        return b

    @property
    def is_empty(self) -> bool:
        return not self.prefills and self.num_decode == 0


ITL_FLUSH = 1 << 16  # values gathered before they move into the arrays


class ItlRecorder:
    """Inter-token latencies as (value, how many tokens had it), in compact arrays (16 bytes an entry).

    Values gather in a list first, where a decode run's durations go in as one pointer copy, with one
    (count, weight) pair per run; they move into the float64 arrays in chunks (array.extend converts a
    list element by element through argument parsing, ~10x slower than numpy)."""

    __slots__ = ("values", "weights", "_buf", "_counts", "_wts")

    def __init__(self) -> None:
        self.values = array("d")
        self.weights = array("q")
        self._buf: list[float] = []
        self._counts: list[int] = []
        self._wts: list[int] = []

    def add(self, value: float, weight: int) -> None:
        if weight > 0:
            self._buf.append(value)
            self._counts.append(1)
            self._wts.append(weight)
            if len(self._buf) >= ITL_FLUSH:
                self._flush()

    def add_many(self, values: list[float], weight: int) -> None:
        if weight > 0 and len(values):
            self._buf.extend(values)
            self._counts.append(len(values))
            self._wts.append(weight)
            if len(self._buf) >= ITL_FLUSH:
                self._flush()

    def _flush(self) -> None:
        if self._buf:
            self.values.frombytes(np.asarray(self._buf, dtype=np.float64).tobytes())
            w = np.repeat(np.asarray(self._wts, dtype=np.int64), np.asarray(self._counts, dtype=np.int64))
            self.weights.frombytes(w.tobytes())
            self._buf = []
            self._counts = []
            self._wts = []

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        self._flush()
        return np.frombuffer(self.values, dtype=np.float64), np.frombuffer(self.weights, dtype=np.int64)


@dataclass
class EngineStats:
    """Counters and weighted samples an instance accumulates over a run."""

    num_steps: int = 0
    busy_time_s: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens of newly admitted requests (vLLM's counter)
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_used_block_seconds: float = 0.0
    kv_peak_used_blocks: int = 0
    generated_tokens: int = 0
    itl: ItlRecorder = field(default_factory=ItlRecorder)


def _by_run_seq(r: Request) -> int:
    return r.run_seq


class Scheduler:
    """Waiting queue, running list, decode group, block pool and records of one engine."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, perf: StepTimeModel,
                 log: RequestLog) -> None:
        self.config = config
        self.pool = pool
        # the range pool (twin/engine/segment_pool.py): requests' keys are `BlockKeys` runs, held copies
        # (chain, gen, j0, n) tuples; the per-block `BlockPool` is the reference (same schedules, tested)
        self.seg: SegmentPool | None = pool if isinstance(pool, SegmentPool) else None  # (a BlockPool subclass)
        self.perf = perf
        self.log = log
        self.block_size = pool.block_size
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # running requests not in the decode group, running order
        # the decode group
        self.D = 0
        self.phase_count = [0] * self.block_size
        self.finish_heap: list[tuple[int, int, Request]] = []
        self._heap_seq = 0
        self.num_decode = 0
        self.decode_context = 0  # sum over members of the tokens each attends to in the next step
        self.group_last_out = 0.0
        self.stale: dict[Request, float] = {}  # members whose last output was not the group's
        # members with blocks still to register, by phase: those with phase (-D-1) % bs fill a block at D
        self.reg_buckets: list[dict[Request, None]] = [{} for _ in range(self.block_size)]
        self.num_reg_members = 0
        self._reg_by_first_key: dict[int, dict[Request, None]] = {}  # the same members by their first key
        self._run_seq = 0
        self._num_registrations = 0  # registration calls so far: a refused head may hit more after one
        self.stats = EngineStats()
        self._watermark_blocks = int(config.watermark * pool.num_gpu_blocks)
        self._blocked: tuple | None = None  # (head, len(running), num_decode, free) when it was refused
        self.on_finish: Callable[[int], None] | None = None  # told each finished request's index
        # async scheduling (see the module docstring)
        self.async_scheduling: bool = config.async_scheduling
        self._reg_lag: int = 1 if config.async_scheduling else 0  # decode steps output caching lags by
        self.inbox: list[tuple[Request, float]] = []  # (request, time it reached the engine), not yet visible
        self.finishing: list[Request] = []  # finished in the last step, blocks held through the next schedule
        self.next_decision_t: float = 0.0  # start of the step in flight: when the next decision is made
        self.prev_gpu_s: float = 0.0  # GPU time of the step in flight, which the next step's CPU hides behind
        # the planned decode run's step-model times and host time: step s's GPU time is run_x[s] - run_c
        self.run_x: list[float] = []
        self.run_c: float = 0.0
        self._host_s: Callable[[int], float] | None = getattr(perf, "host_time_s", None)
        self.on_first_token: Callable[[int, float], None] | None = None  # told (index, time) of each first token

    # ---------------------------------------------------------------------------------------------
    def add_request(self, r: Request, now: float = 0.0) -> None:
        """The request reaches the engine at `now`; under async scheduling it waits in `inbox` until a
        decision made after `now` (vLLM drains its input queue only before `schedule()`)."""
        r.status = RequestStatus.WAITING
        if self.seg is not None and r.block_keys and not isinstance(r.block_keys, BlockKeys):
            r.block_keys = BlockKeys.from_keys(r.block_keys)  # e.g. a forecaster's request from a view
        if self.async_scheduling:
            self.inbox.append((r, now))
        else:
            self.waiting.append(r)
        self.log.status[r.idx] = RequestStatus.WAITING

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting) or bool(self.inbox)

    # -- async scheduling: the loop's bookkeeping (Instance.run and EngineFork.advance call these) --------
    def is_idle(self) -> bool:
        """Nothing running or queued: the next arrival starts the engine afresh."""
        return not self.running and not self.waiting

    def wake(self, now: float) -> None:
        """An idle engine starts again: the next decision is made now, with no GPU work to hide behind."""
        self.next_decision_t = now
        self.prev_gpu_s = 0.0

    def admit_inbox(self) -> bool:
        """Requests that reached the engine by the next decision's time join the waiting queue (in order)."""
        inbox = self.inbox
        if not inbox:
            return False
        t = self.next_decision_t
        i = 0
        while i < len(inbox) and inbox[i][1] <= t:
            self.waiting.append(inbox[i][0])
            i += 1
        if i:
            del inbox[:i]
        return i > 0

    def release_finished(self) -> bool:
        """After schedule(k+1), update_from_output(k) frees the requests that finished in step k."""
        if not self.finishing:
            return False
        for r in self.finishing:
            self._free_request(r, preempted=False)
            self.running.remove(r)
        self.finishing = []
        return True

    def step_duration(self, out: SchedulerOutput) -> float:
        """The step's wall time: the step model's, less (async) the CPU hidden behind the step before it."""
        b = out.batch()
        x = self.perf.step_time(b)
        if not self.async_scheduling:
            return x
        c = self._host_s(b.num_requests) if self._host_s is not None else 0.0
        hidden = c if c < self.prev_gpu_s else self.prev_gpu_s
        self.prev_gpu_s = x - c
        return x - hidden

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_usable_blocks - self.pool.get_num_free_blocks()

    def inflight_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: queued requests plus the rest of partial prefills."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting) + sum(
            r.num_tokens - r.num_computed_tokens for r in self.prefilling) + sum(
            r.num_tokens for r, _ in self.inbox)

    # -- the decode group --------------------------------------------------------------------------
    def _member_output(self, r: Request) -> int:
        return r.out_base + self.D - r.d_base

    def _join_group(self, r: Request, now: float) -> None:
        """A request whose prompt is computed and that sampled a token starts decoding."""
        bs = self.block_size
        r.in_decode = True
        r.out_base = r.num_output_tokens
        r.d_base = self.D
        computed = r.num_prompt_tokens + r.num_output_tokens - 1
        r.phase = (computed - self.D) % bs
        self.phase_count[r.phase] += 1
        self.num_decode += 1
        self.decode_context += computed + 1
        self._heap_seq += 1
        r.heap_seq = self._heap_seq
        heapq.heappush(self.finish_heap, (self.D + r.max_tokens - r.out_base, self._heap_seq, r))
        if r.next_reg < len(r.block_keys) and self.pool.enable_caching:
            r.reg_pending = True
            self.reg_buckets[r.phase][r] = None
            self.num_reg_members += 1
            group = self._reg_by_first_key.get(r.block_keys[0])
            if group is None:
                self._reg_by_first_key[r.block_keys[0]] = {r: None}
            else:
                group[r] = None
        if self.num_decode == 1:
            self.group_last_out = now
        elif self.group_last_out != now:
            self.stale[r] = now

    def _leave_group(self, r: Request) -> None:
        """Materialise a member's counters and take it out of the group."""
        out = self._member_output(r)
        r.num_output_tokens = out
        r.num_computed_tokens = r.num_prompt_tokens + out - 1
        r.num_blocks = -(-r.num_computed_tokens // self.block_size)
        self.phase_count[r.phase] -= 1
        if r.reg_pending:
            self._drop_reg(r)
        self.num_decode -= 1
        self.decode_context -= r.num_computed_tokens + 1
        r.in_decode = False
        r.heap_seq = -1  # invalidates its heap entry
        if r in self.stale:
            r.last_output_time = self.stale.pop(r)
        else:
            r.last_output_time = self.group_last_out

    def _skip_member(self, r: Request) -> None:
        """A member got no token this step (budget exhausted): it falls one step behind the group."""
        bs = self.block_size
        self.phase_count[r.phase] -= 1
        if r.reg_pending:
            del self.reg_buckets[r.phase][r]
            self.reg_buckets[(r.phase - 1) % bs][r] = None
        r.d_base += 1
        r.phase = (r.phase - 1) % bs
        self.phase_count[r.phase] += 1
        self._heap_seq += 1
        r.heap_seq = self._heap_seq
        heapq.heappush(self.finish_heap, (r.d_base + r.max_tokens - r.out_base, self._heap_seq, r))
        if r not in self.stale:
            self.stale[r] = self.group_last_out

    def _drop_reg(self, r: Request) -> None:
        del self.reg_buckets[r.phase][r]
        r.reg_pending = False
        self.num_reg_members -= 1
        first = r.block_keys[0]
        group = self._reg_by_first_key[first]
        del group[r]
        if not group:
            del self._reg_by_first_key[first]

    def _crossing(self, d: int) -> list[Request]:
        """Members that fill a block in the step at group counter `d`, in running order."""
        b = self.reg_buckets[(-d - 1) % self.block_size]
        if not b:
            return []
        if len(b) == 1:
            return list(b)
        return sorted(b, key=_by_run_seq)

    def _register_member(self, r: Request, d: int) -> None:
        """A member's decode at group counter `d` fills a block: cache it (vLLM caches up to num_tokens)."""
        j = r.next_reg
        keys = r.block_keys
        if self.seg is not None or (r.num_prompt_tokens + r.out_base + d - r.d_base) // self.block_size != j + 1:
            self._register_full_blocks(r, r.num_prompt_tokens + r.out_base + d - r.d_base)
        else:  # exactly block j: `_register_full_blocks` for one block, inlined
            pool = self.pool
            key = keys[j]
            m = pool.cached_block_hash_to_ref
            if key in m or key in pool.dups:
                r.keyed.append(pool.add_copy(key))
            else:
                m[key] = 1
                r.keyed.append(key)
            r.next_reg = j + 1
            self._num_registrations += 1
            sink = pool.event_sink
            if sink is not None:
                sink(BlockStored([key], keys[j - 1] if j else None, None, self.block_size))
        if r.next_reg >= len(keys):
            self._drop_reg(r)

    def _next_finish_d(self) -> int | None:
        h = self.finish_heap
        while h and h[0][2].heap_seq != h[0][1]:
            heapq.heappop(h)
        return h[0][0] if h else None

    # -- KV ----------------------------------------------------------------------------------------
    def _register_full_blocks(self, r: Request, computed: int) -> None:
        """Blocks full after computing `computed` tokens get their hash (vLLM `cache_blocks`).

        A hash already cached gets a second copy, as vLLM does not deduplicate (`cache_full_blocks`); one
        `BlockStored` event per call carries all the new hashes (`BlockPool.cache_full_blocks`).
        """
        start = r.next_reg
        end = min(computed // self.block_size, len(r.block_keys))
        if end <= start:
            return
        pool = self.pool
        seg = self.seg
        if seg is not None:
            if seg.enable_caching:
                seg.register_blocks(r.block_keys, r.keyed, start, end)  # type: ignore[arg-type]
                self._num_registrations += 1
        elif pool.enable_caching:  # BlockPool.add_copy, inlined: this loop runs once per prompt block
            m = pool.cached_block_hash_to_ref
            keyed = r.keyed
            keys = r.block_keys
            if pool.dups:
                for j in range(start, end):
                    keyed.append(pool.add_copy(keys[j]))
            else:
                for j in range(start, end):
                    key = keys[j]
                    if key in m:
                        keyed.append(pool.add_copy(key))
                    else:
                        m[key] = 1
                        keyed.append(key)
            self._num_registrations += 1
            sink = pool.event_sink
            if sink is not None:
                sink(BlockStored(list(keys[start:end]), keys[start - 1] if start else None, None,
                                 self.block_size))
        r.next_reg = end

    def _free_request(self, r: Request, preempted: bool, in_flight: int = 0) -> None:
        """Release all blocks in vLLM's order: tail first; hashed blocks to the LRU tail.

        `in_flight` computed tokens are not known yet (async: a preempted decode's last one), so the block
        they fill is freed uncached."""
        pool = self.pool
        bs = self.block_size
        computed = r.num_computed_tokens - in_flight
        if r.next_reg < len(r.block_keys):  # every full computed block is registered; no-op normally
            self._register_full_blocks(r, computed)
        full = computed // bs
        pool.release_anon(r.num_blocks - full)  # the partial block
        seg = self.seg
        held = len(r.keyed) if seg is None else seg.num_held(r.keyed)
        run = pool.release_run(full - held)  # full blocks past the keys: nobody else hits them
        if preempted:
            r.own_run = run
        if seg is None:
            self.pool.release_keyed(reversed(r.keyed))
        else:
            seg.release_held(r.keyed)
        r.keyed = []
        r.num_blocks = 0
        r.next_reg = 0

    # -- admission helpers -------------------------------------------------------------------------
    def _lookup(self, r: Request) -> tuple[int, int, int]:
        """(hit keyed blocks, hit own-run blocks, free blocks among the hits) for a waiting request."""
        keys = r.block_keys
        run = r.own_run
        if not keys and run is None:  # content nobody shares and no blocks of its own left behind
            return 0, 0, 0
        bs = self.block_size
        max_blocks = (r.num_tokens - 1) // bs
        hk = self.pool.num_cached_hits(keys, max_blocks)
        own = 0
        if run is not None and run.count > 0 and hk == len(keys) and hk < max_blocks:
            own = min(run.count, max_blocks - hk)
        if not hk:
            return hk, own, own
        seg = self.seg
        if seg is None:
            free_hits = own + self.pool.num_free_among(keys[:hk])
        else:
            free_hits = own + seg.num_free_hits(keys, hk)  # type: ignore[arg-type]
        return hk, own, free_hits

    def _admission_plan(self, r: Request, budget: int, thr: int) -> tuple[int, int, int] | None:
        """(hit keyed blocks, hit own-run blocks, chunk tokens) if Phase B would admit `r` now, else None.

        No state changes: the fast-forward asks this too.
        """
        cfg = self.config
        bs = self.block_size
        hk, own, free_hits = self._lookup(r)
        hit_blocks = hk + own
        n = r.num_tokens - hit_blocks * bs
        if 0 < thr < n:
            n = thr
        if not cfg.enable_chunked_prefill and n > budget:
            return None
        n = min(n, budget)
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
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return False
        return self._admission_plan(self.waiting[0], budget, thr) is not None

    # -- preemption --------------------------------------------------------------------------------
    def _preempt(self, r: Request, out: SchedulerOutput) -> None:
        in_flight = 0
        if r.status is RequestStatus.FINISHED:  # async: finished in the step in flight, not yet freed
            self.finishing.remove(r)
            self._free_request(r, preempted=False)
            r.num_preemptions += 1
            self.stats.num_preemptions += 1
            self.log.preemptions[r.idx] = r.num_preemptions
            out.preempted.append(r)
            return
        if r.in_decode:
            if self.async_scheduling and r.d_base < self.D:  # it decoded in the step in flight
                in_flight = 1
            self._leave_group(r)
        else:
            self.prefilling.remove(r)
            if r.num_output_tokens > 0 and r.last_output_time < 0:
                r.last_output_time = self.group_last_out
        self._free_request(r, preempted=True, in_flight=in_flight)
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.log.preemptions[r.idx] = r.num_preemptions
        self.log.status[r.idx] = RequestStatus.PREEMPTED
        self.waiting.appendleft(r)
        out.preempted.append(r)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """vLLM's `schedule()`: Phase A over running, Phase B over waiting if nobody was preempted.

        `now` is when the step starts; under async scheduling vLLM decided it at `next_decision_t`, the start
        of the step before (its SCHEDULED time), and the next decision is made now."""
        cfg = self.config
        out = SchedulerOutput(t_start=now)
        if self.async_scheduling:
            out.t_decided = self.next_decision_t
            self.next_decision_t = now
        else:
            out.t_decided = now
        budget = cfg.max_num_batched_tokens
        thr = cfg.long_prefill_token_threshold if len(self.running) + len(self.waiting) > 1 else 0

        # Phase A, fast path: no preemption needed, so the running list need not be walked.
        if not self._schedule_running_fast(budget, thr, out):
            budget = self._schedule_running_exact(budget, thr, out)
        else:
            budget -= out.num_decode + sum(n for _, n, _ in out.prefills)

        # Phase B: admit waiting requests, only if nobody was preempted.
        if not out.preempted:
            self._admit(budget, thr, now, out)
        return out

    def _schedule_running_fast(self, budget: int, thr: int, out: SchedulerOutput) -> bool:
        """Schedule Phase A at group level when the outcome provably equals the exact walk.

        That holds when every request gets its full want within the budget, or when the partial
        prefills are the tail of the running list (always so without a long-prefill threshold), so the
        decodes go first and the prefills split what is left in order; and in both cases only if the
        free blocks cover it all, so nobody is preempted. Returns False to fall back to the exact walk.
        """
        bs = self.block_size
        nd = self.num_decode
        need = self.phase_count[(-self.D) % bs] if nd else 0
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
        out.decode_context = self.decode_context
        D = self.D - self._reg_lag  # the group counter whose output blocks are cached now
        cross = self._crossing(D) if self.num_reg_members else []
        ci = 0
        for r, n in zip(pre, wants):
            if n:
                while ci < len(cross) and cross[ci].run_seq < r.run_seq:  # registrations in running order
                    self._register_member(cross[ci], D)
                    ci += 1
                self._schedule_chunk(r, n, out)
        for m in cross[ci:]:
            self._register_member(m, D)
        return True

    def _schedule_chunk(self, r: Request, n: int, out: SchedulerOutput) -> None:
        c = r.num_computed_tokens
        r.num_blocks = -(-(c + n) // self.block_size)
        r.num_computed_tokens = c + n
        if r.next_reg < len(r.block_keys):
            self._register_full_blocks(r, c + n)
        out.prefills.append((r, n, c))

    def _schedule_running_exact(self, budget: int, thr: int, out: SchedulerOutput) -> int:
        """Phase A request by request, in running order, preempting from the back when blocks run out.

        Allocations are batched (`pending`) but flushed before any preemption frees blocks, so the
        pool sees allocations and releases in vLLM's order. Decode members cost one comparison each.
        """
        bs = self.block_size
        pool = self.pool
        running = self.running
        target = (-self.D) % bs  # a member needs a new block this step iff its phase equals this
        reg_d = self.D - self._reg_lag  # async: the block a member's known tokens fill lags one step
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
        for r in running[i:]:
            if r.in_decode:
                skipped_ctx += r.num_prompt_tokens + self._member_output(r)
                self._skip_member(r)
                out.skipped.append(r)
        out.num_decode = self.num_decode - len(out.skipped)
        out.decode_context = self.decode_context - skipped_ctx
        return budget

    def _admit(self, budget: int, thr: int, now: float, out: SchedulerOutput) -> None:
        cfg = self.config
        bs = self.block_size
        pool = self.pool
        log = self.log
        while budget > 0 and self.waiting:
            if len(self.running) >= cfg.max_num_seqs:
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
                seg = self.seg
                if seg is None:
                    r.keyed = pool.touch(r.block_keys[:hk])
                else:
                    r.keyed = seg.touch_prefix(r.block_keys, hk)  # type: ignore[arg-type]
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
                log.scheduled_s[r.idx] = out.t_decided
                log.cached_tokens[r.idx] = hit_tokens
                self.stats.prefix_cache_queries += r.num_prompt_tokens
                self.stats.prefix_cache_hits += hit_tokens
            r.status = RequestStatus.RUNNING
            log.status[r.idx] = RequestStatus.RUNNING
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
        finished: list[Request] = []

        if out.num_decode:
            n_stale_out = 0
            if self.stale:
                skipped = set(out.skipped)
                for r, last in list(self.stale.items()):
                    if r not in skipped:
                        stats.itl.add(t_end - last, 1)
                        del self.stale[r]
                        n_stale_out += 1
            stats.itl.add(t_end - self.group_last_out, out.num_decode - n_stale_out)
            stats.generated_tokens += out.num_decode
            self.group_last_out = t_end
            self.D += 1
            self.decode_context += out.num_decode
            finished = self._pop_finished_members()

        for r, n, c in out.prefills:
            if r.status is not RequestStatus.RUNNING or r.num_computed_tokens != r.num_tokens:
                continue
            r.num_output_tokens += 1
            stats.generated_tokens += 1
            if r.first_token_time < 0:
                r.first_token_time = t_end
                self.log.first_token_s[r.idx] = t_end
                if self.on_first_token is not None:
                    self.on_first_token(r.idx, t_end)
            else:
                stats.itl.add(t_end - r.last_output_time, 1)
            self.prefilling.remove(r)
            if r.num_output_tokens >= r.max_tokens:
                r.num_computed_tokens = r.num_tokens - 1
                r.last_output_time = t_end
                finished.append(r)
            else:
                self._join_group(r, t_end)

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
        if self.async_scheduling:
            self.finishing.append(r)  # freed after the next schedule (release_finished)
        else:
            self._free_request(r, preempted=False)
            self.running.remove(r)
        r.status = RequestStatus.FINISHED
        log = self.log
        log.finish_s[r.idx] = t_end
        log.output_tokens[r.idx] = r.num_output_tokens
        log.status[r.idx] = RequestStatus.FINISHED
        if self.on_finish is not None:
            self.on_finish(r.idx)

    # -- the fast-forward --------------------------------------------------------------------------
    def plan_decode_run(self, max_steps: int) -> int:
        """How many homogeneous decode-only steps can run from now without any decision changing.

        k < 2 means: take a normal step instead.
        """
        if self.prefilling or self.stale or not self.num_decode or self.finishing or self.inbox:
            return 0
        free = self.pool.get_num_free_blocks()
        if self.waiting and not self._head_stays_blocked(free):
            budget_left = self.config.max_num_batched_tokens - self.num_decode
            thr = self.config.long_prefill_token_threshold if len(self.running) + len(self.waiting) > 1 else 0
            if self._can_admit_head(budget_left, thr):
                return 0
            self._blocked = (self.waiting[0], len(self.running), self.num_decode, free,
                             self._num_registrations)
        d_fin = self._next_finish_d()
        assert d_fin is not None  # every member has a live heap entry
        k = min(d_fin - self.D, max_steps)
        if self.waiting and self.num_reg_members:
            k = min(k, self._steps_until_head_may_hit_more())
        bs = self.block_size
        if free < self.num_decode * -(-k // bs):  # some member may run out of blocks within k steps
            k = min(k, self._steps_until_blocks_run_out(free))
        return k if k >= 2 else 0

    def _head_stays_blocked(self, free: int) -> bool:
        """The queue head was refused with at least as many free blocks and the same batch: still refused.

        Free blocks only shrink while the batch decodes, and evictions only shrink the head's hit; a
        registration since could have grown it.
        """
        b = self._blocked
        return (b is not None and b[0] is self.waiting[0] and b[1] == len(self.running)
                and b[2] == self.num_decode and free <= b[3] and b[4] == self._num_registrations)

    def _steps_until_head_may_hit_more(self) -> int:
        """Steps before a decode member caches the block the queue head misses first (its hit would grow).

        Keys are chained, so the head's hit grows only when its first uncached key is registered, and a
        member holding that key registers it at the same block index.
        """
        head = self.waiting[0]
        keys = head.block_keys
        if not keys or keys[0] not in self._reg_by_first_key:  # it shares no block with any such member
            return 1 << 30
        hk = self.pool.num_cached_hits(keys, len(keys))
        if hk >= len(keys):
            return 1 << 30
        key = keys[hk]
        bs = self.block_size
        best = 1 << 30
        for r in self._reg_by_first_key[keys[0]]:
            if r.next_reg <= hk < len(r.block_keys) and r.block_keys[hk] == key:
                # it caches block hk in the step where prompt + outputs reaches (hk + 1) * bs
                s = (hk + 1) * bs - r.num_prompt_tokens - self._member_output(r) + self._reg_lag
                best = min(best, max(s, 0))
        return best

    def _steps_until_blocks_run_out(self, free: int) -> int:
        """Decode steps the group can take before the free blocks cannot cover a step's allocations."""
        bs = self.block_size
        nd = self.num_decode
        periods = free // nd  # each run of block_size steps takes exactly one block per member
        left = free - periods * nd
        pc = self.phase_count
        D = self.D
        s = 0
        while True:
            need = pc[(-(D + s)) % bs]
            if need > left:
                return periods * bs + s
            left -= need
            s += 1

    def decode_blocks_needed(self, j: int) -> int:
        """New blocks the decode group takes over the next j steps (each member one per block_size)."""
        bs = self.block_size
        full, rest = divmod(j, bs)
        pc = self.phase_count
        D = self.D
        n = full * self.num_decode
        for s in range(rest):  # a loop, not a generator: compiled, a generator is an object per call
            n += pc[(-(D + s)) % bs]
        return n

    def decode_run_plan(self, k: int, t0: float) -> tuple[list[float], list[float]]:
        """The run's step durations, each as `step_duration` would give it step by step, and their end times
        from t0, summed as the clock adds them (so equal to the bit to a step-by-step run's)."""
        xs = self.perf.decode_run_times(self.num_decode, self.decode_context, k)
        ends = []
        t = t0
        if not self.async_scheduling:
            for x in xs:
                t += x
                ends.append(t)
            return xs, ends
        c = self._host_s(self.num_decode) if self._host_s is not None else 0.0
        g_prev = self.prev_gpu_s
        out = []
        for x in xs:
            d = x - (c if c < g_prev else g_prev)
            out.append(d)
            t += d
            ends.append(t)
            g_prev = x - c
        self.run_x = xs
        self.run_c = c
        return out, ends

    def commit_decode_run(self, j: int, durations: list[float], ends: list[float]) -> list[Request]:
        """Apply the first j steps of a planned run that ended at ends[j-1]."""
        stats = self.stats
        bs = self.block_size
        pc = self.phase_count
        D = self.D
        used0 = used = self.num_used_blocks
        block_seconds = 0.0
        for s in range(j):  # allocation happens at each step's start, then the step runs
            used += pc[(-(D + s)) % bs]
            block_seconds += used * durations[s]
        self.pool.allocate(used - used0)
        if self.num_reg_members:  # output blocks filled during the run, step by step in running order
            lag = self._reg_lag
            for s in range(j):
                for r in self._crossing(D + s - lag):
                    self._register_member(r, D + s - lag)
        stats.kv_used_block_seconds += block_seconds
        if used > stats.kv_peak_used_blocks:
            stats.kv_peak_used_blocks = used
        nd = self.num_decode
        t_end = ends[j - 1]
        stats.itl.add(ends[0] - self.group_last_out, nd)
        if j > 1:
            stats.itl.add_many(durations[1:j], nd)
        stats.num_steps += j
        stats.busy_time_s += t_end - (ends[0] - durations[0])
        stats.generated_tokens += nd * j
        if self.async_scheduling:  # the next decision was made as step j started
            self.next_decision_t = ends[j - 2] if j >= 2 else ends[0] - durations[0]
            self.prev_gpu_s = self.run_x[j - 1] - self.run_c
            self.run_x = []
        self.D += j
        self.decode_context += nd * j
        self.group_last_out = t_end
        finished = self._pop_finished_members()
        if len(finished) > 1:  # vLLM's order, not the finish heap's (see `_finish`)
            finished.sort(key=_by_run_seq)
        for r in finished:
            self._finish(r, t_end)
        return finished

    def _pop_finished_members(self) -> list[Request]:
        """Members whose output count reached max_tokens at the current D leave the group."""
        finished = []
        h = self.finish_heap
        D = self.D
        while h:
            d_fin, seq, r = h[0]
            if r.heap_seq != seq:
                heapq.heappop(h)
                continue
            if d_fin > D:
                break
            heapq.heappop(h)
            self._leave_group(r)
            finished.append(r)
        return finished
