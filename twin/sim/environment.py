"""The simulation's environment: SimPy's, with the twin's clock beside its queue (twin.sim.events).

Its `step`, `peek` and `run` take the earlier of the two queues' heads, so SimPy's events and the twin's
timers fire in one order, the order SimPy alone would give them. Everything else is `simpy.Environment`:
scalers, the KV-event bus and users' processes make SimPy events on it as on any environment.
"""

from __future__ import annotations

from typing import Any, Optional

import simpy

from twin.sim import events
from twin.sim.events import Clock


class Environment(simpy.Environment):
    """`simpy.Environment` with a `clock` (twin.sim.events.Clock): the twin's timers and the event-id counter."""

    def __init__(self, initial_time: float = 0.0) -> None:
        self.clock = Clock(self, float(initial_time))  # first: SimPy's __init__ sets `_now`, which is the clock's
        super().__init__(initial_time)
        self._eid = self.clock  # type: ignore[assignment]  # one counter for both queues: one order

    # The time lives in the clock, a native field the compiled modules read as `clock.now`; SimPy's own code
    # (`schedule`, `Timeout`, `Process`) reads and `step` sets `_now`, which is the same value.
    @property  # type: ignore[override]
    def _now(self) -> float:
        return self.clock.now

    @_now.setter
    def _now(self, value: float) -> None:
        self.clock.now = float(value)

    @property
    def now(self) -> float:
        """The current simulation time (SimPy's `now`)."""
        return self.clock.now

    def step(self) -> None:
        events.step(self)

    def peek(self) -> float:
        return events.peek(self)

    def run(self, until: Optional[Any] = None) -> Optional[Any]:
        return events.run(self, until)
