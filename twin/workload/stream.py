"""The one shape every workload takes: a columnar stream of requests, plus an account of where it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TraceStats:
    """How the rows of a source became requests: nothing is dropped without being counted here."""

    source: str = "synthetic"
    rows_read: int = 0
    rows_used: int = 0
    rows_filtered: int = 0  # removed on purpose (a filter, a window, sampling, a cap)
    rows_skipped: int = 0  # malformed rows skipped because the user asked to skip bad rows
    notes: list[str] = field(default_factory=list)
    span_s: float | None = None  # a trace's requests: seconds from its first to its last, before any window

    def to_dict(self) -> dict:
        return {"source": self.source, "rows_read": self.rows_read, "rows_used": self.rows_used,
                "rows_filtered": self.rows_filtered, "rows_skipped": self.rows_skipped, "span_s": self.span_s,
                "notes": self.notes}


@dataclass
class RequestStream:
    """Requests in arrival order. `hash_ids[i]` is request i's prefix identity, each id naming
    `hash_block_size` tokens (None or empty: content nobody shares).

    Closed-loop turns: where `after[i] >= 0`, request i is sent `think_s[i]` seconds after request
    `after[i]` finishes (or is rejected), as a chat user answers; its `arrival_s` is then only the
    open-loop estimate that orders the stream, and the simulation records the real arrival.
    """

    arrival_s: np.ndarray  # float64, non-decreasing, seconds from the start
    prompt_tokens: np.ndarray  # int64 > 0
    output_tokens: np.ndarray  # int64 > 0
    hash_ids: list | None = None
    hash_block_size: int = 16
    hashes_cover_output: bool = False  # ids also name the output tokens (multi-turn sessions)
    session_id: np.ndarray | None = None
    stats: TraceStats = field(default_factory=TraceStats)
    after: np.ndarray | None = None  # index of the turn this one waits for, -1 for none
    think_s: np.ndarray | None = None  # seconds after that turn ends
    texts: list | None = None  # prompt text per request, where the trace has it (length predictors read it)
    priority: np.ndarray | None = None  # vLLM's request priority (int64; lower is served first), None: all 0
    _key_runs: list | None = field(default=None, init=False, repr=False, compare=False)  # twin.sim.cluster.trace_key_runs

    def __post_init__(self) -> None:
        self.arrival_s = np.asarray(self.arrival_s, dtype=np.float64)
        self.prompt_tokens = np.asarray(self.prompt_tokens, dtype=np.int64)
        self.output_tokens = np.asarray(self.output_tokens, dtype=np.int64)
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise ValueError("arrival_s, prompt_tokens and output_tokens must have the same length")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise ValueError("hash_ids must have one entry per request")
        if self.texts is not None and len(self.texts) != n:
            raise ValueError("texts must have one entry per request")
        if self.priority is not None:
            self.priority = np.asarray(self.priority, dtype=np.int64)
            if len(self.priority) != n:
                raise ValueError("priority must have one entry per request")
        if (self.after is None) != (self.think_s is None):
            raise ValueError("after and think_s come together")
        if n and np.any(np.diff(self.arrival_s) < 0):
            order = np.argsort(self.arrival_s, kind="stable")
            self._take(order)

    def _take(self, idx: np.ndarray) -> None:
        self.arrival_s = self.arrival_s[idx]
        self.prompt_tokens = self.prompt_tokens[idx]
        self.output_tokens = self.output_tokens[idx]
        if self.hash_ids is not None:
            self.hash_ids = [self.hash_ids[i] for i in idx]
        if self.texts is not None:
            self.texts = [self.texts[i] for i in idx]
        if self.session_id is not None:
            self.session_id = np.asarray(self.session_id)[idx]
        if self.priority is not None:
            self.priority = self.priority[idx]
        if self.after is not None:
            position = np.empty(len(idx), dtype=np.int64)
            position[idx] = np.arange(len(idx))  # old index -> new index
            old = np.asarray(self.after)[idx]
            self.after = np.where(old >= 0, position[np.maximum(old, 0)], -1)
            self.think_s = np.asarray(self.think_s, dtype=np.float64)[idx]

    def __len__(self) -> int:
        return len(self.arrival_s)

    def head(self, n: int) -> "RequestStream":
        """The first n requests (a cap on count)."""
        s = RequestStream(
            self.arrival_s[:n], self.prompt_tokens[:n], self.output_tokens[:n],
            None if self.hash_ids is None else self.hash_ids[:n], self.hash_block_size,
            self.hashes_cover_output, None if self.session_id is None else self.session_id[:n],
            TraceStats(**{**self.stats.to_dict(), "notes": list(self.stats.notes)}),
            None if self.after is None else self.after[:n], None if self.think_s is None else self.think_s[:n],
            None if self.texts is None else self.texts[:n],
            None if self.priority is None else self.priority[:n],
        )
        s.stats.rows_filtered += len(self) - len(s)
        s.stats.rows_used = len(s)
        return s
