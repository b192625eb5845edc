"""The twin scored offline against published real-GPU serving measurements (`twin score FILE`).

Each row of FILE is one measured point: a model on a GPU at a tensor-parallel degree and precision, vLLM engine
settings, and a closed-loop load (`concurrency` clients, fixed `isl` / `osl` lengths), with the measured mean TTFT
and TPOT in ms (the columns of tests/data/inferencex-h100-vllm.csv and inferencex-h200-vllm.csv, SemiAnalysis
InferenceX as vendored by inference-sim). Each point is simulated under that load (twin.workload.closed_loop),
deterministically, and compared: MAPE and mean signed error per metric, and the error of every point. Bad runs
(`bad_runs`: a TTFT over twice that of more clients in the same series) are scored and listed but left out of the
figures.

The load, as InferenceMAX's client runs it (its README: bench_serving/benchmark_serving.py, `--dataset-name
random --random-range-ratio 0.8 --num-prompts CONC x 10 --max-concurrency CONC --request-rate inf --ignore-eos`):
each prompt and output length an integer uniform in [int(0.8 L), L] (`range_ratio`), 10 requests per client.

Metrics: TTFT and TPOT as measured; E2E and output throughput are derived from them, on both sides alike (the
twin's own means go through the same formulas): the benchmark ignores EOS, so a request's E2E is its TTFT plus
(output - 1) x its TPOT, and mean E2E ~ mean TTFT + (mean output - 1) x mean TPOT; a closed loop of N clients
delivers N x mean output / mean E2E tokens per second (so throughput's error mirrors E2E's).

ASSUMPTIONS where the file is silent (the Llama rows have no engine log): InferenceMAX's vLLM launch (its README:
`--gpu-memory-utilization 0.9 --max-num-seqs CONC --max-num-batched-tokens 8192 --no-enable-prefix-caching
--async-scheduling`), max_model_len 10240 as the logged rows; the rest vLLM's defaults as the twin resolves them.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from twin.errors import TwinInputError, out_folder
from twin.scenario import KV_CACHE_DTYPES

REQUIRED = ("model", "gpu", "precision", "tp", "isl", "osl", "concurrency", "ttft_ms", "tpot_ms")
METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "throughput_tok_s")
GPUS = {"h100": "H100-SXM-80GB", "h200": "H200-SXM-141GB"}
# the file's precision -> the twin's weight dtype: InferenceX's "fp4" for gpt-oss is its MXFP4 MoE checkpoint
PRECISIONS = {"fp8": "fp8", "bf16": "bf16", "fp16": "fp16", "fp4": "mxfp4", "mxfp4": "mxfp4"}
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # ASSUMPTION for rows without an engine log: InferenceMAX's launch
DEFAULT_MAX_MODEL_LEN = 10240  # ASSUMPTION for rows without an engine log: what the logged rows ran
RANGE_RATIO = 0.8  # InferenceMAX's client: --random-range-ratio 0.8
# a point whose mean TTFT is more than this many times that of a higher concurrency in its series is a bad run (see
# `bad_runs`): the H200 table has four (4.7-10.8 s between neighbours of 0.05-1.5 s), the H100 table none
BAD_RUN_RATIO = 2.0


@dataclass
class Point:
    """One measured point of the table, with the line it came from."""

    line: int
    model: str
    gpu: str
    dtype: str
    tp: int
    isl: int
    osl: int
    concurrency: int
    ttft_ms: float
    tpot_ms: float
    label: str = ""
    engine: dict = field(default_factory=dict)  # logged engine arguments, by vLLM's names

    @property
    def key(self) -> str:
        return f"{self.model} tp{self.tp} {self.label or f'{self.isl}/{self.osl}'} c{self.concurrency}"

    def mean_output(self, range_ratio: float) -> float:
        """Mean output length of integers uniform in [int(osl x range_ratio), osl]."""
        return (max(int(self.osl * range_ratio), 1) + self.osl) / 2

    def derived(self, ttft_ms: float, tpot_ms: float, range_ratio: float) -> dict:
        """The four metrics from mean TTFT and TPOT (module docstring)."""
        o = self.mean_output(range_ratio)
        e2e = ttft_ms + (o - 1) * tpot_ms
        return {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "e2e_ms": e2e,
                "throughput_tok_s": self.concurrency * o / (e2e / 1e3)}


def bad_runs(points: list[Point], ratio: float = BAD_RUN_RATIO) -> set[int]:
    """The lines of points whose mean TTFT is more than `ratio` x the TTFT of a higher concurrency in the same series
    (model, GPU, precision, TP, lengths). In a closed loop more clients can only queue more, so such a TTFT is a
    disturbed or failed run (the source does not say which), not a load the twin should match: `twin score` lists
    these and leaves them out of its figures. A saturated top concurrency (KV cache full) is kept: nothing above it."""
    series: dict[tuple, list[Point]] = {}
    for p in points:
        series.setdefault((p.model, p.gpu, p.dtype, p.tp, p.isl, p.osl), []).append(p)
    bad = set()
    for pts in series.values():
        for p in pts:
            if any(q.concurrency > p.concurrency and p.ttft_ms > ratio * q.ttft_ms for q in pts):
                bad.add(p.line)
    return bad


def _cell(row: dict, col: str) -> str:
    return (row.get(col) or "").strip()


def _number(path: Path, line: int, row: dict, col: str, kind=float, low: float = 0.0):
    text = _cell(row, col)
    try:
        v = kind(float(text)) if kind is int else float(text)
    except ValueError:
        raise TwinInputError(f"{path}: line {line}: field {col}: {text!r} is not a number") from None
    if not math.isfinite(v) or v <= low or (kind is int and float(text) != int(float(text))):
        raise TwinInputError(f"{path}: line {line}: field {col}: {text!r} must be a{'n integer' if kind is int else ''}"
                             f" number > {low:g}")
    return v


# vLLM's --kv-cache-dtype values, as the twin's cluster.kv_cache_dtype
KV_DTYPES = KV_CACHE_DTYPES


def _logged(row: dict, col: str, kind):
    """An engine argument the row logged, or None ("not_passed", empty, NaN); a ValueError for a value that is
    none of its kind (it used to be dropped: `kv_cache_dtype: fp8_e4m3` ran with half the KV blocks)."""
    text = _cell(row, col).lower()
    if text in ("", "nan", "not_passed", "none"):
        return None
    if kind is bool:
        if text not in ("true", "false"):
            raise ValueError(f"{text!r} is not true or false")
        return text == "true"
    if kind is str:
        if text not in KV_DTYPES:
            raise ValueError(f"{text!r} unknown (known: {', '.join(KV_DTYPES)})")
        return KV_DTYPES[text]
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or (kind is int and v != int(v)):
        raise ValueError(f"{text!r} is not a{' whole' if kind is int else ''} number >= 0")
    return kind(v)


def read_points(path: str | Path) -> list[Point]:
    """The measured points of a CSV, or one TwinInputError line naming the file, line and field."""
    from twin.specs.hardware import get_gpu
    from twin.specs.models import get_model

    path = Path(path)
    if not path.is_file():
        raise TwinInputError(f"measurements file {path} does not exist" if not path.exists()
                             else f"{path}: is a folder; give a CSV file of measured points")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
            header = rows[0].keys() if rows else []
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise TwinInputError(f"{path}: cannot read as CSV ({type(e).__name__})") from None
    if not rows:
        raise TwinInputError(f"{path}: no measured points (a header and at least one row)")
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise TwinInputError(f"{path}: missing column(s) {', '.join(missing)} (a measured point needs "
                             f"{', '.join(REQUIRED)})")
    points = []
    for i, row in enumerate(rows):
        line = i + 2
        name = _cell(row, "model")
        model = None
        for cand in (name, _cell(row, "model_path")):
            if cand:
                try:
                    model = get_model(cand).name
                    break
                except TwinInputError:
                    pass
        if model is None:
            raise TwinInputError(f"{path}: line {line}: field model: unknown model {name!r} (add it to the specs: "
                                 "twin specs lists the known ones)")
        g = _cell(row, "gpu")
        try:
            gpu = get_gpu(GPUS.get(g.lower(), g)).name
        except TwinInputError:
            raise TwinInputError(f"{path}: line {line}: field gpu: unknown GPU {g!r}") from None
        prec = _cell(row, "precision").lower()
        if prec not in PRECISIONS:
            raise TwinInputError(f"{path}: line {line}: field precision: {prec!r} unknown (known: "
                                 f"{', '.join(PRECISIONS)})")
        engine = {}
        for col, kind in (("max_num_seqs", int), ("max_num_batched_tokens", int), ("max_model_len", int),
                          ("gpu_memory_utilization", float), ("enable_prefix_caching", bool), ("block_size", int),
                          ("kv_cache_dtype", str)):
            try:
                v = _logged(row, col, kind)
            except ValueError as e:
                raise TwinInputError(f"{path}: line {line}: field {col}: {e}") from None
            if v is not None:
                engine[col] = v
        points.append(Point(
            line=line, model=model, gpu=gpu, dtype=PRECISIONS[prec], tp=_number(path, line, row, "tp", int),
            isl=_number(path, line, row, "isl", int), osl=_number(path, line, row, "osl", int),
            concurrency=_number(path, line, row, "concurrency", int), ttft_ms=_number(path, line, row, "ttft_ms"),
            tpot_ms=_number(path, line, row, "tpot_ms"), label=_cell(row, "label"), engine=engine))
    return points


def point_scenario(p: Point, requests_per_client: int, overrides: list[str] | None = None,
                   range_ratio: float = RANGE_RATIO):
    """The scenario of one measured point: one instance, its engine settings, its closed-loop load."""
    from twin.scenario import apply_overrides, parse_scenario, with_served_context

    e = dict(p.engine)
    kv = e.pop("kv_cache_dtype", "auto")
    engine = {"max_num_batched_tokens": e.get("max_num_batched_tokens", 8192),  # vLLM's GPU default
              "max_num_seqs": max(e.get("max_num_seqs", p.concurrency), p.concurrency),
              "gpu_memory_utilization": e.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION),
              "enable_prefix_caching": e.get("enable_prefix_caching", False),
              "max_model_len": e.get("max_model_len", DEFAULT_MAX_MODEL_LEN)}
    if "block_size" in e:
        engine["block_size"] = e["block_size"]
    engine = with_served_context(engine, p.model)  # a measured server ran it, whatever the model's config says
    raw = {
        "name": p.key, "seed": 0,
        "cluster": {"num_instances": 1, "hardware": p.gpu, "model": p.model, "dtype": p.dtype,
                    "kv_cache_dtype": kv,
                    "tensor_parallel": p.tp, "engine": engine},
        "workload": {"num_requests": p.concurrency * requests_per_client,
                     "lengths": {"kind": "uniform", "prompt_tokens": p.isl, "output_tokens": p.osl,
                                 "range_ratio": range_ratio},
                     "closed_loop": {"concurrency": p.concurrency}},
        "sim": {"timeline_interval_s": 0},
    }
    flags: dict = {}
    raw = apply_overrides(raw, overrides or [], flags)
    return parse_scenario(raw, f"point at line {p.line}", ".", flags)


def predict(p: Point, requests_per_client: int, overrides: list[str] | None = None,
            range_ratio: float = RANGE_RATIO) -> dict:
    """The twin's figures for one point, derived as the measured ones are (module docstring)."""
    from twin.sim.cluster import simulate
    from twin.sim.metrics import summarize
    from twin.workload import build_stream

    sc = point_scenario(p, requests_per_client, overrides, range_ratio)
    s = summarize(simulate(sc, build_stream(sc)))
    ttft = 1e3 * (s["ttft_s"]["mean"] or float("nan"))
    tpot = 1e3 * (s["tpot_s"]["mean"] or float("nan"))
    return {**p.derived(ttft, tpot, range_ratio), "finished": s["requests_finished"],
            "requests": s["requests_total"], "preemptions": s["preemptions"],
            "sim_e2e_ms": 1e3 * (s["e2e_s"]["mean"] or float("nan")),
            "sim_throughput_tok_s": s["throughput_output_tok_s"]}


def score(points: list[Point], requests_per_client: int = 10, overrides: list[str] | None = None,
          progress: Callable[[int, Point], None] | None = None, range_ratio: float = RANGE_RATIO) -> list[dict]:
    """One row per point: measured, predicted and signed % error ((predicted - measured) / measured) per metric, and
    whether it is a bad run (`bad_runs`: scored, but left out of the figures)."""
    bad = bad_runs(points)
    rows = []
    for i, p in enumerate(points):
        if progress is not None:
            progress(i, p)
        pred = predict(p, requests_per_client, overrides, range_ratio)
        meas = p.derived(p.ttft_ms, p.tpot_ms, range_ratio)
        row = {"line": p.line, "model": p.model, "gpu": p.gpu, "dtype": p.dtype, "tp": p.tp, "label": p.label,
               "isl": p.isl, "osl": p.osl, "concurrency": p.concurrency, "bad_run": p.line in bad,
               "requests": pred["requests"],
               "finished": pred["finished"], "preemptions": pred["preemptions"]}
        for m in METRICS:
            row[f"{m}_measured"] = meas[m]
            row[f"{m}_predicted"] = pred[m]
            row[f"{m}_err_pct"] = 100.0 * (pred[m] - meas[m]) / meas[m]
        rows.append(row)
    return rows


def aggregate(rows: list[dict], by: tuple[str, ...] = ()) -> list[dict]:
    """MAPE and mean signed error (%) per metric, over all rows or per group of `by` columns."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in by), []).append(r)
    out = []
    for key, rs in groups.items():
        agg = {**dict(zip(by, key)), "points": len(rs)}
        for m in METRICS:
            e = np.array([r[f"{m}_err_pct"] for r in rs], dtype=float)
            agg[f"{m}_mape"] = float(np.mean(np.abs(e)))
            agg[f"{m}_signed"] = float(np.mean(e))
        out.append(agg)
    return out


def write_csv(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def plot(rows: list[dict], path: Path, title: str) -> Path:
    """Predicted against measured, one panel per metric, log-log, the diagonal and a +-10 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 4.2))
    models = sorted({r["model"] for r in rows})
    marks = {1: "D", 2: "o", 4: "s", 8: "^"}
    for ax, m in zip(axes, METRICS):
        for k, model in enumerate(models):
            for tp in sorted({r["tp"] for r in rows if r["model"] == model}):
                rs = [r for r in rows if r["model"] == model and r["tp"] == tp]
                ax.scatter([r[f"{m}_measured"] for r in rs], [r[f"{m}_predicted"] for r in rs], s=16,
                           color=f"C{k}", marker=marks.get(tp, "x"), label=f"{model} TP{tp}", alpha=0.8)
        vals = [r[f"{m}_{s}"] for r in rows for s in ("measured", "predicted") if r[f"{m}_{s}"] > 0]
        lo, hi = min(vals) / 1.2, max(vals) * 1.2
        xs = np.geomspace(lo, hi, 50)
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.fill_between(xs, xs * 0.9, xs * 1.1, color="k", alpha=0.08)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(NullFormatter())
        e = np.array([r[f"{m}_err_pct"] for r in rows])
        ax.set_title(f"{m}: MAPE {np.mean(np.abs(e)):.1f} %, signed {np.mean(e):+.1f} %", fontsize=9)
        ax.set_xlabel("measured")
        ax.set_ylabel("twin")
    axes[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_score(path: str | Path, out: Path, requests_per_client: int = 10, overrides: list[str] | None = None,
              progress: Callable[[int, Point], None] | None = None, range_ratio: float = RANGE_RATIO) -> dict:
    """Score the twin on every point of `path`; write score_points.csv, score_summary.csv and score.png to `out`."""
    if requests_per_client < 1:
        raise TwinInputError(f"--requests-per-client: must be >= 1, got {requests_per_client}")
    if not 0 < range_ratio <= 1:
        raise TwinInputError(f"--range-ratio: must be in (0, 1], got {range_ratio}")
    points = read_points(path)
    out = out_folder(Path(out))  # before the points run
    rows = score(points, requests_per_client, overrides, progress, range_ratio)
    kept = [r for r in rows if not r["bad_run"]]
    if not kept:
        raise TwinInputError(f"{path}: every point is a bad run (a TTFT over {BAD_RUN_RATIO:g}x that of a higher "
                             "concurrency in its series): nothing to score")
    overall = aggregate(kept)[0]
    groups = aggregate(kept, ("model", "tp"))
    write_csv(rows, out / "score_points.csv")
    write_csv([{"model": "all", "tp": "all", **overall}] + groups, out / "score_summary.csv")
    plot(kept, out / "score.png", f"twin vs {Path(path).name} ({len(kept)} points, {requests_per_client} "
                                  "requests per client)")
    return {"rows": rows, "overall": overall, "groups": groups, "out": str(out),
            "bad_runs": [r for r in rows if r["bad_run"]]}


def print_score(result: dict, console) -> None:
    """The summary table: MAPE and signed error per metric, overall and per model and TP degree."""
    from rich.table import Table

    t = Table(title=f"twin vs measured: MAPE % (mean signed error %), {result['overall']['points']} points")
    t.add_column("model")
    t.add_column("TP", justify="right")
    t.add_column("points", justify="right")
    for m in METRICS:
        t.add_column(m.replace("_ms", "").replace("_tok_s", "").upper(), justify="right")
    for g in [{"model": "all", "tp": "", **result["overall"]}] + result["groups"]:
        t.add_row(str(g["model"]), str(g["tp"]), str(g["points"]),
                  *(f"{g[f'{m}_mape']:.1f} ({g[f'{m}_signed']:+.1f})" for m in METRICS))
    console.print(t)
    bad = result.get("bad_runs") or []
    if bad:
        console.print(f"left out as bad runs ({len(bad)}: a mean TTFT over {BAD_RUN_RATIO:g}x that of a higher "
                      "concurrency in the same series): " + "; ".join(
                          f"line {r['line']} {r['model']} TP{r['tp']} {r['label']} c{r['concurrency']} "
                          f"({r['ttft_ms_measured']:,.0f} ms)" for r in bad), highlight=False)
    console.print(f"wrote {result['out']}/score_points.csv, score_summary.csv, score.png", highlight=False)
