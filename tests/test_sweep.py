"""`twin sweep`: grid expansion, one-line errors, resume, failed points, backends agree, Pareto fronts."""

import copy
import json

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from twin.cli import app
from twin.errors import TwinInputError
from twin.scenario import parse_scenario
from twin.analysis.sweep import (LocalBackend, RayBackend, build_grid, expand, flatten, mark_pareto, parse_grid, pareto_mask,
                        plan_sweep, results_frame, run_sweep)

BASE = {
    "name": "sweep-test",
    "seed": 3,
    "cluster": {"num_instances": 1, "hardware": "H100", "model": "Llama-3-8B",
                "engine": {"max_num_batched_tokens": 2048, "max_num_seqs": 64}},
    "workload": {"num_requests": 120, "arrival": {"process": "poisson", "rate": 8},
                 "lengths": {"kind": "fixed", "prompt_tokens": 300, "output_tokens": 40}},
    "slo": {"ttft_s": 0.5, "tpot_s": 0.05},
}
METRICS = ["ttft_mean_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s", "e2e_mean_s", "goodput_req_s", "slo_attainment",
           "throughput_req_s", "prefix_cache_hit_rate", "preemptions", "gpu_seconds", "sim_time_s"]
runner = CliRunner()


def base():
    return copy.deepcopy(BASE)


class Counting:
    """A serial backend that remembers which points it was asked to run."""

    name = "counting"

    def __init__(self):
        self.ran = []

    def describe(self, n):
        return "counting"

    def map(self, fn, tasks):
        for i, t in enumerate(tasks):
            self.ran.append(t.params)
            yield i, fn(t)


def plan(grid, raw=None, **kw):
    return plan_sweep(raw or base(), grid, "sweep-test.yaml", ".", **kw)


# ---------------------------------------------------------------- grid


def test_grid_expands_to_the_cross_product_in_order():
    g = parse_grid(["cluster.num_instances=1,2", "router.params={a: 1, b: 2},{}", "sim.mode=fast,step,fast2"])
    assert g["cluster.num_instances"] == [1, 2]
    assert g["router.params"] == [{"a": 1, "b": 2}, {}]
    assert g["sim.mode"] == ["fast", "step", "fast2"]
    pts = expand(g)
    assert len(pts) == 12
    assert pts[0] == {"cluster.num_instances": 1, "router.params": {"a": 1, "b": 2}, "sim.mode": "fast"}
    assert pts[1]["sim.mode"] == "step" and pts[-1] == {"cluster.num_instances": 2, "router.params": {},
                                                        "sim.mode": "fast2"}
    assert expand({}) == [{}]


def test_routers_and_seeds_become_grid_keys():
    g = build_grid(["cluster.num_instances=1,2"], routers="round_robin,random", seeds=3, base_seed=10)
    assert g == {"cluster.num_instances": [1, 2], "router.name": ["round_robin", "random"], "seed": [10, 11, 12]}
    assert len(expand(g)) == 12


@pytest.mark.parametrize("items,routers,seeds,needle", [
    (["cluster.num_instances"], None, 1, "expected dotted.path=v1,v2"),
    (["cluster.num_instances=1,,2"], None, 1, "empty value"),
    (["cluster..x=1"], None, 1, "empty key"),
    (["seed=1", "seed=2"], None, 1, "given twice"),
    (["seed=1,1"], None, 1, "listed twice"),
    (["router.name=random"], "round_robin", 1, "not both"),
    (["seed=1,2"], None, 2, "not both"),
    ([], None, 0, "--seeds 0"),
])
def test_malformed_grid_options_are_one_line(items, routers, seeds, needle):
    with pytest.raises(TwinInputError) as e:
        build_grid(items, routers, seeds)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("grid,needle", [
    ({"cluster.engine.max_batch": [1]}, "--grid cluster.engine.max_batch=1: cluster.engine.max_batch: unknown key"),
    ({"cluster.num_instances": [1, "many"]}, "--grid cluster.num_instances=many: cluster.num_instances:"),
    ({"router.name": ["round_robin", "fastest"]}, "unknown router 'fastest'"),
    ({"cluster.hardware": ["H100", "TPU9"]}, "TPU9"),
])
def test_bad_grid_keys_and_values_are_one_line_before_anything_runs(grid, needle):
    with pytest.raises(TwinInputError) as e:
        plan(grid)
    assert needle in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_values_that_clash_only_together_stop_the_sweep_or_are_skipped(tmp_path):
    # 128 >= 64 and 256 <= 2048 are fine alone; 128 tokens for 256 sequences is what vLLM refuses
    grid = {"cluster.engine.max_num_batched_tokens": [128, 2048], "cluster.engine.max_num_seqs": [64, 256]}
    with pytest.raises(TwinInputError) as e:
        plan(grid)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert "max_num_batched_tokens=128, cluster.engine.max_num_seqs=256" in msg and "1 of 4 points invalid" in msg
    p = plan(grid, skip_invalid=True)
    b = Counting()
    out = run_sweep(p, tmp_path / "s", b)
    assert len(b.ran) == 3 and out.invalid == 1
    t = out.table
    bad = t[t.status == "invalid"]
    assert len(bad) == 1 and "must be >=" in bad.error.iloc[0]


def test_cli_bad_grid_is_one_line_and_writes_nothing(tmp_path):
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(base()))
    out = tmp_path / "out"
    r = runner.invoke(app, ["sweep", str(sc), "--grid", "cluster.engine.max_num_seqs=32,abc", "--out", str(out)])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --grid cluster.engine.max_num_seqs=abc"), r.output
    assert not out.exists()


# ---------------------------------------------------------------- running


def test_resumed_sweep_skips_finished_points_and_reruns_none(tmp_path):
    out = tmp_path / "s"
    first = Counting()
    r1 = run_sweep(plan({"cluster.num_instances": [1, 2]}), out, first)
    assert r1.ran == 2 and r1.skipped == 0 and len(list((out / "points").glob("*.json"))) == 2
    before = {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json")}
    second = Counting()
    r2 = run_sweep(plan({"cluster.num_instances": [1, 2, 3]}), out, second)
    assert second.ran == [{"cluster.num_instances": 3}]
    assert r2.ran == 1 and r2.skipped == 2
    for name, t in before.items():
        assert (out / "points" / name).stat().st_mtime_ns == t  # not rewritten
    t = r2.table
    assert list(t["cluster.num_instances"]) == [1, 2, 3] and (t.status == "ok").all()
    third = Counting()
    r3 = run_sweep(plan({"cluster.num_instances": [1, 2, 3]}), out, third)
    assert third.ran == [] and r3.skipped == 3
    pd.testing.assert_frame_equal(r3.table, r2.table)
    # a changed base scenario is another point: it runs
    raw = base()
    raw["workload"]["num_requests"] = 60
    fourth = Counting()
    run_sweep(plan({"cluster.num_instances": [1]}, raw), out, fourth)
    assert len(fourth.ran) == 1


def test_a_failed_point_is_recorded_and_the_others_finish(tmp_path):
    # 9,000 prompt tokens exceed Llama-3-8B's 8,192 context: the scenario parses, its stream refuses at run time
    grid = {"workload.lengths.prompt_tokens": [300, 9000, 500]}
    out = tmp_path / "s"
    r = run_sweep(plan(grid), out, LocalBackend(1))
    t = r.table
    assert list(t.status) == ["ok", "failed", "ok"] and r.failed == 1
    assert "max_model_len" in t.error.iloc[1] and "\n" not in t.error.iloc[1]
    assert t.goodput_req_s.iloc[[0, 2]].notna().all() and np.isnan(t.goodput_req_s.iloc[1])
    rec = json.loads(next(p for p in (out / "points").glob("*.json")
                          if json.loads(p.read_text())["status"] == "failed").read_text())
    assert rec["params"] == {"workload.lengths.prompt_tokens": 9000}
    again = Counting()
    r2 = run_sweep(plan(grid), out, again)
    assert again.ran == [{"workload.lengths.prompt_tokens": 9000}] and r2.retried == 1 and r2.skipped == 2


BOOM = """from twin.policy.base import RouterBase


class Boom(RouterBase):
    name = "boom"

    def choose(self, req, fleet):
        raise RuntimeError("boom")
"""


def test_a_raising_point_does_not_stop_the_pool(tmp_path):
    # a router that raises while routing passes every check the plan makes (unknown router parameters and a KV
    # cache vLLM would refuse did, until the plan built each point's router and sized its cache)
    (tmp_path / "boom.py").write_text(BOOM)
    grid = {"router.name": ["round_robin", f"{tmp_path / 'boom.py'}:Boom"]}
    r = run_sweep(plan(grid), tmp_path / "s", LocalBackend(1))
    assert list(r.table.status) == ["ok", "failed"]
    assert "boom" in r.table.error.iloc[1]


def test_a_quiet_sweep_says_which_point_failed(tmp_path):
    (tmp_path / "boom.py").write_text(BOOM)
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(base()))
    r = CliRunner().invoke(app, ["sweep", str(sc), "-q", "--workers", "1", "--out", str(tmp_path / "out"),
                                 "--grid", f"router.name=round_robin,{tmp_path / 'boom.py'}:Boom"])
    assert r.exit_code == 1
    assert "1 point failed" in r.output and "boom" in r.output


def test_a_point_whose_kv_cache_vllm_would_refuse_is_invalid_before_any_run():
    with pytest.raises(TwinInputError, match="max_model_len"):
        plan({"cluster.engine.gpu_memory_utilization": [0.92, 0.235]})


def test_a_point_whose_router_cannot_be_built_is_invalid_before_any_run():
    with pytest.raises(TwinInputError, match="no_such_param"):
        plan({"router.params": [{}, {"no_such_param": 1}]})
    p = plan({"router.params": [{}, {"no_such_param": 1}]}, skip_invalid=True)
    assert [q.error is None for q in p.points] == [True, False]


def test_local_pool_gives_the_serial_summaries(tmp_path):
    grid = {"cluster.num_instances": [1, 2], "router.name": ["round_robin", "random"]}
    serial = run_sweep(plan(grid), tmp_path / "a", LocalBackend(1)).table
    pooled = run_sweep(plan(grid), tmp_path / "b", LocalBackend(2)).table
    assert (serial.status == "ok").all() and len(serial) == 4
    pd.testing.assert_frame_equal(serial[["point", *grid, *METRICS]], pooled[["point", *grid, *METRICS]])
    assert serial.ttft_mean_s.nunique() == 3  # the points differ (one instance: both routers alike)


def test_ray_backend_gives_the_serial_summaries(tmp_path):
    pytest.importorskip("ray")
    grid = {"cluster.num_instances": [1, 2]}
    serial = run_sweep(plan(grid), tmp_path / "a", LocalBackend(1)).table
    # Ray 2.60 dropped local_mode; a one-CPU local instance is the closest (no cluster needed)
    ray_t = run_sweep(plan(grid), tmp_path / "b", RayBackend(init_kwargs={"num_cpus": 1})).table
    pd.testing.assert_frame_equal(serial[["point", *grid, *METRICS]], ray_t[["point", *grid, *METRICS]])


def test_ray_missing_is_one_line(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_ray(name, *a, **kw):
        if name == "ray":
            raise ImportError("no ray")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(TwinInputError, match=r"pip install 'llmtwin\[ray\]'"):
        RayBackend.load()


def test_cli_sweep_writes_table_and_plots_and_resumes(tmp_path):
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(base()))
    out = tmp_path / "out"
    args = ["sweep", str(sc), "--grid", "cluster.num_instances=1,2", "--routers", "round_robin,least_outstanding_requests",
            "--workers", "1", "--out", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    t = pd.read_parquet(out / "results.parquet")
    assert len(t) == 4 and (t.status == "ok").all()
    for col in ["cluster.num_instances", "router.name", *METRICS, "pareto_goodput", "pareto_slo"]:
        assert col in t.columns, col
    assert len(pd.read_csv(out / "results.csv")) == 4
    for png in ("pareto_goodput.png", "pareto_slo.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a fixed fleet: GPU-seconds = instances x TP x simulated time
    assert np.allclose(t.gpu_seconds, t["cluster.num_instances"] * t.sim_time_s)
    r2 = runner.invoke(app, [*args[:3], "cluster.num_instances=1,2,4", *args[4:]])
    assert r2.exit_code == 0, r2.output
    assert "skipped 4 points already finished" in r2.output and "running 2 on" in r2.output


def test_cli_sweep_exits_1_when_a_point_failed(tmp_path):
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump(base()))
    r = runner.invoke(app, ["sweep", str(sc), "--grid", "workload.lengths.prompt_tokens=300,9000", "--workers", "1",
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 1
    assert "point failed" in r.output and "1 ok, 1 failed" in r.output
    assert len(pd.read_parquet(tmp_path / "o" / "results.parquet")) == 2


# ---------------------------------------------------------------- results and Pareto


def dominated_brute(x, y):
    n = len(x)
    on = np.zeros(n, bool)
    for i in range(n):
        if np.isnan(x[i]) or np.isnan(y[i]):
            continue
        on[i] = not any(x[j] <= x[i] and y[j] >= y[i] and (x[j] < x[i] or y[j] > y[i]) for j in range(n)
                        if not (np.isnan(x[j]) or np.isnan(y[j])))
    return on


def test_pareto_front_on_a_hand_made_table():
    #            A    B    C    D    E    F    G       H
    cost = [1.0, 2.0, 2.0, 3.0, 4.0, 4.0, np.nan, 0.5]
    value = [1.0, 3.0, 2.0, 3.0, 5.0, 5.0, 9.0, 0.2]
    # C is beaten by B at equal cost, D by B at lower cost; E and F are equal (neither dominates); G has no cost
    assert pareto_mask(cost, value).tolist() == [True, True, False, False, True, True, False, True]


def test_pareto_front_matches_the_definition():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.integers(0, 8, 40).astype(float)
        y = rng.integers(0, 8, 40).astype(float)
        x[rng.random(40) < 0.1] = np.nan
        assert (pareto_mask(x, y) == dominated_brute(x, y)).all()


def test_pareto_is_per_configuration_over_seeds():
    recs = []
    for n, seed, gpu, good in ((1, 0, 10, 5.0), (1, 1, 12, 5.2), (2, 0, 20, 5.0), (2, 1, 20, 5.1)):
        recs.append({"key": f"{n}-{seed}", "params": {"n": n, "seed": seed}, "status": "ok",
                     "metrics": {"gpu_seconds": gpu, "goodput_req_s": good, "slo_attainment": 1.0}})
    t = mark_pareto(results_frame(recs, ["n", "seed"]), ["n", "seed"])
    # means: n=1 (11 GPU-s, 5.1) dominates n=2 (20 GPU-s, 5.05), though seed 1 of n=1 alone would not
    assert t.pareto_goodput.tolist() == [True, True, False, False]


def test_gpu_seconds_prefers_the_fleets_account():
    sc = parse_scenario({**base(), "cluster": {**base()["cluster"], "num_instances": 3, "tensor_parallel": 2}})
    s = {"sim_time_s": 10.0, "ttft_s": {"mean": 1.0, "p50": 1.0, "p99": 2.0}}
    row = flatten(s, sc)
    assert row["gpu_seconds"] == 60.0 and row["num_gpus"] == 6 and row["gpu_seconds_source"].startswith("num_inst")
    assert row["ttft_p99_s"] == 2.0 and np.isnan(row["tpot_p99_s"]) and np.isnan(row["goodput_req_s"])
    row = flatten({**s, "gpu_seconds": 42.0}, sc)
    assert row["gpu_seconds"] == 42.0 and row["gpu_seconds_source"] == "fleet"
