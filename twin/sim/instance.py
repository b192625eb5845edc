"""One vLLM instance in the simulation: its step loop as a SimPy process, and the scrape clock of its gauges."""

from __future__ import annotations

import math
from typing import Any, Callable, Generator

import simpy

from twin.engine.block_pool import BlockPool
from twin.engine.output import SchedulerOutput
from twin.engine.request import Request
from twin.engine.segment_pool import SegmentPool
from twin.engine.config import EngineConfig
from twin.engine.core import EngineCore, run_index
from twin.engine.async_scheduler import make_scheduler
from twin.engine.sink import FanOut
from twin.sim.environment import Environment
from twin.sim.events import Clock, Proc, Timer
from twin.perf.base import StepTimeModel
from twin.engine.records import RequestLog


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
            for _ in range(8):  # a step or two from the estimate (bounded: past 2**53 ticks, k + 1 is k as a float)
                if start + (k + 1) * dt > now:
                    break
                k += 1
        for _ in range(8):
            if k <= 0 or start + k * dt <= now:
                break
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

    def __init__(self, env: Environment, name: str, index: int, config: EngineConfig,
                 perf: StepTimeModel, num_blocks: int, log: RequestLog, fast_forward: bool = True,
                 max_run_steps: int = 4096, segmented: bool = False, sink: Any = None) -> None:
        self.env = env
        self.clock: Clock = env.clock  # twin.sim.environment: SimPy's environment with the twin's timers
        self.id = name
        self.index = index
        self.config = config
        self.perf = perf
        self.log = log
        self._instance_col = log.buffers["instance"]  # its column's memoryview (twin.engine.records)
        # segmented: the range pool for keys given as runs (prefix-heavy traces); else the per-block reference
        pool_cls = SegmentPool if segmented else BlockPool
        self.pool: BlockPool = pool_cls(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = make_scheduler(config.scheduler_config(), self.pool, perf, log if sink is None else sink)
        self.core = EngineCore(self.scheduler, perf, self.clock.now, fast_forward, max_run_steps, name)
        self._running = self.scheduler.running  # the same list and deque objects, for cheap views
        self._waiting = self.scheduler.waiting
        self.fast_forward = fast_forward
        self.max_run_steps = max_run_steps
        self._wakeup: simpy.Event | None = None
        self.num_dispatched = 0
        self.state = "serving"  # starting | serving | draining | stopped: the fleet's lifecycle
        self.serving_since = self.clock.now
        self.num_wakeups = 0  # times the step loop resumed: what simulation cost grows with
        # stale gauges without a scrape process: the dispatcher sets the clock; `touch` keeps the gauges
        # as of the last tick before the first change after it
        self.scrape_clock: ScrapeClock | None = None
        self._snap_t = -math.inf
        self._snap: tuple[int, int, float] = (0, 0, 0.0)
        self.on_idle: Callable[[Instance], None] | None = None  # the engine ran out of work (the fleet's drain)
        self.timeline: Any = None  # twin.sim.timeline.Timeline when one records this instance (it sets both)
        self.timeline_next = math.inf  # the next timeline tick not yet recorded
        self.process = Proc(env, self.run())  # twin.sim.events: SimPy's process, compiled

    # -- the step loop -------------------------------------------------------------------------------
    def run(self) -> Generator[Any, Any, None]:
        """The engine core's loop (twin.engine.core) on the simulation clock: bring it to now, wait for the
        work it started, and sleep when it has none (an arrival wakes it, or cuts a decode run short)."""
        env = self.env
        clock = self.clock
        core = self.core
        while True:
            core.advance(until=clock.now)
            if not core.is_busy():
                if self.on_idle is not None:  # a draining instance stops here (under async scheduling its
                    self.on_idle(self)  # finished requests kept their blocks until the step after they finished)
                self._wakeup = env.event()
                yield self._wakeup
                self.touch(clock.now)
                self._wakeup = None
                continue
            try:
                yield Timer(clock, core.wait_s)
            except simpy.Interrupt:
                pass  # an arrival: `EngineCore.add_request` cut the run; the loop waits out its last step
            self.touch(clock.now)
            self.num_wakeups += 1

    @property
    def pending_step(self) -> tuple[SchedulerOutput, float] | None:
        """(SchedulerOutput, t_end) of the step being computed (twin.engine.core)."""
        return self.core.pending_step

    @property
    def pending_run(self) -> tuple[int, list[float], float] | None:
        """(k, ends, t0) of the decode run in progress."""
        return self.core.pending_run

    @property
    def pending_tail(self) -> tuple[int, list[float], float, float] | None:
        """(j, ends, t_resume, t0): a decode run cut at an arrival, its last step still running."""
        return self.core.pending_tail

    def subscribe(self, sink: Any) -> None:
        """Add a sink for this engine's events (twin.engine.sink), after those it has: e.g. a step recorder."""
        sched = self.scheduler
        sched.sink = FanOut([sched.sink, sink])
        sched.wants_steps = sched.sink.wants_steps

    def add_request(self, r: Request) -> None:
        """Dispatch: the request joins the waiting queue; a sleeping or fast-forwarding engine is woken."""
        now = self.clock.now
        self.touch(now)
        self.num_dispatched += 1
        self._instance_col[r.idx] = self.index
        cut = self.core.pending_run is not None  # the loop waits on a decode run's timer, which this arrival cuts
        self.core.add_request(r, now)
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif cut:
            wait = self.core.wait_s
            if wait > 0.0:  # the loop would only wait out the cut run's last step: it waits for that instead
                self.process.wait_instead(wait)
            else:  # the cut run ends now: the loop goes on at once, before anything else now
                self.process.interrupt()

    def fits(self, num_tokens: int) -> bool:
        """Could a request of this many tokens ever be held by this instance's KV pool?"""
        return math.ceil(num_tokens / self.config.block_size) <= self.pool.num_usable_blocks

    def admission_refusal(self) -> str | None:
        """Why vLLM 0.32's API server would answer a new request 503 now, else None (`AsyncLLM.check_admission`):
        `max_num_queued_reqs` caps the requests in the engine and not finished (its output processor's, so not those
        still in pre-processing), `max_num_queued_tokens` the prompt tokens of those without a first token."""
        cfg = self.config
        s = self.scheduler
        cap = cfg.max_num_queued_reqs
        if cap is not None:
            n = self.num_running + self.num_waiting  # (its waiting count holds the async inbox)
            if n + 1 > cap:
                return f"max_num_queued_reqs: {n} in flight, limit {cap}"
        cap = cfg.max_num_queued_tokens
        if cap is not None:
            t = 0
            for r in s.waiting:
                if r.first_token_time < 0:
                    t += r.num_prompt_tokens
            for r, _t in s.inbox:
                t += r.num_prompt_tokens
            for r in s.prefilling:
                if r.first_token_time < 0:
                    t += r.num_prompt_tokens
            if t >= cap:
                return f"max_num_queued_tokens: {t} prompt tokens before their first token, limit {cap}"
        return None

    # -- InstanceView --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self.scheduler.inbox)

    @property
    def free_blocks(self) -> int:
        return self.free_blocks_at(self.clock.now)

    def free_blocks_at(self, t: float) -> int:
        """Free blocks at time t, no change since: the decode run in progress took a block per step started."""
        free = self.pool.get_num_free_blocks()
        tail = self.core.pending_tail
        if tail is not None:  # a run cut at an arrival: its steps started by t took their blocks (the commit allocates)
            free -= self.scheduler.decode_blocks_needed(min(run_index(tail[1], t, True) + 1, tail[0]))
        elif self.core.pending_run is not None:  # blocks taken by the decode steps of the run started so far
            ends = self.core.pending_run[1]
            started = min(run_index(ends, t, True) + 1, len(ends))
            free -= self.scheduler.decode_blocks_needed(started)
        return free

    def token_rate(self) -> float:
        """Tokens per second the step in progress emits (its batch's sampled tokens over its duration): the
        per-step account of the output work the API server streams (twin.sim.api_server). 0 when idle.

        A decode run's step lasts `ends[j] - ends[j-1]` (from the run's start for its first), the same floats
        the clock sees when it runs the steps one by one (`t_end - out.t_start`), so a fast-forwarded and a
        stepped engine hand the API server the same rate to the last bit."""
        now = self.clock.now
        run = self.pending_run
        if run is not None:  # a fast-forwarded decode run: every step emits one token per member
            k, ends, t0 = run
            j = run_index(ends, now)
            if k - 1 < j:
                j = k - 1
            d = ends[j] - (ends[j - 1] if j else t0)
            return self.scheduler.num_decode / d if d > 0 else 0.0
        tail = self.pending_tail
        if tail is not None:  # a run cut at an arrival: the rate of its last step still to run
            jt, ends, _t, t0 = tail
            j = jt - 1
            d = ends[j] - (ends[j - 1] if j else t0)
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
