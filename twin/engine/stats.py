"""What an engine accumulates over a run: vLLM's scheduler and iteration stats (`vllm/v1/metrics/stats.py`),
with inter-token latencies kept compactly."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Final

import numpy as np


ITL_FLUSH: Final = 1 << 16  # values gathered before they move into the arrays (Final: compiled, a constant)


class ItlRecorder:
    """Inter-token latencies as (value, how many tokens had it), in compact arrays (16 bytes an entry).

    Values gather in lists first, a weight each; a decode run's steps go in as its end times (one pointer copy)
    with one weight per run, and their gaps are taken when the lists move into the float64 arrays, in chunks
    (array.extend converts a list element by element through argument parsing, ~10x slower than numpy)."""

    __slots__ = ("values", "weights", "_buf", "_wts", "_ends", "_runs", "_run_wts")

    def __init__(self) -> None:
        self.values = array("d")
        self.weights = array("q")
        self._buf: list[float] = []
        self._wts: list[int] = []
        self._ends: list[float] = []
        self._runs: list[int] = []
        self._run_wts: list[int] = []

    def add(self, value: float, weight: int) -> None:
        if weight > 0:
            self._buf.append(value)
            self._wts.append(weight)
            if len(self._buf) >= ITL_FLUSH:
                self._flush()

    def add_steps(self, ends: list[float], j: int, weight: int) -> None:
        """Steps 1..j-1 of a decode run that ended at ends[0..j-1]: each step's gap, ends[s] - ends[s-1] (as a
        stepped engine's `t_end - group_last_out`), `weight` tokens each."""
        if weight > 0 and j > 1:
            self._ends.extend(ends if j == len(ends) else ends[:j])  # a whole run: no slice copied
            self._runs.append(j)
            self._run_wts.append(weight)
            if len(self._ends) >= ITL_FLUSH:
                self._flush()

    def _flush(self) -> None:
        if self._ends:
            e = np.asarray(self._ends, dtype=np.float64)
            runs = np.asarray(self._runs, dtype=np.int64)
            gaps = e[1:] - e[:-1]
            keep = np.ones(len(gaps), dtype=bool)
            keep[np.cumsum(runs)[:-1] - 1] = False  # a gap across two runs' ends is no step
            self.values.frombytes(gaps[keep].tobytes())
            self.weights.frombytes(np.repeat(np.asarray(self._run_wts, dtype=np.int64), runs - 1).tobytes())
            self._ends = []
            self._runs = []
            self._run_wts = []
        if self._buf:
            self.values.frombytes(np.asarray(self._buf, dtype=np.float64).tobytes())
            self.weights.frombytes(np.asarray(self._wts, dtype=np.int64).tobytes())
            self._buf = []
            self._wts = []

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        self._flush()
        return np.frombuffer(self.values, dtype=np.float64), np.frombuffer(self.weights, dtype=np.int64)


@dataclass
class EngineStats:
    """Counters and weighted samples an instance accumulates over a run."""

    num_steps: int = 0
    busy_time_s: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens of newly admitted requests (vLLM's counter)
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_used_block_seconds: float = 0.0
    kv_peak_used_blocks: int = 0
    generated_tokens: int = 0
    itl: ItlRecorder = field(default_factory=ItlRecorder)
