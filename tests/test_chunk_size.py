"""`max_num_batched_tokens` changes predicted step times (issue 20 item 5): a long prompt split into small chunks
runs more mixed steps, each paying again the per-step costs of the decodes it shares the step with (their KV
read, the LM head, the CPU), and each chunk's attention reads the prompt's earlier KV again."""

import numpy as np
import pytest

from twin.perf.base import StepBatch
from twin.perf.registry import build_perf

from conftest import make_scenario, run_checked, stream_of


def run(mnbt, arrivals, prompts, outputs):
    sc = make_scenario(**{"cluster.engine.max_num_batched_tokens": mnbt, "cluster.engine.max_num_seqs": 64,
                          "cluster.engine.async_scheduling": True})
    res = run_checked(sc, stream_of(arrivals, prompts, outputs))
    itl_v, itl_n = res.instances[0].scheduler.stats.itl.arrays()
    return res.log, float(np.sum(itl_v * itl_n) / np.sum(itl_n)), res.instances[0].scheduler.stats.num_steps


def test_mnbt_changes_the_prediction_on_a_prefill_heavy_load():
    """40 prompts of 4096 tokens, 32 outputs each, Poisson at 6/s on one H100."""
    rng = np.random.default_rng(3)
    n = 40
    arr = np.cumsum(rng.exponential(1 / 6.0, n))
    (_, itl_s, steps_s), (_, itl_l, steps_l) = (run(m, arr, [4096] * n, [32] * n) for m in (1024, 8192))
    assert steps_s > steps_l  # a 4096-token prompt takes at least 4 steps instead of 1
    assert itl_s != itl_l


def test_a_long_prompt_among_decodes_takes_longer_in_small_chunks():
    """32 requests decoding; one 4096-token prompt arrives alone: its chunks each share a step with the decodes,
    and each such step pays the decodes' per-step costs again, so its first token comes later."""
    arr = [0.0] * 32 + [1.0]
    prompts, outputs = [100] * 32 + [4096], [400] * 32 + [8]
    ttft = {}
    for m in (1024, 8192):
        log, _, _ = run(m, arr, prompts, outputs)
        ttft[m] = log.first_token_s[32] - log.arrival_s[32]
    # (1024 against 2048 can go either way by less than a step: where the arrival falls in the step in flight)
    assert ttft[1024] > ttft[8192]


def chunk(n, computed, decodes, ctx):
    return StepBatch(num_prefill_tokens=n, prefill_attn_tokens=n * computed + n * (n + 1) / 2,
                     prefill_kv_read_tokens=computed + n, num_prefill_sampled=0, num_prefill_reqs=1,
                     num_decode_tokens=decodes, decode_context_tokens=decodes * ctx)


def test_each_small_chunk_pays_the_per_step_costs_again():
    perf = build_perf(make_scenario())
    decodes, ctx = 32, 1500
    whole = perf.group_times(chunk(4096, 0, decodes, ctx))
    parts = [perf.group_times(chunk(1024, 1024 * i, decodes, ctx)) for i in range(4)]
    total = {k: sum(p[k] for p in parts) for k in whole}
    # the decodes' KV, the LM head and the CPU are per step: four times over
    for g in ("decode_attn", "lm_head", "cpu"):
        assert total[g] == np.float64(4 * whole[g]) or abs(total[g] - 4 * whole[g]) < 1e-12
    # the chunks attend the same (query, key) pairs in all, but read the prompt's earlier KV again
    pairs = sum(chunk(1024, 1024 * i, 0, 0).prefill_attn_tokens for i in range(4))
    assert pairs == chunk(4096, 0, 0, 0).prefill_attn_tokens
    assert sum(chunk(1024, 1024 * i, 0, 0).prefill_kv_read_tokens for i in range(4)) > 4096
    # and the four steps stay above the physical floor
    ideal = perf.ideal()
    for i in range(4):
        b = chunk(1024, 1024 * i, decodes, ctx)
        assert ideal.step_time(b) <= perf.step_time(b)


def test_the_kernels_fixed_time_is_paid_per_layer_per_step_and_never_hidden():
    sc0 = make_scenario()
    sc1 = make_scenario(**{"cluster.perf.layer_overhead_s": 30e-6})
    p0, p1 = build_perf(sc0), build_perf(sc1)
    layers = p0.model.num_layers
    for b in (chunk(1024, 0, 32, 1500), chunk(64, 0, 0, 0), StepBatch(num_decode_tokens=8, decode_context_tokens=800)):
        assert p1.step_time(b) - p0.step_time(b) == pytest.approx(layers * 30e-6, rel=1e-9)
        g = p1.group_times(b)
        assert p1.step_time(b) == pytest.approx(sum(g.values()), rel=1e-12)
        assert p1.ideal().step_time(b) == p0.ideal().step_time(b) <= p0.step_time(b)
    steps = [p1.step_time(StepBatch(num_decode_tokens=8, decode_context_tokens=800 + 8 * s)) for s in range(3)]
    assert p1.decode_run_times(8, 800, 3) == steps
    assert p1.host_time_s(8) == p0.host_time_s(8)  # GPU time: async scheduling hides none of it
    assert "layer_overhead_s" in p1.describe()["assumptions"]


def test_each_compute_bound_step_pays_the_gemms_last_wave_and_decodes_do_not():
    """perf.gemm_tail_tokens (twin.perf.roofline): a compute-bound step's linear group costs the FLOPs of T + tail
    tokens; a memory-bound decode step and the ideal floor pay no tail."""
    perf = build_perf(make_scenario())
    none = build_perf(make_scenario(**{"cluster.perf.gemm_tail_tokens": 0.0}))
    tail = perf.gemm_tail_tokens
    assert tail == 150.0 and none.gemm_tail_tokens == 0.0 and perf.ideal().gemm_tail_tokens == 0.0
    big = chunk(4096, 0, 0, 0)
    assert perf.group_times(big)["linear"] == pytest.approx(perf._lin_s * (4096 + tail))
    assert none.group_times(big)["linear"] == pytest.approx(perf._lin_s * 4096)
    # four 1024-token chunks pay it four times, one 4096-token prompt once
    four = sum(perf.group_times(chunk(1024, 1024 * i, 0, 0))["linear"] for i in range(4))
    assert four - perf.group_times(big)["linear"] == pytest.approx(3 * tail * perf._lin_s)
    dec = StepBatch(num_decode_tokens=16, decode_context_tokens=16 * 1000)
    assert perf.step_time(dec) == none.step_time(dec)  # the weights read bounds it
    for b in (big, dec, chunk(1024, 2048, 32, 1500)):
        assert perf.ideal().step_time(b) <= none.step_time(b) <= perf.step_time(b)


def test_small_chunks_take_longer_when_prefill_bounds_the_run():
    """16 prompts of 4096 tokens at once, one output token each (nothing decoding for a chunk to carry): 1024-token
    chunks run 64 compute-bound steps against 8 of two prompts each, so they pay the GEMMs' last wave 8x as often
    and finish later. Under async scheduling (the host time hidden) and without the tail, the two budgets come within
    two per cent of each other."""
    n = 16

    def last_finish(mnbt, tail):
        sc = make_scenario(**{"cluster.engine.max_num_batched_tokens": mnbt, "cluster.perf.gemm_tail_tokens": tail,
                              "cluster.engine.async_scheduling": True})
        return float(np.max(run_checked(sc, stream_of([0.0] * n, [4096] * n, [1] * n)).log.finish_s))
    with_tail = last_finish(1024, 150.0) / last_finish(8192, 150.0)
    without = last_finish(1024, 0.0) / last_finish(8192, 0.0)
    assert with_tail > 1.05 and abs(without - 1) < 0.02, (with_tail, without)


def test_the_fitted_model_prices_the_tail_it_names_over_the_ideal_floor(tmp_path):
    """A profile's optional gemm_tail_tokens adds its FLOPs to the linear group's compute side (0 when absent)."""
    import yaml

    coef = {"linear": 1.2, "prefill_attn": 1.4, "decode_attn": 1.5, "lm_head": 1.0, "allreduce": 1.0,
            "step_s": 0.001, "per_request_s": 2e-6}
    models = {}
    for name, extra in (("no", {}), ("yes", {"gemm_tail_tokens": 150.0})):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"basis": "roofline-groups/1", "coefficients": {**coef, **extra}}))
        models[name] = build_perf(make_scenario(**{"cluster.perf.kind": "fitted", "cluster.perf.fit_path": str(path),
                                                   "cluster.perf.api_request_overhead_s": 0.0}))
    g = models["no"].ideal()
    big = chunk(4096, 0, 0, 0)
    assert models["yes"].step_time(big) - models["no"].step_time(big) == pytest.approx(1.2 * 150.0 * g._lin_s)
    dec = StepBatch(num_decode_tokens=16, decode_context_tokens=16 * 1000)
    assert models["yes"].step_time(dec) == models["no"].step_time(dec)
