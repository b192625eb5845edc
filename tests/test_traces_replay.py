"""Replay controls (window, rate, sample, cap, filters, seed), generators, scenarios naming a trace, and a
Mooncake slice through the simulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from twin.sim.cluster import Cluster
from twin.errors import TwinInputError
from twin.sim.metrics import summarize
from twin.scenario import load_scenario, parse_scenario
from twin.workload import build_stream
from twin.workload.formats import BurstGPTSynthetic, ideal_block_reuse, load_trace
from twin.workload.formats.burstgpt import bounded_zipf
from twin.workload.replay import mean_rate

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
MOON = TRACES / "mooncake_conversation.sample.jsonl"
AZURE = TRACES / "azure_conv.sample.csv"


def accounted(s) -> None:
    st = s.stats
    assert st.rows_used == len(s)
    assert st.rows_read == st.rows_used + st.rows_filtered + st.rows_skipped, st.to_dict()


def same(a, b) -> bool:
    return (np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
            and np.array_equal(a.output_tokens, b.output_tokens))


def test_window_keeps_the_span_and_rebases_time():
    full = load_trace(AZURE)
    s = load_trace(AZURE, start_s=60, duration_s=30)
    accounted(s)
    inside = (full.arrival_s >= 60) & (full.arrival_s < 90)
    assert len(s) == int(inside.sum()) > 0
    assert np.allclose(s.arrival_s, full.arrival_s[inside] - 60)
    assert any("outside the window [60, 90)" in n for n in s.stats.notes)


def test_rate_scale_and_target_rate():
    full = load_trace(AZURE)
    fast = load_trace(AZURE, rate_scale=4)
    assert np.allclose(fast.arrival_s, full.arrival_s / 4)
    assert len(fast) == len(full)
    tgt = load_trace(AZURE, target_rate=20.0)
    assert mean_rate(tgt.arrival_s) == pytest.approx(20.0)
    with pytest.raises(TwinInputError, match="not both"):
        load_trace(AZURE, rate_scale=2, target_rate=3)


def test_sample_fraction_and_seed_determinism():
    a = load_trace(AZURE, sample=0.25, seed=7)
    b = load_trace(AZURE, sample=0.25, seed=7)
    c = load_trace(AZURE, sample=0.25, seed=8)
    accounted(a)
    assert same(a, b) and not same(a, c)
    assert len(a) == pytest.approx(250, abs=50)
    assert a.stats.rows_filtered == 1000 - len(a)


def test_cap_and_filters():
    s = load_trace(AZURE, max_requests=100)
    accounted(s)
    assert len(s) == 100 and s.stats.rows_filtered == 900
    f = load_trace(AZURE, max_prompt_tokens=1000, max_total_tokens=1500)
    accounted(f)
    assert f.prompt_tokens.max() <= 1000 and (f.prompt_tokens + f.output_tokens).max() <= 1500
    assert 0 < f.stats.rows_filtered < 1000


def test_controls_compose_in_order():
    s = load_trace(MOON, start_s=30, duration_s=100, sample=0.5, rate_scale=2, max_requests=40, seed=1)
    accounted(s)
    assert len(s) == 40
    assert s.arrival_s.max() < 50  # the 100 s window compressed by 2


def test_untimed_sample_cap_before_arrivals_and_seed():
    s = load_trace(TRACES / "sharegpt.sample.json", rate=2.0, max_requests=50, seed=3)
    t = load_trace(TRACES / "sharegpt.sample.json", rate=2.0, max_requests=50, seed=3)
    u = load_trace(TRACES / "sharegpt.sample.json", rate=2.0, max_requests=50, seed=4)
    accounted(s)
    assert len(s) == 50 and same(s, t) and not same(s, u)
    assert s.stats.rows_read == 200 and s.stats.rows_filtered == 21 + 129
    half = load_trace(TRACES / "sharegpt_lengths.sample.csv", rate=50.0, sample=0.5, seed=0)
    accounted(half)
    assert len(half) == pytest.approx(5000, rel=0.05)
    assert mean_rate(half.arrival_s) == pytest.approx(50.0, rel=0.1)  # the rate the user asked for


def test_servegen_cap_and_guard(monkeypatch):
    s = load_trace(TRACES / "servegen_m-large", start_s=693000, duration_s=1200, max_requests=1000, seed=2)
    assert len(s) == 1000
    assert s.stats.rows_read == s.stats.rows_used + s.stats.rows_filtered
    assert any("generation stopped" in n for n in s.stats.notes)
    a = load_trace(TRACES / "servegen_m-large", start_s=693000, duration_s=60, seed=5)
    b = load_trace(TRACES / "servegen_m-large", start_s=693000, duration_s=60, seed=5)
    assert same(a, b)
    from twin.workload.formats import servegen

    monkeypatch.setattr(servegen, "MAX_GENERATED", 100_000)
    with pytest.raises(TwinInputError, match="narrow it"):
        load_trace(TRACES / "servegen_m-large")  # all 14 days of client 28: ~1.2M requests


def test_burstgpt_style_synthetic():
    g = BurstGPTSynthetic(rate=5.0, gamma_shape=0.25, max_request_tokens=2048, max_response_tokens=1024)
    s = g.generate(20_000, np.random.default_rng(0))
    assert len(s) == 20_000
    assert mean_rate(s.arrival_s) == pytest.approx(5.0, rel=0.05)
    gaps = np.diff(s.arrival_s)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    assert s.prompt_tokens.min() >= 1 and s.prompt_tokens.max() <= 2048 and s.output_tokens.max() <= 1024
    assert "assumptions" in s.stats.notes[0]
    z = bounded_zipf(100_000, 1.1, 1, 100, np.random.default_rng(1))
    k = np.arange(1, 101)
    p = k ** -1.1 / (k ** -1.1).sum()
    assert (z == 1).mean() == pytest.approx(p[0], abs=0.01)
    assert (z == 2).mean() / (z == 1).mean() == pytest.approx(2 ** -1.1, abs=0.03)


BASE = {
    "name": "t", "seed": 4,
    "cluster": {"num_instances": 2, "hardware": "H200", "model": "Qwen2.5-32B", "tensor_parallel": 2,
                "engine": {"max_model_len": 131072, "rope_scaling_factor": 4.0}},  # YaRN, as its model card
}


def test_scenario_trace_section(tmp_path):
    sc = parse_scenario({**BASE, "workload": {"trace": {"path": str(MOON), "max_requests": 50}}}, "t")
    s = build_stream(sc)
    assert len(s) == 50 and s.hash_block_size == 512
    sg = parse_scenario({**BASE, "workload": {"trace": {"path": "sharegpt.sample.json", "max_requests": 20},
                                              "arrival": {"process": "gamma", "rate": 4, "cv": 2}}},
                        "t", base_dir=TRACES)
    s = build_stream(sg)
    assert len(s) == 20 and any("gamma at 4" in n for n in s.stats.notes)
    with pytest.raises(TwinInputError, match="either trace"):
        parse_scenario({**BASE, "workload": {"on_too_long": "reject"}}, "t")
    with pytest.raises(TwinInputError, match="drop num_requests"):
        parse_scenario({**BASE, "workload": {"trace": {"path": "x"}, "num_requests": 5}}, "t")
    with pytest.raises(TwinInputError, match="workload.trace.skip_bad_rowz: unknown key"):
        parse_scenario({**BASE, "workload": {"trace": {"path": "x", "skip_bad_rowz": True}}}, "t")


def test_scenario_on_too_long_applies_to_traces():
    raw = {**BASE, "cluster": {**BASE["cluster"], "engine": {"max_model_len": 32768}},
           "workload": {"trace": {"path": str(MOON), "max_requests": 100}}}
    with pytest.raises(TwinInputError, match="longer than the model's context"):
        build_stream(parse_scenario(raw, "t"))
    raw["workload"]["on_too_long"] = "reject"
    s = build_stream(parse_scenario(raw, "t"))
    assert any("rejected at arrival" in n for n in s.stats.notes)


def test_shipped_mooncake_scenario_validates():
    sc = load_scenario(ROOT / "scenarios" / "mooncake-replay.yaml")
    assert sc.workload.trace is not None and sc.cluster.engine.max_model_len == 131072
    s = build_stream(sc)
    assert len(s) == 500


def test_mooncake_slice_through_the_simulator():
    sc = parse_scenario({**BASE, "sim": {"mode": "fast"},
                         "workload": {"trace": {"path": str(MOON), "max_requests": 150}}}, "t")
    stream = build_stream(sc)
    ideal = ideal_block_reuse(stream.hash_ids, stream.prompt_tokens)
    res = Cluster(sc, stream).run()
    summary = summarize(res)
    assert summary["requests_finished"] == 150
    hit = summary["prefix_cache_hit_rate"]
    assert 0 < hit <= ideal.token_hit_rate
    assert summary["workload"]["rows_used"] == 150 and summary["workload"]["rows_filtered"] == 350


def test_an_unbounded_cache_on_one_instance_reaches_the_traces_own_reuse():
    """With room for every block and one instance, the engine's hit rate is the trace's ideal reuse
    (the engine recomputes the last token and hits whole 16-token blocks, so slightly less)."""
    sc = parse_scenario({**BASE, "workload": {"trace": {"path": str(MOON)}, "on_too_long": "reject"},
                         "cluster": {**BASE["cluster"], "num_instances": 1, "model": "Qwen2.5-32B",
                                     "engine": {"max_model_len": 131072, "rope_scaling_factor": 4.0,
                                                "num_gpu_blocks_override": 2_000_000}}},
                        "t")
    stream = build_stream(sc)
    ideal = ideal_block_reuse(stream.hash_ids, stream.prompt_tokens)
    hit = summarize(Cluster(sc, stream).run())["prefix_cache_hit_rate"]
    assert ideal.token_hit_rate - 0.01 <= hit <= ideal.token_hit_rate
