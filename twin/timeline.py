"""Per-instance time series of a run (running, waiting, KV use, in flight), sampled at a fixed resolution."""

from __future__ import annotations

from array import array

import pandas as pd
import simpy


class Timeline:
    """Samples every instance every `interval_s` of simulated time into compact columns."""

    def __init__(self, env: simpy.Environment, dispatcher, interval_s: float) -> None:
        self.env = env
        self.dispatcher = dispatcher
        self.interval_s = interval_s
        self.t = array("d")
        self.instance = array("i")
        self.running = array("i")
        self.waiting = array("i")
        self.kv_usage = array("d")
        self.inflight = array("i")
        self.state: list[str] = []
        self._names: list[str] = []
        self._pos: dict[str, int] = {}
        self.stopped = False
        env.process(self._sample())

    def _index(self, name: str) -> int:
        i = self._pos.get(name)
        if i is None:
            i = self._pos[name] = len(self._names)
            self._names.append(name)
        return i

    def sample(self) -> None:
        now = self.env.now
        loads = self.dispatcher.bookkeeping.loads
        for inst in self.dispatcher.instances:
            self.t.append(now)
            self.instance.append(self._index(inst.id))
            self.running.append(inst.num_running)
            self.waiting.append(inst.num_waiting)
            self.kv_usage.append(inst.kv_usage)
            ld = loads.get(inst.id)
            self.inflight.append(ld.requests if ld is not None else 0)
            self.state.append(inst.state)

    def _sample(self):
        while not self.stopped:
            self.sample()
            yield self.env.timeout(self.interval_s)

    def to_frame(self) -> pd.DataFrame:
        names = pd.Categorical.from_codes(list(self.instance), categories=self._names) if self._names else []
        return pd.DataFrame({
            "t_s": pd.Series(self.t, dtype="float64"),
            "instance": names,
            "running": pd.Series(self.running, dtype="int32"),
            "waiting": pd.Series(self.waiting, dtype="int32"),
            "kv_usage": pd.Series(self.kv_usage, dtype="float64"),
            "inflight": pd.Series(self.inflight, dtype="int32"),
            "state": pd.Series(self.state, dtype="category"),
        })
