"""Users' own GPU and model specs (`twin --specs FILE`, `LLMTWIN_SPECS`), merged over the built-ins."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from twin import specs
from twin.cli import app
from twin.specs.hardware import get_gpu
from twin.specs.models import get_model

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
runner = CliRunner()

L40S = {"aliases": ["l40s"], "peak_flops": {"bf16": 362.0e12, "fp8": 733.0e12}, "hbm_bytes": 48.0e9,
        "device_memory_gib": 44.4, "hbm_bandwidth": 0.864e12, "nvlink_bandwidth": 64.0e9, "gpus_per_node": 4,
        "source": "NVIDIA L40S datasheet"}
SMALL = {"num_layers": 16, "hidden_size": 2048, "num_heads": 32, "num_kv_heads": 8, "head_dim": 64,
         "intermediate_size": 8192, "vocab_size": 128256, "num_params": 1.24e9, "max_model_len": 131072,
         "source": "meta-llama/Llama-3.2-1B config.json"}


@pytest.fixture(autouse=True)
def clean_specs():
    """Each test starts and ends with the built-ins only (use_files also exports the env var)."""
    saved = os.environ.pop(specs.ENV_VAR, None)
    specs.use_files([])
    yield
    specs.use_files([])
    os.environ.pop(specs.ENV_VAR, None)
    if saved is not None:
        os.environ[specs.ENV_VAR] = saved


def write(tmp_path, data, name="mine.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error(r) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_a_new_gpu_and_model_simulate_and_show_where_they_come_from(tmp_path):
    f = write(tmp_path, {"hardware": {"L40S": L40S}, "models": {"Llama-3.2-1B": SMALL}})
    r = invoke("--specs", f, "validate", QUICKSTART, "--set", "cluster.hardware=l40s",
               "--set", "cluster.model=Llama-3.2-1B")
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["--specs", str(f), "specs"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    rows = {ln.split("│")[1].strip(): ln for ln in r.output.splitlines() if ln.count("│") > 3}
    assert str(f) in rows["L40S"] and "44.40" in rows["L40S"]
    assert "131,072" in rows["Llama-3.2-1B"] and str(f) in rows["Llama-3.2-1B"]
    assert "built-in" in rows["H100-SXM-80GB"] and "8,192" in rows["Llama-3-8B"]


def test_a_correction_merges_field_by_field_and_moves_the_kv_pool(tmp_path):
    from twin.sim.cluster import Cluster
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    def blocks() -> int:
        sc = load_scenario(QUICKSTART, ["workload.num_requests=5"])
        return Cluster(sc, build_stream(sc)).instances[0].scheduler.pool.num_gpu_blocks

    before = blocks()
    base = get_gpu("H100")
    specs.use_files([str(write(tmp_path, {"hardware": {"H100": {"device_memory_gib": 70.0}}}))])
    g = get_gpu("H100")
    assert g.device_memory == 70.0 * 2**30 and g.hbm_bandwidth == base.hbm_bandwidth  # the rest kept
    assert specs.origin("hardware.yaml", g.name).startswith("built-in + ")
    assert blocks() < before  # less framework memory, fewer KV blocks


def test_the_environment_variable_names_spec_files_too(tmp_path):
    os.environ[specs.ENV_VAR] = str(write(tmp_path, {"models": {"Llama-3.2-1B": SMALL}}))
    assert get_model("llama-3.2-1b").max_model_len == 131072
    r = invoke("validate", QUICKSTART, "--set", "cluster.model=Llama-3.2-1B")
    assert r.exit_code == 0, r.output


def test_gpus_per_node_from_the_spec_bounds_tensor_parallel(tmp_path):
    f = write(tmp_path, {"hardware": {"L40S": L40S}})
    line = one_error(invoke("--specs", f, "validate", QUICKSTART, "--set", "cluster.hardware=L40S",
                            "--set", "cluster.model=Llama-3-70B", "--set", "cluster.tensor_parallel=8"))
    assert "has 4" in line and "tensor parallel size 8" in line


def test_a_new_entry_missing_a_field_names_file_entry_and_field(tmp_path):
    model = dict(SMALL)
    del model["head_dim"]
    f = write(tmp_path, {"models": {"Llama-3.2-1B": model}})
    line = one_error(invoke("--specs", f, "validate", QUICKSTART))
    assert str(f) in line and "'Llama-3.2-1B'" in line and "missing field 'head_dim'" in line
    os.environ[specs.ENV_VAR] = str(f)
    specs.use_files([])
    line = one_error(invoke("validate", QUICKSTART))
    assert line.startswith(f"error: {specs.ENV_VAR}: ") and "missing field 'head_dim'" in line


def test_a_bad_field_value_in_a_correction_names_the_user_file(tmp_path):
    f = write(tmp_path, {"hardware": {"H100": {"hbm_bandwidth": "fast"}}})
    line = one_error(invoke("--specs", f, "validate", QUICKSTART))
    assert str(f) in line and "H100-SXM-80GB" in line


@pytest.mark.parametrize("content, says", [
    (b"\xff\xfe\x00binary", "not UTF-8"),
    (b"hardware: [unclosed\n", "not valid YAML"),
    (b"- a list\n", "expected a mapping"),
    (b"gpus: {}\n", "unknown section 'gpus'"),
    (b"hardware: 3\n", "must map entry names"),
    (b"models:\n  X: 1\n", "must be a mapping of fields"),
])
def test_a_malformed_spec_file_is_one_line(tmp_path, content, says):
    p = tmp_path / "bad.yaml"
    p.write_bytes(content)
    line = one_error(invoke("--specs", p, "specs"))
    assert str(p) in line and says in line


def test_a_missing_or_directory_spec_file_is_one_line(tmp_path):
    assert "no such file" in one_error(invoke("--specs", tmp_path / "nope.yaml", "specs"))
    assert "directory" in one_error(invoke("--specs", tmp_path, "specs"))


@pytest.mark.parametrize("section,entry,fields,says", [
    ("models", "Llama-3-8B", {"num_layers": 0}, "num_layers must be > 0"),
    ("models", "Llama-3-8B", {"num_kv_heads": 7}, "num_kv_heads (7) must divide num_heads (32)"),
    ("models", "Llama-3-8B", {"num_heads": 0}, "num_heads must be > 0"),
    ("models", "Llama-3-8B", {"num_attention_heads": 40}, "unknown field 'num_attention_heads'"),
    ("hardware", "H100", {"device_memory_gib": -5}, "device_memory_gib must be >= 0, got -5"),
    ("hardware", "H100", {"peak_flops": "nan"}, "peak_flops must map dtypes to FLOP/s"),
    ("hardware", "H100", {"peak_flops": {"bf16": float("nan")}}, "peak_flops must map dtypes to FLOP/s >= 1e9"),
    ("hardware", "H100", {"bogus_field": 1}, "unknown field 'bogus_field'"),
])
def test_figures_no_gpu_or_model_has_and_unknown_fields_are_refused(tmp_path, section, entry, fields, says):
    """Before: num_layers 0 ended in a ZeroDivisionError; a negative memory or an unknown field (config.json's
    own name for the heads) was dropped without a word; 7 KV heads over 32 ran."""
    f = write(tmp_path, {section: {entry: fields}})
    line = one_error(invoke("--specs", f, "simulate", QUICKSTART, "-q", "--set", "workload.num_requests=5",
                            "--out", tmp_path / "run"))
    assert says in line and str(f) in line, line


def test_a_gpu_slower_than_any_accelerator_is_refused(tmp_path):
    """A fuzzing pass (2026-12-07): hbm_bandwidth or peak FLOP/s of 1e-300 made step times where the clock stops
    moving, and the run hung."""
    f = write(tmp_path, {"hardware": {"H100": {"hbm_bandwidth": 1.0e-300}}})
    r = invoke("--specs", f, "simulate", QUICKSTART, "-q", "--set", "workload.num_requests=20")
    assert r.exit_code == 2 and "hbm_bandwidth must be >= 1e9 bytes/s" in r.output
    f = write(tmp_path, {"hardware": {"H100": {"peak_flops": {"bf16": 1.0e-300}}}}, "flops.yaml")
    r = invoke("--specs", f, "simulate", QUICKSTART, "-q", "--set", "workload.num_requests=20")
    assert r.exit_code == 2 and "peak_flops must map dtypes to FLOP/s >= 1e9" in r.output


def test_an_alias_that_names_another_entry_is_refused(tmp_path):
    """It took the other entry's name over: cluster.hardware H200-SXM-141GB resolved to the H100, and `twin specs`
    listed the H100 twice and no H200 (a fuzzing pass, 2026-12-07)."""
    f = write(tmp_path, {"hardware": {"H100": {"aliases": ["H200-SXM-141GB"]}}})
    r = invoke("--specs", f, "validate", QUICKSTART)
    assert r.exit_code == 2 and "alias 'H200-SXM-141GB' already names entry 'H200-SXM-141GB'" in r.output, r.output


def test_a_fractional_count_in_a_model_is_refused_not_cut(tmp_path):
    f = write(tmp_path, {"models": {"Llama-3-8B": {"max_model_len": 1.5}}})  # it became 1 without a word
    r = invoke("--specs", f, "validate", QUICKSTART)
    assert r.exit_code == 2 and "max_model_len must be a whole number, got 1.5" in r.output, r.output
