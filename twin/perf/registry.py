"""Step models by name: `perf.kind` in a scenario picks the builder; any `StepTimeModel` will do."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from twin.specs.hardware import get_gpu
from twin.specs.models import get_model
from twin.perf.base import StepTimeModel
from twin.perf.fitted import FittedModel
from twin.perf.roofline import RooflineModel

if TYPE_CHECKING:
    from twin.scenario import Scenario


def roofline(sc: "Scenario") -> RooflineModel:
    """The per-group roofline with the scenario's corrections and assumptions."""
    c, p = sc.cluster, sc.cluster.perf
    return RooflineModel(
        get_gpu(c.hardware), get_model(c.model), dtype=c.dtype, kv_cache_dtype=c.kv_cache_dtype,
        tensor_parallel=c.tensor_parallel, compute_efficiency=p.compute_efficiency,
        memory_efficiency=p.memory_efficiency, step_overhead_s=p.step_overhead_s,
        per_request_overhead_s=p.per_request_overhead_s, allreduce_latency_s=p.allreduce_latency_s,
        layer_overhead_s=p.layer_overhead_s, gemm_tail_tokens=p.gemm_tail_tokens,
        api_request_overhead_s=p.api_request_overhead_s, api_prompt_token_s=p.api_prompt_token_s,
        api_output_token_s=p.api_output_token_s, api_queue=p.api_queue, api_rho_cap=p.api_rho_cap,
        api_handoff_s=p.api_handoff_s,
    )


def fitted(sc: "Scenario") -> FittedModel:
    """Coefficients from `perf.fit_path` (twin.perf.fitted) over the scenario's roofline groups."""
    p = sc.cluster.perf
    if p.profile is not None:
        from twin.perf.fitted import profile_path

        return FittedModel.from_file(roofline(sc), profile_path(p.profile))
    assert p.fit_path is not None  # PerfSpec requires one of them for kind fitted
    return FittedModel.from_file(roofline(sc), sc.resolve_path(p.fit_path))


STEP_MODELS: dict[str, Callable[["Scenario"], StepTimeModel]] = {"roofline": roofline, "fitted": fitted}


def build_perf(sc: "Scenario") -> StepTimeModel:
    """The step model the scenario names (`cluster.perf.kind`), wrapped in the what-if actions' effects when
    `whatif.precision`, `partial_kv` or `early_exit` is on (twin.whatif.model), and in the engine generation's
    step loop when `engine.vllm_version` is V0 or async overlap keeps host time in series (twin.perf.generation)."""
    perf = STEP_MODELS[sc.cluster.perf.kind](sc)
    w = sc.whatif
    if w.precision.enabled or w.partial_kv.enabled or w.early_exit.enabled:
        from twin.whatif.model import WhatIfModel

        perf = WhatIfModel(perf, w)
    from twin.perf.generation import wrap_for_generation

    return wrap_for_generation(perf, sc.cluster.engine)  # the release's engine loop (twin.specs.vllm_versions)
