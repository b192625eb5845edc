"""Figures and tables a user looks at first: latency CDFs, per-instance timelines, router comparisons."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"))


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: np.ndarray, label: str) -> None:
    v = np.sort(values[~np.isnan(values)])
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def latency_cdfs(requests: Mapping[str, pd.DataFrame], path: Path, title: str = "") -> Path:
    """One panel per latency (TTFT, TPOT, E2E), one CDF line per run label."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (col, name) in zip(axes, LATENCIES):
        for label, df in requests.items():
            fin = df[df["status"] == "finished"]
            _cdf(ax, fin[col].to_numpy(dtype=float), label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_cdf(requests: Mapping[str, pd.DataFrame], path: Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, df in requests.items():
        fin = df[df["status"] == "finished"]
        _cdf(ax, fin["ttft_s"].to_numpy(dtype=float), label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "TTFT by router")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timelines(timeline: Mapping[str, pd.DataFrame], path: Path, title: str = "") -> Path:
    """Per run label a row of panels: requests at each instance (running + waiting) and KV use, over time."""
    plt = _plt()
    labels = [k for k, v in timeline.items() if v is not None and len(v)]
    n = max(len(labels), 1)
    fig, axes = plt.subplots(n, 2, figsize=(13, 2.6 * n), squeeze=False, sharex=True)
    for row, label in enumerate(labels):
        tl = timeline[label]
        for inst, g in tl.groupby("instance", observed=True):
            axes[row][0].plot(g["t_s"], g["running"] + g["waiting"], lw=0.8, label=str(inst))
            axes[row][1].plot(g["t_s"], g["kv_usage"] * 100, lw=0.8, label=str(inst))
        axes[row][0].set_ylabel(f"{label}\nrunning+waiting")
        axes[row][1].set_ylabel("KV use (%)")
        axes[row][1].set_ylim(0, 102)
    for ax in axes[-1]:
        ax.set_xlabel("simulated time (s)")
    if labels and timeline[labels[0]]["instance"].nunique() <= 16:
        axes[0][1].legend(fontsize=6, ncol=2, loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def load_imbalance(requests: pd.DataFrame, num_instances: int) -> float:
    """Max over instances of requests dispatched there, over the mean (1.0 = perfectly even)."""
    inst = requests.loc[requests["instance"] >= 0, "instance"].to_numpy()
    if num_instances <= 0 or len(inst) == 0:
        return float("nan")
    counts = np.bincount(inst, minlength=num_instances)
    return float(counts.max() / counts.mean())


def summary_row(summary: dict) -> dict:
    """The flat columns a comparison table shows for one run."""
    def g(k, q):
        v = summary[k][q]
        return float("nan") if v is None else v

    return {
        "ttft_mean_s": g("ttft_s", "mean"), "ttft_p99_s": g("ttft_s", "p99"),
        "tpot_mean_s": g("tpot_s", "mean"), "tpot_p99_s": g("tpot_s", "p99"),
        "e2e_mean_s": g("e2e_s", "mean"), "e2e_p99_s": g("e2e_s", "p99"),
        "goodput_req_s": summary["goodput_req_s"], "slo_attainment": summary["slo_attainment"],
        "throughput_req_s": summary["throughput_req_s"],
        "prefix_hit_rate": summary["prefix_cache_hit_rate"], "preemptions": summary["preemptions"],
        "finished": summary["requests_finished"], "rejected": summary["requests_rejected"],
    }


def plot_run(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Figures for any run folder written by `twin simulate`/`replay` (requests.parquet, timeline.parquet), or by
    `twin compare`: its tables hold a `label` column, one curve per contender, drawn again as compare drew them
    (read as one run, its figure was overwritten by a single curve over every contender's requests)."""
    from twin.errors import TwinInputError, out_folder

    run_dir = Path(run_dir)
    req_path = run_dir / "requests.parquet"
    if not req_path.is_file():
        raise TwinInputError(f"{run_dir}: no requests.parquet here (is it a run folder from `twin simulate --out`?)")
    out = out_folder(Path(out) if out is not None else run_dir)
    df = _read_table(req_path, ["status", *(col for col, _ in LATENCIES)])
    name = run_dir.name
    written = [latency_cdfs(_by_label(df, name), out / "latency_cdf.png", name)]
    tl_path = run_dir / "timeline.parquet"
    if tl_path.is_file():
        tl = _read_table(tl_path, ["t_s", "instance", "running", "waiting", "kv_usage"])
        labelled = "label" in tl.columns
        written.append(timelines(_by_label(tl, name), out / ("timelines.png" if labelled else "timeline.png"),
                                 f"{name}: per-instance load and KV use" if labelled else name))
    return written


def _by_label(df: pd.DataFrame, name: str) -> dict[str, pd.DataFrame]:
    """A run's table as {name: table}, or a comparison's (a `label` column) as one table per contender, in order."""
    if "label" not in df.columns:
        return {name: df}
    return {str(k): g.drop(columns="label") for k, g in df.groupby("label", sort=False)}


def _read_table(path: Path, columns: list[str]) -> pd.DataFrame:
    """A run's parquet table with the columns the figures read, or one clear line (a corrupt or foreign file)."""
    from twin.errors import TwinInputError

    try:
        df = pd.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file is bad input
        raise TwinInputError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise TwinInputError(f"{path}: missing column(s) {', '.join(missing)}: not written by twin simulate/replay?")
    for c in columns:
        if c not in ("status", "instance", "state") and not pd.api.types.is_numeric_dtype(df[c]):
            raise TwinInputError(f"{path}: column {c} holds {df[c].dtype} values, not numbers: not written by twin "
                                 "simulate/replay?")
    return df
