"""Chunk planners: choose vLLM's prefill chunk (`max_num_batched_tokens`) and friends for a workload and SLOs.

Pure policy objects (DESIGN.md, "Policies and their hooks": `ChunkPlanner.plan(window, slo) -> EngineKnobs`).
They never run the twin themselves: the world hands them an *evaluator*, a callable
`(window, knobs, slo) -> summary-like mapping` (the simulator's is `twin.sim.evaluate.TwinEvaluator`; a test's is a
formula). The mapping needs `goodput_req_s` and may carry `slo_attainment` and the `ttft_s`/`tpot_s`/`itl_s`
distributions (each a mapping with `p99`) that the table reports.

The knobs are vLLM's engine arguments by their vLLM names (vllm/config/scheduler.py, `SchedulerConfig`):
`max_num_batched_tokens` is the per-step token budget, which with chunked prefill is the largest prefill chunk;
`long_prefill_token_threshold` caps one request's share of a step (0: no cap).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

DEFAULT_CHUNKS: tuple[int, ...] = tuple(2 ** k for k in range(8, 15))  # 256 .. 16384


@dataclass(frozen=True)
class EngineKnobs:
    """The engine settings a planner decides; None leaves the engine's current value."""

    max_num_batched_tokens: int
    max_num_seqs: Optional[int] = None
    long_prefill_token_threshold: Optional[int] = None

    def as_engine_args(self) -> dict[str, int]:
        """The set knobs by their vLLM names (`cluster.engine.*` in a scenario, CLI flags in vLLM)."""
        return {k: v for k, v in (("max_num_batched_tokens", self.max_num_batched_tokens),
                                   ("max_num_seqs", self.max_num_seqs),
                                   ("long_prefill_token_threshold", self.long_prefill_token_threshold))
                if v is not None}

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.as_engine_args().items())

    def sort_key(self) -> tuple:
        """Smaller chunk first (the tie-break), then fewer sequences, then a tighter per-request cap."""
        return (self.max_num_batched_tokens, self.max_num_seqs or 0, self.long_prefill_token_threshold or 0)


@dataclass(frozen=True)
class SLO:
    """Per-request bounds; a request counts toward goodput when every set bound holds (as twin.sim.metrics does)."""

    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None  # the per-request mean inter-token latency (ITL)
    e2e_s: Optional[float] = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))


@dataclass(frozen=True)
class WorkloadWindow:
    """A slice of traffic a planner plans for: arrival times and lengths, in arrival order.

    `source` may carry the world's own representation of the same requests (the twin's RequestStream with its
    prefix hashes and closed-loop turns) for an evaluator that can use it; a planner never reads it.
    """

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    source: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        a = np.asarray(self.arrival_s, dtype=np.float64)
        p = np.asarray(self.prompt_tokens, dtype=np.int64)
        o = np.asarray(self.output_tokens, dtype=np.int64)
        if not (len(a) == len(p) == len(o)):
            raise ValueError("arrival_s, prompt_tokens and output_tokens must have the same length")
        object.__setattr__(self, "arrival_s", a)
        object.__setattr__(self, "prompt_tokens", p)
        object.__setattr__(self, "output_tokens", o)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    @property
    def mean_prompt_tokens(self) -> float:
        return float(self.prompt_tokens.mean()) if len(self) else 0.0

    @property
    def mean_output_tokens(self) -> float:
        return float(self.output_tokens.mean()) if len(self) else 0.0

    @property
    def rate(self) -> float:
        """Requests per second over the window (0 for fewer than two requests)."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else 0.0


Evaluator = Callable[[WorkloadWindow, EngineKnobs, SLO], Mapping[str, Any]]


def _p99(summary: Mapping[str, Any], key: str) -> Optional[float]:
    d = summary.get(key)
    return d.get("p99") if isinstance(d, Mapping) else None


@dataclass
class Candidate:
    """One evaluated setting: the row of the table behind a choice."""

    knobs: EngineKnobs
    goodput_req_s: float = math.nan
    slo_attainment: Optional[float] = None
    ttft_p99_s: Optional[float] = None
    tpot_p99_s: Optional[float] = None
    itl_p99_s: Optional[float] = None
    error: Optional[str] = None
    chosen: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not math.isnan(self.goodput_req_s)

    def row(self) -> dict[str, Any]:
        return {**self.knobs.as_engine_args(), "goodput_req_s": self.goodput_req_s,
                "slo_attainment": self.slo_attainment, "ttft_p99_s": self.ttft_p99_s,
                "tpot_p99_s": self.tpot_p99_s, "itl_p99_s": self.itl_p99_s, "chosen": self.chosen,
                "error": self.error}


def best_of(cands: Sequence[Candidate], tie_tolerance: float) -> Optional[Candidate]:
    """The highest goodput; candidates within `tie_tolerance` (relative) of it tie, and the smallest chunk wins."""
    ok = [c for c in cands if c.ok]
    if not ok:
        return None
    top = max(c.goodput_req_s for c in ok)
    ties = [c for c in ok if c.goodput_req_s >= top * (1 - tie_tolerance) - 1e-12]
    return min(ties, key=lambda c: c.knobs.sort_key())


def chosen_knobs(rows: Sequence[Candidate], failure: str, fallback: str) -> EngineKnobs:
    """The knobs of the row a planner's `rank` marked chosen; none chosen is a ValueError naming the first
    evaluation error (or `fallback`), prefixed by `failure`."""
    for c in rows:
        if c.chosen:
            return c.knobs
    first = next((c.error for c in rows if c.error), fallback)
    raise ValueError(f"{failure} ({first})")


@dataclass
class ChunkPlanner:
    """Offline planner: evaluate every candidate on the window, keep the best goodput under the SLOs.

    `tie_tolerance` (relative goodput, default 1 %) treats near-equal goodputs as ties, broken toward the smaller
    chunk: a smaller chunk stalls running decodes less for the same goodput. It is a planner setting, not a
    property of vLLM: set it to 0 for strict ties.
    """

    evaluate: Evaluator
    chunks: Sequence[int] = DEFAULT_CHUNKS
    max_num_seqs: Sequence[Optional[int]] = (None,)
    long_prefill_token_threshold: Sequence[Optional[int]] = (None,)
    tie_tolerance: float = 0.01
    name: str = "offline"
    table: list[Candidate] = field(default_factory=list, repr=False)  # the last plan's rows

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError("chunk planner: no candidate chunk sizes")
        if any(int(c) <= 0 for c in self.chunks):
            raise ValueError(f"chunk planner: chunk sizes must be > 0 (got {list(self.chunks)})")
        if self.tie_tolerance < 0:
            raise ValueError("chunk planner: tie_tolerance must be >= 0")

    def candidates(self) -> list[EngineKnobs]:
        """The cross product, minus settings vLLM refuses (a budget below max_num_seqs)."""
        out = []
        for c, s, t in itertools.product(sorted(set(int(x) for x in self.chunks)), self.max_num_seqs,
                                         self.long_prefill_token_threshold):
            if s is not None and c < s:
                continue  # vLLM: max_num_batched_tokens must be >= max_num_seqs
            out.append(EngineKnobs(c, s, t))
        return out

    def score(self, window: WorkloadWindow, knobs: EngineKnobs, slo: SLO) -> Candidate:
        """One candidate through the evaluator; an evaluator error becomes the row's error, not a crash."""
        try:
            s = self.evaluate(window, knobs, slo)
        except Exception as e:  # a candidate the world refuses (e.g. an invalid engine config) is reported
            return Candidate(knobs, error=str(e).splitlines()[0] if str(e) else type(e).__name__)
        return Candidate(knobs, float(s["goodput_req_s"]), s.get("slo_attainment"), _p99(s, "ttft_s"),
                         _p99(s, "tpot_s"), _p99(s, "itl_s"))

    def rank(self, window: WorkloadWindow, slo: SLO,
             progress: Optional[Callable[[Candidate], None]] = None) -> list[Candidate]:
        """Every candidate scored, the chosen one marked; kept as `self.table`."""
        rows = []
        for k in self.candidates():
            rows.append(self.score(window, k, slo))
            if progress is not None:
                progress(rows[-1])
        best = best_of(rows, self.tie_tolerance)
        if best is not None:
            best.chosen = True
        self.table = rows
        return rows

    def plan(self, window: WorkloadWindow, slo: SLO) -> EngineKnobs:
        """The knobs with the highest goodput under `slo` (ties to the smaller chunk)."""
        return chosen_knobs(self.rank(window, slo), "chunk planner: no candidate could be evaluated",
                            "no candidate produced a goodput")


@dataclass
class OnlineChunkPlanner:
    """Re-plans on a sliding window of recent requests and emits a change only when the workload shifted.

    Observe each request as it arrives; call `step(now, slo)` at each decision time. It returns new knobs or
    None. A re-plan happens when the window's mean prompt length (or its rate) moved by more than
    `shift_threshold` (relative) since the last plan; the best candidate is emitted only when it differs from the
    current knobs and beats them by `margin` (relative goodput), so the engine is not restarted for noise.
    Thresholds are planner settings (defaults 25 % and 5 %), not properties of vLLM.
    """

    planner: ChunkPlanner
    current: EngineKnobs
    window_s: float = 60.0
    min_requests: int = 50
    shift_threshold: float = 0.25
    rate_threshold: Optional[float] = None  # also re-plan when the rate moved this much (None: prompt length only)
    margin: float = 0.05
    name: str = "online"
    reference: Optional[dict[str, float]] = None  # the window statistics at the last plan
    changes: list[tuple[float, EngineKnobs]] = field(default_factory=list)
    plans: int = 0  # how many times the evaluator was run over the candidates
    _arrival: list[float] = field(default_factory=list, repr=False)
    _prompt: list[int] = field(default_factory=list, repr=False)
    _output: list[int] = field(default_factory=list, repr=False)

    def observe(self, arrival_s: float, prompt_tokens: int, output_tokens: int) -> None:
        """A request to plan on (both worlds call it at finish, with the output it produced). Kept in arrival
        order: requests finish out of it, and the window's cut and the evaluator's replay read arrival order."""
        a = float(arrival_s)
        k = len(self._arrival)
        if k and self._arrival[-1] > a:
            k = bisect.bisect_right(self._arrival, a)
        self._arrival.insert(k, a)
        self._prompt.insert(k, int(prompt_tokens))
        self._output.insert(k, int(output_tokens))

    def window(self, now: float) -> WorkloadWindow:
        """The requests of the last `window_s` seconds; older ones are forgotten."""
        cut = now - self.window_s
        drop = 0
        while drop < len(self._arrival) and self._arrival[drop] < cut:
            drop += 1
        if drop:
            del self._arrival[:drop], self._prompt[:drop], self._output[:drop]
        return WorkloadWindow(np.array(self._arrival), np.array(self._prompt), np.array(self._output))

    @staticmethod
    def signature(w: WorkloadWindow) -> dict[str, float]:
        return {"mean_prompt_tokens": w.mean_prompt_tokens, "rate": w.rate}

    def shifted(self, sig: dict[str, float]) -> bool:
        """Whether the workload moved enough since the last plan to plan again."""
        ref = self.reference
        if ref is None:
            return True

        def moved(key: str, threshold: float) -> bool:
            base = ref[key]
            return abs(sig[key] - base) > threshold * base if base > 0 else sig[key] > 0

        return moved("mean_prompt_tokens", self.shift_threshold) or (
            self.rate_threshold is not None and moved("rate", self.rate_threshold))

    def step(self, now: float, slo: SLO) -> Optional[EngineKnobs]:
        """New knobs to apply, or None (too few requests, no shift, or no candidate better by the margin)."""
        w = self.window(now)
        if len(w) < self.min_requests:
            return None
        sig = self.signature(w)
        if not self.shifted(sig):
            return None
        if hasattr(self.planner, "default"):  # a planner that keeps a default (robust_chunk) keeps the current knobs
            self.planner.default = self.current
        rows = self.planner.rank(w, slo)
        self.plans += 1
        self.reference = sig
        best = next((c for c in rows if c.chosen), None)
        if best is None or best.knobs == self.current:
            return None
        cur = next((c for c in rows if c.knobs == self.current), None)
        if cur is None:
            cur = self.planner.score(w, self.current, slo)
        if cur.ok and best.goodput_req_s <= cur.goodput_req_s * (1 + self.margin):
            return None
        self.current = best.knobs
        self.changes.append((now, best.knobs))
        return best.knobs

    def plan(self, window: WorkloadWindow, slo: SLO) -> EngineKnobs:
        """The protocol's one-shot form: the offline choice for this window."""
        return self.planner.plan(window, slo)


__all__ = ["DEFAULT_CHUNKS", "Candidate", "ChunkPlanner", "EngineKnobs", "Evaluator", "OnlineChunkPlanner", "SLO",
           "WorkloadWindow", "best_of"]
