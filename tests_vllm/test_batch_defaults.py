"""The twin's batch defaults for a CPU host are the ones vLLM's CPU build resolves (`EngineArgs`, 0.32), its
`--performance-mode` included."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.engine.defaults import resolve_batch_limits
from twin.errors import TwinInputError
from twin.scenario import load_scenario
from twin.specs.hardware import get_gpu

QUICKSTART = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml"
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


@pytest.mark.parametrize("mml,threshold", [(2048, 2048), (2048, 2049), (512, 512), (512, 600), (512, 0)])
def test_a_long_prefill_threshold_is_refused_where_vllm_refuses_it(tiny_llama_dir, mml, threshold):
    """`SchedulerConfig.verify_max_model_len`: a threshold above the context stops
    `vllm serve`; the twin's scenario refuses the same ones."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = EngineArgs(model=tiny_llama_dir, skip_tokenizer_init=True, max_model_len=mml,
                      long_prefill_token_threshold=threshold)
    try:
        args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        vllm_refuses = False
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError wrapping vLLM's ValueError
        assert "long_prefill_token_threshold" in str(e)
        vllm_refuses = True
    sets = ["cluster.hardware=cpu", "cluster.model=tiny-llama", "cluster.engine.block_size=128",
            "cluster.engine.max_num_batched_tokens=null",
            "cluster.engine.max_num_seqs=null", f"cluster.engine.max_model_len={mml or 'null'}",
            f"cluster.engine.long_prefill_token_threshold={threshold}"]
    try:
        load_scenario(QUICKSTART, sets)
        twin_refuses = False
    except TwinInputError as e:
        assert "long_prefill_token_threshold" in str(e)
        twin_refuses = True
    assert twin_refuses == vllm_refuses
