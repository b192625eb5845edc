"""The `twin` command: the quickstart writes its files; every bad input is one clear line and exit 2."""

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from twin.cli import app

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
runner = CliRunner()

SUMMARY_FIELDS = ["requests_total", "requests_finished", "requests_rejected", "sim_time_s", "wall_time_s",
                  "throughput_output_tok_s", "prefix_cache_hit_rate", "preemptions", "goodput_req_s", "build"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_quickstart_writes_summary_and_requests(tmp_path):
    out = tmp_path / "out"
    r = invoke("simulate", QUICKSTART, "--out", out, "--set", "workload.num_requests=400", "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    for f in SUMMARY_FIELDS:
        assert f in s, f
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(s[metric]) >= {"mean", "p50", "p90", "p99"}
        assert s[metric]["p50"] <= s[metric]["p90"] <= s[metric]["p99"]
    assert s["requests_total"] == 400
    assert s["requests_finished"] + s["requests_rejected"] + s["requests_running"] + s["requests_not_arrived"] == 400
    assert s["physics_ok"]
    df = pd.read_parquet(out / "requests.parquet")
    assert len(df) == 400
    for col in ("arrival_s", "scheduled_s", "first_token_s", "finish_s", "instance", "prompt_tokens",
                "output_tokens", "cached_tokens", "preemptions", "status"):
        assert col in df.columns
    fin = df[df.status == "finished"]
    assert (fin.ttft_s <= fin.e2e_s).all()


def test_the_summary_names_the_build_and_a_long_pure_run_points_to_the_compiled_one(tmp_path):
    from rich.console import Console

    import twin.sim.events
    from twin.cli.common import SLOW_PURE_RUN_S, print_summary

    out = tmp_path / "out"
    r = invoke("simulate", QUICKSTART, "--out", out, "--set", "workload.num_requests=50")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["build"] == ("pure Python" if twin.sim.events.__file__.endswith(".py") else "compiled")
    assert f"{s['build']} build)" in " ".join(r.output.split())
    for build, wall, hint in (("pure Python", SLOW_PURE_RUN_S, True), ("pure Python", SLOW_PURE_RUN_S / 2, False),
                              ("compiled", 10 * SLOW_PURE_RUN_S, False)):
        console = Console(record=True, width=200)
        print_summary({**s, "build": build, "wall_time_s": wall}, console)
        assert ("make compiled" in console.export_text()) == hint, (build, wall)


def test_the_summary_prints_slo_attainment_gpu_time_and_what_a_scaler_did(tmp_path):
    out = tmp_path / "out"
    r = invoke("simulate", QUICKSTART, "--out", out, "--set", "workload.num_requests=300", "--set", "scaler.name=twin",
               "--set", "cluster.num_instances=3", "--set", "scaler.interval_s=5")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    text = " ".join(r.output.split())
    assert f"SLO attainment {s['slo_attainment']:.1%} of finished requests (TTFT <= " in text
    assert f"{s['gpu_seconds'] / 3600:,.2f} GPU-hours ({s['gpu_seconds']:,.0f} GPU-s)" in text
    f = s["fleet"]
    started, drained = (sum(e["action"] == a for e in f["scale_events"]) for a in ("start", "drain"))
    assert f["decisions"] and f"fleet (twin scaler, {f['decisions']} decisions): 3 at the start, peak " \
                              f"{f['peak_active']}, {f['final_active']} at the end; {started} started, {drained} " \
                              "drained" in text
    r = invoke("simulate", QUICKSTART, "--out", tmp_path / "b", "--set", "workload.num_requests=50",
               "--set", "slo.ttft_s=null", "--set", "slo.tpot_s=null")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "no SLO bound set;" in text and "fleet (" not in text  # a fixed fleet: no scaler line


def test_seed_flag_and_set_override_apply(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out, seed in ((a, 1), (b, 2)):
        r = invoke("simulate", QUICKSTART, "--out", out, "--seed", seed, "-q",
                   "--set", "workload.num_requests=50", "--set", "cluster.num_instances=2")
        assert r.exit_code == 0, r.output
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["seed"] == 1 and sb["seed"] == 2 and len(sa["instances"]) == 2
    assert sa["e2e_s"]["mean"] != sb["e2e_s"]["mean"]


def write(tmp_path, edit):
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["workload"]["lengths"]["path"] = str(ROOT / "traces" / "sharegpt_lengths.sample.csv")
    edit(raw)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


BAD = {
    "unknown key": (lambda r: r["cluster"].update(num_instance=3), "cluster.num_instance: unknown key"),
    "wrong type": (lambda r: r["cluster"].update(num_instances="many"), "cluster.num_instances:"),
    "negative rate": (lambda r: r["workload"]["arrival"].update(rate=-5), "workload.arrival.rate:"),
    "unknown model": (lambda r: r["cluster"].update(model="GPT-9"), "unknown model 'GPT-9'"),
    "unknown GPU": (lambda r: r["cluster"].update(hardware="TPU-v9"), "unknown GPU 'TPU-v9'"),
    "budget below seqs": (lambda r: r["cluster"]["engine"].update(max_num_batched_tokens=8),
                          "max_num_batched_tokens (8) must be >= max_num_seqs"),
    "too long for the context": (
        lambda r: r["workload"].update(lengths={"kind": "fixed", "prompt_tokens": 9000, "output_tokens": 10}),
        "longer than the model's context"),
    "unknown router": (lambda r: r["router"].update(name="magic"), "unknown router 'magic'"),
    "missing trace": (lambda r: r["workload"]["lengths"].update(path="/nonexistent.csv"), "does not exist"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_scenarios_get_one_clear_line_and_exit_2(tmp_path, case):
    edit, expected = BAD[case]
    r = invoke("simulate", write(tmp_path, edit), "-q")
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert expected in r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("error:")]) == 1


def test_malformed_yaml_and_missing_file(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("cluster: [unclosed\n")
    r = invoke("simulate", p)
    assert r.exit_code == 2 and "not valid YAML" in r.output and "Traceback" not in r.output
    r = invoke("simulate", tmp_path / "nope.yaml")
    assert r.exit_code == 2 and "does not exist" in r.output


def test_bad_length_trace_names_file_line_and_field(tmp_path):
    csv = tmp_path / "lens.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n-3,4\n")
    r = invoke("simulate", write(tmp_path, lambda raw: raw["workload"]["lengths"].update(path=str(csv))), "-q")
    assert r.exit_code == 2
    assert "lens.csv: line 3: field num_prefill_tokens" in r.output
    csv.write_text("prompt,output\n10,5\n")
    r = invoke("simulate", write(tmp_path, lambda raw: raw["workload"]["lengths"].update(path=str(csv))), "-q")
    assert r.exit_code == 2 and "missing column(s) num_prefill_tokens, num_decode_tokens" in r.output


def test_too_long_requests_can_be_rejected_with_a_reason_instead(tmp_path):
    def edit(r):
        r["workload"].update(lengths={"kind": "fixed", "prompt_tokens": 9000, "output_tokens": 10},
                             on_too_long="reject", num_requests=5)
    out = tmp_path / "o"
    r = invoke("simulate", write(tmp_path, edit), "-q", "--out", out)
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["requests_rejected"] == 5 and s["reject_reasons"] == {"longer than max_model_len": 5}


def test_validate_and_specs_commands():
    r = invoke("validate", QUICKSTART)
    assert r.exit_code == 0 and '"num_instances": 4' in r.output
    r = invoke("specs")
    assert r.exit_code == 0 and "H200-SXM-141GB" in r.output and "Qwen2.5-32B" in r.output


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_scenario_is_valid(path):
    from twin.scenario import load_scenario

    sc = load_scenario(path)
    assert sc.name
