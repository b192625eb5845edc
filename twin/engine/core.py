"""One engine's step loop, SimPy-free: what vLLM's `EngineCore.step` / `step_with_batch_queue` repeat.

`EngineCore.advance(until)` runs the scheduler forward step by step (or a fast-forwarded run of identical
decode steps at once) up to `until`, and keeps the work in progress at `until` pending, so a later call
resumes exactly. Its clock arithmetic is the one a SimPy timer does (`now + delay`), so the same loop drives:
- the simulated instance (`twin.sim.instance.Instance`): its SimPy process calls `advance(until=env.now)`
  and waits `wait_s` for the work just started;
- the look-ahead fork (`twin.engine.fork`): Block and the twin scaler copy an engine and advance the copy
  alone, and get exactly what the original would do with no further arrivals.

Under async scheduling (`twin.engine.async_scheduler`) the scheduler's `begin_step` admits the requests that
reached the engine by the decision's time, and `after_schedule` frees the previous step's finished requests
after the next decision (`EngineCore.step_with_batch_queue`, `vllm/v1/engine/core.py`).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import Any, Callable, Final

from twin.engine.output import SchedulerOutput
from twin.engine.request import Request
from twin.engine.scheduler import Scheduler


_NATIVE: Final[bool] = not __file__.endswith(".py")  # (as twin.sim.events.NATIVE; the engine does not import sim)


def run_index(ends: list[float], t: float, right: bool = False) -> int:
    """`bisect_left(ends, t)` (`bisect_right` with `right`) on a decode run's step ends: compiled, a typed search
    on C doubles instead of a generic comparison per probe; pure Python keeps the C `bisect`."""
    if not _NATIVE:
        return bisect_right(ends, t) if right else bisect_left(ends, t)
    lo = 0
    hi = len(ends)
    while lo < hi:
        mid = (lo + hi) >> 1
        e = ends[mid]
        if e < t or (right and e == t):
            lo = mid + 1
        else:
            hi = mid
    return lo


class EngineCore:
    """A scheduler, its step model and its clock; `advance` runs it, `add_request` is an arrival."""

    def __init__(self, scheduler: Scheduler, perf: Any, now: float = 0.0, fast_forward: bool = True,
                 max_run_steps: int = 4096, name: str = "engine") -> None:
        self.scheduler = scheduler
        self.perf = perf
        self.now = now  # the time the engine has been brought to
        self.fast_forward = fast_forward
        self.max_run_steps = max_run_steps
        self.name = name
        # work in progress at `now`, each finished as the loop would finish it
        # (typed: compiled, their parts unpack to native ints and doubles, not objects added and compared generically)
        self.pending_step: tuple[SchedulerOutput, float] | None = None  # (SchedulerOutput, t_end): one scheduled step
        self.pending_run: tuple[int, list[float], float] | None = None  # (k, ends, t0): a fast-forwarded decode run
        # (j, ends, t_resume, t0): a run cut at an arrival
        self.pending_tail: tuple[int, list[float], float, float] | None = None
        self.wait_s = 0.0  # from the time the pending work was started or cut to its end: what a timer waits
        self.steps = 0  # steps run by `advance`
        self.drained_at: float | None = None  # when the engine last ran out of work

    @property
    def sink(self) -> Any:
        """Where the engine's events go (twin.engine.sink); a fork's is its own `ForkLog`."""
        return self.scheduler.sink

    def is_busy(self) -> bool:
        """Work in progress: a step, a decode run or its cut tail."""
        return self.pending_step is not None or self.pending_run is not None or self.pending_tail is not None

    # -- arrivals --------------------------------------------------------------------------------------
    def add_request(self, r: Request, now: float) -> None:
        """`r` reaches the engine at `now`. A decode run in progress is cut: the step running now completes
        (async: and the one already decided after it), then the scheduler sees the newcomer."""
        self.scheduler.add_request(r, now)
        self.now = now
        run = self.pending_run
        if run is not None:
            k, ends, t0 = run
            j = run_index(ends, now) + (2 if self.scheduler.async_scheduling else 1)
            if k < j:
                j = k
            self.pending_run = None
            self.pending_tail = (j, ends, now, t0)
            self.wait_s = ends[j - 1] - now

    def arrive(self, r: Request, at: float) -> None:
        """Run to `at`, then `r` arrives (as the engine sees a request the API server hands over then)."""
        if at > self.now:
            self.advance(until=at)
        self.add_request(r, self.now)

    # -- the loop --------------------------------------------------------------------------------------
    def _finish_pending(self, until: float) -> bool:
        """Complete work in progress if it ends by `until`; False if it would end later."""
        sched = self.scheduler
        if self.pending_step is not None:
            out, t_end = self.pending_step
            if t_end > until:
                return False
            self.pending_step = None
            self.now = t_end
            sched.update_from_output(out, t_end)
        if self.pending_tail is not None:
            j, ends, t_resume, t0 = self.pending_tail
            t = t_resume + (ends[j - 1] - t_resume)
            if t > until:
                return False
            self.pending_tail = None
            if t > self.now:
                self.now = t
            sched.commit_decode_run(j, ends, t0)
        if self.pending_run is not None:
            k, ends, t0 = self.pending_run
            t = t0 + (ends[-1] - t0)
            if t > until:
                return False
            self.pending_run = None
            self.now = t
            sched.commit_decode_run(k, ends, t0)
        return True

    def advance(self, until: float = math.inf, stop: Callable[[], bool] | None = None) -> float:
        """Run until `until`, until idle, or until `stop()` is true after a step; returns the clock.

        At a finite `until` the clock stops there with the step or decode run in progress kept pending
        (`wait_s` from `until` when it was started there), so `add_request` then is an arrival at `until`,
        and a later `advance` resumes exactly."""
        sched = self.scheduler
        if not self._finish_pending(until):
            if until > self.now:
                self.now = until
            return self.now
        while sched.has_unfinished_requests():
            if stop is not None and stop():
                break
            now = self.now
            sched.begin_step(now)  # async: an idle engine starts afresh; arrivals by the decision join
            k = sched.plan_decode_run(self.max_run_steps) if self.fast_forward else 0
            if k >= 2:
                ends = sched.decode_run_plan(k, now)  # summed as the clock would add the steps
                wait = ends[-1] - now
                t = now + wait
                if t > until:
                    self.pending_run = (k, ends, now)
                    self.wait_s = wait
                    self.now = until
                    break
                self.now = t
                sched.commit_decode_run(k, ends, now)
                self.steps += k
                continue
            out = sched.schedule(now)
            again = sched.after_schedule(out)  # async: the previous step's finishers are freed now
            if out.is_empty:
                if again:  # nothing to run as decided: decide again now, after the frees
                    continue
                # nothing fits even an empty pool: cannot happen for admitted requests (checked at dispatch)
                raise RuntimeError(f"{self.name}: scheduler made no progress with {len(sched.waiting)} waiting")
            dt = sched.step_duration(out)
            t = now + dt
            if t > until:
                self.pending_step = (out, t)
                self.wait_s = dt
                self.now = until
                break
            self.now = t
            sched.update_from_output(out, t)
            self.steps += 1
        else:
            self.drained_at = self.now  # the clock below idles on to the horizon; Block's makespan reads this
            if until != math.inf and self.now < until:
                self.now = until  # idle until the horizon
        return self.now
