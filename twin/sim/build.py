"""A scenario turned into the parts of a run: the engine's config, the step-time model, the router."""

from __future__ import annotations

from twin.engine.config import EngineConfig
from twin.engine.defaults import resolve_batch_limits
from twin.specs.vllm_versions import GENERATION_KNOBS, generation
from twin.perf.registry import build_perf
from twin.policy.base import Router
from twin.policy.base import build_router as build_router_from
from twin.scenario import Scenario
from twin.specs.hardware import get_gpu


def engine_config(sc: Scenario) -> EngineConfig:
    """The engine's knobs with vLLM's per-GPU defaults filled in where the scenario leaves them unset."""
    e = sc.cluster.engine
    d = e.model_dump()
    for k in GENERATION_KNOBS:  # the step model's (twin.perf.generation), not the engine's
        d.pop(k)
    d.pop("rope_scaling_factor")  # the context it allows is in max_model_len
    d["max_model_len"] = sc.cluster.max_model_len()
    d["max_num_batched_tokens"], d["max_num_seqs"] = resolve_batch_limits(
        get_gpu(sc.cluster.hardware), e.max_num_batched_tokens, e.max_num_seqs, d["max_model_len"],
        e.enable_chunked_prefill, v1=generation(e.vllm_version).is_v1)
    return EngineConfig(**d)


def build_router(sc: Scenario) -> Router:
    """The scenario's router by name or `module:Class`; bad names or parameters are one line."""
    return build_router_from(sc.router, sc.seed)


__all__ = ["build_perf", "build_router", "engine_config"]
