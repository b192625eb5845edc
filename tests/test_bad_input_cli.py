"""Bad input to the commands gets one clear line and exit 2, before any work: found by a fuzzing pass over the
CLI (2026-12-07), each case a traceback, an out-of-memory kill or a silent misreading before."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from twin.cli import app

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
SMALL = ["--set", "workload.num_requests=20"]


def one_error(args) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.mark.parametrize("command", [
    ["compare", QUICKSTART, "-q", *SMALL, "--routers", "round-robin"],
    ["sweep", QUICKSTART, "-q", *SMALL, "--grid", "cluster.num_instances=1"],
    ["plan-chunk", QUICKSTART, "-q", *SMALL, "--candidates", "512"],
    ["score", ROOT / "tests" / "data" / "inferencex-h100-vllm.csv"],
])
def test_an_out_folder_that_cannot_be_made_is_refused_before_any_work(tmp_path, command):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    line = one_error([*command, "--out", a_file])
    assert f"--out {a_file}: cannot make the folder" in line
    line = one_error([*command, "--out", a_file / "below"])
    assert "cannot make the folder" in line


def test_plot_refuses_an_out_file_and_a_foreign_table(tmp_path):
    run = tmp_path / "run"
    CliRunner().invoke(app, ["simulate", str(QUICKSTART), "-q", *SMALL, "--out", str(run)])
    (tmp_path / "afile").write_text("x")
    assert "cannot make the folder" in one_error(["plot", run, "--out", tmp_path / "afile"])
    import pandas as pd

    pd.DataFrame({"a": [1]}).to_parquet(run / "requests.parquet")
    assert "missing column(s) status" in one_error(["plot", run])


def test_a_router_variant_with_a_set_that_is_no_list_is_refused(tmp_path):
    line = one_error(["compare", QUICKSTART, "-q", *SMALL, "--router", "{label: x, name: round-robin, set: 5}",
                      "--out", tmp_path / "c"])
    assert "set must be a list of dotted.path=value overrides" in line


def test_a_nan_tie_tolerance_is_refused(tmp_path):
    assert "--tie-tolerance nan" in one_error(["plan-chunk", QUICKSTART, "-q", *SMALL, "--tie-tolerance", "nan"])


def test_online_chunk_candidates_are_checked_at_load(tmp_path):
    line = one_error(["simulate", QUICKSTART, "-q", *SMALL, "--set", "chunk_plan.online=true",
                      "--set", "chunk_plan.candidates=[0,512]", "--out", tmp_path / "r"])
    assert "chunk sizes must be > 0" in line


@pytest.mark.parametrize("value", ["inf", ".inf", "nan"])
def test_an_infinite_or_nan_rate_is_refused(tmp_path, value):
    line = one_error(["simulate", QUICKSTART, "-q", *SMALL, "--set", f"workload.arrival.rate={value}",
                      "--out", tmp_path / "r"])
    assert "workload.arrival.rate" in line and "finite" in line


def test_a_key_given_twice_in_a_scenario_is_refused(tmp_path):
    text = QUICKSTART.read_text().replace("  num_requests: 3000\n", "  num_requests: 3000\n  num_requests: 5\n")
    assert text.count("num_requests") == 2
    p = tmp_path / "dup.yaml"
    p.write_text(text)
    line = one_error(["validate", p])
    assert "duplicate key 'num_requests'" in line and "line" in line


def test_yaml_merge_keys_may_still_be_overridden():
    import yaml

    from twin.scenario import _UniqueKeys

    assert yaml.load("a: &x {b: 1}\nc:\n  <<: *x\n  b: 2\n", Loader=_UniqueKeys) == {"a": {"b": 1}, "c": {"b": 2}}


@pytest.mark.parametrize("kind", ["binary", "folder"])
def test_a_live_config_that_is_no_text_or_a_folder_is_one_line(tmp_path, kind):
    pytest.importorskip("aiohttp")
    p = tmp_path / "live.yaml"
    if kind == "binary":
        p.write_bytes(bytes(range(128, 256)))
    else:
        p.mkdir()
    line = one_error(["live", p])
    assert str(p) in line and ("not UTF-8" in line if kind == "binary" else "is a folder" in line)


@pytest.mark.parametrize("sets,says", [
    (["scaler.name=static", "scaler.params.target=abc"], "scaler.params.target: 'abc' is not a number"),
    (["router.name=lmetric", "router.params.bs_offset=nan"], "router.params.bs_offset: 'nan' is not a number"),
])
def test_a_policy_parameter_of_the_wrong_kind_is_said_plainly(tmp_path, sets, says):
    """The constructors' own TypeError read "'<' not supported between instances of 'str' and 'int'"."""
    args = [a for s in sets for a in ("--set", s)]
    assert says in one_error(["simulate", QUICKSTART, "-q", *SMALL, *args, "--out", tmp_path / "r"])


def test_a_sweep_point_whose_router_cannot_be_built_is_refused_before_any_runs(tmp_path):
    """The point used to run and fail (exit 1) while compare refused the same value up front."""
    out = tmp_path / "sweep"
    line = one_error(["sweep", QUICKSTART, "-q", *SMALL, "--set", "router.name=lmetric",
                      "--grid", "router.params.bs_offset=1,abc", "--out", out])
    assert "router.params.bs_offset: 'abc' is not a number" in line and "--skip-invalid" in line
    assert not out.exists()


def test_truncating_to_a_context_of_one_token_is_refused(tmp_path):
    """It made requests of one prompt token and no room for output, reported as finished."""
    line = one_error(["simulate", QUICKSTART, "-q", *SMALL, "--set", "workload.on_too_long=truncate",
                      "--set", "cluster.engine.max_model_len=1", "--out", tmp_path / "r"])
    assert "max_model_len 1 leaves no room" in line


def test_true_is_no_count(tmp_path):
    """pydantic's lax mode read `num_requests: true` as 1."""
    line = one_error(["simulate", QUICKSTART, "-q", "--set", "workload.num_requests=true", "--out", tmp_path / "r"])
    assert "workload.num_requests" in line and "expected a number" in line


@pytest.mark.parametrize("setting", ["chunk_plan.candidates=[true]", "whatif.precision.fp8_layers=[true]"])
def test_true_is_no_number_in_a_list_either(setting):
    line = one_error(["validate", QUICKSTART, "--set", setting])
    assert "expected numbers" in line


def test_a_set_path_into_a_list_names_its_own_flag():
    """It turned the list into a mapping, and the error named the earlier flag that had set the list."""
    line = one_error(["validate", QUICKSTART, "--set", "chunk_plan.candidates=[512,1024]",
                      "--set", "chunk_plan.candidates.0=0"])
    assert line.startswith("error: --set chunk_plan.candidates.0=0: chunk_plan.candidates is a list")


def test_plot_refuses_a_latency_column_of_text(tmp_path):
    import pandas as pd

    run = tmp_path / "run"
    CliRunner().invoke(app, ["simulate", str(QUICKSTART), "-q", *SMALL, "--out", str(run)])
    df = pd.read_parquet(run / "requests.parquet")
    df["ttft_s"] = "abc"
    df.to_parquet(run / "requests.parquet")
    assert "column ttft_s holds" in one_error(["plot", run])


def test_predictor_outputs_that_cannot_be_written_are_refused_before_the_work(tmp_path):
    pytest.importorskip("xgboost")
    data = tmp_path / "pairs.csv"
    data.write_text("prompt,output_tokens\n" + "".join(f"question number {i} please,{10 + i}\n" for i in range(40)))
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    r = CliRunner().invoke(app, ["predictor", "train", "--data", str(data), "--kind", "xgboost", "--out", str(a_file),
                                 "-q"])
    assert r.exit_code == 2 and "cannot make the folder" in r.output and "examples" not in r.output, r.output


@pytest.mark.parametrize("args,says", [
    (["simulate", QUICKSTART, "--seed", "abc"], "Invalid value for '--seed'"),
    (["compare", QUICKSTART, "--seeds", "0", "--out", "x"], "Invalid value for '--seeds'"),
    (["simulate"], "Missing argument"),
    (["simulate", QUICKSTART, "--bogus"], "No such option: --bogus"),
    (["no-such-command"], "No such command"),
])
def test_command_line_mistakes_are_one_line_too(args, says):
    """click's Usage text and a boxed Error, before; now one line like every other bad input, exit 2."""
    line = one_error(args)
    assert says in line and "--help" in line


def test_no_arguments_still_show_the_help():
    r = CliRunner().invoke(app, [])
    assert "Usage" in r.output and "simulate" in r.output


def test_a_bug_surfaces_as_itself_not_as_the_error_handlers_own(monkeypatch):
    """An unexpected exception (a bug) passes through with its own traceback: the handler's `except` named click's
    Abort, which typer 0.2x's copy of click lacks, so every such traceback ended in an AttributeError instead."""
    import twin.scenario

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(twin.scenario, "load_scenario", boom)
    r = CliRunner().invoke(app, ["simulate", str(QUICKSTART), "-q"])
    assert isinstance(r.exception, RuntimeError) and str(r.exception) == "boom"


# -- a second fuzzing pass (2026-12-07): extreme values that crashed, hung or misled -------------------------
def refused(*sets: str) -> str:
    """The one line `twin simulate` (the quickstart, made small) refuses these `--set` overrides with."""
    return one_error(["simulate", QUICKSTART, "-q", *SMALL, *(a for s in sets for a in ("--set", s))])


@pytest.mark.parametrize("sets, words", [
    (["workload.arrival.process=gamma", "workload.arrival.cv=1e160"], "less than or equal to 100"),
    (["workload.arrival.rate=1e-18"], "s, past 1e+09 s (about 31 years)"),  # it ran: every latency 0 ms
    (["workload.arrival.rate=1e-30"], "check workload.arrival.rate"),  # never ended
    (["workload.sessions={think_time_s: 1e300}"], "less than or equal to 1000000"),
    (["whatif.partial_kv={link_bandwidth_gbs: 1e-300}"], "greater than or equal to 0.01"),
    (["scaler.name=static", "scaler.interval_s=1e-9"], "greater than or equal to 0.01"),
])
def test_extreme_scenario_values_are_refused_in_one_line(sets, words):
    assert words in refused(*sets)


def test_trace_timing_scaled_past_the_simulated_horizon_is_refused(tmp_path):
    trace = ROOT / "traces" / "azure_code.sample.csv"
    for flag in ("--rate-scale", "--target-rate"):
        line = one_error(["replay", trace, "--scenario", QUICKSTART, "-q", flag, "1e-300", "--out", tmp_path / "r"])
        assert "past 1e+09 s" in line and "rate_scale, target_rate or rate" in line
    line = one_error(["replay", ROOT / "traces" / "sharegpt.sample.json", "--scenario", QUICKSTART, "-q", "--rate", "5",
                      "--max-requests", "5", "--chars-per-token", "1e-300", "--out", tmp_path / "r"])
    assert "--chars-per-token" in line  # an OverflowError in the reader before


def test_values_that_divided_by_zero_now_run(tmp_path):
    """Every layer skipped by early exits (layer_share 0.99 of 32 rounds to 32) and a mix of 1e308:1e308 tokens
    (the sum overflows) divided by zero; a token now exits after one layer at least, and the mix is normalised."""
    r = CliRunner().invoke(app, ["simulate", str(QUICKSTART), "-q", *SMALL, "--out", str(tmp_path / "e"),
                                 "--set", "whatif.early_exit={layer_share: 0.99, token_share: 1}"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["check", "--mix", "1e308:1e308"])
    assert r.exit_code == 0 and "mixed, prompt:output 1e+308:1e+308" in r.output, r.output


def test_a_long_scenario_name_makes_a_short_run_folder(tmp_path):
    from twin.cli.common import default_out

    out = default_out("a" * 300, tmp_path)  # OSError: File name too long, after the whole run
    assert len(out.name) < 120 and out.name.startswith("a" * 80 + "-")


def test_a_scrape_interval_far_below_the_clock_resolution_still_answers():
    from twin.sim.instance import ScrapeClock

    c = ScrapeClock(0.0, 1e-25)  # k + 1 is k as a float past 2**53 ticks: the search looped for ever
    t = c.last_tick(5.0)
    assert 4.99 < t <= 5.0 and c.last_tick(5.0) == t


def test_a_sweep_point_file_that_is_not_text_is_run_again(tmp_path):
    from twin.analysis.sweep import point_path, read_point

    p = point_path(tmp_path, "k")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\xff\xfe")  # a UnicodeDecodeError stopped the resumed sweep
    assert read_point(tmp_path, "k") is None


def test_an_activation_reserve_that_leaves_no_kv_cache_is_named():
    line = refused("cluster.engine.activation_reserve_gb=1000")
    assert "cluster.engine.activation_reserve_gb 1000 leaves no room for a KV cache" in line  # it blamed the weights


@pytest.mark.parametrize("sets, words", [
    (["workload.arrival.cv=5"], "cv 5 applies to process gamma only"),
    (["workload.lengths={kind: fixed, prompt_tokens: 100, output_tokens: 10, max_total_tokens: 2}"],
     "max_total_tokens applies to kind trace, not 'fixed'"),
    (["workload.lengths={kind: fixed, prompt_tokens: 100, output_tokens: 10, range_ratio: 0.5}"],
     "range_ratio applies to kind uniform, not 'fixed'"),
    (["workload.lengths.range_ratio=0.5"], "range_ratio applies to kind uniform, not 'trace'"),
])
def test_a_setting_that_does_not_apply_is_refused_not_ignored(sets, words):
    assert words in refused(*sets)


def test_a_length_csv_of_true_and_false_is_not_read_as_one_and_zero(tmp_path):
    csv = tmp_path / "l.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\nTrue,False\n")
    line = refused(f"workload.lengths={{kind: trace, path: {csv}}}")
    assert "field num_prefill_tokens: True is not a token count" in line


def test_mxfp4_on_a_dense_model_is_refused():
    line = refused("cluster.dtype=mxfp4")  # ran as bf16
    assert "dtype mxfp4 quantizes MoE experts only" in line


def test_a_huge_time_in_a_message_is_short():
    from twin.workload.formats.common import seconds

    assert seconds(1e300) == "1e+300 s" and seconds(1_000_000.0) == "1,000,000 s"  # it printed 300 digits


def test_an_endless_scenario_file_is_refused():
    assert "/dev/zero: over 16 MiB; a scenario is a small YAML file" in one_error(["validate", "/dev/zero"])


@pytest.mark.parametrize("rows, says", [("", "has no rows, only a header"),
                                        ("0,10\n0,5\n", "every row of the length trace (2) has a prompt of 0 tokens")])
def test_a_length_trace_with_no_usable_row_says_why(tmp_path, rows, says):
    csv = tmp_path / "l.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n" + rows)  # both read "fits max_total_tokens"
    line = refused(f"workload.lengths.path={csv}")
    assert says in line


def test_a_check_across_fields_names_the_flags_in_it():
    """A cross-field refusal blamed the file alone, though the flags set the values it names (the fuzzing pass)."""
    line = one_error(["validate", QUICKSTART, "--set", "cluster.min_instances=5", "--set", "cluster.max_instances=2",
                      "--set", "seed=3"])
    assert "with --set cluster.min_instances=5, --set cluster.max_instances=2:" in line and "seed=3" not in line
    line = one_error(["validate", QUICKSTART, "--set", "chunk_plan.candidates.0=5"])
    assert "with --set chunk_plan.candidates.0=5: chunk_plan.candidates: Input should be a valid list" in line
