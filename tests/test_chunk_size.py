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
