"""Block-style predictive routing: run every candidate instance forward with the new request, pick the best.

After Block (Da & Kalyvianaki, "Block: Balancing Load in LLM Serving with Context, Knowledge and
Predictive Scheduling", 2025): predict each request's output length from its prompt, simulate how each
instance's current batch plus the new request would run, and send the request where the predicted latency
is lowest. The simulation is the world's `Forecaster` (the twin's own engine, forked): this policy imports
no engine code, so the live controller runs it unchanged with a forecaster built from its mirror of what
is in flight on each worker (`live.shadow.ShadowInstanceForecaster`, shadow mode on).

Objectives: `ttft` (the new request's first token), `e2e` (its completion), `makespan` (until the instance
would be idle). A candidate whose forecast hits the horizon first scores as infinitely late; ties go to
the instance with fewer requests in flight, then at random.

Branch and bound (`prune`, on by default, for `ttft` and `e2e`): candidates are forecast fewest-in-flight first, and
each later forecast gets as horizon the best score so far (a hair above it). Every objective is a time since now that
the forecast reaches only by running its fork that far, so a candidate that hits that horizon would score
strictly worse than the best: it cannot win or tie, and its fork stops there instead of running to its own
finish. The choice (and the random tie-break's draws) is the same as with every forecast run out; only
`last_scores` differs: a cut-off candidate reads inf. When the forecaster can guess cheaply (`estimates(ids,
request, until)`: the simulator's reads each instance's work in progress, running decodes and queued prompts, no
fork), candidates are forecast in that order instead, so the best comes early and later forks stop sooner; and
the forecaster skips the fork of a candidate whose first token (`ttft`) or last token (`e2e`) cannot come
before the horizon (`SimForecaster.first_token_bound`, `finish_bound`). Any order gives the same choice: a
candidate tying the final best scores at most every horizon it was given.

`max_forecasts: k` (0, the default: all) forecasts only the k candidates with the lowest estimate; the rest
read inf. This one CHANGES decisions where the best candidate ranks below k by the estimate (on the
16-instance bench at 120 req/s, `ttft`: 88.5 % of decisions alike with k = 4, 97.3 % with k = 6; near
saturation on 16 H100s, benchmarks/block_quality.py over 3 seeds, mean TTFT +2.5 % and +0.7 % against full
Block, small but in every seed); it is a cost bound, off by default.
"""

from __future__ import annotations

import math
import random

from twin.policy.base import RouterBase, check_seed, register_router, require, require_finite
from twin.policy.routers import NO_INSTANCE
from twin.policy.views import FleetView, Reject, RequestView

_UNTIL = {"ttft": "first_token", "e2e": "finish", "makespan": "drain"}


@register_router("block")
class Block(RouterBase):
    """Predictive look-ahead (Block): fork each instance with the request added, choose the lowest predicted latency."""

    name = "block"
    needs_forecaster = True

    def __init__(self, objective: str = "e2e", horizon_s: float = 60.0, max_candidates: int = 0,
                 seed: int = 0, prune: bool = True, max_forecasts: int = 0) -> None:
        require(objective in _UNTIL, "objective", f"must be one of {', '.join(_UNTIL)}, got {objective!r}")
        require_finite("horizon_s", horizon_s, 0)
        require(max_candidates >= 0, "max_candidates",
                f"must be >= 0 (0: every serving instance), got {max_candidates}")
        require(max_forecasts >= 0, "max_forecasts", f"must be >= 0 (0: forecast every candidate), got {max_forecasts}")
        self.objective = objective
        self.horizon_s = horizon_s
        self.max_candidates = max_candidates  # 0: every serving instance; else the k with fewest in flight
        self._rng = random.Random(check_seed(seed))
        self.prune = prune  # bound each forecast's horizon by the best score so far (module docstring)
        self.max_forecasts = max_forecasts  # 0: all; else the k lowest by the forecaster's estimate (changes choices)
        self.last_scores: dict[str, float] = {}

    def score(self, fc) -> float:
        v = {"ttft": fc.ttft_s, "e2e": fc.e2e_s, "makespan": fc.drain_s}[self.objective]
        return math.inf if v is None else v

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        insts = list(fleet.instances)
        if not insts:
            return NO_INSTANCE
        if fleet.forecaster is None:
            raise RuntimeError("the block router needs a forecaster (the world did not provide one)")
        if self.max_candidates and len(insts) > self.max_candidates:
            insts.sort(key=lambda v: (v.inflight_requests, self._rng.random()))
            insts = insts[:self.max_candidates]
        until = _UNTIL[self.objective]
        prune = self.prune and self.objective != "makespan"  # a cut-off fork is not drained: no drain time to bound
        estimates = getattr(fleet.forecaster, "estimates", None)
        if estimates is not None and (prune or self.max_forecasts):
            ids = [v.id for v in insts]
            est = estimates(ids, req, until) if until == "finish" else estimates(ids, req)
            order = sorted(insts, key=lambda v: (est[v.id], v.inflight_requests))
        else:
            order = sorted(insts, key=lambda v: v.inflight_requests) if prune or self.max_forecasts else insts
        scores = {}
        if self.max_forecasts and len(order) > self.max_forecasts:
            scores = {v.id: math.inf for v in order[self.max_forecasts:]}
            order = order[:self.max_forecasts]
        best = math.inf
        for v in order:
            # past the best so far (with a relative and absolute hair for rounding) a candidate scores worse
            horizon = min(self.horizon_s, best * (1 + 1e-9) + 1e-9)
            s = self.score(fleet.forecaster.forecast(v.id, req, horizon, until))
            scores[v.id] = s
            if prune and s < best:
                best = s
        self.last_scores = scores
        best = min(scores.values())
        tied = [v for v in insts if scores[v.id] == best]
        # each count read once: live, the controller's loop updates them while Block decides on its own thread
        load = {v.id: v.inflight_requests for v in tied}
        fewest = min(load.values())
        tied = [v for v in tied if load[v.id] == fewest]
        return tied[0].id if len(tied) == 1 else tied[self._rng.randrange(len(tied))].id
