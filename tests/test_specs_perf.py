"""Specs are the published numbers; the step model is priced per operator group and never beats the hardware."""

import dataclasses

import pytest

from twin.errors import TwinInputError
from twin.specs.hardware import get_gpu, known_gpus
from twin.specs.models import get_model, known_models
from twin.perf import RooflineModel, StepBatch
from twin.perf.base import decode_run_times_by_steps


@pytest.mark.parametrize("name,kv", [("Llama-2-7B", 524288), ("Llama-3-8B", 131072), ("Llama-3-70B", 327680),
                                     ("Qwen2.5-32B", 262144), ("Llama-2-70B", 327680), ("Llama-3.1-8B", 131072),
                                     ("Llama-3.1-70B", 327680), ("Qwen3-14B", 163840), ("Qwen3-32B", 262144),
                                     ("CodeLlama-34B", 196608), ("Mixtral-8x7B", 131072),
                                     ("Qwen3-30B-A3B", 98304)])
def test_kv_bytes_per_token_match_the_model_configs(name, kv):
    assert get_model(name).kv_bytes_per_token(2) == kv


@pytest.mark.parametrize("name", known_models())
def test_parameter_count_follows_from_the_shapes(name):
    """Every stored weight the config implies (embedding and an untied LM head included) is the model card's count."""
    m = get_model(name)
    assert m.total_params == pytest.approx(m.num_params, rel=0.01)
    if m.is_moe:  # and the active count, from the top-k experts; cards count the embedding and LM head, or the
        # LM head only (gpt-oss: 4.55 B in the blocks + 0.58 B unembedding = 5.13 B)
        with_embedding = m.active_linear_params + m.vocab_params
        lm_head_only = m.active_linear_params + m.lm_head_params
        assert (with_embedding == pytest.approx(m.num_active_params, rel=0.03)
                or lm_head_only == pytest.approx(m.num_active_params, rel=0.03))
        assert m.active_linear_params < m.linear_params / 3


def test_every_spec_states_its_source_and_reported_memory():
    for n in known_models():
        assert "config.json" in get_model(n).source
    for n in known_gpus():
        g = get_gpu(n)
        assert g.device_memory_source and g.source
        # the datasheet's "80 GB" is a binary 80 GiB part; the driver reports a little less of it to the
        # framework (and more than 80e9 bytes, which the twin used to size the KV cache from)
        nominal_gib = g.hbm_bytes / 1e9 * 2**30
        assert 0.98 * nominal_gib < g.device_memory < nominal_gib
        assert g.device_memory > g.hbm_bytes


def test_lookup_by_alias_and_clear_errors():
    assert get_gpu("h100").name == "H100-SXM-80GB"
    assert get_model("meta-llama/Meta-Llama-3-8B").name == "Llama-3-8B"
    assert get_model("meta-llama/Llama-3.1-8B").max_model_len == 131072
    assert get_model("Qwen/Qwen3-30B-A3B").num_experts == 128
    with pytest.raises(TwinInputError, match="unknown GPU 'B300'"):
        get_gpu("B300")
    with pytest.raises(TwinInputError, match="unknown model"):
        get_model("gpt-5")
    with pytest.raises(TwinInputError, match="no fp8"):
        RooflineModel(get_gpu("A100"), get_model("Llama-3-8B"), dtype="fp8")


def model(name="Llama-3-8B", gpu="H100", **kw):
    return RooflineModel(get_gpu(gpu), get_model(name), **kw)


def prefill(n, c=0, reqs=1):
    return StepBatch(num_prefill_tokens=n, prefill_attn_tokens=n * c + n * (n + 1) / 2,
                     prefill_kv_read_tokens=c + n, num_prefill_sampled=1, num_prefill_reqs=reqs)


def mixed(n_prefill, n_decode, ctx):
    b = prefill(n_prefill)
    b.num_decode_tokens = n_decode
    b.decode_context_tokens = n_decode * ctx
    return b


def test_weights_counted_for_sizing_include_the_embedding():
    m = get_model("Llama-3-8B")
    # 8.03 B parameters x 2 bytes = 14.96 GiB, as vLLM logs "model weights take 14.96GiB" for this model
    assert model().weight_bytes_per_gpu == m.weight_bytes(2) == pytest.approx(14.96 * 2**30, rel=0.002)
    assert model(tensor_parallel=2).weight_bytes_per_gpu == pytest.approx(m.weight_bytes(2) / 2)
    # FP8 halves the matmuls only: embedding and LM head stay 16-bit
    assert model(dtype="fp8").weight_bytes_per_gpu == m.linear_params + m.vocab_params * 2


def test_decode_step_is_bounded_by_reading_the_weights():
    gpu, m = get_gpu("H100"), get_model("Llama-3-8B")
    one = StepBatch(num_decode_tokens=1, decode_context_tokens=128)
    # the default (corrected) model: at least all weights / HBM bandwidth, ~4.8 ms
    assert model().step_time(one) >= m.weight_bytes(2) / gpu.hbm_bandwidth > 4.7e-3
    # the ideal roofline: at least the matmul weights and the LM head (the embedding table is only indexed)
    ideal = model().ideal()
    matmul_bytes = (m.linear_params + m.lm_head_params) * 2
    assert ideal.step_time(one) >= matmul_bytes / gpu.hbm_bandwidth
    assert ideal.step_time(one) < 1.05 * matmul_bytes / gpu.hbm_bandwidth


def test_long_prefill_is_compute_bound():
    gpu, m = get_gpu("H100"), get_model("Llama-3-8B")
    n = 8192
    t = model().ideal().step_time(prefill(n))
    flops_floor = 2 * m.linear_params * n / gpu.flops("bf16")
    memory_time = (m.linear_params * 2 + m.kv_bytes_per_token() * 2 * n) / gpu.hbm_bandwidth
    assert t >= flops_floor
    assert flops_floor > 5 * memory_time  # far above the memory roof


def test_step_time_is_the_sum_of_the_groups():
    for kw in ({}, {"tensor_parallel": 4}, {"dtype": "fp8"}, {"name": "Qwen3-30B-A3B"}):
        m = model(**kw)
        b = mixed(1024, 96, 1500)
        g = m.group_times(b)
        assert set(g) == {"linear", "prefill_attn", "decode_attn", "lm_head", "allreduce", "cpu"}
        assert m.step_time(b) == pytest.approx(sum(g.values()), rel=1e-12)
        assert all(v > 0 for k, v in g.items() if k != "allreduce" or m.tensor_parallel > 1)


def test_groups_are_priced_separately_so_decode_attention_is_not_hidden_under_matmuls():
    """A single max(FLOPs/peak, bytes/bandwidth) over a mixed step hides the decode KV reads under the
    compute-bound prefill matmuls; per group, they cost their own memory time."""
    gpu = get_gpu("H100")
    ideal = model().ideal()
    b = mixed(2048, 128, 2000)  # a typical chunked-prefill step: one chunk plus a decode batch
    compute_only = RooflineModel(dataclasses.replace(gpu, hbm_bandwidth=1e30), get_model("Llama-3-8B")).ideal()
    memory_only = RooflineModel(dataclasses.replace(gpu, peak_flops={"bf16": 1e30}), get_model("Llama-3-8B")).ideal()
    single_max = max(compute_only.step_time(b), memory_only.step_time(b))
    per_group = ideal.step_time(b)
    assert per_group > 1.08 * single_max  # the "about 11 % too fast" on such a step
    # the decode contexts add their whole KV read time on top of a compute-bound step
    shorter = mixed(2048, 128, 1000)
    kv_read = ideal.kv_bytes_per_token_per_gpu * 128 * 1000 / gpu.hbm_bandwidth
    assert ideal.step_time(b) - ideal.step_time(shorter) == pytest.approx(kv_read, rel=1e-6)


def test_fp8_speeds_the_matmuls_only():
    b = mixed(8192, 64, 4000)
    bf16, fp8 = model().group_times(b), model(dtype="fp8").group_times(b)
    assert fp8["linear"] == pytest.approx(bf16["linear"] / 2, rel=1e-4)  # compute-bound, 2x the FLOP/s
    for g in ("prefill_attn", "decode_attn", "lm_head"):  # 16-bit in vLLM's FP8 models
        assert fp8[g] == bf16[g]
    assert model(kv_cache_dtype="fp8").group_times(b)["decode_attn"] == pytest.approx(bf16["decode_attn"] / 2)


def test_cpu_overhead_grows_with_the_scheduled_requests():
    m = model()
    one, four = prefill(2000, reqs=1), prefill(2000, reqs=4)  # the same tokens, in 1 or 4 chunks
    assert m.step_time(four) - m.step_time(one) == pytest.approx(3 * m.per_request_overhead_s, rel=1e-9)
    d = StepBatch(num_decode_tokens=200, decode_context_tokens=200 * 500)
    assert d.num_requests == 200
    assert m.group_times(d)["cpu"] == pytest.approx(m.step_overhead_s + 200 * m.per_request_overhead_s)
    assert model(per_request_overhead_s=0.0).step_time(four) == model(per_request_overhead_s=0.0).step_time(one)


def test_no_configuration_beats_the_ideal_roofline():
    for kw in ({}, {"tensor_parallel": 2}, {"dtype": "fp8"}, {"compute_efficiency": 1.0, "memory_efficiency": 1.0},
               {"name": "Mixtral-8x7B", "tensor_parallel": 2}, {"name": "Qwen3-30B-A3B"}):
        m = model(**kw)
        for b in (StepBatch(num_decode_tokens=64, decode_context_tokens=64 * 2000), prefill(4096),
                  mixed(512, 200, 3000)):
            assert m.step_time(b) >= m.ideal().step_time(b)


def test_fp8_and_tensor_parallel_make_compute_faster():
    b = prefill(8192)
    base = model().step_time(b)
    assert model(dtype="fp8").step_time(b) < base
    assert model(tensor_parallel=2).step_time(b) < base


def test_moe_flops_follow_the_active_experts_and_bytes_the_touched_ones():
    m = get_model("Mixtral-8x7B")
    ideal = model("Mixtral-8x7B").ideal()
    gpu = get_gpu("H100")
    bw, E, k = gpu.hbm_bandwidth, m.num_experts, m.num_experts_per_tok
    dense = m.num_layers * (m.layer_attn_params + m.router_params) * 2
    experts = m.num_layers * E * m.expert_params * 2
    for t in (1, 2, 4, 16):  # memory-bound: weights of the experts T tokens touch, in expectation
        touched = E * (1 - (1 - k / E) ** t)
        want = (dense + experts * touched / E + 2 * m.hidden_size * t) / bw
        assert ideal.group_times(StepBatch(num_decode_tokens=t, decode_context_tokens=t))["linear"] == \
            pytest.approx(want, rel=1e-12)
    one = ideal.group_times(StepBatch(num_decode_tokens=1, decode_context_tokens=1))["linear"]
    assert one == pytest.approx((dense + experts * k / E + 2 * m.hidden_size) / bw)  # one token: k experts
    n = 16384  # compute-bound: FLOPs of the active (top-k) parameters only
    big = ideal.group_times(prefill(n))["linear"]
    assert big == pytest.approx(2 * m.active_linear_params * n / gpu.flops("bf16"), rel=1e-12)
    # an MoE model of about the same active size decodes about as fast as a dense one, not like its total size
    qwen_moe = model("Qwen3-30B-A3B").ideal().step_time(StepBatch(num_decode_tokens=1, decode_context_tokens=1))
    qwen_dense = model("Qwen3-32B").ideal().step_time(StepBatch(num_decode_tokens=1, decode_context_tokens=1))
    assert qwen_moe < qwen_dense / 5


@pytest.mark.parametrize("kw", [{}, {"tensor_parallel": 4}, {"dtype": "fp8"}, {"name": "Qwen3-30B-A3B"},
                                {"name": "Mixtral-8x7B", "tensor_parallel": 2}, {"per_request_overhead_s": 0.0}])
def test_decode_run_equals_step_by_step(kw):
    m = model(**kw)
    for nd, c0, k in ((37, 37 * 900, 50), (1, 5, 7), (300, 300 * 3, 40), (5, 5 * 100_000, 3)):
        fast = m.decode_run_times(nd, c0, k)
        assert fast == decode_run_times_by_steps(m, nd, c0, k)  # equal, not approximately
        assert all(b >= a for a, b in zip(fast, fast[1:]))  # attention over a growing context never gets cheaper
    assert m.decode_run_times(4, 40, 0) == []


def test_empty_step_costs_nothing():
    assert model().step_time(StepBatch()) == 0.0
    assert model("Qwen3-30B-A3B", tensor_parallel=2).step_time(StepBatch()) == 0.0


def test_api_server_times_are_per_request_and_per_token_assumptions():
    m = model(api_request_overhead_s=0.002, api_prompt_token_s=1e-6, api_output_token_s=5e-5)
    assert m.api_request_s(0) == pytest.approx(0.002)
    assert m.api_request_s(4000) - m.api_request_s(1000) == pytest.approx(3000 * 1e-6)  # grows with the prompt
    assert m.api_token_s() == 5e-5
    assert m.ideal().api_request_s(4000) == 0.0 and m.ideal().api_token_s() == 0.0
    d = model().describe()
    assert {"api_request_overhead_s", "api_prompt_token_s", "api_output_token_s",
            "per_request_overhead_s", "step_overhead_s"} <= set(d["assumptions"])
