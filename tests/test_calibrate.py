"""Calibration: fits on data the twin itself generated with known coefficients must recover them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from twin.lab.calibrate import (Observation, Profile, fit_operator_profile, fit_schedule, perf_block, profile_document,
                            read_observation, simulate_observation, write_profile)
from twin.cli import app
from twin.errors import TwinInputError
from twin.specs.hardware import get_gpu
from twin.specs.models import get_model
from twin.lab.observe import Load, cache_config, calibration_load, check_loopback
from twin.perf.fitted import FittedModel
from twin.perf.roofline import RooflineModel

META = {"engine": {"block_size": 128, "max_num_batched_tokens": 2048, "max_num_seqs": 16, "max_model_len": 512,
                   "num_gpu_blocks": 256}, "twin": {"hardware": "CPU-2core-AVX512", "model": "tiny-llama"}}
TRUE = {"linear": 2.0, "attn": 3.0, "step_s": 0.0015, "per_request_s": 5e-5, "api_request_overhead_s": 0.003,
        "api_prompt_token_s": 2e-6, "api_output_token_s": 2e-4}


def deterministic_load():
    """Isolated requests and simultaneous bursts: no arrival lands mid-step, so the schedule is exact."""
    arr, p, o = [], [], []
    t = 0.0
    for L in (8, 32, 64, 128, 256, 384, 480):
        arr.append(t), p.append(L), o.append(24)
        t += 0.5
    for B, L, O in ((2, 32, 48), (4, 200, 32), (8, 64, 64), (16, 16, 40), (12, 300, 16), (6, 100, 80)):
        for _ in range(B):
            arr.append(t), p.append(L), o.append(O)
        t += 3.0
    return np.array(arr), np.array(p), np.array(o)


def synthetic(profile: Profile, arr, p, o, path: Path = Path("synthetic")) -> Observation:
    req = pd.DataFrame({"request_id": np.arange(len(arr)), "arrival_s": arr, "first_token_s": np.nan,
                        "finish_s": np.nan, "prompt_tokens": p, "max_tokens": o, "output_tokens": o,
                        "status": "finished"})
    obs = Observation(path, req, None, META)
    obs.requests = simulate_observation(obs, profile).requests
    return obs


def test_fit_recovers_known_coefficients():
    obs = synthetic(Profile.from_params(TRUE), *deterministic_load())
    assert (obs.requests["status"] == "finished").all()
    fit = fit_schedule([obs])
    got = fit.profile.params()
    for k in ("linear", "attn", "step_s", "per_request_s"):
        assert got[k] == pytest.approx(TRUE[k], rel=0.03), k
    # bursts queue in the API server, which tells its per-request work from the per-token delay of every token
    assert got["api_request_overhead_s"] == pytest.approx(TRUE["api_request_overhead_s"], rel=0.03)
    total = got["api_handoff_s"] + got["api_output_token_s"]  # these two delay an idle request's tokens alike
    assert total == pytest.approx(TRUE["api_output_token_s"], rel=0.05)
    assert fit.cost < 1e-3 < fit.history[0]["cost"]


def queue_load():
    """The deterministic load, then simultaneous bursts of mixed prompt lengths: in the API server's processor
    sharing the short ones end first, so the per-request and per-prompt-token work are told apart."""
    arr, p, o = [list(x) for x in deterministic_load()]
    t = arr[-1] + 3.0
    for lens in ((16, 64, 256, 480), (32, 32, 128, 128, 384, 384), (8, 100, 200, 300, 400, 450, 480, 20)):
        for L in lens:
            arr.append(t), p.append(L), o.append(32)
        t += 3.0
    return np.array(arr), np.array(p), np.array(o)


def test_fit_recovers_the_api_servers_queue():
    truth = dict(TRUE, api_handoff_s=0.002)
    obs = synthetic(Profile.from_params(truth), *queue_load())
    got = fit_schedule([obs]).profile.params()
    for k in ("linear", "attn", "step_s", "per_request_s", "api_request_overhead_s"):
        assert got[k] == pytest.approx(truth[k], rel=0.03), k
    assert got["api_prompt_token_s"] == pytest.approx(truth["api_prompt_token_s"], rel=0.05)
    # the hand-off before the engine and each token's streaming after it delay an idle request alike
    shift = got["api_handoff_s"] + got["api_output_token_s"]
    assert shift == pytest.approx(truth["api_handoff_s"] + truth["api_output_token_s"], rel=0.05)


def test_fit_from_a_wrong_start_moves_toward_the_truth():
    obs = synthetic(Profile.from_params(TRUE), *deterministic_load())
    start = {k: v * (3.0 if i % 2 else 0.4) for i, (k, v) in enumerate(TRUE.items())}
    fit = fit_schedule([obs], init=start)
    got = fit.profile.params()
    assert got["step_s"] == pytest.approx(TRUE["step_s"], rel=0.05)
    assert got["linear"] == pytest.approx(TRUE["linear"], rel=0.1)
    assert fit.cost < fit.history[0]["cost"] / 100


def test_profile_file_round_trips_through_a_scenario(tmp_path):
    obs = synthetic(Profile.from_params(TRUE), *deterministic_load())
    fit = fit_schedule([obs], iterations=3)
    doc = profile_document(fit, [obs])
    path = write_profile(tmp_path / "cpu.yaml", doc)
    prof = Profile.from_file(path)
    assert prof.api == pytest.approx(fit.profile.api)
    block = perf_block(path.name, doc)
    assert "kind: fitted" in block and "api_request_overhead_s" in block
    from twin.perf.registry import build_perf
    from twin.scenario import parse_scenario

    raw = {"cluster": {"num_instances": 1, "hardware": "cpu", "model": "tiny-llama",
                       "engine": {"block_size": 128, "max_model_len": 512, "num_gpu_blocks_override": 256},
                       "perf": {"kind": "fitted", "fit_path": path.name, **prof.api}},
           "workload": {"num_requests": 5, "arrival": {"rate": 1.0},
                        "lengths": {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 5}}}
    perf = build_perf(parse_scenario(raw, "t", tmp_path))
    assert isinstance(perf, FittedModel)
    assert perf.coefficients == pytest.approx(fit.profile.coefficients)
    assert perf.api_request_s(0) == pytest.approx(prof.api["api_request_overhead_s"])


def _profile_csv(path: Path, model: str, c: float, fixed_s: float) -> None:
    """A Vidur-style per-layer profile whose linear time is exactly c x the ideal roofline + fixed."""
    m = get_model(model)
    ideal = RooflineModel(get_gpu("H100"), m).ideal()
    rows = []
    for t in (1, 8, 64, 256, 1024, 4096):
        total_ms = (c * ideal._linear(t) + fixed_s) * 1e3
        per_layer = total_ms / m.num_layers
        rows.append({"time_stats.attn_pre_proj.median": per_layer * 0.25, "time_stats.attn_post_proj.median": per_layer * 0.25,
                     "time_stats.mlp_up_proj.median": per_layer * 0.25, "time_stats.mlp_down_proj.median": per_layer * 0.25,
                     "n_head": m.num_heads, "n_kv_head": m.num_kv_heads, "n_embd": m.hidden_size,
                     "n_expanded_embd": m.intermediate_size, "vocab_size": m.vocab_size, "use_gated_mlp": True,
                     "num_tokens": t, "num_tensor_parallel_workers": 1})
    pd.DataFrame(rows).to_csv(path, index=False)


def test_operator_profile_fit_recovers_slowdown_and_launch_cost(tmp_path):
    csv = tmp_path / "mlp.csv"
    _profile_csv(csv, "Llama-2-7B", 1.4, 0.0008)
    doc = fit_operator_profile([csv], lambda m: RooflineModel(get_gpu("H100"), m))
    assert doc["model"] == "Llama-2-7B"  # found by its shapes
    assert doc["coefficients"]["linear"] == pytest.approx(1.4, rel=1e-3)
    g = doc["fit"]["groups"][0]
    assert g["fixed_s"] == pytest.approx(0.0008, rel=1e-2) and g["mape"] < 1e-3
    # the launch cost joins the per-step time; the groups the profile does not cover keep the defaults
    assert doc["coefficients"]["step_s"] == pytest.approx(0.002 + 0.0008, rel=1e-2)
    assert doc["coefficients"]["decode_attn"] == pytest.approx(1 / 0.9)


def test_operator_profile_bad_input(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(TwinInputError, match="missing column"):
        fit_operator_profile([bad], lambda m: RooflineModel(get_gpu("H100"), m))
    csv = tmp_path / "mlp.csv"
    _profile_csv(csv, "Llama-2-7B", 1.4, 0.0)
    with pytest.raises(TwinInputError, match="tensor parallel degree 2"):
        fit_operator_profile([csv], lambda m: RooflineModel(get_gpu("H100"), m, tensor_parallel=2))


@pytest.mark.parametrize("mangle, says", [
    ("faster", "faster than the hardware"),  # half the ideal time: not this GPU, model or dtype
    ("flat", "faster than the hardware"),  # one time at every size: the layers cost nothing per token
    ("one size", "two token counts"),  # num_tokens 0 everywhere: no slope to fit (it was a coefficient of 0)
])
def test_an_operator_profile_the_hardware_cannot_have_produced_is_one_line(tmp_path, mangle, says):
    csv = tmp_path / "mlp.csv"
    _profile_csv(csv, "Llama-2-7B", 0.5 if mangle == "faster" else 1.4, 0.0)
    df = pd.read_csv(csv)
    if mangle == "flat":
        for c in [c for c in df.columns if c.startswith("time_stats.")]:
            df[c] = 1e12
    if mangle == "one size":
        df["num_tokens"] = 0
    df.to_csv(csv, index=False)
    with pytest.raises(TwinInputError, match=says) as e:
        fit_operator_profile([csv], lambda m: RooflineModel(get_gpu("H100"), m))
    assert str(e.value).startswith(str(csv)) and "\n" not in str(e.value)


def test_cli_calibrate_operator_profile_and_bad_inputs(tmp_path):
    csv = tmp_path / "mlp.csv"
    _profile_csv(csv, "Llama-2-7B", 1.25, 0.0)
    r = CliRunner().invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0, r.output
    assert "1.25" in r.output and (tmp_path / "p.yaml").is_file()
    r = CliRunner().invoke(app, ["calibrate", str(tmp_path), str(csv), "--out", str(tmp_path / "q.yaml")])
    assert r.exit_code == 2 and "not both" in r.output and "Traceback" not in r.output


def test_observation_folder_errors(tmp_path):
    with pytest.raises(TwinInputError, match="not an observation folder"):
        read_observation(tmp_path / "missing")
    (tmp_path / "o").mkdir()
    with pytest.raises(TwinInputError, match="missing requests.parquet"):
        read_observation(tmp_path / "o")


def observation_dir(tmp_path: Path, meta: dict = META) -> tuple[Path, Observation]:
    """A synthetic observation written as `twin observe` writes one, with `meta` as its observe.json."""
    obs = synthetic(Profile.from_params(TRUE), *deterministic_load())
    d = tmp_path / "obs"
    d.mkdir()
    obs.requests.to_parquet(d / "requests.parquet", index=False)
    (d / "observe.json").write_text(json.dumps(meta))
    return d, obs


def test_observation_written_and_read_back(tmp_path):
    d, obs = observation_dir(tmp_path)
    back = read_observation(d)
    assert len(back.finished) == len(obs.requests)
    r = CliRunner().invoke(app, ["calibrate", str(d), "--out", str(tmp_path / "fit.yaml"), "--iterations", "2"])
    assert r.exit_code == 0, r.output
    assert "fit_path" in r.output


def test_observer_refuses_remote_hosts_and_parses_cache_config():
    with pytest.raises(TwinInputError, match="this machine only"):
        check_loopback("http://10.0.0.1:8000")
    assert check_loopback("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    line = ('vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
            'kv_offloading_size="None",num_gpu_blocks="16",sliding_window="None"} 1.0')
    assert cache_config("# HELP x\n" + line + "\n") == {"block_size": 128, "num_gpu_blocks": 16,
                                                        "enable_prefix_caching": True}


def test_loads_are_bounded_and_fit_the_context():
    lo = calibration_load(512, 16)
    assert len(lo) < 200 and np.all(lo.prompt_tokens + lo.output_tokens < 512)
    assert np.all(np.diff(lo.arrival_s) >= 0)
    with pytest.raises(TwinInputError, match="bounded"):
        Load("big", np.zeros(10_000), np.ones(10_000), np.ones(10_000))
    prompts = lo.prompts(4096)
    assert [len(x) for x in prompts] == lo.prompt_tokens.tolist()


def test_a_profile_cell_that_is_no_number_is_one_line(tmp_path):
    """It ended in 'could not convert string to float' from deep in the fit."""
    csv = tmp_path / "prof.csv"
    _profile_csv(csv, "Llama-2-7B", 1.25, 0.0)
    df = pd.read_csv(csv)
    col = next(c for c in df.columns if c.startswith("time_stats."))
    df[col] = df[col].astype(object)
    df.loc[3, col] = "abc"
    df.to_csv(csv, index=False)
    r = CliRunner().invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2 and f"line 5: field {col}: 'abc' is not a finite number" in r.output, r.output
    df.loc[3, col] = 0.1
    df["n_head"] = df["n_head"].astype(float)
    df.loc[2, "n_head"] = float("inf")  # an OverflowError in the shape match before (a fuzzing pass, 2026-12-07)
    df.to_csv(csv, index=False)
    r = CliRunner().invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2 and "line 4: field n_head: inf is not a finite whole number" in r.output, r.output
    df.loc[2, "n_head"] = float("nan")  # an empty cell: it read "rows of 2 different model shapes"
    df.to_csv(csv, index=False)
    r = CliRunner().invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2 and "line 4: field n_head: an empty cell is not a finite whole number" in r.output, r.output
    df.loc[2, "n_head"] = 32.5  # a fraction was cut to a whole number without a word
    df.to_csv(csv, index=False)
    r = CliRunner().invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2 and "line 4: field n_head: 32.5 is not a finite whole number" in r.output, r.output
    df.iloc[:0].to_csv(csv, index=False)  # a header only: it read "rows of 0 different model shapes"
    r = CliRunner().invoke(app, ["calibrate", str(csv), "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2 and "no rows, only a header" in r.output, r.output


@pytest.mark.parametrize("meta,says", [
    ({"engine": {}, "twin": {}}, "engine.block_size: None is not a count"),
    ({**META, "engine": {**META["engine"], "block_size": "abc"}}, "engine.block_size: 'abc'"),
    ({"engine": "x", "twin": {}}, "missing 'engine'"),
    ({**META, "twin": {}}, "twin.hardware: None is not a name"),
])
def test_an_observation_whose_settings_are_missing_or_wrong_is_one_line(tmp_path, meta, says):
    d, _ = observation_dir(tmp_path, meta)
    with pytest.raises(TwinInputError, match=says.replace("(", r"\(")):
        read_observation(d)


def test_an_unreadable_tokens_table_is_one_line(tmp_path):
    d, _ = observation_dir(tmp_path)
    (d / "tokens.parquet").write_text("garbage")
    with pytest.raises(TwinInputError, match="tokens.parquet: not a readable parquet file"):
        read_observation(d)
