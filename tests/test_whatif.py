"""What-if actions: each one's effect direction and size on the step model, its knobs, and whole runs with it."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import make_scenario, run_checked, stream_of
from twin.cli import app
from twin.sim.cluster import Cluster, engine_config
from twin.engine.config import num_gpu_blocks
from twin.errors import TwinInputError
from twin.perf import RooflineModel, StepBatch, build_perf
from twin.perf.base import decode_run_times_by_steps
from twin.whatif.model import WhatIfModel
from twin.whatif.semantic import semantic_order

runner = CliRunner()


def perf(whatif=None, **cluster):
    sc = make_scenario(**{f"cluster.{k}": v for k, v in cluster.items()}, **({"whatif": whatif} if whatif else {}))
    return build_perf(sc), sc


def blocks(p, sc):
    return num_gpu_blocks(engine_config(sc), p.gpu.device_memory, p.weight_bytes_per_gpu, p.kv_bytes_per_token_per_gpu)


PREFILL = StepBatch(num_prefill_tokens=8192, prefill_attn_tokens=8192 * 8193 / 2, prefill_kv_read_tokens=8192,
                    num_prefill_sampled=1, num_prefill_reqs=1)
BIG_DECODE = StepBatch(num_decode_tokens=2048, decode_context_tokens=2048 * 1000)  # compute-bound linear
SMALL_DECODE = StepBatch(num_decode_tokens=16, decode_context_tokens=16 * 1000)  # memory-bound linear


def test_off_by_default_and_the_plain_model_is_unwrapped():
    p, sc = perf()
    assert isinstance(p, RooflineModel)
    assert not any(getattr(sc.whatif, a).enabled for a in ("precision", "partial_kv", "early_exit", "semantic_batching"))
    # an empty wrapper changes nothing, to the bit
    w = WhatIfModel(p, sc.whatif)
    for b in (PREFILL, BIG_DECODE, SMALL_DECODE):
        assert w.step_time(b) == p.step_time(b)
    assert w.kv_bytes_per_token_per_gpu == p.kv_bytes_per_token_per_gpu
    assert w.weight_bytes_per_gpu == pytest.approx(p.weight_bytes_per_gpu)


def test_giving_a_section_turns_it_on_and_validate_shows_it_resolved(tmp_path):
    _, sc = perf({"precision": {"fp8_fraction": 0.5}})
    assert sc.whatif.precision.enabled and not sc.whatif.partial_kv.enabled
    _, sc = perf({"precision": {"enabled": False, "fp8_fraction": 0.5}})
    assert not sc.whatif.precision.enabled
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({"cluster": {"num_instances": 1}, "workload": {
        "num_requests": 1, "arrival": {"rate": 1}, "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1}},
        "whatif": {"early_exit": {"token_share": 0.3}}}))
    r = runner.invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    w = json.loads(r.output)["whatif"]
    assert w["early_exit"] == {"enabled": True, "token_share": 0.3, "layer_share": 0.4}
    assert w["precision"]["enabled"] is False and "fp8_fraction" in w["precision"]
    assert w["semantic_batching"]["predictor"] == "cap"


def test_all_fp8_halves_compute_bound_linear_time_and_half_fp8_sits_between():
    base, _ = perf()
    full, _ = perf({"precision": {"fp8_fraction": 1.0}})
    half, _ = perf({"precision": {"fp8_fraction": 0.5}})
    for b in (PREFILL, BIG_DECODE):
        lin0 = base.group_times(b)["linear"]
        assert full.group_times(b)["linear"] / lin0 == pytest.approx(0.5, rel=0.01)
        assert half.group_times(b)["linear"] / lin0 == pytest.approx(0.75, rel=0.01)
        # attention and the LM head stay 16-bit
        for g in ("prefill_attn", "decode_attn", "lm_head"):
            assert full.group_times(b)[g] == pytest.approx(base.group_times(b)[g])
    # memory-bound decode: the weight bytes halve too
    assert full.group_times(SMALL_DECODE)["linear"] / base.group_times(SMALL_DECODE)["linear"] == pytest.approx(0.5, rel=0.02)
    assert base.weight_bytes_per_gpu > half.weight_bytes_per_gpu > full.weight_bytes_per_gpu
    assert full.peak_tokens_per_s() == pytest.approx(2 * base.peak_tokens_per_s(), rel=1e-3)


def test_named_fp8_layers_and_fraction_agree():
    by_name, _ = perf({"precision": {"fp8_layers": list(range(16))}})
    by_share, _ = perf({"precision": {"fp8_fraction": 0.5}})
    assert len(by_name.fp8_layers) == 16 == len(by_share.fp8_layers)
    assert by_name.step_time(PREFILL) == pytest.approx(by_share.step_time(PREFILL))
    assert by_name.describe()["whatif"]["precision"]["fp8_layers"] == list(range(16))


def test_fp8_kv_cache_doubles_the_blocks_and_halves_kv_reads():
    base, sc0 = perf()
    kv8, sc1 = perf({"precision": {"fp8_fraction": 0.0, "kv_cache_fp8": True}})
    assert blocks(kv8, sc1) / blocks(base, sc0) == pytest.approx(2.0, rel=1e-3)
    b = StepBatch(num_decode_tokens=64, decode_context_tokens=64 * 4000)
    assert kv8.group_times(b)["decode_attn"] / base.group_times(b)["decode_attn"] == pytest.approx(0.5, rel=0.01)
    assert kv8.group_times(b)["linear"] == pytest.approx(base.group_times(b)["linear"])


def test_partial_kv_capacity_and_transfer_time():
    base, sc0 = perf()
    h, w, hit, share = 0.25, 0.5, 0.6, 0.5
    pk, sc1 = perf({"partial_kv": {"hot_fraction": h, "warm_fraction": w, "hit_rate": hit, "fetch_share": share}})
    q = 4 / 16  # 4-bit warm copy of a 16-bit KV cache
    factor = 1 / (h + w * hit * q)
    assert factor < 1 / h  # the staged warm share costs some of the 1/h
    assert blocks(pk, sc1) / blocks(base, sc0) == pytest.approx(factor, rel=1e-3)
    b = StepBatch(num_decode_tokens=32, decode_context_tokens=32 * 8000)
    link = pk.gpu.host_link_bandwidth
    assert link == 64e9  # H100 SXM: PCIe Gen5 x16, per direction
    kv_bytes = base.kv_bytes_per_token_per_gpu
    want = share * (1 - hit) * w * q * kv_bytes * b.decode_context_tokens / link
    assert pk.group_times(b)["kv_transfer"] == pytest.approx(want, rel=1e-9)
    assert pk.group_times(b)["decode_attn"] < base.group_times(b)["decode_attn"]  # the cold share is never read
    assert pk.step_time(b) == pytest.approx(sum(pk.group_times(b).values()))
    # a faster link (NVLink-C2C) moves the same bytes 450/64 times faster
    c2c, _ = perf({"partial_kv": {"hot_fraction": h, "warm_fraction": w, "hit_rate": hit, "fetch_share": share,
                                  "link": "nvlink-c2c"}})
    assert c2c.group_times(b)["kv_transfer"] == pytest.approx(want * 64 / 450, rel=1e-9)
    d = pk.describe()
    assert "whatif.partial_kv.hit_rate" in d["assumptions"] and d["whatif"]["partial_kv"]["capacity_factor"] == pytest.approx(factor)


def test_early_exit_cuts_compute_bound_decode_linear_time_by_token_share_times_layer_share():
    base, _ = perf()
    ee, _ = perf({"early_exit": {"token_share": 0.5, "layer_share": 0.4}})
    skipped = len(ee.skipped_layers) / 32  # round(0.4 x 32) = 13 layers
    cut = 1 - ee.group_times(BIG_DECODE)["linear"] / base.group_times(BIG_DECODE)["linear"]
    # the exiting tokens' FLOPs go; the GEMMs' last wave (perf.gemm_tail_tokens) is paid by the tokens that stay
    tail = base.gemm_tail_tokens
    assert cut == pytest.approx(0.5 * skipped * 2048 / (2048 + tail), rel=0.01) and cut == pytest.approx(0.19, abs=0.01)
    # prefill never exits; a memory-bound decode still reads nearly all weights
    assert ee.step_time(PREFILL) == pytest.approx(base.step_time(PREFILL))
    assert 1 - ee.group_times(SMALL_DECODE)["linear"] / base.group_times(SMALL_DECODE)["linear"] < 0.01
    assert ee.peak_tokens_per_s() > base.peak_tokens_per_s()


@pytest.mark.parametrize("whatif", [
    {"precision": {"fp8_fraction": 0.5, "kv_cache_fp8": True}},
    {"partial_kv": {"hit_rate": 0.5, "fetch_share": 0.3}},
    {"early_exit": {}},
    {"precision": {"fp8_fraction": 0.25}, "partial_kv": {}, "early_exit": {"token_share": 0.7}},
])
def test_decode_runs_equal_step_by_step_and_ideal_is_a_floor(whatif):
    p, _ = perf(whatif)
    assert p.decode_run_times(37, 1234, 9) == decode_run_times_by_steps(p, 37, 1234, 9)
    ideal = p.ideal()
    for b in (PREFILL, BIG_DECODE, SMALL_DECODE):
        assert ideal.step_time(b) <= p.step_time(b)


def test_wraps_a_fitted_model(tmp_path):
    fit = tmp_path / "fit.yaml"
    fit.write_text("basis: roofline-groups/1\ncoefficients: {linear: 1.3, prefill_attn: 1.4, decode_attn: 1.9, "
                   "lm_head: 1.2, allreduce: 1.0, step_s: 0.001, per_request_s: 4.0e-6}\n")
    sc = make_scenario(**{"cluster.perf": {"kind": "fitted", "fit_path": str(fit)}})
    base = build_perf(sc)
    sc2 = make_scenario(**{"cluster.perf": {"kind": "fitted", "fit_path": str(fit)}, "whatif": {"precision": {}}})
    w = build_perf(sc2)
    assert isinstance(w, WhatIfModel) and w.describe()["kind"] == "whatif(fitted)"
    assert WhatIfModel(base, make_scenario().whatif).step_time(BIG_DECODE) == pytest.approx(base.step_time(BIG_DECODE))
    assert w.group_times(BIG_DECODE)["linear"] == pytest.approx(0.5 * 1.3 * base.basis.group_times(BIG_DECODE)["linear"], rel=0.01)


@pytest.mark.parametrize("whatif,msg", [
    ({"partial_kv": {"hot_fraction": 0.6, "warm_fraction": 0.5}}, "hot_fraction + warm_fraction must be <= 1"),
    ({"partial_kv": {"hit_rate": 1.5}}, "whatif.partial_kv.hit_rate"),
    ({"early_exit": {"layer_share": 1.0}}, "whatif.early_exit.layer_share"),
    ({"precision": {"fp8_fraction": 0.5, "fp8_layers": [1]}}, "fp8_fraction or fp8_layers"),
    ({"precision": {"fp8_layers": [1, 1]}}, "whatif.precision.fp8_layers"),
    ({"precision": {"bogus": 1}}, "whatif.precision.bogus: unknown key"),
    ({"semantic_batching": {"max_new_tokens_ratio": 0.5}}, "max_new_tokens_ratio"),
])
def test_bad_knobs_are_one_line(whatif, msg):
    with pytest.raises(TwinInputError, match=msg.replace("+", r"\+")) as e:
        make_scenario(whatif=whatif)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("whatif,cluster,msg", [
    ({"precision": {"fp8_layers": [40]}}, {}, "Llama-3-8B has 32 layers"),
    ({"precision": {"fp8_fraction": 0.5}}, {"hardware": "A100"}, "no fp8"),
])
def test_knobs_that_clash_with_the_cluster_are_one_line(whatif, cluster, msg):
    with pytest.raises(TwinInputError, match=msg) as e:
        perf(whatif, **cluster)
    assert "\n" not in str(e.value)


def test_cli_bad_knob_is_one_error_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({"cluster": {"num_instances": 1}, "workload": {
        "num_requests": 1, "arrival": {"rate": 1}, "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1}}}))
    r = runner.invoke(app, ["simulate", str(path), "--set", "whatif.early_exit.token_share=2", "--quiet"])
    assert r.exit_code == 2
    assert [ln for ln in r.output.splitlines() if ln.strip()] == [
        "error: --set whatif.early_exit.token_share=2: Input should be less than or equal to 1 (got 2)"]


def test_runs_with_each_action_account_for_every_request_and_stay_under_the_ceiling():
    rng = np.random.default_rng(3)
    n = 120
    st = stream_of(np.sort(rng.uniform(0, 4, n)), rng.integers(50, 1500, n), rng.integers(5, 300, n))
    out = {}
    for name, w in [("base", None), ("fp8", {"precision": {"kv_cache_fp8": True}}),
                    ("pkv", {"partial_kv": {"hit_rate": 0.8, "fetch_share": 0.2}}), ("ee", {"early_exit": {}}),
                    ("sem", {"semantic_batching": {"predictor": "oracle"}})]:
        sc = make_scenario(**({"whatif": w} if w else {}))
        res = run_checked(sc, st)
        from twin.sim.metrics import summarize

        s = summarize(res)
        assert s["physics_ok"], name
        out[name] = s
    assert out["fp8"]["sim_time_s"] < out["base"]["sim_time_s"]
    assert out["ee"]["tpot_s"]["mean"] < out["base"]["tpot_s"]["mean"]
    assert out["pkv"]["num_gpu_blocks"] > 2 * out["base"]["num_gpu_blocks"]
    assert out["sem"]["requests_finished"] == n


# ---- semantic batching ------------------------------------------------------------------------------------
def test_semantic_order_groups_similar_lengths_oldest_group_first():
    prompt = [100, 5000, 110, 5200, 105]
    pred = [50, 900, 55, 950, 52]
    order = semantic_order(prompt, pred, eps=0.3)
    assert order == [0, 2, 4, 1, 3]
    assert sorted(order) == list(range(5))
    # the ratio cap splits a DBSCAN cluster: 50 and 150 tokens of output do not share a group at ratio 2
    order = semantic_order([100, 100, 100], [50, 150, 60], eps=5.0, max_new_tokens_ratio=2.0)
    assert order == [0, 2, 1]


def test_semantic_hook_reorders_only_fresh_waiting_requests():
    from collections import deque

    from twin.engine.request import Request
    from twin.whatif.semantic import queue_order

    sc = make_scenario(whatif={"semantic_batching": {"predictor": "oracle"}})
    hook = queue_order(sc, 8192)
    pre = Request(9, 0.0, 3000, 500)
    pre.num_preemptions = 1  # vLLM put it back at the front: it stays there
    reqs = [Request(i, 0.1 * i, p, o) for i, (p, o) in enumerate([(100, 50), (5000, 900), (110, 55), (5100, 950)])]
    q = deque([pre, *reqs])
    hook(q)
    assert [r.idx for r in q] == [9, 0, 2, 1, 3]
    assert queue_order(make_scenario(), 8192) is None


def test_semantic_batching_same_arrivals_as_fcfs_and_its_groups_are_tighter():
    rng = np.random.default_rng(5)
    n = 200
    prompts = rng.choice([80, 3000], n)
    outs = np.where(prompts > 1000, rng.integers(400, 600, n), rng.integers(20, 40, n))
    st = stream_of(np.sort(rng.uniform(0, 0.5, n)), prompts, outs)
    sc0 = make_scenario(**{"cluster.engine.max_num_seqs": 8})
    sc1 = make_scenario(**{"cluster.engine.max_num_seqs": 8}, whatif={"semantic_batching": {"predictor": "oracle"}})
    fcfs, sem = run_checked(sc0, st), run_checked(sc1, st)
    assert np.array_equal(fcfs.log.arrival_s, sem.log.arrival_s)
    # groups admitted together: neighbours in scheduling order have similar outputs under semantic batching
    def spread(res):
        order = np.argsort(res.log.scheduled_s, kind="stable")
        o = res.log.output_tokens[order].astype(float)
        return np.mean(np.abs(np.diff(np.log(o))))
    assert spread(sem) < 0.5 * spread(fcfs)


# ---- the XGBoost resource estimator -------------------------------------------------------------------------
def test_resource_estimator_learns_the_twin_and_reports_its_error():
    pytest.importorskip("xgboost")
    from twin.whatif.estimator import train_from_run

    rng = np.random.default_rng(7)
    n = 150
    st = stream_of(np.sort(rng.uniform(0, 5, n)), rng.integers(50, 2000, n), rng.integers(5, 200, n))
    est, rep = train_from_run(make_scenario(), st)
    assert rep["steps"] > 20 and rep["train_steps"] > 4 * rep["steps"] - 5
    assert rep["step_time_mape"] < 0.05  # against the twin's own step times, on steps it did not train on
    assert rep["kv_blocks_rel_err"] < 0.1
    b = [BIG_DECODE, SMALL_DECODE]
    assert est.step_time(b).shape == (2,)


def test_summary_and_cli_say_which_actions_ran_and_which_numbers_are_assumptions(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps({"cluster": {"num_instances": 1}, "workload": {
        "num_requests": 30, "arrival": {"rate": 10}, "lengths": {"kind": "fixed", "prompt_tokens": 200, "output_tokens": 20}},
        "whatif": {"early_exit": {}, "precision": {"fp8_fraction": 0.5, "accuracy_note": "MMLU -0.3 (our eval)"},
                   "semantic_batching": {"predictor": "oracle"}}}))
    r = runner.invoke(app, ["simulate", str(path), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("what-if:"))
    assert "semantic_batching (oracle lengths)" in line and "MMLU -0.3 (our eval)" in line
    assert "whatif.early_exit.token_share" in line
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert set(s["whatif"]) == {"early_exit", "precision", "semantic_batching"}
    assert s["perf_model"]["whatif"]["precision"]["accuracy_note"] == "MMLU -0.3 (our eval)"
    assert s["perf_model"]["whatif"]["precision"]["accuracy"] == "not simulated"
