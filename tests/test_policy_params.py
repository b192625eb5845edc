"""Router, scaler and predictor parameters are judged before the policy is built: one clear line naming the
parameter, never a silent misreading (a quoted "false" is truthy), never a crash mid-run. Found by a fuzzing pass
over `router: / scaler: / predictor: {name, params}` and `--set`."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_bad_input_cli import one_error
from twin.cli import app
from twin.errors import TwinInputError
from twin.policy import make_router
from twin.policy.base import ParamError, build_router, judge_params
from twin.policy.predictors import make_predictor
from twin.policy.scalers import make_scaler
from twin.scenario import load_scenario
from twin.sim.build import build_scaler, check_policies

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
SMALL = ["--set", "workload.num_requests=20"]


def scenario(*sets: str):
    return load_scenario(QUICKSTART, ["workload.num_requests=20", *sets])


def refusal(*sets: str) -> str:
    """The one line a scenario's policies are refused with, as `twin simulate` builds them."""
    with pytest.raises(TwinInputError) as e:
        check_policies(scenario(*sets))
    line = str(e.value)
    assert "\n" not in line
    return line


# ---- 1. kinds judged before the constructor runs ----

@pytest.mark.parametrize("sets, says", [
    (["router.name=lmetric", 'router.params={hotspot: "false"}'],
     "router.params.hotspot: 'false' is not true or false"),
    (["router.name=block", 'router.params={prune: "no"}'], "router.params.prune: 'no' is not true or false"),
    (["scaler.name=twin", 'scaler.params={early_stop: "no"}'], "scaler.params.early_stop: 'no' is not true or false"),
    (["router.name=sticky", 'router.params={inner: {name: lmetric, params: {cold_start: "off"}}}'],
     "router.params.inner.params.cold_start: 'off' is not true or false"),
])
def test_a_quoted_bool_is_refused_not_read_as_true(sets, says):
    """A constructor that took "false" ran with the feature on: the kinds were judged only when it raised."""
    assert refusal(*sets) == says


@pytest.mark.parametrize("sets, says", [
    (["router.name=block", "router.params={horizon_s: .nan}"], "router.params.horizon_s: nan is not a number"),
    (["router.name=weighted", "router.params={scorers: {queue: .nan}}"], "router.params.scorers: scorer weight"),
    (["router.name=kv-cost", "router.params={overlap_score_weight: .nan}"],
     "router.params.overlap_score_weight: nan is not a number"),
    (["scaler.name=threshold", "scaler.params={threshold_s: 1, max_step_frac: .nan}"],
     "scaler.params.max_step_frac: nan is not a number"),
    (["router.name=lmetric", "router.params={bs_offset: .nan}"], "router.params.bs_offset: nan is not a number"),
    (["router.name=weighted", "router.params={scorers: {queue: .inf}}"], "router.params.scorers: scorer weight"),
    (["router.name=kv-cost", "router.params={overlap_score_weight: .inf}"],
     "router.params.overlap_score_weight: must be a finite number"),
])
def test_nan_and_a_meaningless_inf_are_refused(sets, says):
    assert refusal(*sets).startswith(says)


def test_an_int_parameter_takes_only_a_whole_number():
    """`max_candidates: 1.5` crashed mid-run with 'slice indices must be integers', reported as a router bug."""
    assert refusal("router.name=block", "router.params={max_candidates: 1.5}") == \
        "router.params.max_candidates: 1.5 is not a whole number"
    assert "not a whole number" in refusal("router.name=lmetric", "router.params={hotspot_window: .inf}")
    r = build_router(scenario("router.name=block", "router.params={max_candidates: 2.0}").router, 0)
    assert r.max_candidates == 2 and type(r.max_candidates) is int


def test_a_string_that_reads_as_a_number_is_taken_but_never_as_a_bool():
    """YAML 1.1 reads 1e-3 as a string; scenario fields take it, so parameters do too."""
    r = build_router(scenario("router.name=kv-cost", "router.params={temperature: 1e-3}").router, 0)
    assert r.temperature == pytest.approx(0.001)
    assert make_scaler("queue", target_waiting="2.5").target_waiting == 2.5
    assert make_router("lmetric", hotspot_window="1e3")._window.maxlen == 1000
    assert "'1' is not true or false" in refusal("router.name=lmetric", 'router.params={hotspot: "1"}')
    assert "'abc' is not a number" in refusal("router.name=kv-cost", "router.params={temperature: abc}")


def test_user_policies_are_judged_only_where_a_default_says_the_kind(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("from twin.policy import RouterBase\n"
                 "class Mine(RouterBase):\n"
                 "    def __init__(self, label=None, weights=(1, 2), k: int = 3, on: bool = False, cap=None):\n"
                 "        self.label, self.weights, self.k, self.on, self.cap = label, weights, k, on, cap\n"
                 "    def choose(self, req, fleet):\n"
                 "        return fleet.instances[0].id\n")
    r = make_router(f"{f}:Mine", label="x", weights=[3], k="4", cap="anything", on=True)
    assert (r.label, r.weights, r.k, r.on, r.cap) == ("x", [3], 4, True, "anything")
    with pytest.raises(ParamError, match="on: 'yes' is not true or false"):
        make_router(f"{f}:Mine", on="yes")
    assert judge_params(lambda x=None, y=2.0: None, {"x": "a", "y": "1"}) == {"x": "a", "y": 1.0}


def test_none_is_taken_where_the_parameter_declares_it():
    assert make_scaler("queue", scale_up_percent=None).scale_up_percent is None
    with pytest.raises(TwinInputError, match="scaler.params.scale_up_pods: None is not a number"):
        make_scaler("queue", scale_up_pods=None)


# ---- 2. ranges ----

@pytest.mark.parametrize("name, params, says", [
    ("threshold", {"threshold_s": 1, "quantile": 0}, "scaler.params.quantile: must be in (0, 1]"),
    ("threshold", {"threshold_s": 1, "quantile": 1.5}, "scaler.params.quantile: must be in (0, 1]"),
    ("threshold", {"threshold_s": 1, "window_s": 0}, "scaler.params.window_s: must be a finite number > 0"),
    ("threshold", {"threshold_s": 1, "cooldown_s": -1}, "scaler.params.cooldown_s: must be >= 0"),
    ("threshold", {"threshold_s": float("nan")}, "scaler.params.threshold_s: nan is not a number"),
    ("throughput", {"history": 0}, "scaler.params.history: must be >= 1"),
    ("throughput", {"capacity_req_s": 0}, "scaler.params.capacity_req_s: must be a finite number > 0"),
    ("throughput", {"capacity_req_s": -2.0}, "scaler.params.capacity_req_s: must be a finite number > 0"),
    ("throughput", {"headroom": -0.5}, "scaler.params.headroom: must be a finite number >= 0"),
    ("throughput", {"headroom": -1}, "scaler.params.headroom: must be a finite number >= 0"),
    ("queue", {"scale_up_pods": 0}, "scaler.params.scale_up_pods: must be >= 1"),
    ("queue", {"stabilization_s": -1}, "scaler.params.stabilization_s: must be >= 0"),
    ("twin", {"horizon_s": 0}, "scaler.params.horizon_s: must be a finite number > 0"),
    ("twin", {"horizon_s": float("inf")}, "scaler.params.horizon_s: must be a finite number > 0"),
    ("twin", {"max_step": 0}, "scaler.params.max_step: must be >= 1"),
    ("twin", {"min_instances": 3, "max_instances": 2}, "scaler.params.min_instances: 3 is above max_instances"),
    ("static", {"target": "x"}, "scaler.params.target: 'x' is not a number"),
])
def test_scaler_parameters_out_of_range_are_one_line(name, params, says):
    with pytest.raises(TwinInputError) as e:
        make_scaler(name, **params)
    assert str(e.value).startswith(says), str(e.value)


def test_a_twin_scaler_min_above_the_clusters_max_is_refused():
    line = refusal("cluster.max_instances=4", "scaler.name=twin", "scaler.params={min_instances: 5}")
    assert line.startswith("scaler.params.min_instances: 5 is above cluster.max_instances (4)")
    check_policies(scenario("cluster.max_instances=4", "scaler.name=twin", "scaler.params={min_instances: 4}"))


@pytest.mark.parametrize("name, params, says", [
    ("cache-aware", {"balance_abs_threshold": -1}, "router.params.balance_abs_threshold: must be >= 0"),
    ("block", {"max_candidates": -1}, "router.params.max_candidates: must be >= 0"),
    ("random", {"seed": -1}, "router.params.seed: must be >= 0"),
    ("random", {"seed": 1.5}, "router.params.seed: 1.5 is not a whole number"),
    ("random", {"seed": "x"}, "router.params.seed: 'x' is not a number"),
    ("lmetric", {"cold_token_penalty": float("inf")}, "router.params.cold_token_penalty: must be a finite"),
    ("kv-cost", {"temperature": -1}, "router.params.temperature: must be a finite number >= 0"),
])
def test_router_parameters_out_of_range_are_one_line(name, params, says):
    spec = scenario(f"router.name={name}").router.model_copy(update={"params": params})
    with pytest.raises(TwinInputError) as e:
        build_router(spec, 0)
    assert str(e.value).startswith(says), str(e.value)


def test_a_random_seed_of_its_own_wins_and_is_kept():
    assert make_router("random", seed=7).seed == 7
    assert build_router(scenario("router.name=random", "router.params={seed: 3}").router, 0).seed == 3


# ---- 3. a throughput scaler's load predictor ----

def test_an_unknown_load_predictor_is_one_line_naming_the_known_ones(tmp_path):
    line = one_error(["simulate", QUICKSTART, "-q", *SMALL, "--set", "scaler.name=throughput",
                      "--set", "scaler.params={predictor: nope}", "--out", tmp_path / "r"])
    assert "scaler.params.predictor: unknown load predictor 'nope'" in line and "moving-average" in line
    assert refusal("scaler.name=twin", "scaler.params={predictor_params: {window: 0}}").startswith(
        "scaler.params.predictor_params: ")
    assert refusal("scaler.name=throughput", "scaler.params={predictor_params: {window: 1.5}}") == \
        "scaler.params.predictor_params.window: 1.5 is not a whole number"
    assert "takes no parameter 'x'" in refusal("scaler.name=throughput",
                                               "scaler.params={predictor: constant, predictor_params: {x: 1}}")


# ---- 4. a length predictor's prior ----

@pytest.mark.parametrize("name", ["mean", "bucket-quantile"])
@pytest.mark.parametrize("prior, says", [
    (float("nan"), "predictor.params.prior: nan is not a number"),
    (float("inf"), "prior must be a finite number >= 0"),
    (-1, "prior must be a finite number >= 0"),
])
def test_a_nan_inf_or_negative_prior_is_refused_up_front(name, prior, says):
    """A NaN prior ran until the first prediction: 'cannot convert float NaN to integer' mid-run."""
    with pytest.raises(TwinInputError, match=says):
        make_predictor(name, prior=prior)


def test_a_nan_prior_is_refused_before_the_run(tmp_path):
    line = one_error(["simulate", QUICKSTART, "-q", *SMALL, "--set", "predictor={name: mean, params: {prior: .nan}}",
                      "--out", tmp_path / "r"])
    assert "predictor.params.prior: nan is not a number" in line
    with pytest.raises(TwinInputError, match="predictor.params.inner_params.prior: 'x' is not a number"):
        make_predictor("noisy", inner="mean", inner_params={"prior": "x"})
    with pytest.raises(TwinInputError, match="error_rate must be a finite number"):
        make_predictor("noisy", inner="mean", error_rate=float("inf"), dist="lognormal")


# ---- 5. what `twin validate` can check: the policies built as a run builds them ----

@pytest.mark.parametrize("sets, says", [
    (["router.params={foo: 1}"], "router.params: router 'least-outstanding' takes no parameter 'foo'"),
    (["router.name=/tmp/llmtwin-nonexist.py:X"], "router.name: router file /tmp/llmtwin-nonexist.py does not exist"),
    (["scaler.name=static", "scaler.params={target: x}"], "scaler.params.target: 'x' is not a number"),
    (["predictor={name: model, params: {path: /llmtwin-nonexist}}"], "/llmtwin-nonexist: not a length model"),
])
def test_check_policies_refuses_what_simulate_refuses(tmp_path, sets, says):
    assert refusal(*sets).startswith(says)
    args = [a for s in sets for a in ("--set", s)]
    assert says in one_error(["simulate", QUICKSTART, "-q", *SMALL, *args, "--out", tmp_path / "r"])


def test_check_policies_passes_a_good_scenario():
    check_policies(scenario())
    check_policies(scenario("router.name=lmetric", "scaler.name=twin", "predictor={name: mean}"))


# ---- 6. a scaler file is called a scaler file ----

def test_a_missing_scaler_file_is_called_a_scaler_file():
    with pytest.raises(TwinInputError, match="scaler.name: scaler file /tmp/llmtwin-nonexist.py does not exist"):
        build_scaler(scenario("scaler.name=/tmp/llmtwin-nonexist.py:X"))
    with pytest.raises(TwinInputError, match="scaler.params: scaler 'static' takes no parameter 'tagret'"):
        make_scaler("static", tagret=2)


# ---- the live controller builds them alike ----

def test_the_live_config_refuses_them_alike(tmp_path, capsys):
    pytest.importorskip("aiohttp")
    from live.cli import run

    p = tmp_path / "live.yaml"
    p.write_text('workers: [{url: http://127.0.0.1:9}]\nrouter: {name: lmetric, params: {hotspot: "false"}}\n')
    assert run(p) == 2
    assert "router.params.hotspot: 'false' is not true or false" in capsys.readouterr().err
    p.write_text("workers: [{url: http://127.0.0.1:9}]\npredictor: {name: mean, params: {prior: .nan}}\n")
    assert run(p) == 2
    assert "predictor.params.prior: nan is not a number" in capsys.readouterr().err
    p.write_text("workers: [{url: http://127.0.0.1:9}]\nscaler: {name: queue, params: {scale_up_pods: 0}}\n")
    assert run(p) == 2
    assert "scaler.params.scale_up_pods: must be >= 1" in capsys.readouterr().err
