"""Scenario files: YAML validated by pydantic. A scenario is data: cluster, workload, router, SLOs, seed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from twin.errors import TwinInputError
from twin.hardware import get_gpu
from twin.models import get_model


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PerfSpec(_Spec):
    """Step-time model and its corrections (see twin.perf.roofline for which values are assumptions)."""

    kind: Literal["roofline"] = "roofline"
    compute_efficiency: float = Field(0.75, gt=0, le=1)
    memory_efficiency: float = Field(0.9, gt=0, le=1)
    step_overhead_s: float = Field(0.002, ge=0)
    allreduce_latency_s: float = Field(10e-6, ge=0)


class EngineSpec(_Spec):
    """vLLM engine arguments, by their vLLM names."""

    block_size: int = Field(16, gt=0)
    max_num_batched_tokens: int = Field(8192, gt=0)
    max_num_seqs: int = Field(256, gt=0)
    long_prefill_token_threshold: int = Field(0, ge=0)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduler_reserve_full_isl: bool = True
    watermark: float = Field(0.0, ge=0, lt=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    activation_reserve_gb: float = Field(2.0, ge=0)
    num_gpu_blocks_override: Optional[int] = Field(None, ge=2)
    max_model_len: Optional[int] = Field(None, gt=0)

    @model_validator(mode="after")
    def _budget_covers_seqs(self) -> "EngineSpec":
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), as vLLM requires"
            )
        return self


class ClusterSpec(_Spec):
    num_instances: int = Field(gt=0)
    hardware: str = "H100-SXM-80GB"
    model: str = "Llama-3-8B"
    dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    kv_cache_dtype: Literal["auto", "bf16", "fp16", "fp8"] = "auto"
    tensor_parallel: int = Field(1, gt=0)
    engine: EngineSpec = EngineSpec()
    perf: PerfSpec = PerfSpec()

    @field_validator("hardware")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        return get_gpu(v).name

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        return get_model(v).name


class ArrivalSpec(_Spec):
    process: Literal["poisson", "gamma"] = "poisson"
    rate: float = Field(gt=0, description="requests per second")
    cv: float = Field(1.0, gt=0, description="coefficient of variation of the gaps (gamma only)")


class LengthSpec(_Spec):
    kind: Literal["fixed", "trace"] = "fixed"
    prompt_tokens: Optional[int] = Field(None, gt=0)
    output_tokens: Optional[int] = Field(None, gt=0)
    path: Optional[str] = None
    max_total_tokens: Optional[int] = Field(None, gt=1)

    @model_validator(mode="after")
    def _complete(self) -> "LengthSpec":
        if self.kind == "fixed" and (self.prompt_tokens is None or self.output_tokens is None):
            raise ValueError("kind 'fixed' needs prompt_tokens and output_tokens")
        if self.kind == "trace" and not self.path:
            raise ValueError("kind 'trace' needs path (a CSV with num_prefill_tokens, num_decode_tokens)")
        return self


class SessionSpec(_Spec):
    turns_mean: float = Field(3.0, ge=1)
    think_time_s: float = Field(10.0, ge=0)
    closed_loop: bool = True  # a turn waits for the previous answer (false: think time after it was sent)


class TraceSpec(_Spec):
    """A public trace as the workload (twin.workload.formats), with replay controls; paths resolve
    against the scenario file's folder. Traces without timestamps take workload.arrival."""

    path: str
    format: Literal["auto", "sharegpt", "burstgpt", "azure", "mooncake", "servegen", "lengths", "arena"] = "auto"
    skip_bad_rows: bool = False
    start_s: float = Field(0.0, ge=0, description="window start on the trace's own clock")
    duration_s: Optional[float] = Field(None, gt=0)
    rate_scale: Optional[float] = Field(None, gt=0, description="replay k times as fast")
    target_rate: Optional[float] = Field(None, gt=0, description="or: scale to this mean req/s")
    sample: Optional[float] = Field(None, gt=0, le=1, description="keep this fraction, at random")
    max_requests: Optional[int] = Field(None, gt=0)
    max_prompt_tokens: Optional[int] = Field(None, gt=0)
    max_total_tokens: Optional[int] = Field(None, gt=1)
    shuffle: bool = True  # sharegpt, lengths: rows are independent samples
    think_time_s: float = Field(10.0, ge=0)  # sharegpt: gap before a conversation's next turn
    tokenizer: Optional[str] = None  # sharegpt: local Hugging Face tokenizer folder
    output_lengths: Optional[str] = None  # sharegpt: length CSV for turns without an answer
    chars_per_token: float = Field(4.0, gt=0)  # sharegpt: the estimate without a tokenizer
    models: list[str] = []  # burstgpt: keep these Model values
    log_types: list[str] = []  # burstgpt: conversation | api
    keep_failed: bool = False  # burstgpt: keep rows with Response tokens 0
    clients: list[int] = []  # servegen: client ids (chunk-<id>); empty: all in the folder
    lengths: Optional[str] = None  # servegen: length CSV where the dataset JSON has none
    answers: Optional[str] = None  # arena: the answers JSONL (default: the one beside the prompts)

    @model_validator(mode="after")
    def _one_rate_control(self) -> "TraceSpec":
        if self.rate_scale is not None and self.target_rate is not None:
            raise ValueError("give rate_scale or target_rate, not both")
        return self


class WorkloadSpec(_Spec):
    num_requests: Optional[int] = Field(None, gt=0)
    arrival: Optional[ArrivalSpec] = None
    lengths: Optional[LengthSpec] = None
    sessions: Optional[SessionSpec] = None
    trace: Optional[TraceSpec] = None
    on_too_long: Literal["error", "reject", "truncate"] = "error"
    max_tokens: Optional[int] = Field(None, gt=0, description=(
        "the client's max_tokens cap on every request (None: vLLM's default, max_model_len - prompt); "
        "routers see this, never the true length"))

    @model_validator(mode="after")
    def _synthetic_or_trace(self) -> "WorkloadSpec":
        if self.trace is not None:
            extra = [k for k in ("num_requests", "lengths", "sessions") if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"with a trace, drop {', '.join(extra)} (cap the count with trace.max_requests; "
                                 "arrival is used only by traces without timestamps)")
        elif self.num_requests is None or self.arrival is None or self.lengths is None:
            raise ValueError("give either trace (a trace file to replay) or num_requests, arrival and lengths "
                             "(a synthetic workload)")
        return self


class RouterSpec(_Spec):
    """The routing policy and the signals it sees (names and parameters as in the live controller's config)."""

    name: str = "least-outstanding"
    params: dict[str, Any] = {}
    scrape_interval_s: float = Field(0.05, ge=0, description="gauge age: /metrics scrape period (0 = exact)")
    prefix_index: Optional[Literal["approximate", "precise"]] = Field(
        None, description="for prefix-aware routers: the router's own default when unset")
    prefix_index_capacity_blocks: int = Field(100_000, gt=0, description="approximate index: LRU blocks per instance")
    kv_event_delay_s: float = Field(0.005, ge=0, description="ASSUMPTION: KV-event publish-to-index latency")
    on_error: Literal["raise", "reject"] = "raise"

    @field_validator("name")
    @classmethod
    def _known_router(cls, v: str) -> str:
        from twin.policy import ROUTERS
        from twin.policy.base import canonical_name

        key = canonical_name(v)
        if key not in ROUTERS and ":" not in v:
            raise ValueError(f"unknown router {v!r} (known: {', '.join(ROUTERS)}; or module:Class, file.py:Class)")
        return key


class SLOSpec(_Spec):
    """A request meets the SLOs when every set bound holds; goodput counts such requests per second."""

    ttft_s: Optional[float] = Field(None, gt=0)
    tpot_s: Optional[float] = Field(None, gt=0)
    e2e_s: Optional[float] = Field(None, gt=0)


class SimSpec(_Spec):
    mode: Literal["fast", "step"] = "fast"
    max_sim_time_s: Optional[float] = Field(None, gt=0)
    timeline_interval_s: float = Field(1.0, ge=0, description="per-instance time series resolution (0 = off)")


class Scenario(_Spec):
    name: str = "scenario"
    description: str = ""
    seed: int = 0
    cluster: ClusterSpec
    workload: WorkloadSpec
    router: RouterSpec = RouterSpec()
    slo: SLOSpec = SLOSpec()
    sim: SimSpec = SimSpec()
    base_dir: str = Field(".", exclude=True, description="where relative paths resolve (the file's folder)")

    def resolve_path(self, p: str) -> Path:
        path = Path(p)
        return path if path.is_absolute() else Path(self.base_dir) / path


def _format_error(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        got = err.get("input")
        tail = "" if err["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{source}: {loc}: {msg}{tail}")
    return "\n".join(lines)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`--set a.b.c=value` edits of the raw YAML; the value is parsed as YAML (numbers, bools, lists)."""
    for item in overrides:
        if "=" not in item:
            raise TwinInputError(f"--set {item!r}: expected dotted.path=value")
        path, value = item.split("=", 1)
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise TwinInputError(f"--set {item!r}: empty path")
        node = raw
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        try:
            node[keys[-1]] = yaml.safe_load(value)
        except yaml.YAMLError:
            node[keys[-1]] = value
    return raw


def parse_scenario(raw: Any, source: str = "scenario", base_dir: str | Path = ".") -> Scenario:
    if not isinstance(raw, dict):
        raise TwinInputError(f"{source}: a scenario must be a YAML mapping, got {type(raw).__name__}")
    try:
        sc = Scenario.model_validate({**raw, "base_dir": str(base_dir)})
    except ValidationError as e:
        raise TwinInputError(_format_error(e, source)) from None
    return sc


def read_scenario_yaml(path: str | Path) -> dict:
    """The raw mapping of a scenario file, or a TwinInputError naming the file (and line) and the problem."""
    path = Path(path)
    if not path.exists():
        raise TwinInputError(f"scenario file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise TwinInputError(f"{path}:{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise TwinInputError(f"{path}: a scenario must be a YAML mapping, got {type(raw).__name__}")
    return raw


def load_scenario(path: str | Path, overrides: list[str] | None = None, seed: int | None = None) -> Scenario:
    """Read, override and validate a scenario file; bad input raises TwinInputError with one line per problem."""
    path = Path(path)
    raw = apply_overrides(read_scenario_yaml(path), overrides or [])
    if seed is not None:
        raw["seed"] = seed
    return parse_scenario(raw, str(path), path.parent)
