"""`twin replay` end to end: summary.json with the row accounting; bad input gives exit 2 and one clear line."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from twin.cli import app

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
MOONCAKE_SC = ROOT / "scenarios" / "mooncake-replay.yaml"
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["replay", *map(str, args)])


def test_replay_azure_writes_summary_with_row_accounting(tmp_path):
    out = tmp_path / "run"
    r = run(TRACES / "azure_code.sample.csv", "--scenario", QUICKSTART, "--max-requests", 300, "--rate-scale", 2,
            "--out", out, "--quiet")
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    w = s["workload"]
    assert (w["rows_read"], w["rows_used"], w["rows_filtered"], w["rows_skipped"]) == (1000, 300, 700, 0)
    assert s["requests_total"] == 300
    assert (out / "requests.parquet").exists()


def test_replay_mooncake_prints_ideal_reuse(tmp_path):
    r = run(TRACES / "mooncake_conversation.sample.jsonl", "--scenario", MOONCAKE_SC, "--max-requests", 120,
            "--set", "cluster.num_instances=2", "--out", tmp_path)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "prefix-cache hit rate: simulated" in text and "trace ideal prefix reuse" in text
    s = json.loads((tmp_path / "summary.json").read_text())
    assert any("trace ideal prefix reuse" in n for n in s["workload"]["notes"])
    assert s["workload"]["rows_used"] == 120


def test_replay_sharegpt_needs_and_takes_a_rate(tmp_path):
    r = run(TRACES / "sharegpt.sample.json", "--scenario", QUICKSTART, "--rate", 4, "--max-requests", 40,
            "--out", tmp_path, "-q")
    assert r.exit_code == 0, r.output
    w = json.loads((tmp_path / "summary.json").read_text())["workload"]
    assert w["rows_read"] == 200 and w["rows_used"] == 40
    assert w["rows_read"] == w["rows_used"] + w["rows_filtered"] + w["rows_skipped"]
    r = run(TRACES / "mooncake_conversation.sample.jsonl", "--scenario", QUICKSTART, "--rate", 4)
    assert r.exit_code == 2 and "--rate-scale" in r.output


def test_replay_skip_bad_rows(tmp_path):
    bad = tmp_path / "azure.csv"
    lines = (TRACES / "azure_conv.sample.csv").read_text().splitlines()[:51]
    lines[10] = "2023-11-16 18:16:00.1,oops,3"
    bad.write_text("\n".join(lines) + "\n")
    r = run(bad, "--scenario", QUICKSTART, "-q")
    assert r.exit_code == 2
    out = r.output.strip()
    assert len(out.splitlines()) == 1 and "Traceback" not in out
    assert str(bad) in out
    assert "line 11" in out and "ContextTokens" in out
    r = run(bad, "--scenario", QUICKSTART, "-q", "--skip-bad-rows", "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    w = json.loads((tmp_path / "o" / "summary.json").read_text())["workload"]
    assert (w["rows_read"], w["rows_used"], w["rows_skipped"]) == (50, 49, 1)


def test_replay_bad_trace_exit_2_one_line(tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 1,\n')
    r = run(p, "--scenario", QUICKSTART)
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.output
    assert "line 2" in lines[0] and "not valid JSON" in lines[0]
    r = run(tmp_path / "missing.csv", "--scenario", QUICKSTART)
    assert r.exit_code == 2 and "does not exist" in r.output


def test_simulate_runs_a_scenario_naming_a_trace(tmp_path):
    sc = tmp_path / "sc.yaml"
    sc.write_text(
        "name: tr\ncluster: {num_instances: 1, model: Llama-3-8B}\n"
        f"workload:\n  trace: {{path: {TRACES / 'azure_conv.sample.csv'}, max_requests: 50}}\n")
    r = runner.invoke(app, ["simulate", str(sc), "--out", str(tmp_path / "o"), "-q"])
    assert r.exit_code == 0, r.output
    w = json.loads((tmp_path / "o" / "summary.json").read_text())["workload"]
    assert w["rows_used"] == 50 and w["rows_filtered"] == 950


def test_a_window_past_the_end_is_a_clear_error_not_an_empty_report(tmp_path):
    scenario = Path(__file__).resolve().parents[1] / "scenarios" / "mooncake-replay.yaml"
    r = CliRunner().invoke(app, ["simulate", str(scenario), "--set", "workload.trace.start_s=100000", "-q"])
    assert r.exit_code == 2 and "no requests left to replay" in r.output and "Traceback" not in r.output
