"""Per-request records as columns: every request of a run, whatever became of it."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pandas as pd

from twin.engine.request import RequestStatus
from twin.engine.sink import EngineSink


def account(log: "RequestLog") -> dict[str, int]:
    """How many requests ended in each state; they always add up to the total."""
    counts = np.bincount(log.status, minlength=len(RequestStatus))
    return {s.name.lower(): int(counts[s]) for s in RequestStatus}


class RequestLog(EngineSink):
    """Column arrays indexed by request number; NaN means 'did not happen (yet)'. The engine's sink for a run:
    its request events fill the columns (twin.engine.sink)."""

    def __init__(self, n: int) -> None:
        self.n = n
        # each column is a numpy view of an `array.array`, written through a memoryview of it (`buffers`): the
        # simulator writes one element at a time, several times a request, at a small part of what numpy's
        # indexing costs per element (and under the array's own item assignment, which parses its argument)
        self.buffers: dict[str, Any] = {}  # memoryviews (typeshed types their items as ints only)
        nan = float("nan")
        self.arrival_s = self._column("arrival_s", "d", np.float64, nan)
        self.scheduled_s = self._column("scheduled_s", "d", np.float64, nan)
        self.first_token_s = self._column("first_token_s", "d", np.float64, nan)
        self.finish_s = self._column("finish_s", "d", np.float64, nan)
        self.instance = self._column("instance", "i", np.int32, -1)
        self.prompt_tokens = self._column("prompt_tokens", "q", np.int64, 0)
        self.max_tokens = self._column("max_tokens", "q", np.int64, 0)
        self.output_tokens = self._column("output_tokens", "q", np.int64, 0)
        self.cached_tokens = self._column("cached_tokens", "q", np.int64, 0)
        self.preemptions = self._column("preemptions", "i", np.int32, 0)
        self.status = self._column("status", "b", np.int8, int(RequestStatus.PENDING))
        self.session_id = self._column("session_id", "q", np.int64, -1)
        self.priority = self._column("priority", "q", np.int64, 0)  # vLLM's request priority (lower first)
        self.reject_reason: dict[int, str] = {}
        self.reject_counts: dict[str, int] = {}

    def _column(self, name: str, code: str, dtype, fill) -> np.ndarray:
        buf = memoryview(array(code, [fill]) * self.n)
        assert buf.itemsize == np.dtype(dtype).itemsize
        self.buffers[name] = buf
        return np.frombuffer(buf, dtype=dtype)

    # -- the engine's events (twin.engine.sink.EngineSink) ---------------------------------------------
    def request_queued(self, r, now: float) -> None:
        self.status[r.idx] = RequestStatus.WAITING

    def request_scheduled(self, r, t_decided: float, cached_tokens: int) -> None:
        self.scheduled_s[r.idx] = t_decided
        self.cached_tokens[r.idx] = cached_tokens

    def request_running(self, r) -> None:
        self.status[r.idx] = RequestStatus.RUNNING

    def request_preempted(self, r) -> None:
        self.preemptions[r.idx] = r.num_preemptions
        if r.status is RequestStatus.PREEMPTED:  # not one finished in the step in flight (async), taken as a victim
            self.status[r.idx] = RequestStatus.PREEMPTED

    def first_token(self, r, t: float) -> None:
        self.first_token_s[r.idx] = t

    def request_finished(self, r, t: float) -> None:
        self.finish_s[r.idx] = t
        self.output_tokens[r.idx] = r.num_output_tokens
        self.status[r.idx] = RequestStatus.FINISHED

    def reject(self, idx: int, reason: str, detail: str = "") -> None:
        """Record a rejection: `reason` is a short category (counted), `detail` the specifics."""
        self.status[idx] = RequestStatus.REJECTED
        self.reject_reason[idx] = f"{reason}: {detail}" if detail else reason
        self.reject_counts[reason] = self.reject_counts.get(reason, 0) + 1

    def to_frame(self, instance_names: list[str] | None = None) -> pd.DataFrame:
        """One row per request, with status names and derived latencies."""
        names = np.array([s.name.lower() for s in RequestStatus])
        df = pd.DataFrame({
            "request_id": np.arange(self.n),
            "arrival_s": self.arrival_s,
            "scheduled_s": self.scheduled_s,
            "first_token_s": self.first_token_s,
            "finish_s": self.finish_s,
            "instance": self.instance,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "preemptions": self.preemptions,
            "status": names[self.status],
            "session_id": self.session_id,
            "priority": self.priority,
        })
        if instance_names is not None:
            labels = np.array(list(instance_names) + [""], dtype=object)
            df["instance_name"] = labels[self.instance]
        reasons = np.full(self.n, "", dtype=object)
        for i, r in self.reject_reason.items():
            reasons[i] = r
        df["reject_reason"] = reasons
        df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
        df["e2e_s"] = df["finish_s"] - df["arrival_s"]
        df["queue_s"] = df["scheduled_s"] - df["arrival_s"]
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = (df["finish_s"] - df["first_token_s"]) / (df["output_tokens"] - 1)
        df["tpot_s"] = tpot.where(df["output_tokens"] > 1)
        return df
