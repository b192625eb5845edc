"""`twin score`: the twin scored offline on real-GPU points (twin.analysis.gpu_fidelity); the InferenceX H100 table is scored
in full with a regression guard; MXFP4 and FP8 weights priced as vLLM runs them; bad tables are one line."""

import csv
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from twin.cli import app
from twin.errors import TwinInputError
from twin.analysis.gpu_fidelity import METRICS, point_scenario, read_points, run_score, score
from twin.specs.hardware import get_gpu
from twin.specs.models import MXFP4_BYTES, get_model
from twin.perf.base import StepBatch
from twin.perf.roofline import RooflineModel
from twin.workload import build_stream

DATA = Path(__file__).resolve().parent / "data" / "inferencex-h100-vllm.csv"
# MAPE (%) of the whole table at 2 requests per client, with today's default on H100 (the shipped h100-vllm profile,
# async scheduling): TTFT 122.6 (the first wave of N simultaneous prompts dominates at 2 per client; 13.3 on the
# held-out TP 4 points at 10, test_h100_profile.py), TPOT 6.0, E2E 5.5, throughput 5.8; and with `perf.kind:
# roofline`: 60.3, 38.9, 37.7, 66.5 (its TTFT is lower only because it is too fast everywhere: signed +41 against the
# profile's +121 at 2 per client, while its TPOT is -39 %). A change that makes any of them worse by more than the
# margin fails; one that improves them should lower these bounds. (The profile's moved with the dense compute side
# pinned at the GEMMs' measured efficiency and `per_request_gpu_s`, 2026-12-05, from 122.7, 6.8, 6.4, 6.9; with
# `refine`, 2026-12-04, from 126.0, 6.1, 5.8, 6.2; the roofline's with the GEMMs' last wave, perf.gemm_tail_tokens 150, and compute_efficiency
# 0.75 -> 0.78: from 60.7, 38.8, 37.7, 66.3.)
MAPE_BOUNDS = {"default": {"ttft_ms": 122.6, "tpot_ms": 6.0, "e2e_ms": 5.5, "throughput_tok_s": 5.8},
               "roofline": {"ttft_ms": 60.3, "tpot_ms": 38.9, "e2e_ms": 37.7, "throughput_tok_s": 66.5}}
MARGIN = 2.0


@pytest.mark.parametrize("model", ["default", "roofline"])
def test_the_inferencex_h100_table_scores_no_worse_than_today(tmp_path, model):
    overrides = ["cluster.perf.kind=roofline"] if model == "roofline" else None
    result = run_score(DATA, tmp_path, requests_per_client=2, overrides=overrides)
    rows = result["rows"]
    assert len(rows) == 88 and {r["model"] for r in rows} == {"gpt-oss-120b", "Llama-3.1-70B"}
    assert all(r["finished"] == r["requests"] == 2 * r["concurrency"] for r in rows)
    for m in METRICS:
        assert result["overall"][f"{m}_mape"] <= MAPE_BOUNDS[model][m] + MARGIN, (m, result["overall"])
    for name in ("score_points.csv", "score_summary.csv", "score.png"):
        assert (tmp_path / name).stat().st_size > 0
    with (tmp_path / "score_summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    assert summary[0]["model"] == "all" and len(summary) == 1 + 6  # overall, then 2 models x 3 TP degrees


H200 = DATA.parent / "inferencex-h200-vllm.csv"
# The H200 table is never fitted on: the shipped profile (fitted on H100) prices H200 through H200's own bandwidth and
# FLOP/s. MAPE (%) over its 105 scored points at 2 requests per client (2026-12-05, the dense compute side pinned and
# `per_request_gpu_s`): TTFT 131.1 (the first wave of simultaneous prompts dominates at 2 per client, as on H100), TPOT
# 11.0, E2E 9.4, throughput 10.6 (2026-12-04: 126.7, 11.4, 9.8, 10.8). At 10 per client (README): 35.2, 10.0, 9.4,
# 10.5 (2026-12-04: 36.3, 10.2, 9.7, 10.7), against the roofline's 62.4, 40.1, 39.6, 73.4.
H200_MAPE_BOUNDS = {"ttft_ms": 131.1, "tpot_ms": 11.0, "e2e_ms": 9.4, "throughput_tok_s": 10.6}
H200_BAD_RUNS = {64, 78, 80, 84}  # gpt-oss TP1 8k1k c16, TP2 8k1k c8 and c32, TP4 1k1k c16: 4.7-11 s TTFTs


def test_the_inferencex_h200_table_never_fitted_on_scores_no_worse_than_today(tmp_path):
    points = read_points(H200)
    assert point_scenario(points[0], 1).cluster.hardware == "H200-SXM-141GB"
    result = run_score(H200, tmp_path, requests_per_client=2)
    rows = result["rows"]
    assert len(rows) == 109 and {r["tp"] for r in rows} == {1, 2, 4, 8}
    assert {r["line"] for r in result["bad_runs"]} == H200_BAD_RUNS and result["overall"]["points"] == 105
    for m in METRICS:
        assert result["overall"][f"{m}_mape"] <= H200_MAPE_BOUNDS[m] + MARGIN, (m, result["overall"])
    with (tmp_path / "score_points.csv").open() as f:
        assert sum(r["bad_run"] == "True" for r in csv.DictReader(f)) == 4  # listed, not dropped


def _point(line, c, ttft, tp=2, model="gpt-oss-120b"):
    from twin.analysis.gpu_fidelity import Point
    return Point(line=line, model=model, gpu="H200-SXM-141GB", dtype="mxfp4", tp=tp, isl=1024, osl=1024,
                 concurrency=c, ttft_ms=ttft, tpot_ms=5.0)


def test_a_bad_run_is_a_ttft_over_twice_a_higher_concurrency_s_in_its_series():
    from twin.analysis.gpu_fidelity import bad_runs
    series = [_point(2, 4, 50.0), _point(3, 8, 4000.0), _point(4, 16, 90.0), _point(5, 32, 5000.0)]
    # c8's 4 s is over 2x c16's 90 ms; c32, the top of its series, may be saturated: kept; other series apart
    assert bad_runs(series) == {3}
    assert bad_runs(series + [_point(6, 4, 3000.0, tp=4), _point(7, 8, 100.0, model="Llama-3.1-70B")]) == {3}
    assert bad_runs([_point(2, 4, 50.0), _point(3, 8, 99.0), _point(4, 16, 50.0)]) == set()  # 1.98x: kept


def test_scoring_is_deterministic_and_errors_are_signed():
    pts = read_points(DATA)[:2]
    a, b = score(pts, requests_per_client=1), score(pts, requests_per_client=1)
    assert a == b
    r = a[0]
    for m in METRICS:
        assert r[f"{m}_err_pct"] == pytest.approx(100 * (r[f"{m}_predicted"] - r[f"{m}_measured"])
                                                  / r[f"{m}_measured"])


def test_a_point_becomes_its_closed_loop_scenario():
    p = next(p for p in read_points(DATA) if p.model == "gpt-oss-120b" and p.tp == 4 and p.label == "8k1k"
             and p.concurrency == 16)
    sc = point_scenario(p, 3)
    c = sc.cluster
    assert (c.model, c.dtype, c.tensor_parallel, c.hardware) == ("gpt-oss-120b", "mxfp4", 4, "H100-SXM-80GB")
    assert (c.engine.max_num_seqs, c.engine.max_num_batched_tokens, c.engine.enable_prefix_caching,
            c.engine.max_model_len, c.engine.gpu_memory_utilization) == (16, 8192, False, 10240, 0.9)
    assert sc.workload.closed_loop.concurrency == 16 and sc.workload.num_requests == 48
    s = build_stream(sc)
    # InferenceMAX's random dataset: lengths uniform in [int(0.8 L), L]
    assert s.prompt_tokens.min() >= int(0.8 * 8192) and s.prompt_tokens.max() <= 8192
    assert s.output_tokens.min() >= int(0.8 * 1024) and s.output_tokens.max() <= 1024
    assert len(np.unique(s.output_tokens)) > 10
    llama = next(p for p in read_points(DATA) if p.model == "Llama-3.1-70B")
    assert point_scenario(llama, 1).cluster.dtype == "fp8"


def test_mxfp4_experts_are_4_25_bits_at_the_16_bit_peak_and_fp8_is_priced_at_8_bits():
    gpu, m = get_gpu("H100"), get_model("gpt-oss-120b")
    assert m.is_moe and 116e9 < m.total_params < 117.5e9
    assert 5.0e9 < m.active_linear_params + m.embedding_params < 5.2e9  # the model card's 5.1 B active
    mx = RooflineModel(gpu, m, dtype="mxfp4", tensor_parallel=2).ideal()
    bf = RooflineModel(gpu, m, dtype="bf16", tensor_parallel=2).ideal()
    experts = m.num_layers * m.num_experts * m.expert_params
    dense = m.linear_params - experts
    assert mx.weight_bytes_per_gpu == pytest.approx((dense * 2 + experts * MXFP4_BYTES + m.vocab_params * 2) / 2)
    assert mx.weight_bytes_per_gpu < 0.3 * bf.weight_bytes_per_gpu
    big = StepBatch(num_prefill_tokens=8192, prefill_attn_tokens=8192 * 4096, prefill_kv_read_tokens=8192,
                    num_prefill_sampled=1, num_prefill_reqs=1)
    # a large prefill is compute-bound: same time as BF16 (no FP4 tensor cores on Hopper); a decode reads fewer bytes
    assert mx.group_times(big)["linear"] == pytest.approx(bf.group_times(big)["linear"])
    dec = StepBatch(num_decode_tokens=8, decode_context_tokens=8 * 2048)
    assert mx.group_times(dec)["linear"] < 0.5 * bf.group_times(dec)["linear"]
    llama = get_model("llama-3.1-70b-instruct")
    f8 = RooflineModel(gpu, llama, dtype="fp8", tensor_parallel=4).ideal()
    b16 = RooflineModel(gpu, llama, dtype="bf16", tensor_parallel=4).ideal()
    assert f8.group_times(big)["linear"] == pytest.approx(b16.group_times(big)["linear"] / 2, rel=1e-4)
    one = StepBatch(num_decode_tokens=1, decode_context_tokens=1024)
    assert f8.group_times(one)["linear"] == pytest.approx(b16.group_times(one)["linear"] / 2, rel=0.01)


def write(path, rows, header=("model", "gpu", "precision", "tp", "isl", "osl", "concurrency", "ttft_ms", "tpot_ms")):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


GOOD = ["llama-3.1-70b-instruct", "h100", "fp8", 8, 1024, 1024, 4, 70.4, 9.1]


@pytest.mark.parametrize("row,needle", [
    (["nope-7b", *GOOD[1:]], "line 2: field model: unknown model 'nope-7b'"),
    ([GOOD[0], "tpu", *GOOD[2:]], "line 2: field gpu: unknown GPU 'tpu'"),
    ([*GOOD[:2], "int3", *GOOD[3:]], "line 2: field precision: 'int3' unknown"),
    ([*GOOD[:3], "two", *GOOD[4:]], "line 2: field tp: 'two' is not a number"),
    ([*GOOD[:6], 0, *GOOD[7:]], "line 2: field concurrency: '0' must be an integer number > 0"),
    ([*GOOD[:7], "nan", GOOD[8]], "line 2: field ttft_ms: 'nan' must be a number > 0"),
])
def test_bad_rows_are_one_line_naming_line_and_field(tmp_path, row, needle):
    path = write(tmp_path / "m.csv", [GOOD, row])
    with pytest.raises(TwinInputError) as e:
        read_points(path)
    assert needle.replace("line 2", "line 3") in str(e.value) and "\n" not in str(e.value)


def test_bad_files_are_one_line(tmp_path):
    for path, needle in [(tmp_path / "none.csv", "does not exist"), (tmp_path, "is a folder"),
                         (write(tmp_path / "e.csv", []), "no measured points"),
                         (write(tmp_path / "c.csv", [GOOD[:8]], header=("model", "gpu", "precision", "tp", "isl",
                                                                        "osl", "concurrency", "ttft_ms")),
                          "missing column(s) tpot_ms")]:
        with pytest.raises(TwinInputError) as e:
            read_points(path)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_score_writes_its_table_and_figure_and_refuses_bad_input(tmp_path):
    path = write(tmp_path / "m.csv", [GOOD, [*GOOD[:6], 8, 75.8, 9.4]])
    runner = CliRunner()
    r = runner.invoke(app, ["score", str(path), "--out", str(tmp_path / "out"), "--requests-per-client", "1",
                            "--set", "cluster.engine.async_scheduling=false"])
    assert r.exit_code == 0, r.output
    assert "MAPE" in r.output and (tmp_path / "out" / "score.png").is_file()
    with (tmp_path / "out" / "score_points.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2
    r = runner.invoke(app, ["score", str(tmp_path / "missing.csv")])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = runner.invoke(app, ["score", str(path), "--out", str(tmp_path / "o2"), "--set", "cluster.tensor_parallel=3"])
    assert r.exit_code == 2 and "--set cluster.tensor_parallel=3" in r.output


@pytest.mark.parametrize("cells,says", [
    ("abc,,", "field max_num_seqs: 'abc' is not a number"),
    (",maybe,", "field enable_prefix_caching: 'maybe' is not true or false"),
    (",,fp9", "field kv_cache_dtype: 'fp9' unknown"),
    ("-4,,", "field max_num_seqs: '-4' is not a whole number >= 0"),
])
def test_an_engine_cell_that_cannot_be_read_is_an_error_not_dropped(tmp_path, cells, says):
    """Before, each was dropped with exit 0: a KV dtype of vLLM's own spelling (fp8_e4m3) ran as auto, half the
    blocks it had."""
    from twin.analysis.gpu_fidelity import read_points

    p = tmp_path / "m.csv"
    p.write_text("model,gpu,precision,tp,isl,osl,concurrency,ttft_ms,tpot_ms,max_num_seqs,enable_prefix_caching,"
                 f"kv_cache_dtype\nLlama-3-8B,h100,bf16,1,1024,128,4,50,6,{cells}\n")
    with pytest.raises(TwinInputError) as e:
        read_points(p)
    assert str(e.value) == f"{p}: line 2: {says}" or str(e.value).startswith(f"{p}: line 2: {says}")


def test_vllms_kv_cache_dtype_spellings_are_read():
    from twin.analysis.gpu_fidelity import KV_DTYPES

    assert KV_DTYPES["fp8_e4m3"] == KV_DTYPES["fp8_e5m2"] == "fp8" and KV_DTYPES["bfloat16"] == "bf16"
