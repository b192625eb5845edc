"""`twin check`: the physical ceilings, claim verdicts, and a run faster than its ceiling rejected as a bug."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import make_scenario
from twin.cli import app
from twin.sim.cluster import build_perf, engine_config
from twin.errors import TwinInputError
from twin.specs.hardware import get_gpu
from twin.specs.models import get_model
from twin.perf import registry
from twin.analysis.physics import ceilings, judge, parse_claim, parse_mix

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_ceilings_follow_the_datasheet():
    sc = make_scenario()
    c = ceilings(build_perf(sc), engine_config(sc), 2048)
    gpu, m = get_gpu("H100"), get_model("Llama-3-8B")
    # compute-bound: 2 x active params FLOPs per token at the dense BF16 peak
    assert c.compute_tok_s == pytest.approx(gpu.flops("bf16") / (2 * m.active_linear_params), rel=1e-9)
    # the crossover: weight bytes / bandwidth = tokens x FLOPs / peak -> peak / bandwidth x bytes per weight / 2
    assert c.crossover_batch == pytest.approx(gpu.flops("bf16") / gpu.hbm_bandwidth, rel=0.01)
    # decode of one sequence reads every weight once per token: at most bandwidth / weight bytes
    assert c.decode_batch1_tok_s < gpu.hbm_bandwidth / (m.linear_params * 2)
    assert c.decode_batch1_tok_s > 0.8 * gpu.hbm_bandwidth / (m.total_params * 2)
    assert c.decode_batch1_tok_s < c.decode_tok_s < c.prefill_tok_s < c.compute_tok_s
    assert c.decode_tok_s < c.mixed_tok_s < c.prefill_tok_s
    assert c.max_concurrent_seqs == c.num_gpu_blocks // (2048 // 16)
    assert c.kv_capacity_tokens == c.num_gpu_blocks * 16
    assert c.decode_bound == "memory (KV reads)"  # 2k-token contexts: KV reads outweigh the weights
    short = ceilings(build_perf(sc), engine_config(sc), 64)
    assert short.decode_bound == "compute" and short.max_concurrent_seqs > short.crossover_batch
    assert short.decode_tok_s > 0.5 * short.compute_tok_s


def test_per_gpu_ceilings_with_tensor_parallelism_and_fp8():
    sc = make_scenario(**{"cluster.model": "Llama-3-70B", "cluster.tensor_parallel": 4})
    c = ceilings(build_perf(sc), engine_config(sc), 2048)
    m, gpu = get_model("Llama-3-70B"), get_gpu("H100")
    assert c.compute_tok_s == pytest.approx(gpu.flops("bf16") / (2 * m.active_linear_params), rel=1e-9)
    sc8 = make_scenario(**{"cluster.model": "Llama-3-70B", "cluster.tensor_parallel": 4, "cluster.dtype": "fp8"})
    c8 = ceilings(build_perf(sc8), engine_config(sc8), 2048)
    assert c8.compute_tok_s == pytest.approx(2 * c.compute_tok_s, rel=1e-3)
    assert c8.decode_batch1_tok_s > 1.5 * c.decode_batch1_tok_s  # half the weight bytes
    # what-if actions move the ceilings they touch: an FP8 schedule on a bf16 cluster as the fp8 dtype
    scw = make_scenario(**{"cluster.model": "Llama-3-70B", "cluster.tensor_parallel": 4},
                        whatif={"precision": {"fp8_fraction": 1.0}})
    cw = ceilings(build_perf(scw), engine_config(scw), 2048)
    assert cw.compute_tok_s == pytest.approx(c8.compute_tok_s, rel=1e-6)


@pytest.mark.parametrize("text,tok_s,per", [
    ("1e9 tokens/min/GPU", 1e9 / 60, "gpu"),
    ("more than 1 billion tokens per minute per H100", 1e9 / 60, "gpu"),
    ("20k tok/s per instance", 20e3, "instance"),
    ("2.5M tokens/hour", 2.5e6 / 3600, "gpu"),
    ("1,000 tokens per second per replica", 1000.0, "instance"),
])
def test_claims_parse(text, tok_s, per):
    c = parse_claim(text)
    assert c.tokens_per_s == pytest.approx(tok_s) and c.per == per
    assert c.per_gpu(4) == pytest.approx(tok_s / 4 if per == "instance" else tok_s)


@pytest.mark.parametrize("text", ["lots of tokens", "5 tokens/fortnight", "0 tok/s", "1e9 tokens/min/banana", ""])
def test_bad_claims_are_one_line(text):
    with pytest.raises(TwinInputError) as e:
        parse_claim(text)
    assert "\n" not in str(e.value) and "--claim" in str(e.value)


def test_bad_mix_and_context():
    with pytest.raises(TwinInputError, match="--mix"):
        parse_mix("5")
    assert parse_mix("5:1") == (5.0, 1.0)
    sc = make_scenario()
    with pytest.raises(TwinInputError, match="--context"):
        ceilings(build_perf(sc), engine_config(sc), 0)
    # sequences longer than the engine takes have no ceiling to report (Llama-3-8B: 8,192)
    with pytest.raises(TwinInputError, match="--context 8193: above max_model_len"):
        ceilings(build_perf(sc), engine_config(sc), 8193)
    ceilings(build_perf(sc), engine_config(sc), 8192)


def test_verdicts_factor_is_claim_over_ceiling():
    sc = make_scenario()
    c = ceilings(build_perf(sc), engine_config(sc), 2048)
    v = {x.traffic: x for x in judge(parse_claim("1e9 tokens/min/GPU"), c)}
    assert v["prefill"].factor == pytest.approx(1e9 / 60 / c.prefill_tok_s)
    assert not any(x.reachable for x in v.values())
    ok = {x.traffic: x for x in judge(parse_claim(f"{0.5 * c.decode_tok_s:.0f} tok/s"), c)}
    assert all(x.reachable for x in ok.values())


def test_check_prints_the_ceilings_of_a_scenario():
    r = invoke("check", QUICKSTART, "--context", 4096)
    assert r.exit_code == 0, r.output
    for s in ("Llama-3-8B", "H100-SXM-80GB", "prefill, 4,096-token prompts", "decode, 1 sequence at 4,096",
              "KV capacity:", "cross at a batch of", "sequences at once"):
        assert s in r.output, s


def test_check_headline_claim_is_not_reachable_and_says_by_how_much():
    r = invoke("check", "--claim", "1e9 tokens/min/GPU", "--model", "Llama-3-8B", "--gpu", "H100-SXM-80GB")
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.splitlines() if "NOT physically reachable" in ln]
    assert len(lines) == 3 and all("x above the ceiling" in ln for ln in lines)
    assert "16.7M tokens/s per GPU" in r.output
    r = invoke("check", "--claim", "1e9 tokens/min/GPU", "--model", "Llama-3-8B", "--gpu", "H100", "--dtype", "fp8")
    assert r.exit_code == 1 and "weights fp8" in r.output
    r = invoke("check", "--claim", "500 tok/s per GPU", "--model", "Llama-3-8B", "--gpu", "H100")
    assert r.exit_code == 0 and r.output.count("physically reachable") == 3


def test_check_bad_input_is_one_line():
    for args in (["--claim", "fast"], ["--model", "gpt-5"], ["--gpu", "H100", "--tp", "3"], ["--mix", "a:b"]):
        r = invoke("check", *args)
        errors = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(errors) == 1 and errors[0].startswith("error:"), (args, r.output)


class ImpossiblyFast:
    """A step model 1000x faster than the roofline's ideal: what a units bug would look like."""

    def __init__(self, base):
        self.base = base
        self.gpu = base.gpu

    def step_time(self, b):
        return self.base.ideal().step_time(b) * 1e-3

    def decode_run_times(self, n, c, k):
        return [x * 1e-3 for x in self.base.ideal().decode_run_times(n, c, k)]

    def __getattr__(self, name):
        return getattr(self.base, name)


def test_a_run_above_the_ceiling_exits_non_zero(tmp_path, monkeypatch):
    real = registry.STEP_MODELS["roofline"]
    monkeypatch.setitem(registry.STEP_MODELS, "roofline", lambda sc: ImpossiblyFast(real(sc)))
    out = tmp_path / "out"
    load = ["--set", "workload.num_requests=200", "--set", "workload.arrival.rate=1e5", "--set",
            "cluster.num_instances=1", "--set", "cluster.perf.kind=roofline"]  # all at once: the engine, not the
    # arrivals, sets the pace; the roofline is the model patched here (H100's default is the fitted profile)
    r = invoke("simulate", QUICKSTART, *load, "--out", out, "--quiet")
    assert r.exit_code == 1, r.output
    assert "above the" in r.output and "step-model bug, not a result" in r.output
    s = json.loads((out / "summary.json").read_text())  # kept for debugging
    assert s["physics_ok"] is False and s["processed_tok_s"] > s["roofline_ceiling_tok_s"]
    monkeypatch.setitem(registry.STEP_MODELS, "roofline", real)
    r = invoke("simulate", QUICKSTART, *load, "--out", tmp_path / "ok", "--quiet")
    assert r.exit_code == 0, r.output
