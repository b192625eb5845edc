"""SimPy's timeout, process and run loop for the simulator's hot path, as compiled classes in SimPy's own queue.

Every engine step, decode run and API-server timer is one SimPy event. With SimPy's classes each costs five
interpreted frames (`env.timeout`, `Timeout.__init__`, `env.schedule`, `Environment.step`,
`Process._resume`), about 8,000 instructions: a sixth of a compiled replay. These do the same in compiled
code (`make compiled`; in pure Python they are plain classes, as fast as SimPy's):

- `Timer` is a `simpy.Timeout`: it goes into the environment's own queue with SimPy's (time, priority, event
  id) key, so it fires in exactly the order a SimPy timeout made at the same moment would, among SimPy's own
  events; it has the attributes SimPy's `step` and `Process._resume` read, so `env.step()` and
  `env.run()` handle it too.
- `Proc` is a `simpy.Process` for the simulator's own loops: it starts, resumes, is interrupted (a
  `simpy.Interrupt` is thrown in) and fails as SimPy's does (`simpy/events.py`, `Process` and
  `Interruption`). It may wait on any SimPy event; nothing may wait on it, and an exception it raises
  stops the run at once.
- `run(env, until)` is `simpy.Environment.run` (`simpy/core.py`) with `step` inlined.

The compiled modules read the clock as `env._now`, the field behind SimPy's `env.now`: the property is an
interpreted call, ~11,000 a replay.

SimPy stays the environment: scalers, chunk planning, the KV-event bus and users' processes use
`simpy.Environment` and its events unchanged. `tests/test_events.py` runs the same processes on SimPy's
classes and on these, and compares every step.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import Any, Callable, Generator, Optional, cast

import simpy
from simpy.core import EmptySchedule, StopSimulation

NORMAL = 1  # simpy.events.NORMAL: timeouts
URGENT = 0  # simpy.events.URGENT: a process's start and its interrupts, before anything else at that time


class Timer:
    """A `simpy.Timeout`: fires `delay` after now with `callbacks` (the waiting process's resume among them).

    `callback`: the first one, as `then(callback)` adds it, without the second call."""

    def __init__(self, env: Any, delay: float, priority: int = NORMAL,
                 callback: Optional[Callable[[Any], None]] = None) -> None:
        if delay < 0:
            raise ValueError(f"Negative delay {delay}")
        self.env = env
        self.callbacks: Optional[list[Callable[[Any], None]]] = [] if callback is None else [callback]
        self._value: Any = None
        self._ok = True
        self._defused = False
        self._delay = delay
        heappush(env._queue, (env._now + delay, priority, next(env._eid), self))

    def then(self, fn: Callable[[Any], None]) -> Timer:
        """Call `fn(timer)` when it fires (SimPy: `timeout.callbacks.append(fn)`)."""
        cbs = self.callbacks
        assert cbs is not None, "the timer has fired already"
        cbs.append(fn)
        return self

    # what SimPy's events answer
    @property
    def triggered(self) -> bool:
        return True  # a timeout is triggered when it is made; it is processed when it fires

    @property
    def processed(self) -> bool:
        return self.callbacks is None

    @property
    def ok(self) -> bool:
        return self._ok

    @property
    def value(self) -> Any:
        return self._value

    @property
    def defused(self) -> bool:
        return self._defused

    def __repr__(self) -> str:
        return f"<Timer({self._delay}) object at {id(self):#x}>"


class Proc:
    """A `simpy.Process` running `generator`: started now (before anything else at this time), resumed when the
    event it yielded fires, interrupted by `interrupt()`."""

    def __init__(self, env: Any, generator: Generator[Any, Any, Any]) -> None:
        self.env = env
        self.generator = generator
        self.alive = True
        self.value: Any = None  # what the generator returned
        self._resume_cb = self._resume  # one bound method: appended to, and removed from, the target's callbacks
        self.target: Any = Timer(env, 0.0, URGENT, self._resume_cb)  # SimPy's `Initialize`

    @property
    def is_alive(self) -> bool:
        return self.alive

    def _resume(self, event: Any) -> None:
        """`simpy.Process._resume`: send the event's value in (or throw its failure) until the generator waits."""
        gen = self.generator
        while True:
            try:
                if type(event) is Timer:  # compiled: the fields, not attribute lookups
                    t = cast(Timer, event)
                    ok = t._ok
                    value = t._value
                else:
                    ok = event._ok
                    value = event._value
                if ok:
                    nxt = gen.send(value)
                else:  # the process handles the failure (or fails itself) on its own copy of the exception
                    event._defused = True
                    nxt = gen.throw(_copy_of(value))
            except StopIteration as e:
                self.alive = False
                self.value = e.value
                self.target = None
                return
            except BaseException:
                self.alive = False
                self.target = None
                raise
            if type(nxt) is Timer:
                cbs = cast(Timer, nxt).callbacks
            else:
                try:
                    cbs = nxt.callbacks
                except AttributeError:
                    raise RuntimeError(f'Invalid yield value "{nxt}" from {gen!r}') from None
            if cbs is not None:  # not fired yet: resume when it does
                cbs.append(self._resume_cb)
                self.target = nxt
                return
            event = nxt  # fired already: its value goes in at once

    def interrupt(self, cause: Any = None) -> None:
        """`simpy.Process.interrupt`: a `simpy.Interrupt` is thrown in now, before anything else at this time."""
        if not self.alive:
            raise RuntimeError(f"{self} has terminated and cannot be interrupted.")
        t = Timer(self.env, 0.0, URGENT, self._interrupt)
        t._ok = False
        t._value = simpy.Interrupt(cause)
        t._defused = True

    def wait_instead(self, delay: float) -> None:
        """Wait for a fresh timer `delay` from now instead of the timer it waits on, which fires without it: what
        an interrupt whose handler waits again does, with no interrupt event and no exception thrown in."""
        cbs = self.target.callbacks
        assert cbs is not None, "wait_instead: the event it waits on has fired"
        cbs.remove(self._resume_cb)
        self.target = Timer(self.env, delay, NORMAL, self._resume_cb)

    def _interrupt(self, event: Any) -> None:
        if not self.alive:  # ended meanwhile (SimPy: multiple interrupts, or the process finished)
            return
        self.target.callbacks.remove(self._resume_cb)
        self._resume(event)


def run(env: Any, until: Optional[Any] = None) -> Optional[Any]:
    """`env.run(until)`: SimPy's loop (`simpy/core.py`, `Environment.run` and `step`), its step inlined."""
    if until is not None:
        if not isinstance(until, simpy.Event):
            at = float(until)
            if at <= env._now:
                raise ValueError(f"until ({at}) must be greater than the current simulation time")
            ev = simpy.Event(env)
            ev._ok = True
            ev._value = None
            env.schedule(ev, URGENT, at - env._now)
            until = ev
        elif until.callbacks is None:
            return until.value
        until.callbacks.append(StopSimulation.callback)
    queue: list = env._queue
    # `Environment.step`'s callback loop, inlined: on a stop inside it (the `until` event's callback), the
    # event's remaining callbacks run first when the simulation resumes (`entry`, `cbs` and `i` say where)
    entry: tuple = (0.0, 0, 0, None)
    cbs: list = []
    i = -1  # callbacks of `entry` run so far; -1: outside a callback loop
    try:
        while queue:
            entry = heappop(queue)
            event = entry[3]
            env._now = entry[0]
            if type(event) is Timer:  # compiled: the fields, not attribute lookups
                t = cast(Timer, event)
                tcbs = t.callbacks
                t.callbacks = None
                assert tcbs is not None
                cbs = tcbs
                i = 0
                for cb in cbs:
                    i += 1
                    cb(event)
                i = -1
                if not t._ok and not t._defused:
                    raise _copy_of(t._value)
            else:
                cbs = event.callbacks
                event.callbacks = None
                i = 0
                for cb in cbs:
                    i += 1
                    cb(event)
                i = -1
                if not event._ok and not hasattr(event, "_defused"):
                    raise _copy_of(event._value)
        raise EmptySchedule
    except StopSimulation as stop:
        if i >= 0:
            event = entry[3]
            event.callbacks = cbs[i:]
            heappush(queue, (entry[0], -1, next(env._eid), event))
        return stop.args[0]
    except EmptySchedule:
        if until is not None:
            assert not until.triggered
            raise RuntimeError(f'No scheduled events left but "until" event was not triggered: {until}') from None
    return None


def _copy_of(failure: Any) -> BaseException:
    """A fresh copy of a failed event's exception, as SimPy raises it: the original, traceback and all, is its cause."""
    exc = type(failure)(*failure.args)
    exc.__cause__ = failure
    return exc
