"""Specs are the published numbers; the step model never beats the hardware."""

import pytest

from twin.errors import TwinInputError
from twin.hardware import get_gpu
from twin.models import get_model
from twin.perf import RooflineModel, StepBatch
from twin.perf.base import decode_run_times_by_steps


@pytest.mark.parametrize("name,kv", [("Llama-2-7B", 524288), ("Llama-3-8B", 131072), ("Llama-3-70B", 327680),
                                     ("Qwen2.5-32B", 262144), ("Llama-2-70B", 327680)])
def test_kv_bytes_per_token_match_the_model_configs(name, kv):
    assert get_model(name).kv_bytes_per_token(2) == kv


@pytest.mark.parametrize("name", ["Llama-2-7B", "Llama-3-8B", "Llama-3-70B", "Qwen2.5-32B"])
def test_parameter_count_follows_from_the_shapes(name):
    m = get_model(name)
    derived = m.linear_params + m.embedding_params + m.lm_head_params
    assert derived == pytest.approx(m.num_params, rel=0.01)


def test_lookup_by_alias_and_clear_errors():
    assert get_gpu("h100").name == "H100-SXM-80GB"
    assert get_model("meta-llama/Meta-Llama-3-8B").name == "Llama-3-8B"
    with pytest.raises(TwinInputError, match="unknown GPU 'B300'"):
        get_gpu("B300")
    with pytest.raises(TwinInputError, match="unknown model"):
        get_model("gpt-5")
    with pytest.raises(TwinInputError, match="no fp8"):
        RooflineModel(get_gpu("A100"), get_model("Llama-3-8B"), dtype="fp8")


def model(**kw):
    return RooflineModel(get_gpu("H100"), get_model("Llama-3-8B"), **kw)


def test_decode_step_is_bounded_by_reading_the_weights():
    gpu, m = get_gpu("H100"), get_model("Llama-3-8B")
    one = StepBatch(num_decode_tokens=1, decode_context_tokens=128)
    # the default (calibrated-by-assumption) model: at least all weights / HBM bandwidth, ~4.8 ms
    assert model().step_time(one) >= m.weight_bytes(2) / gpu.hbm_bandwidth > 4.7e-3
    # the ideal roofline: at least the matmul weights (the embedding table is only indexed)
    ideal = model().ideal()
    matmul_bytes = (m.linear_params + m.lm_head_params) * 2
    assert ideal.step_time(one) >= matmul_bytes / gpu.hbm_bandwidth
    assert ideal.step_time(one) < 1.05 * matmul_bytes / gpu.hbm_bandwidth


def test_long_prefill_is_compute_bound():
    gpu, m = get_gpu("H100"), get_model("Llama-3-8B")
    n = 8192
    b = StepBatch(num_prefill_tokens=n, prefill_attn_tokens=n * (n + 1) / 2, prefill_kv_read_tokens=n,
                  num_prefill_sampled=1)
    ideal = model().ideal()
    t = ideal.step_time(b)
    flops_floor = 2 * m.linear_params * n / gpu.flops("bf16")
    memory_time = (m.linear_params * 2 + m.kv_bytes_per_token() * 2 * n) / gpu.hbm_bandwidth
    assert t >= flops_floor
    assert flops_floor > 5 * memory_time  # far above the memory roof


def test_no_configuration_beats_the_ideal_roofline():
    for kw in ({}, {"tensor_parallel": 2}, {"dtype": "fp8"}, {"compute_efficiency": 1.0, "memory_efficiency": 1.0}):
        m = model(**kw)
        for b in (StepBatch(num_decode_tokens=64, decode_context_tokens=64 * 2000),
                  StepBatch(num_prefill_tokens=4096, prefill_attn_tokens=4096 * 4097 / 2,
                            prefill_kv_read_tokens=4096, num_prefill_sampled=1)):
            assert m.step_time(b) >= m.ideal().step_time(b)


def test_fp8_and_tensor_parallel_make_compute_faster():
    b = StepBatch(num_prefill_tokens=8192, prefill_attn_tokens=8192 * 8193 / 2, prefill_kv_read_tokens=8192,
                  num_prefill_sampled=1)
    base = model().step_time(b)
    assert model(dtype="fp8").step_time(b) < base
    assert model(tensor_parallel=2).step_time(b) < base


def test_decode_run_equals_step_by_step():
    m = model()
    fast = m.decode_run_times(37, 37 * 900, 50)
    slow = decode_run_times_by_steps(m, 37, 37 * 900, 50)
    assert fast == pytest.approx(slow, rel=1e-12)
    assert all(b >= a for a, b in zip(fast, fast[1:]))  # attention over a growing context never gets cheaper


def test_empty_step_costs_nothing():
    assert model().step_time(StepBatch()) == 0.0
