"""The twin's batch defaults for a CPU host are the ones vLLM's CPU build resolves (`EngineArgs`, 0.32), its
`--performance-mode` included."""

from __future__ import annotations

import pytest

from twin.engine.defaults import resolve_batch_limits
from twin.specs.hardware import get_gpu

CASES = [  # (tensor_parallel, max_model_len, max_num_seqs, max_num_batched_tokens, chunked prefill, mode)
    (1, 512, None, None, True, "balanced"), (2, 512, None, None, True, "balanced"),
    (4, 512, None, None, True, "balanced"),
    (1, 8, None, None, True, "balanced"),  # the token default capped at seqs x max_model_len
    (1, 512, None, 64, True, "balanced"),  # the seqs default capped at the token budget
    (1, 512, 16, None, True, "balanced"),
    (1, 4096, None, None, False, "balanced"),  # without chunked prefill: raised to the context
    (1, 512, None, None, True, "throughput"), (2, 512, None, 1024, True, "throughput"),  # unset ones doubled
    (1, 512, None, None, True, "interactivity"),
]


def _vllm(model_dir: str, tp: int, mml: int, seqs: int | None, tokens: int | None, chunked: bool,
          mode: str) -> tuple[int, int]:
    """What `vllm serve` on this CPU would run with (`_set_default_max_num_seqs_and_batched_tokens_args`)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, max_model_len=mml, tensor_parallel_size=tp,
                      max_num_seqs=seqs, max_num_batched_tokens=tokens, enable_chunked_prefill=chunked,
                      performance_mode=mode)
    args._set_default_max_num_seqs_and_batched_tokens_args(
        UsageContext.OPENAI_API_SERVER, args.create_model_config(), ParallelConfig(tensor_parallel_size=tp))
    return int(args.max_num_batched_tokens), int(args.max_num_seqs)


@pytest.mark.parametrize("tp,mml,seqs,tokens,chunked,mode", CASES)
def test_cpu_host_defaults_match_vllm_cpu(tiny_llama_dir, tp, mml, seqs, tokens, chunked, mode):
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    twin = resolve_batch_limits(get_gpu("CPU-2core-AVX512"), tokens, seqs, mml, chunked, world_size=tp,
                                performance_mode=mode)
    assert twin == _vllm(tiny_llama_dir, tp, mml, seqs, tokens, chunked, mode)
