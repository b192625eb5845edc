#!/usr/bin/env python
"""GPU-seconds vs SLO attainment of each scaler on a bursty trace shipped in the repo (issue 21).

Replays `traces/azure_code.sample.csv` (the Azure 2023 code trace's first 1,000 rows: inter-arrival CV about
12.7, bursts of ~11 req/s between idle gaps) on H100s serving Llama-3-8B under: fixed fleets of N instances
(`none`), `threshold`, `queue`, `throughput` (capacity measured by the twin) and `twin` (look-ahead, measured
rate, no oracle), each with its defaults except where a flag says otherwise; `/last` runs forecast the next
interval's rate as the last one's (`constant` predictor) instead of a 5-interval moving average; `twin/hold` scales
down no lower than its largest choice over `--hold` seconds (`stabilization_s`, the HPA's rule); `twin/pattern`
forecasts the last horizon's arrivals stretched to the rate instead of Poisson ones. Every run starts from the same
fleet (`--start`). Prints a table and writes it as CSV plus a GPU-seconds vs attainment PNG. No assertions.

ASSUMPTIONS (flags): `--startup-delay 30` s for a new instance (the scenario default of 90 s is longer than most
bursts here), decisions every `--interval 15` s, SLO TTFT 1 s and TPOT 50 ms, `--rate-scale 2` (the trace
replayed twice as fast, so a burst needs several instances). The default run takes a few seconds on one core.

  .venv/bin/python benchmarks/scalers_tradeoff.py [--out DIR] [--rate-scale 2] [--fixed 1,2,3,4]
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def scenario(args, name: str, params: dict, n0: int):
    from twin.scenario import parse_scenario

    raw = {
        "name": f"tradeoff-{name}", "seed": 0,
        "cluster": {"num_instances": n0, "min_instances": 1, "max_instances": args.max_instances,
                    "startup_delay_s": args.startup_delay, "hardware": "H100-SXM-80GB", "model": "Llama-3-8B",
                    "engine": {"enable_prefix_caching": True}},
        "workload": {"trace": {"path": str(ROOT / args.trace), "rate_scale": args.rate_scale}},
        "router": {"name": "least-outstanding"},
        "scaler": {"name": name, "params": params, "interval_s": args.interval},
        "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot},
        "sim": {"timeline_interval_s": 0},
    }
    return parse_scenario(raw, f"tradeoff [{name}]", ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="traces/azure_code.sample.csv")
    ap.add_argument("--rate-scale", type=float, default=2.0)
    ap.add_argument("--startup-delay", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=15.0)
    ap.add_argument("--ttft", type=float, default=1.0)
    ap.add_argument("--tpot", type=float, default=0.05)
    ap.add_argument("--start", type=int, default=2, help="instances at t = 0 for every scaler")
    ap.add_argument("--max-instances", type=int, default=8)
    ap.add_argument("--fixed", default="1,2,3,4", help="fixed fleet sizes to compare")
    ap.add_argument("--horizon", type=float, default=120.0, help="the twin scaler's look-ahead")
    ap.add_argument("--hold", type=float, default=120.0,
                    help="the twin/hold run's scale-down stabilisation window (stabilization_s)")
    ap.add_argument("--out", default="benchmarks/results/scalers_tradeoff")
    args = ap.parse_args()

    from twin.sim.cluster import Cluster
    from twin.sim.metrics import summarize
    from twin.workload import build_stream

    runs = [(f"fixed {n}", "none", {}, n) for n in (int(x) for x in args.fixed.split(",") if x)]
    runs += [("threshold", "threshold", {"window_s": 30.0, "cooldown_s": 60.0}, args.start),
             ("queue", "queue", {}, args.start),
             ("throughput", "throughput", {"interval_s": args.interval}, args.start),
             ("throughput/last", "throughput", {"interval_s": args.interval, "predictor": "constant"}, args.start),
             ("twin", "twin", {"horizon_s": args.horizon, "interval_s": args.interval}, args.start),
             ("twin/last", "twin", {"horizon_s": args.horizon, "interval_s": args.interval,
                                    "predictor": "constant"}, args.start),
             (f"twin/hold {args.hold:g}s", "twin", {"horizon_s": args.horizon, "interval_s": args.interval,
                                                   "stabilization_s": args.hold}, args.start),
             ("twin/pattern", "twin", {"horizon_s": args.horizon, "interval_s": args.interval,
                                       "arrivals": "pattern"}, args.start)]
    stream = build_stream(scenario(args, "none", {}, 1))
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
          f"trace {args.trace} x{args.rate_scale:g}: {len(stream)} requests over {stream.arrival_s.max():.0f} s; "
          f"start-up delay {args.startup_delay:g} s, decisions every {args.interval:g} s, SLO TTFT {args.ttft} s "
          f"TPOT {args.tpot * 1e3:.0f} ms")
    rows = []
    for label, name, params, n0 in runs:
        sc = scenario(args, name, params, n0)
        t0 = time.perf_counter()
        cl = Cluster(sc, stream)
        s = summarize(cl.run())
        wall = time.perf_counter() - t0
        ev = s["fleet"]["scale_events"] if s.get("fleet") else []
        done = s["requests_total"]
        good = (s["slo_attainment"] or 0.0) * (done - s["requests_rejected"])
        rows.append({"scaler": label, "start": n0, "gpu_s": round(s["gpu_seconds"], 1),
                     "slo_attainment": round(s["slo_attainment"] or 0.0, 4),
                     "good_of_all": round(good / done, 4) if done else 0.0,
                     "ttft_p99_s": round(s["ttft_s"]["p99"], 3), "rejected": s["requests_rejected"],
                     "starts": sum(e["action"] == "start" for e in ev),
                     "drains": sum(e["action"] == "drain" for e in ev),
                     "peak_active": s["fleet"]["peak_active"] if s.get("fleet") else n0, "wall_s": round(wall, 1)})
        r = rows[-1]
        print(f"  {label:<16} {r['gpu_s']:>8.0f} GPU-s  attainment {r['slo_attainment']:.1%}  "
              f"(P99 TTFT {r['ttft_p99_s']:.2f} s, {r['starts']} starts, {r['drains']} drains, peak "
              f"{r['peak_active']}; {wall:.1f} s wall)")
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "scalers_tradeoff.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out / 'scalers_tradeoff.csv'} (no matplotlib: no figure)")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    markers = "so^vDP*Xh<>"
    for k, r in enumerate(rows):
        ax.scatter(r["gpu_s"], r["slo_attainment"], marker=markers[k % len(markers)], s=46, alpha=0.8,
                   label=r["scaler"])  # a legend, not labels: runs that land on one point stay readable
    ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("GPU-seconds")
    ax.set_ylabel("SLO attainment (finished requests)")
    ax.set_title(f"{Path(args.trace).name} x{args.rate_scale:g}: cost vs SLO per scaler", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "scalers_tradeoff.png", dpi=120)
    print(f"wrote {out / 'scalers_tradeoff.csv'} and {out / 'scalers_tradeoff.png'}")


if __name__ == "__main__":
    main()
