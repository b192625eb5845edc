"""The chunk planner's evaluator: a candidate's engine knobs tried by running the twin on a window of requests."""

from __future__ import annotations

from typing import Any, Callable

from twin.policy.chunk import SLO, EngineKnobs, WorkloadWindow
from twin.scenario import Scenario, parse_scenario
from twin.sim.metrics import summarize
from twin.workload.stream import RequestStream


def slo_of(sc: Scenario) -> SLO:
    return SLO(sc.slo.ttft_s, sc.slo.tpot_s, sc.slo.e2e_s)


def window_of(stream: RequestStream) -> WorkloadWindow:
    """A whole stream as a planner's window (the stream rides along, so the twin replays it exactly)."""
    return WorkloadWindow(stream.arrival_s, stream.prompt_tokens, stream.output_tokens, source=stream)


def with_knobs(sc: Scenario, knobs: EngineKnobs, slo: SLO | None = None) -> Scenario:
    """The scenario with `knobs` in cluster.engine (and `slo`), validated as a scenario file would be."""
    raw = sc.model_dump(mode="json")
    raw["cluster"]["engine"].update(knobs.as_engine_args())
    if slo is not None:
        raw["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s}
    return parse_scenario(raw, f"candidate {knobs.label()}", sc.base_dir)


class TwinEvaluator:
    """`(window, knobs, slo) -> summary`: the twin run on the window's requests with candidate engine knobs.

    A window that carries its RequestStream is replayed as is (prefix hashes, closed-loop turns); a bare window
    (arrival times and lengths, as the online planner keeps) becomes an open-loop stream starting at 0 with no
    shared prefixes.
    """

    def __init__(self, sc: Scenario, simulate: Callable[[Scenario, RequestStream], Any]) -> None:
        self.scenario = sc
        self.simulate = simulate  # twin.sim.cluster.simulate, or a lighter run: handed in (no import circle)
        self.runs = 0

    def stream_of(self, window: WorkloadWindow) -> RequestStream:
        if isinstance(window.source, RequestStream):
            return window.source
        a = window.arrival_s - (window.arrival_s[0] if len(window) else 0.0)
        return RequestStream(a, window.prompt_tokens, window.output_tokens)

    def __call__(self, window: WorkloadWindow, knobs: EngineKnobs, slo: SLO) -> dict[str, Any]:
        sc = with_knobs(self.scenario, knobs, slo)
        self.runs += 1
        return summarize(self.simulate(sc, self.stream_of(window)))


def online_chunk_planner(spec: Any, evaluate: Any, current: EngineKnobs, seed: int = 0) -> Any:
    """The online chunk planner a `chunk_plan:` section (`twin.scenario.ChunkPlanSpec`) describes, one builder for
    the simulator's fleet and the live controller: the robust planner when `resamples` > 0, else the offline one,
    re-planned on a sliding window (`twin.policy.chunk.OnlineChunkPlanner`)."""
    from twin.policy.chunk import DEFAULT_CHUNKS, ChunkPlanner, OnlineChunkPlanner

    chunks = tuple(spec.candidates) or DEFAULT_CHUNKS
    if spec.resamples:
        from twin.policy.robust_chunk import RobustChunkPlanner

        inner: Any = RobustChunkPlanner(evaluate, current, chunks, blocks=spec.blocks, resamples=spec.resamples,
                                        seed=seed)
    else:
        inner = ChunkPlanner(evaluate, chunks)
    return OnlineChunkPlanner(inner, current, window_s=spec.window_s, min_requests=spec.min_requests,
                              shift_threshold=spec.shift_threshold, margin=spec.margin)
