"""A chunk planner that keeps vLLM's default unless a candidate beats it on most resampled recent windows.

The offline `ChunkPlanner` keeps the highest goodput on one window, ties to the smaller chunk. Planned on the
first part of a trace and applied to the rest, that overfits: one lucky stretch, or a light window where every
chunk meets the SLOs (a tie, so the smallest chunk), picks a small chunk that then loses under the rest's load
(issue 21: -18 % goodput against vLLM's default on Azure conversation). This planner asks a stricter question.

The rule (say it when reporting a pick):

1. Plan on the *recent* part of the window: its last `recent_s` seconds (None: all of it).
2. Cut that part into `blocks` contiguous, equal-duration time blocks and draw `resamples` moving-block bootstrap
   windows: `blocks` blocks drawn with replacement, laid end to end with each block's own inter-arrival gaps
   (bursts and their lengths stay together; which stretches of traffic appear, and how often, varies).
3. Score vLLM's default knobs and every candidate on every resample with the evaluator.
4. A candidate *wins* a resample when its goodput beats the default's by more than `margin` (relative).
   It is eligible when it wins at least `min_wins` (a fraction) of the resamples.
5. Among eligible candidates, the one with the highest median relative gain over the default is chosen (ties:
   more wins, then the smaller chunk). With none eligible the default is kept: a tie keeps the default.

`margin`, `min_wins`, `blocks` and `resamples` are planner settings (defaults 2 %, 0.8, 8, 8), not properties of
vLLM. The default knobs are the world's to give (`twin.engine.defaults.batch_defaults` resolves vLLM's for a GPU,
as `vllm/engine/arg_utils.py` `EngineArgs.get_batch_defaults` does); a policy never resolves them itself.
Cost: (candidates + 1) x resamples evaluator runs, each over a window as long as the recent part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from twin.policy.chunk import (DEFAULT_CHUNKS, SLO, Candidate, ChunkPlanner, EngineKnobs, Evaluator, WorkloadWindow,
                               chosen_knobs)


def recent(window: WorkloadWindow, recent_s: Optional[float]) -> WorkloadWindow:
    """The window's last `recent_s` seconds (all of it when None or longer than the window)."""
    if recent_s is None or len(window) == 0:
        return window
    keep = window.arrival_s >= window.arrival_s[-1] - recent_s
    return WorkloadWindow(window.arrival_s[keep], window.prompt_tokens[keep], window.output_tokens[keep])


def block_bounds(window: WorkloadWindow, blocks: int) -> list[tuple[int, int]]:
    """Index ranges of `blocks` equal-duration time blocks (a block may be empty)."""
    a = window.arrival_s
    if len(a) == 0:
        return [(0, 0)] * blocks
    edges = np.linspace(a[0], a[-1], blocks + 1)
    cut = np.searchsorted(a, edges[1:-1], side="left")
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(a)]])
    return [(int(s), int(e)) for s, e in zip(starts, ends)]


def block_resample(window: WorkloadWindow, blocks: int, rng: np.random.Generator) -> WorkloadWindow:
    """One moving-block bootstrap window: `blocks` time blocks drawn with replacement, laid end to end.

    Each block keeps its arrivals' offsets from the block's start; a drawn block starts where the previous one
    ended (its nominal duration), so the resample lasts as long as the window and its rate is the drawn blocks'.
    """
    bounds = block_bounds(window, blocks)
    span = window.duration_s / blocks if blocks else 0.0
    a, p, o = window.arrival_s, window.prompt_tokens, window.output_tokens
    t0 = a[0] if len(a) else 0.0
    arr, pro, out = [], [], []
    for k, b in enumerate(rng.integers(0, blocks, blocks)):
        s, e = bounds[b]
        arr.append(a[s:e] - (t0 + b * span) + k * span)
        pro.append(p[s:e])
        out.append(o[s:e])
    return WorkloadWindow(np.concatenate(arr), np.concatenate(pro), np.concatenate(out))


@dataclass
class RobustChunkPlanner:
    """Choose `max_num_batched_tokens` by the win rule in the module docstring; the default unless beaten."""

    evaluate: Evaluator
    default: EngineKnobs
    chunks: Sequence[int] = DEFAULT_CHUNKS
    recent_s: Optional[float] = None
    blocks: int = 8
    resamples: int = 8
    margin: float = 0.02
    min_wins: float = 0.8
    seed: int = 0
    name: str = "robust"
    table: list[Candidate] = field(default_factory=list, repr=False)  # the last plan's rows (mean over resamples)
    wins: dict = field(default_factory=dict, repr=False)  # knobs -> fraction of resamples won, last plan
    gains: dict = field(default_factory=dict, repr=False)  # knobs -> median relative gain over the default

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.resamples < 1:
            raise ValueError("robust chunk planner: blocks and resamples must be >= 1")
        if not 0 < self.min_wins <= 1:
            raise ValueError("robust chunk planner: min_wins must be in (0, 1]")
        if self.margin < 0:
            raise ValueError("robust chunk planner: margin must be >= 0")
        self._inner = ChunkPlanner(self.evaluate, self.chunks)

    def candidates(self) -> list[EngineKnobs]:
        """The default first, then the chunk ladder (the default's other knobs kept)."""
        out = [self.default]
        for c in sorted(set(int(x) for x in self.chunks)):
            k = EngineKnobs(c, self.default.max_num_seqs, self.default.long_prefill_token_threshold)
            if k != self.default and (k.max_num_seqs is None or c >= k.max_num_seqs):
                out.append(k)
        return out

    def windows(self, window: WorkloadWindow) -> list[WorkloadWindow]:
        """The resampled windows a plan scores (the same for the same window and seed)."""
        w = recent(window, self.recent_s)
        rng = np.random.default_rng(self.seed)
        return [block_resample(w, self.blocks, rng) for _ in range(self.resamples)]

    def score(self, window: WorkloadWindow, knobs: EngineKnobs, slo: SLO) -> Candidate:
        """One candidate on the window itself (the online planner's check of the current knobs)."""
        return self._inner.score(window, knobs, slo)

    def rank(self, window: WorkloadWindow, slo: SLO,
             progress: Optional[Callable[[Candidate], None]] = None) -> list[Candidate]:
        """Every candidate scored on every resample; rows carry the mean, the chosen one marked."""
        ws = self.windows(window)
        knobs = self.candidates()
        per = {k: [self._inner.score(w, k, slo) for w in ws] for k in knobs}
        base = [c.goodput_req_s if c.ok else math.nan for c in per[self.default]]
        rows, self.wins, self.gains = [], {}, {}
        for k in knobs:
            g = [c.goodput_req_s if c.ok else math.nan for c in per[k]]
            errs = [c.error for c in per[k] if c.error]
            won, rel = [], []
            for x, b in zip(g, base):
                if math.isnan(x) or math.isnan(b):
                    won.append(False)
                    continue
                won.append(x > b * (1 + self.margin) + 1e-12)
                rel.append(x / b - 1 if b > 0 else (math.inf if x > 0 else 0.0))
            self.wins[k] = sum(won) / len(ws)
            self.gains[k] = float(np.median(rel)) if rel else math.nan
            ok = [c for c in per[k] if c.ok]

            def mean(attr: str) -> Optional[float]:
                v = [getattr(c, attr) for c in ok if getattr(c, attr) is not None]
                return float(np.mean(v)) if v else None

            row = Candidate(k, float(np.mean([c.goodput_req_s for c in ok])) if ok else math.nan,
                            mean("slo_attainment"), mean("ttft_p99_s"), mean("tpot_p99_s"), mean("itl_p99_s"),
                            errs[0] if errs and not ok else None)
            rows.append(row)
            if progress is not None:
                progress(row)
        eligible = [r for r in rows if r.knobs != self.default and self.wins[r.knobs] >= self.min_wins]
        best = max(eligible, key=lambda r: (self.gains[r.knobs], self.wins[r.knobs], -r.knobs.max_num_batched_tokens),
                   default=None)
        if best is None:
            best = next(r for r in rows if r.knobs == self.default)
        if best.ok:
            best.chosen = True
        self.table = rows
        return rows

    def plan(self, window: WorkloadWindow, slo: SLO) -> EngineKnobs:
        """The chosen knobs: vLLM's default unless a candidate wins enough resamples."""
        return chosen_knobs(self.rank(window, slo), "robust chunk planner: the default could not be evaluated",
                            "no goodput for the default")


__all__ = ["RobustChunkPlanner", "block_bounds", "block_resample", "recent"]
