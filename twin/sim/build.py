"""A scenario turned into the parts of a run: the engine's config, the step-time model, the router, the scaler."""

from __future__ import annotations

from typing import Any

from twin.engine.config import EngineConfig
from twin.engine.defaults import resolve_batch_limits
from twin.errors import TwinInputError
from twin.specs.vllm_versions import GENERATION_KNOBS, generation
from twin.perf.registry import build_perf
from twin.policy.base import Router
from twin.policy.base import build_router as build_router_from
from twin.policy.scalers import make_scaler
from twin.scenario import Scenario
from twin.specs.hardware import get_gpu


def engine_config(sc: Scenario) -> EngineConfig:
    """The engine's knobs with vLLM's per-GPU defaults filled in where the scenario leaves them unset."""
    e = sc.cluster.engine
    d = e.model_dump()
    for k in GENERATION_KNOBS:  # the step model's (twin.perf.generation), not the engine's
        d.pop(k)
    d.pop("rope_scaling_factor")  # the context it allows is in max_model_len
    d.pop("performance_mode")  # what it changes is the defaults resolved here
    d["max_model_len"] = sc.cluster.max_model_len()
    d["max_num_batched_tokens"], d["max_num_seqs"] = resolve_batch_limits(
        get_gpu(sc.cluster.hardware), e.max_num_batched_tokens, e.max_num_seqs, d["max_model_len"],
        e.enable_chunked_prefill, v1=generation(e.vllm_version).is_v1,
        world_size=sc.cluster.tensor_parallel, performance_mode=e.performance_mode)
    active = d.get("max_num_active_seqs")
    if active is not None and active > d["max_num_seqs"]:  # vLLM's SchedulerConfig refuses it at start
        raise TwinInputError(f"cluster.engine.max_num_active_seqs ({active}) cannot be greater than max_num_seqs "
                             f"({d['max_num_seqs']}{'' if e.max_num_seqs else ', the default'}), as vLLM refuses")
    return EngineConfig(**d)


def build_router(sc: Scenario) -> Router:
    """The scenario's router by name or `module:Class`; bad names or parameters are one line."""
    return build_router_from(sc.router, sc.seed)


def build_scaler(scenario: Scenario, max_instances: int | None = None) -> Any:
    """The scenario's scaler, given the scenario's SLO where it takes one (the twin and threshold scalers);
    bad names or parameters are one TwinInputError line. A `min_instances` of its own above the fleet's
    `max_instances` (the cluster's by default) is refused: the fleet could never reach it."""
    sc = scenario.scaler
    scaler = make_scaler(sc.name, **sc.params)
    if getattr(scaler, "slo", 0) is None:  # the twin and threshold scalers read the scenario's
        try:
            scaler.slo = scenario.slo
        except (TypeError, ValueError) as e:
            raise TwinInputError(f"scaler.params: {e}") from None
    top = scenario.cluster.max_instances if max_instances is None else max_instances
    low = getattr(scaler, "min_instances", None)
    if isinstance(low, int) and top is not None and low > top:
        raise TwinInputError(f"scaler.params.min_instances: {low} is above cluster.max_instances ({top}); "
                             "the fleet never grows that far")
    return scaler


def check_policies(sc: Scenario) -> None:
    """Build the scenario's router, scaler and length predictor as a run would, and drop them: a bad name, a
    user file that does not exist, a parameter they do not take or a value they refuse is the one
    TwinInputError line `twin simulate` would give, without running (`twin validate`)."""
    build_router(sc)
    build_scaler(sc)
    if sc.predictor is not None:
        from twin.policy.predictors import make_predictor

        make_predictor(sc.predictor.name, **sc.predictor.params)


__all__ = ["build_perf", "build_router", "build_scaler", "check_policies", "engine_config"]
