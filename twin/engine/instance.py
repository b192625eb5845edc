"""One vLLM instance in the simulation: its engine config, KV capacity and its step loop (a SimPy process)."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any, Callable, Generator

import simpy

from twin.engine.block_pool import BlockPool
from twin.engine.request import Request
from twin.engine.segment_pool import SegmentPool
from twin.engine.scheduler import Scheduler, SchedulerConfig
from twin.errors import TwinInputError
from twin.events import Proc, Timer
from twin.perf.base import StepTimeModel
from twin.records import RequestLog


@dataclass
class EngineConfig:
    """Engine knobs of one instance, by vLLM's names, plus how the KV pool is sized.

    `max_num_batched_tokens` / `max_num_seqs` here are resolved values (twin.engine.defaults fills in
    vLLM's per-GPU defaults); `gpu_memory_utilization` 0.92 is vLLM 0.32's default."""

    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    gpu_memory_utilization: float = 0.92
    # ASSUMPTION (GB): what vLLM's profile run finds besides the weights: non-torch memory (NCCL, cuBLAS
    # workspaces), the activation peak of a max_num_batched_tokens forward pass and the CUDA-graph estimate.
    # 3.3 GB = the 3.05 GiB vLLM logged for Llama-3-8B on an H100 (non_torch 1.79 + activation peak 1.26 GiB,
    # vllm-project/vllm PR #10511); 0.32 also subtracts its CUDA-graph estimate, not included here.
    activation_reserve_gb: float = 3.3
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    # vLLM resolves `async_scheduling` on for GPU engines (`config/vllm.py`); see twin.engine.scheduler
    async_scheduling: bool = True
    vllm_version: str = "0.32"  # the release modelled (twin.engine.generation); the scheduler is V1's

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
            watermark=self.watermark,
            async_scheduling=self.async_scheduling,
        )


def num_gpu_blocks(cfg: EngineConfig, device_memory_bytes: float, weight_bytes_per_gpu: float,
                   kv_bytes_per_token_per_gpu: float) -> int:
    """vLLM's sizing (`v1/worker/gpu_worker.py: Worker.determine_available_memory`, `kv_cache_utils.py:
    get_kv_cache_config_from_groups`): requested = ceil(device memory x gpu_memory_utilization), minus all
    weights (embedding and LM head included) and the non-KV reserve, floor-divided by the bytes per block.

    `device_memory_bytes` is what the device reports to the framework (e.g. 79.22 GiB on an H100 80 GB),
    not the datasheet's capacity.
    """
    if cfg.num_gpu_blocks_override:
        return int(cfg.num_gpu_blocks_override)
    requested = math.ceil(device_memory_bytes * cfg.gpu_memory_utilization)
    avail = requested - weight_bytes_per_gpu - cfg.activation_reserve_gb * 1e9
    per_block = kv_bytes_per_token_per_gpu * cfg.block_size
    n = int(avail // per_block)
    gib = float(1 << 30)
    if n < 2:
        raise TwinInputError(
            f"the model's weights ({weight_bytes_per_gpu / gib:.1f} GiB per GPU) leave no room for a KV cache "
            f"in {device_memory_bytes / gib:.1f} GiB x {cfg.gpu_memory_utilization}: use more tensor "
            "parallelism, a bigger GPU or fp8"
        )
    return n


class ScrapeClock:
    """When a `/metrics` poller every `interval_s` scrapes (start + k x interval_s), computed on demand.

    The gauges a router reads are as old as the last tick. No SimPy process ticks: an instance keeps its
    gauges as of a tick only when it is about to change after that tick (`Instance.touch`), and the
    dispatcher reads them when a decision needs them, so cost grows with events, not with simulated time.
    A scrape at tick T sees the state before any event at T."""

    def __init__(self, start: float, interval_s: float) -> None:
        self.start = start
        self.interval_s = interval_s
        self.k = 0  # the last tick asked for, so the search below starts near the answer
        self.cur = start  # tick k's time
        self.nxt = start + interval_s  # tick k + 1's

    def last_tick(self, now: float) -> float:
        """The latest tick at or before `now`."""
        if self.cur <= now < self.nxt:
            return self.cur
        dt = self.interval_s
        start = self.start
        k = self.k
        if start + (k + 1) * dt <= now:
            k = max(k, int((now - start) / dt) - 1)
            while start + (k + 1) * dt <= now:
                k += 1
        while k > 0 and start + k * dt > now:
            k -= 1
        self.k = k
        self.cur = start + k * dt
        self.nxt = start + (k + 1) * dt
        return self.cur

    def ticks_through(self, now: float) -> int:
        """How many scrapes a poller would have made from `start` through `now`."""
        self.last_tick(now)
        return self.k + 1


class Instance:
    """A vLLM engine as a SimPy process. Also the simulator's `InstanceView` for routers."""

    def __init__(self, env: simpy.Environment, name: str, index: int, config: EngineConfig,
                 perf: StepTimeModel, num_blocks: int, log: RequestLog, fast_forward: bool = True,
                 max_run_steps: int = 4096, segmented: bool = False) -> None:
        self.env = env
        self.id = name
        self.index = index
        self.config = config
        self.perf = perf
        self.log = log
        # segmented: the range pool for keys given as runs (prefix-heavy traces); else the per-block reference
        pool_cls = SegmentPool if segmented else BlockPool
        self.pool: BlockPool = pool_cls(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.pool, perf, log)
        self._running = self.scheduler.running  # the same list and deque objects, for cheap views
        self._waiting = self.scheduler.waiting
        self.fast_forward = fast_forward
        self.max_run_steps = max_run_steps
        self._wakeup: simpy.Event | None = None
        self._run: list[float] | None = None  # end times of the steps of the decode run in progress
        self._interruptible = False
        # work in progress, so a fork can finish it exactly as this loop will (twin.engine.fork)
        self.pending_step: tuple | None = None  # (SchedulerOutput, t_end) of the step being computed
        self.pending_run: tuple | None = None  # (k, durations, ends, t0) of the decode run in progress
        self.pending_tail: tuple | None = None  # (j, durations, ends, t_resume): an interrupted run's last step
        self.num_dispatched = 0
        self.state = "serving"  # starting | serving | draining | stopped: the fleet's lifecycle
        self.serving_since = env._now
        self.num_wakeups = 0  # times the step loop resumed: what simulation cost grows with
        # stale gauges without a scrape process: the dispatcher sets the clock; `touch` keeps the gauges
        # as of the last tick before the first change after it
        self.scrape_clock: ScrapeClock | None = None
        self._snap_t = -math.inf
        self._snap: tuple[int, int, float] = (0, 0, 0.0)
        self.on_idle: Callable[[Instance], None] | None = None  # the engine ran out of work (the fleet's drain)
        self.timeline: Any = None  # twin.timeline.Timeline when one records this instance (it sets both)
        self.timeline_next = math.inf  # the next timeline tick not yet recorded
        self.process = Proc(env, self.run())  # twin.events: SimPy's process, compiled

    # -- the step loop -------------------------------------------------------------------------------
    def run(self) -> Generator[Any, Any, None]:
        if self.scheduler.async_scheduling:
            yield from self._run_async()
        env = self.env
        sched = self.scheduler
        while True:
            if not sched.has_unfinished_requests():
                if self.on_idle is not None:
                    self.on_idle(self)
                self._wakeup = env.event()
                yield self._wakeup
                self.touch(env._now)
                self._wakeup = None
                continue
            k = sched.plan_decode_run(self.max_run_steps) if self.fast_forward else 0
            if k >= 2:
                t0 = env._now
                durations, ends = sched.decode_run_plan(k, t0)  # ends summed as the clock would add them
                self._run = ends
                self.pending_run = (k, durations, ends, t0)
                self._interruptible = True
                j = k
                try:
                    yield Timer(env, ends[-1] - t0)
                except simpy.Interrupt:
                    # an arrival: the step in progress completes, then the scheduler sees the newcomer
                    j = min(bisect_left(ends, env._now) + 1, k)
                self.touch(env._now)
                self._interruptible = False
                self._run = None
                self.pending_run = None
                self.num_wakeups += 1
                if env._now < ends[j - 1]:
                    self.pending_tail = (j, durations, ends, env._now)
                    yield Timer(env, ends[j - 1] - env._now)
                    self.touch(env._now)
                    self.pending_tail = None
                sched.commit_decode_run(j, durations, ends)
                continue
            self.num_wakeups += 1
            out = sched.schedule(env._now)
            if out.is_empty:
                # nothing fits even an empty pool: cannot happen for admitted requests (checked at dispatch)
                raise RuntimeError(f"{self.id}: scheduler made no progress with {len(sched.waiting)} waiting")
            dt = self.perf.step_time(out.batch())
            self.pending_step = (out, env._now + dt)
            yield Timer(env, dt)
            self.touch(env._now)
            self.pending_step = None
            sched.update_from_output(out, env._now)

    def _run_async(self) -> Generator[Any, Any, None]:
        """`run` under async scheduling: vLLM's `EngineCore.step_with_batch_queue` (see twin.engine.scheduler).

        At each step boundary: update(k) (finished requests keep their blocks), the decision for step k+1 as
        made when step k started (arrivals up to then), then step k's finished requests are freed. Mirrored
        by `EngineFork.advance`."""
        env = self.env
        sched = self.scheduler
        while True:
            if sched.is_idle():
                if not sched.inbox:
                    if self.on_idle is not None:  # a draining instance stops here: its finished requests
                        self.on_idle(self)  # kept their blocks until the step after they finished
                    self._wakeup = env.event()
                    yield self._wakeup
                    self.touch(env._now)
                    self._wakeup = None
                sched.wake(env._now)
            sched.admit_inbox()
            k = sched.plan_decode_run(self.max_run_steps) if self.fast_forward else 0
            if k >= 2:
                t0 = env._now
                durations, ends = sched.decode_run_plan(k, t0)
                self._run = ends
                self.pending_run = (k, durations, ends, t0)
                self._interruptible = True
                j = k
                try:
                    yield Timer(env, ends[-1] - t0)
                except simpy.Interrupt:
                    # an arrival during step s: step s+1 was decided before it, so it sees it at s+2
                    j = min(bisect_left(ends, env._now) + 2, k)
                now = env._now
                self.touch(now)
                self._interruptible = False
                self._run = None
                self.pending_run = None
                self.num_wakeups += 1
                if now < ends[j - 1]:
                    self.pending_tail = (j, durations, ends, now)
                    yield Timer(env, ends[j - 1] - now)
                    self.touch(env._now)
                    self.pending_tail = None
                sched.commit_decode_run(j, durations, ends)
                continue
            self.num_wakeups += 1
            now = env._now
            out = sched.schedule(now)
            released = sched.release_finished()
            if out.is_empty:
                # nothing to run as decided: decide again now, after the frees, with nothing to overlap
                sched.prev_gpu_s = 0.0
                if not released and not sched.inbox:
                    raise RuntimeError(f"{self.id}: scheduler made no progress with {len(sched.waiting)} waiting")
                continue
            dt = sched.step_duration(out)
            self.pending_step = (out, now + dt)
            yield Timer(env, dt)
            now = env._now
            self.touch(now)
            self.pending_step = None
            sched.update_from_output(out, now)

    def add_request(self, r: Request) -> None:
        """Dispatch: the request joins the waiting queue; a sleeping or fast-forwarding engine is woken."""
        now = self.env._now
        self.touch(now)
        self.num_dispatched += 1
        self.log.instance[r.idx] = self.index
        self.scheduler.add_request(r, now)
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif self._interruptible:
            self._interruptible = False
            self.process.interrupt()

    def fits(self, num_tokens: int) -> bool:
        """Could a request of this many tokens ever be held by this instance's KV pool?"""
        return math.ceil(num_tokens / self.config.block_size) <= self.pool.num_usable_blocks

    # -- InstanceView --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self.scheduler.inbox)

    @property
    def free_blocks(self) -> int:
        return self.free_blocks_at(self.env._now)

    def free_blocks_at(self, t: float) -> int:
        """Free blocks at time t, no change since: the decode run in progress took a block per step started."""
        free = self.pool.get_num_free_blocks()
        if self._run is not None:  # blocks taken by the decode steps of the run started so far
            ends = self._run
            started = min(bisect_right(ends, t) + 1, len(ends))
            free -= self.scheduler.decode_blocks_needed(started)
        return free

    def token_rate(self) -> float:
        """Tokens per second the step in progress emits (its batch's sampled tokens over its duration): the
        per-step account of the output work the API server streams (twin.api_server). 0 when idle."""
        now = self.env._now
        run = self.pending_run
        if run is not None:  # a fast-forwarded decode run: every step emits one token per member
            k, durations, ends, _t0 = run
            j = min(bisect_left(ends, now), k - 1)
            d = durations[j]
            return self.scheduler.num_decode / d if d > 0 else 0.0
        tail = self.pending_tail
        if tail is not None:
            jt, tdur, _ends, _t = tail
            d = tdur[jt - 1]
            return self.scheduler.num_decode / d if d > 0 else 0.0
        step = self.pending_step
        if step is not None:
            out, t_end = step
            d = t_end - out.t_start
            if d <= 0:
                return 0.0
            sampled = out.num_decode
            for r, n, c in out.prefills:
                if c + n == r.num_tokens:
                    sampled += 1
            return sampled / d
        return 0.0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.pool.num_usable_blocks

    def kv_usage_at(self, t: float) -> float:
        """KV use at time t, nothing having changed since t but the decode run's steps."""
        return 1.0 - self.free_blocks_at(t) / self.pool.num_usable_blocks

    def _gauges_if_unchanged_since(self, t: float) -> tuple[int, int, float]:
        """(running, waiting, KV use) at time t, nothing having changed since t but the decode run's steps."""
        return (self.num_running, self.num_waiting, self.kv_usage_at(t))

    def touch(self, now: float) -> None:
        """About to change what the gauges, the timeline or the books read: the timeline records its ticks
        through now, and the gauges are kept as of the last scrape tick, if not kept yet."""
        if now >= self.timeline_next:
            self.timeline.fill(self, now)
        c = self.scrape_clock
        if c is None:
            return
        t = c.last_tick(now)
        if t > self._snap_t:
            self._snap_t = t
            self._snap = self._gauges_if_unchanged_since(t)

    def gauges_at(self, tick: float) -> tuple[int, int, float]:
        """(running, waiting, KV use) as a scrape at `tick` (the last tick, or later with no change) saw them."""
        if self._snap_t == tick:
            return self._snap
        return self._gauges_if_unchanged_since(tick)

    @property
    def inflight_prefill_tokens(self) -> int:
        return self.scheduler.inflight_prefill_tokens()

    def cached_prefix_tokens(self, req) -> int:
        """Exact prefix-cache hit (in tokens) this request would get here now."""
        keys = getattr(req, "block_keys", ())
        if not keys:
            return 0
        bs = self.config.block_size
        max_blocks = (req.num_prompt_tokens - 1) // bs
        return self.pool.num_cached_hits(keys, max_blocks) * bs
