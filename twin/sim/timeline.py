"""Per-instance time series of a run (running, waiting, KV use, in flight), sampled at a fixed resolution.

No SimPy process ticks: like the scrape clock (twin.sim.instance.ScrapeClock), an instance records the
ticks since its last record only when it is about to change (`Instance.touch`), each with the state it
had then, so cost grows with events and ticks, not with a process's events. A tick at T sees the state
before any event at T; the run's end records every instance through its last tick."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import simpy

from twin.sim.dispatcher import Dispatcher
from twin.sim.instance import Instance, ScrapeClock


# at most about this many rows (instances x ticks, ~240 bytes each while the run holds them): a trace whose arrivals
# span a month at the default 1 s would hold 2.6 M ticks per instance, and a year's ran the machine out of memory
MAX_ROWS = 2_000_000
_ROUND_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)


def timeline_interval(interval_s: float, span_s: float, instances: int) -> tuple[float, str | None]:
    """The timeline's resolution for a run whose arrivals span `span_s` on up to `instances`: `interval_s`, or
    the first round interval above it that keeps the rows within `MAX_ROWS`, with a note saying so."""
    rows = span_s / interval_s * max(1, instances)
    if rows <= MAX_ROWS:
        return interval_s, None
    need = span_s * max(1, instances) / MAX_ROWS
    new = next((float(r) for r in _ROUND_S if r >= need), float(math.ceil(need / 86400) * 86400))
    return new, (f"timeline every {new:g} s, not {interval_s:g} s: arrivals over {span_s:,.0f} s on up to "
                 f"{instances} instances would be {rows:,.0f} rows (at most {MAX_ROWS:,} are kept in memory); "
                 "set sim.timeline_interval_s (0: no timeline)")


class Timeline:
    """Samples every instance every `interval_s` of simulated time (start + k x interval_s) into compact columns."""

    def __init__(self, env: simpy.Environment, dispatcher: Dispatcher, interval_s: float) -> None:
        self.env = env
        self.dispatcher = dispatcher
        self.interval_s = interval_s
        self.note: str | None = None  # why `interval_s` is coarser than the scenario's (`timeline_interval`)
        self.start: float = env.now
        self.clock = ScrapeClock(self.start, interval_s)  # the ticks: start + k x interval_s, as a scrape poller's
        # plain lists: compiled, their appends are native (an array's are method calls)
        self.t: list[float] = []
        self.instance: list[int] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.kv_usage: list[float] = []
        self.inflight: list[int] = []
        self.state: list[str] = []
        self._names: list[str] = []
        self._pos: dict[str, int] = {}
        for inst in dispatcher.instances:
            self.attach(inst, self.start)

    def _index(self, name: str) -> int:
        i = self._pos.get(name)
        if i is None:
            i = self._pos[name] = len(self._names)
            self._names.append(name)
        return i

    def attach(self, inst: Instance, first_tick: float | None = None) -> None:
        """Record `inst` from `first_tick` (default: the first tick after now: it did not exist before now)."""
        self._index(inst.id)
        if first_tick is None:
            self.clock.last_tick(self.env.now)
            first_tick = self.clock.nxt
        inst.timeline = self
        inst.timeline_next = first_tick

    def fill(self, inst: Instance, now: float) -> None:
        """`inst` is about to change at `now`: record its ticks through `now` with the state it has had since."""
        t: float = inst.timeline_next
        dt = self.interval_s
        start = self.start
        k = int(round((t - start) / dt))
        code = self._pos[inst.id]
        ld = self.dispatcher.bookkeeping.loads.get(inst.id)
        inflight: int = ld.requests if ld is not None else 0
        state: str = inst.state
        running: int = inst.num_running
        waiting: int = inst.num_waiting
        while t <= now:
            self.t.append(t)
            self.instance.append(code)
            self.running.append(running)
            self.waiting.append(waiting)
            self.kv_usage.append(inst.kv_usage_at(t))  # a decode run in progress takes a block per step
            self.inflight.append(inflight)
            self.state.append(state)
            k += 1
            t = start + k * dt
        inst.timeline_next = t

    def finish(self, now: float) -> None:
        """The run ended at `now`: every instance's ticks through it."""
        for inst in self.dispatcher.instances:
            if inst.timeline_next <= now:
                self.fill(inst, now)

    def to_frame(self) -> pd.DataFrame:
        """Rows in time order, then in the order instances joined (as a sampling process would append them)."""
        t = np.asarray(self.t, dtype=np.float64)
        codes = np.asarray(self.instance, dtype=np.int32)
        order = np.lexsort((codes, t))
        return pd.DataFrame({
            "t_s": pd.Series(t[order], dtype="float64"),
            "instance": pd.Categorical.from_codes(codes[order], categories=self._names) if self._names else [],
            "running": pd.Series(np.asarray(self.running, dtype=np.int32)[order], dtype="int32"),
            "waiting": pd.Series(np.asarray(self.waiting, dtype=np.int32)[order], dtype="int32"),
            "kv_usage": pd.Series(np.asarray(self.kv_usage, dtype=np.float64)[order], dtype="float64"),
            "inflight": pd.Series(np.asarray(self.inflight, dtype=np.int32)[order], dtype="int32"),
            "state": pd.Series(np.asarray(self.state, dtype=object)[order], dtype="category"),
        })
