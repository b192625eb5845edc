"""SimPy's timeout, process and run loop for the simulator's hot path: compiled classes on a clock of their own.

Every engine step, decode run and API-server timer is one timer. With SimPy's classes each costs five
interpreted frames (`env.timeout`, `Timeout.__init__`, `env.schedule`, `Environment.step`,
`Process._resume`), and in SimPy's queue every push and pop compares (time, priority, event id) tuples
through Python's generic comparison, ~250 instructions a comparison. These do the same in compiled code
(`make compiled`; in pure Python they are plain classes, as fast as SimPy's):

- `Clock` holds the simulation time and the timers, in a heap of their own beside SimPy's queue, ordered
  by SimPy's own key (time, priority, event id). It is also the environment's event-id counter (SimPy's
  `env._eid`), so a timer and a SimPy event made at the same moment are ordered exactly as two SimPy events
  would be: the two queues are one order, merged at each step.
- `Environment` is a `simpy.Environment` with a clock: its `step`, `peek` and `run` take the earlier of the
  two queues' heads. Everything else is SimPy's.
- `Timer` is a `simpy.Timeout` on the clock: it fires `delay` after now with its callbacks, in exactly
  the order a SimPy timeout made at the same moment would, among SimPy's own events; it has the attributes
  SimPy's `Process._resume` reads, so a SimPy process may wait on it.
- `Proc` is a `simpy.Process` for the simulator's own loops: it starts, resumes, is interrupted (a
  `simpy.Interrupt` is thrown in) and fails as SimPy's does (`simpy/events.py`, `Process` and
  `Interruption`). It may wait on any SimPy event; nothing may wait on it, and an exception it raises
  stops the run at once.
- `step(env)` and `run(env, until)` are `simpy.Environment.step` and `run` (`simpy/core.py`) over both queues.

The time is the clock's `now`, a native field the compiled modules read; the environment's `now` and `_now`
(SimPy's names) are properties over it, so there is one time and nothing keeps two copies equal.

SimPy stays the environment: scalers, chunk planning, the KV-event bus and users' processes use its events
unchanged. `tests/test_events.py` runs the same processes on SimPy's classes and on these, and compares
every step.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import Any, Callable, Final, Generator, Optional, cast

import simpy
from simpy.core import EmptySchedule, StopSimulation

NORMAL = 1  # simpy.events.NORMAL: timeouts
URGENT = 0  # simpy.events.URGENT: a process's start and its interrupts, before anything else at that time
RESUMED = -1  # SimPy's priority for an event whose callbacks a stop cut short: the rest run first on resume


# The compiled build keeps the timers in a heap of its own code, comparing native fields; pure Python keeps them
# in `heapq` as SimPy does, (time, priority, event id, timer) tuples compared in C: the other way round, each
# build would be ~10 % slower (instruction counts, benchmarks/instructions.py).
NATIVE: Final[bool] = not __file__.endswith(".py")  # (Final: compiled, a C static, not a dict lookup)
BUILD: Final[str] = "compiled" if NATIVE else "pure Python"  # what `summary.json` and `twin --version` report


class Clock:
    """The simulation time, the timers' heap, and the event-id counter both queues draw from.

    `next(clock)` is SimPy's `next(env._eid)`: the environment's counter is this object."""

    def __init__(self, env: Any, now: float = 0.0) -> None:
        self.env = env
        self.now = now
        self.eid = 0  # SimPy's `itertools.count()` starts at 0
        self.heap: list[Timer] = []  # compiled build
        self.entries: list[tuple[float, int, int, Timer]] = []  # pure Python

    def __iter__(self) -> Clock:
        return self

    def __next__(self) -> Any:  # (`Any`: mypyc's iterator slot returns an object)
        e = self.eid
        self.eid = e + 1
        return e

    def head(self) -> Optional[Timer]:
        """The earliest timer, left in place; None when there is none."""
        if NATIVE:
            return self.heap[0] if self.heap else None
        return self.entries[0][3] if self.entries else None

    def push(self, t: Timer) -> None:
        """`heapq.heappush` on SimPy's key: compiled, on the timers' native fields."""
        if not NATIVE:
            heappush(self.entries, (t.at, t.priority, t.eid, t))
            return
        heap = self.heap
        heap.append(t)
        _sift_up(heap, t, len(heap) - 1)

    def pop(self) -> Timer:
        """`heapq.heappop`: the earliest timer (compiled: CPython's bottom-up variant, fewer comparisons)."""
        if not NATIVE:
            return heappop(self.entries)[3]
        heap = self.heap
        last = heap.pop()
        if not heap:
            return last
        top = heap[0]
        n = len(heap)
        pos = 0
        child = 1
        while child < n:  # the smaller child up, to a leaf
            right = child + 1
            if right < n and not _before(heap[child], heap[right]):
                child = right
            heap[pos] = heap[child]
            pos = child
            child = 2 * pos + 1
        _sift_up(heap, last, pos)  # then `last` up from there
        return top


def _sift_up(heap: list[Timer], t: Timer, pos: int) -> None:
    """Place `t` at `pos` or above it, moving later parents down (heapq's `_siftdown`)."""
    while pos > 0:
        up = (pos - 1) >> 1
        parent = heap[up]
        if not _before(t, parent):
            break
        heap[pos] = parent
        pos = up
    heap[pos] = t


def _before(a: Timer, b: Timer) -> bool:
    """SimPy's queue order, (time, priority, event id) ascending."""
    if a.at != b.at:
        return a.at < b.at
    if a.priority != b.priority:
        return a.priority < b.priority
    return a.eid < b.eid


class Timer:
    """A `simpy.Timeout`: fires `delay` after now with `callbacks` (the waiting process's resume among them).

    `callback`: the first one, as `then(callback)` adds it, without the second call."""

    def __init__(self, clock: Clock, delay: float, priority: int = NORMAL,
                 callback: Optional[Callable[[Any], None]] = None) -> None:
        if delay < 0:
            raise ValueError(f"Negative delay {delay}")
        self.env = clock.env
        self.callbacks: Optional[list[Callable[[Any], None]]] = [] if callback is None else [callback]
        self._value: Any = None
        self._ok = True
        self._defused = False
        self._delay = delay
        self.at = clock.now + delay
        self.priority = priority
        e = clock.eid
        clock.eid = e + 1
        self.eid = e
        if NATIVE:
            clock.push(self)
        else:  # `Clock.push`, inlined: a call per timer counts in pure Python
            heappush(clock.entries, (self.at, priority, e, self))

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
    event it yielded fires, interrupted by `interrupt()`. `env`: an `Environment` (twin.sim.environment)."""

    def __init__(self, env: Any, generator: Generator[Any, Any, Any]) -> None:
        self.env = env
        self.clock: Clock = env.clock
        self.generator = generator
        self._send: Callable[[Any], Any] = generator.send  # bound once: compiled, `gen.send(v)` looked `send` up by name
        self.alive = True
        self.value: Any = None  # what the generator returned
        self._resume_cb = self._resume  # one bound method: appended to, and removed from, the target's callbacks
        self.target: Any = Timer(self.clock, 0.0, URGENT, self._resume_cb)  # SimPy's `Initialize`

    @property
    def is_alive(self) -> bool:
        return self.alive

    def _resume(self, event: Any) -> None:
        """`simpy.Process._resume`: send the event's value in (or throw its failure) until the generator waits."""
        gen = self.generator
        while True:
            try:
                if NATIVE and type(event) is Timer:  # compiled: the fields, not attribute lookups
                    t = cast(Timer, event)
                    ok = t._ok
                    value = t._value
                else:
                    ok = event._ok
                    value = event._value
                if ok:
                    nxt = self._send(value)
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
            if NATIVE and type(nxt) is Timer:  # (pure Python: `cast` would be a call)
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
        t = Timer(self.clock, 0.0, URGENT, self._interrupt)
        t._ok = False
        t._value = simpy.Interrupt(cause)
        t._defused = True

    def wait_instead(self, delay: float) -> None:
        """Wait for a fresh timer `delay` from now instead of the timer it waits on, which fires without it: what
        an interrupt whose handler waits again does, with no interrupt event and no exception thrown in."""
        cbs = self.target.callbacks
        assert cbs is not None, "wait_instead: the event it waits on has fired"
        cbs.remove(self._resume_cb)
        self.target = Timer(self.clock, delay, NORMAL, self._resume_cb)

    def _interrupt(self, event: Any) -> None:
        if not self.alive:  # ended meanwhile (SimPy: multiple interrupts, or the process finished)
            return
        self.target.callbacks.remove(self._resume_cb)
        self._resume(event)


def peek(env: Any) -> float:
    """`env.peek()`: the time of the next event in either queue, infinity when both are empty."""
    clock: Clock = env.clock
    queue: list = env._queue
    t = clock.head()
    if t is not None:
        return min(t.at, float(queue[0][0])) if queue else t.at
    return float(queue[0][0]) if queue else float("inf")


def step(env: Any) -> None:
    """`env.step()` (`simpy/core.py`, `Environment.step`): process the earliest event of either queue.

    A `StopSimulation` raised by a callback reschedules the event with its remaining callbacks, to run first
    when the simulation resumes, as SimPy does."""
    _step(env, env.clock, env._queue)


def _step(env: Any, clock: Clock, queue: list[tuple[float, int, int, Any]]) -> None:
    """`step`, given the environment's clock and SimPy's queue (a loop reads them once). The queue's entries are
    SimPy's (time, priority, event id, event), its time a float (`Environment._now` is one): typed, compiled, the
    head unpacks to native parts (it is read at every step: the run's end event waits there)."""
    if NATIVE:  # `Clock.head`, inlined
        t = clock.heap[0] if clock.heap else None
    else:
        t = clock.entries[0][3] if clock.entries else None
    timer_first = False
    if t is not None:
        if queue:
            head = queue[0]
            at = float(head[0])
            if t.at != at:
                timer_first = t.at < at
            elif t.priority != head[1]:
                timer_first = t.priority < head[1]
            else:
                timer_first = t.eid < head[2]
        else:
            timer_first = True
    elif not queue:
        raise EmptySchedule
    if timer_first:
        t = clock.pop() if NATIVE else heappop(clock.entries)[3]
        clock.now = t.at  # also `env._now` and `env.now` (twin.sim.environment)
        tcbs = t.callbacks
        t.callbacks = None
        assert tcbs is not None
        i = 0
        try:
            for cb in tcbs:
                i += 1
                cb(t)
        except StopSimulation:
            t.callbacks = tcbs[i:]
            t.priority = RESUMED
            e = clock.eid
            clock.eid = e + 1
            t.eid = e
            clock.push(t)
            raise
        if not t._ok and not t._defused:
            raise _copy_of(t._value)
        return
    entry = heappop(queue)
    event = entry[3]
    clock.now = float(entry[0])
    cbs = event.callbacks
    event.callbacks = None
    i = 0
    try:
        for cb in cbs:
            i += 1
            cb(event)
    except StopSimulation:
        event.callbacks = cbs[i:]
        heappush(queue, (entry[0], RESUMED, next(clock), event))
        raise
    if not event._ok and not hasattr(event, "_defused"):
        raise _copy_of(event._value)


def run(env: Any, until: Optional[Any] = None) -> Optional[Any]:
    """`env.run(until)`: SimPy's loop (`simpy/core.py`, `Environment.run`) over `step`."""
    if until is not None:
        if not isinstance(until, simpy.Event):
            at = float(until)
            if at <= env.clock.now:
                raise ValueError(f"until ({at}) must be greater than the current simulation time")
            ev = simpy.Event(env)
            ev._ok = True
            ev._value = None
            env.schedule(ev, URGENT, at - env.clock.now)
            until = ev
        elif until.callbacks is None:
            return until.value
        until.callbacks.append(StopSimulation.callback)
    clock: Clock = env.clock
    queue: list = env._queue
    try:
        while True:
            _step(env, clock, queue)
    except StopSimulation as stop:
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
