"""One instance's engine knobs by vLLM's names, and how vLLM sizes its KV cache from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from twin.engine.scheduler import SchedulerConfig
from twin.errors import TwinInputError


@dataclass
class EngineConfig:
    """Engine knobs of one instance, by vLLM's names, plus how the KV pool is sized.

    `max_num_batched_tokens` / `max_num_seqs` here are resolved values (twin.engine.defaults fills in
    vLLM's per-GPU defaults); `gpu_memory_utilization` 0.92 is vLLM 0.32's default."""

    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False  # vLLM 0.32: floored at the budget's fair share
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    gpu_memory_utilization: float = 0.92
    # ASSUMPTION (GB): what vLLM's profile run finds besides the weights: non-torch memory (NCCL, cuBLAS
    # workspaces), the activation peak of a max_num_batched_tokens forward pass and the CUDA-graph estimate.
    # 3.3 GB = the 3.05 GiB vLLM logged for Llama-3-8B on an H100 (non_torch 1.79 + activation peak 1.26 GiB,
    # vllm-project/vllm PR #10511); 0.32 also subtracts its CUDA-graph estimate, not included here.
    activation_reserve_gb: float = 3.3
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    # vLLM resolves `async_scheduling` on for GPU engines (`config/vllm.py`); see twin.engine.scheduler
    async_scheduling: bool = True
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs or priority (twin.engine.scheduler)
    max_num_active_seqs: int | None = None  # vLLM 0.32's admission limit into RUNNING (<= max_num_seqs)
    # vLLM 0.32's API-server admission (503 past them): requests in the engine, prompt tokens before a first token
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    vllm_version: str = "0.32"  # the release modelled (twin.specs.vllm_versions); the scheduler is V1's

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=self.long_prefill_token_threshold_adaptive,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
            watermark=self.watermark,
            async_scheduling=self.async_scheduling,
            policy=self.scheduling_policy,
            max_num_active_seqs=self.max_num_active_seqs,
        )


def num_gpu_blocks(cfg: EngineConfig, device_memory_bytes: float, weight_bytes_per_gpu: float,
                   kv_bytes_per_token_per_gpu: float) -> int:
    """vLLM's sizing (`v1/worker/gpu_worker.py: Worker.determine_available_memory`, `kv_cache_utils.py:
    get_kv_cache_config_from_groups`): requested = ceil(device memory x gpu_memory_utilization), minus all
    weights (embedding and LM head included) and the non-KV reserve, floor-divided by the bytes per block.

    `device_memory_bytes` is what the device reports to the framework (e.g. 79.22 GiB on an H100 80 GB),
    not the datasheet's capacity.
    """
    gib = float(1 << 30)
    if cfg.num_gpu_blocks_override:
        n = int(cfg.num_gpu_blocks_override)
        _check_one_request_fits(cfg, n, "cluster.engine.num_gpu_blocks_override",
                                f"the {n} blocks of num_gpu_blocks_override")
        return n
    requested = math.ceil(device_memory_bytes * cfg.gpu_memory_utilization)
    avail = requested - weight_bytes_per_gpu - cfg.activation_reserve_gb * 1e9
    per_block = kv_bytes_per_token_per_gpu * cfg.block_size
    n = int(avail // per_block)
    if n < 2:
        left = requested - weight_bytes_per_gpu
        if left >= 2 * per_block:  # without the reserve there was room: name it, not the weights
            raise TwinInputError(
                f"cluster.engine.activation_reserve_gb {cfg.activation_reserve_gb:g} leaves no room for a KV cache: "
                f"{device_memory_bytes / gib:.1f} GiB x {cfg.gpu_memory_utilization} less the weights "
                f"({weight_bytes_per_gpu / gib:.1f} GiB per GPU) leaves {left / 1e9:.1f} GB")
        raise TwinInputError(
            f"the model's weights ({weight_bytes_per_gpu / gib:.1f} GiB per GPU) leave no room for a KV cache "
            f"in {device_memory_bytes / gib:.1f} GiB x {cfg.gpu_memory_utilization}: use more tensor "
            "parallelism, a bigger GPU or fp8"
        )
    _check_one_request_fits(cfg, n, "cluster.engine.gpu_memory_utilization",
                            f"the {avail / gib:.2f} GiB available ({n} blocks of {per_block / gib * 1024:.2f} MiB)")
    return n


def tokens_held(num_gpu_blocks: int, block_size: int) -> int:
    """The longest request a cache of `num_gpu_blocks` holds: all its blocks but the null one `BlockPool` holds back
    (vLLM starts no engine whose max_model_len needs more: `_check_one_request_fits`, in blocks)."""
    return (int(num_gpu_blocks) - 1) * int(block_size)


def _check_one_request_fits(cfg: EngineConfig, n: int, knob: str, what: str) -> None:
    """vLLM refuses at start-up a cache that cannot hold one request of max_model_len tokens besides its null
    block (`v1/core/kv_cache_utils.py: get_kv_cache_configs`, then `_check_enough_kv_cache_memory`: the memory
    checked is the override's blocks when `num_gpu_blocks_override` is set, less one block, the one `BlockPool`
    holds back)."""
    need = -(-cfg.max_model_len // cfg.block_size) if cfg.max_model_len else 0
    if need and n - 1 < need:
        raise TwinInputError(
            f"to serve one request of max_model_len {cfg.max_model_len} tokens, {need} KV blocks of "
            f"{cfg.block_size} tokens are needed besides vLLM's null block, more than {what} hold, as vLLM "
            f"refuses: raise {knob} or lower cluster.engine.max_model_len"
        )
