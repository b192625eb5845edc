#!/usr/bin/env python
"""The twin scaler's `when_short` rules side by side: GPU-seconds vs SLO attainment when no fleet size reaches the
target while instances are starting (issue 21, scalers).

`largest` (the rule before) adds `max_step` instances at every decision until the first new ones serve; `gain`
(the default) grows only as far as the forecast still gains; `hold` waits for the starting instances. Each workload
runs under the three rules, beside a fixed fleet for reference:

- `servegen`: `scenarios/servegen-autoscale.yaml` at `workload.trace.sample=0.05` (a 10x time-compressed ServeGen
  burst, 31,459 requests; 2 fixed instances meet the SLOs), with the default moving average and with Holt-Winters;
- `azure/last`: `traces/azure_code.sample.csv` at 2x (as `scalers_tradeoff.py`), the `constant` predictor;
- `step`: synthetic, 8 req/s of 4,000-token prompts for 60 s, then a step to `--step-rate` for 3 minutes (H100,
  Llama-3-8B, vLLM's defaults; 30 s start-up, 60 s horizon, decisions every 10 s), from 2 instances;
- `one short`: the same shape as the regression test, one instance under a load two serve, a start-up as long as
  the horizon (60 s).

Prints a table, writes it as CSV and a GPU-seconds vs attainment PNG. No assertions. A few minutes in pure Python.

  .venv/bin/python benchmarks/scaler_short.py [--out DIR] [--step-rate 40] [--only servegen,step]
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RULES = ("largest", "gain", "hold")


def synthetic(name: str, n0: int, arrivals: np.ndarray, scaler: dict, startup: float, horizon: float):
    from twin.scenario import parse_scenario
    from twin.workload import RequestStream

    raw = {"name": name, "seed": 0,
           "cluster": {"num_instances": n0, "min_instances": 1, "max_instances": 12, "startup_delay_s": startup,
                       "hardware": "H100-SXM-80GB", "model": "Llama-3-8B"},
           "workload": {"num_requests": 1, "arrival": {"process": "poisson", "rate": 1},
                        "lengths": {"kind": "fixed", "prompt_tokens": 4000, "output_tokens": 20}},
           "router": {"name": "least-outstanding"},
           "scaler": {**scaler, "interval_s": 10.0},
           "slo": {"ttft_s": 1.0},
           "sim": {"timeline_interval_s": 0}}
    if scaler["name"] == "twin":
        raw["scaler"]["params"] = {"horizon_s": horizon, "interval_s": 10.0, **scaler.get("params", {})}
    n = len(arrivals)
    return parse_scenario(raw, name, ROOT), RequestStream(arrivals, np.full(n, 4000), np.full(n, 20))


def cases(args):
    """(workload, label, scenario, stream) for every run."""
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    sys.path.insert(0, str(ROOT / "benchmarks"))
    out = []
    if "servegen" in args.only:
        sg = ROOT / "scenarios" / "servegen-autoscale.yaml"
        base = ["workload.trace.sample=0.05", "sim.timeline_interval_s=0"]
        stream = build_stream(load_scenario(sg, base))
        for pred in ("moving-average", "holt-winters"):
            out.append((f"servegen/{pred}", "fixed 2", load_scenario(sg, base + ["scaler.name=none"]), stream))
            for rule in RULES:
                sc = load_scenario(sg, base + ["scaler.name=twin", f"scaler.params.predictor={pred}",
                                               f"scaler.params.when_short={rule}"])
                out.append((f"servegen/{pred}", rule, sc, stream))
    if "azure" in args.only:
        from scalers_tradeoff import scenario as tradeoff

        targs = argparse.Namespace(trace="traces/azure_code.sample.csv", rate_scale=2.0, startup_delay=30.0,
                                   interval=15.0, ttft=1.0, tpot=0.05, max_instances=8)
        stream = build_stream(tradeoff(targs, "none", {}, 1))
        out.append(("azure/last", "fixed 2", tradeoff(targs, "none", {}, 2), stream))
        for rule in RULES:
            out.append(("azure/last", rule, tradeoff(targs, "twin", {"horizon_s": 120.0, "interval_s": 15.0,
                                                                     "predictor": "constant", "when_short": rule}, 2),
                        stream))
    if "step" in args.only:
        arr = np.concatenate([np.arange(0.0, 60.0, 1 / 8.0), 60.0 + np.arange(0.0, 180.0, 1 / args.step_rate)])
        for rule in RULES:
            sc, stream = synthetic("step", 2, arr, {"name": "twin", "params": {"when_short": rule}}, 30.0, 60.0)
            out.append((f"step to {args.step_rate:g} req/s", rule, sc, stream))
        sc, stream = synthetic("step", args.step_fixed, arr, {"name": "none"}, 30.0, 60.0)
        out.append((f"step to {args.step_rate:g} req/s", f"fixed {args.step_fixed}", sc, stream))
    if "one" in args.only:
        arr = np.arange(0.0, 120.0, 1 / 20.0)
        for rule in RULES:
            sc, stream = synthetic("one short", 1, arr, {"name": "twin", "params": {"when_short": rule}}, 60.0, 60.0)
            out.append(("one short", rule, sc, stream))
        sc, stream = synthetic("one short", 2, arr, {"name": "none"}, 60.0, 60.0)
        out.append(("one short", "fixed 2", sc, stream))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-rate", type=float, default=40.0)
    ap.add_argument("--step-fixed", type=int, default=8, help="the fixed fleet shown beside the step")
    ap.add_argument("--only", default="servegen,azure,step,one")
    ap.add_argument("--out", default="benchmarks/results/scaler_short")
    args = ap.parse_args()
    args.only = set(args.only.split(","))

    from twin.sim.cluster import Cluster
    from twin.sim.events import BUILD
    from twin.sim.metrics import summarize

    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, {BUILD} build")
    rows = []
    for workload, label, sc, stream in cases(args):
        t0 = time.perf_counter()
        s = summarize(Cluster(sc, stream).run())
        fleet = s.get("fleet") or {}
        ev = fleet.get("scale_events", [])
        rows.append({"workload": workload, "run": label, "gpu_s": round(s["gpu_seconds"], 1),
                     "slo_attainment": round(s["slo_attainment"] or 0.0, 4),
                     "peak_active": fleet.get("peak_active", sc.cluster.num_instances),
                     "starts": sum(e["action"] == "start" for e in ev), "requests": s["requests_total"],
                     "wall_s": round(time.perf_counter() - t0, 1)})
        r = rows[-1]
        print(f"  {workload:<26} {label:<8} {r['gpu_s']:>8.0f} GPU-s  attainment {r['slo_attainment']:6.1%}  "
              f"peak {r['peak_active']:>2}, {r['starts']:>2} starts  ({r['wall_s']:.1f} s wall)", flush=True)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "scaler_short.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.8 * len(groups), 3.4), squeeze=False)
    marks = {"largest": ("s", "C3"), "gain": ("o", "C0"), "hold": ("^", "C2")}
    for ax, g in zip(axes[0], groups):
        for r in (r for r in rows if r["workload"] == g):
            m, c = marks.get(r["run"], ("x", "0.4"))
            ax.scatter(r["gpu_s"], 100 * r["slo_attainment"], marker=m, color=c, s=60, label=r["run"])
        ax.set_title(g, fontsize=9)
        ax.legend(fontsize=7)
        ax.set_xlabel("GPU-seconds")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("SLO attainment (%)")
    fig.suptitle("twin scaler, when_short: no size reaches the target while instances start", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "scaler_short.png", dpi=110)
    print(f"wrote {out / 'scaler_short.csv'} and {out / 'scaler_short.png'}")


if __name__ == "__main__":
    main()
