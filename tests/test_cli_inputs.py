"""Inputs that used to end in a traceback, and the small things a new user hit: one line, exit 2, the flag named."""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from twin.cli import app

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
TRACES = ROOT / "traces"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error(r) -> str:
    """The run failed with exit 2 and exactly one `error:` line, no traceback; returns that line."""
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


# --- the five tracebacks -----------------------------------------------------------------------------------

def test_binary_scenario_file(tmp_path):
    p = tmp_path / "sc.yaml"
    p.write_bytes(bytes(range(256)) * 4)
    line = one_error(invoke("simulate", p, "-q"))
    assert str(p) in line and "not UTF-8" in line


def test_non_utf8_scenario_file(tmp_path):
    p = tmp_path / "sc.yaml"
    p.write_bytes(QUICKSTART.read_text().replace("quickstart", "caf\u00e9").encode("latin-1"))
    line = one_error(invoke("validate", p))
    assert str(p) in line and "line 2" in line and "0xe9" in line


def test_a_folder_given_as_the_scenario(tmp_path):
    line = one_error(invoke("simulate", tmp_path, "-q"))
    assert str(tmp_path) in line and "folder" in line
    line = one_error(invoke("replay", TRACES / "azure_code.sample.csv", "--scenario", tmp_path))
    assert "folder" in line


def test_negative_seed_names_the_flag(tmp_path):
    line = one_error(invoke("simulate", QUICKSTART, "--seed", -1, "-q"))
    assert line.startswith("error: --seed: ") and "(got -1)" in line
    line = one_error(invoke("replay", TRACES / "azure_code.sample.csv", "--scenario", QUICKSTART, "--seed", -1))
    assert line.startswith("error: --seed: ")
    bad = tmp_path / "sc.yaml"
    bad.write_text(QUICKSTART.read_text().replace("seed: 42", "seed: -5"))
    assert f"{bad}: seed: " in one_error(invoke("validate", bad))


def test_binary_file_as_mooncake(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_bytes(bytes(range(255, -1, -1)) * 8)
    line = one_error(invoke("replay", p, "--format", "mooncake", "--scenario", QUICKSTART, "-q"))
    assert str(p) in line and "line 1" in line and "not UTF-8" in line
    r = invoke("replay", p, "--format", "mooncake", "--scenario", QUICKSTART, "-q", "--skip-bad-rows")
    assert "no requests left" in one_error(r)


def test_spec_entry_missing_a_field(monkeypatch):
    from twin import specs

    real = specs.load
    table = {k: dict(v) for k, v in real("models.yaml").items()}
    del table["Llama-3-8B"]["num_kv_heads"]
    monkeypatch.setattr(specs, "load", lambda name: table if name == "models.yaml" else real(name))
    line = one_error(invoke("validate", QUICKSTART))
    assert "models.yaml" in line and "entry 'Llama-3-8B'" in line and "missing field 'num_kv_heads'" in line


# --- small things --------------------------------------------------------------------------------------------

def test_version_from_the_installed_package_with_its_build():
    import twin.sim.events

    build = "pure Python" if twin.sim.events.__file__.endswith(".py") else "compiled"
    r = invoke("--version")
    assert r.exit_code == 0 and r.output.strip() == f"llmtwin {version('llmtwin')} ({build} build)"


def test_no_out_writes_to_a_named_default_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke("simulate", QUICKSTART, "-q", "--set", "workload.num_requests=30", "--set", "name=my run/1")
    assert r.exit_code == 0, r.output
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and re.fullmatch(r"my-run-1-\d{8}-\d{6}", runs[0].name)
    assert (runs[0] / "summary.json").exists() and (runs[0] / "requests.parquet").exists()
    assert str(Path("runs") / runs[0].name / "summary.json") in " ".join(r.output.split())
    r = invoke("simulate", QUICKSTART, "-q", "--set", "workload.num_requests=30", "--set", "name=my run/1")
    assert r.exit_code == 0 and len(list((tmp_path / "runs").iterdir())) == 2  # a second run, a new folder


def test_replay_flag_errors_name_the_flag():
    azure = TRACES / "azure_code.sample.csv"
    line = one_error(invoke("replay", azure, "--scenario", QUICKSTART, "--rate-scale", -2))
    assert line.startswith("error: --rate-scale: ") and str(QUICKSTART) not in line
    line = one_error(invoke("replay", azure, "--scenario", QUICKSTART, "--sample", 2))
    assert line.startswith("error: --sample: ")
    line = one_error(invoke("replay", TRACES / "sharegpt.sample.json", "--scenario", QUICKSTART, "--rate", 0))
    assert line.startswith("error: --rate: ")
    line = one_error(invoke("replay", azure, "--scenario", QUICKSTART, "--think-time", 3))
    assert line.startswith("error: --think-time: ") and "azure" in line
    line = one_error(invoke("replay", azure, "--scenario", QUICKSTART, "--format", "csv"))
    assert line.startswith("error: --format 'csv': ")
    line = one_error(invoke("simulate", QUICKSTART, "-q", "--set", "cluster.num_instances=0"))
    assert line.startswith("error: --set cluster.num_instances=0: ")


def test_router_param_error_lists_what_the_router_takes():
    line = one_error(invoke("simulate", QUICKSTART, "-q", "--set", "router.name=random",
                            "--set", "router.params.speed=3"))
    assert "'speed'" in line and "(it takes: seed=0)" in line
    line = one_error(invoke("simulate", QUICKSTART, "-q", "--set", "router.name=rr", "--set", "router.params.x=1"))
    assert "takes no parameter 'x' (it takes: none)" in line


def test_requests_per_wall_s_counts_only_arrived_requests(tmp_path):
    r = invoke("simulate", QUICKSTART, "-q", "--out", tmp_path, "--set", "workload.num_requests=400",
               "--set", "sim.max_sim_time_s=5")
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "summary.json").read_text())
    arrived = s["requests_total"] - s["requests_not_arrived"]
    assert s["requests_not_arrived"] > 0 and arrived > 0
    assert s["requests_per_wall_s"] == pytest.approx(arrived / s["wall_time_s"])
