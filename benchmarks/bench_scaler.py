#!/usr/bin/env python
"""Decision cost of the `twin` scaler: one look-ahead over a 5-minute horizon on a loaded 16-instance fleet.

Runs bench-16xh100 (ShareGPT lengths) with the twin scaler and times each `decide` call (which runs the
fleet forecaster for every candidate size it tries). Prints p50/p99/max wall time per decision, and per number
of sizes tried (a size's run stops once its verdict against the target is known, so a clear miss costs a
fraction of a look-ahead), with the machine and its load, and what the decisions bought (SLO attainment,
GPU-seconds, the fleet's final size). `--exact` runs every size to the end (`early_stop: false`), for an A/B.
No assertions.

  .venv/bin/python benchmarks/bench_scaler.py [--rate 60] [--horizon 300] [--requests 6000] [--exact]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--rate", type=float, default=60.0)
    ap.add_argument("--horizon", type=float, default=300.0)
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--representatives", type=int, default=2)
    ap.add_argument("--exact", action="store_true", help="run every size to the end (early_stop: false)")
    args = ap.parse_args()

    from twin.sim.cluster import Cluster
    from twin.policy.scalers import TwinScaler
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    sc = load_scenario(ROOT / "scenarios" / "bench-16xh100.yaml", [
        f"cluster.num_instances={args.instances}", f"cluster.max_instances={args.instances + 4}",
        f"workload.num_requests={args.requests}", f"workload.arrival.rate={args.rate}",
        "sim.timeline_interval_s=0", "scaler.name=twin", "scaler.interval_s=30", "slo.ttft_s=1.0"])
    times: list[float] = []
    cpu: list[float] = []  # this process's CPU seconds per decision: less moved by other jobs than wall time
    tried: list[int] = []  # fleet sizes forecast per decision (each one full look-ahead)

    class Timed(TwinScaler):
        def decide(self, now, fleet, forecast=None):
            if forecast is not None:  # the fleet builds the forecaster with its default; the flag sets it
                forecast.representatives = args.representatives
            t0, c0 = time.perf_counter(), time.process_time()
            out = super().decide(now, fleet, forecast)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            tried.append(len(self.last.get("attainment", {})) if self.last.get("t") == now else 0)
            return out

    scaler = Timed(horizon_s=args.horizon, early_stop=not args.exact)
    scaler.slo = sc.slo
    cl = Cluster(sc, build_stream(sc), scaler=scaler)
    from twin.lab.machine import describe
    from twin.sim.metrics import summarize

    before = describe()
    t0 = time.perf_counter()
    s = summarize(cl.run())
    wall = time.perf_counter() - t0
    t = np.array(times)
    print(f"machine: {before} (at the start; {describe().split('load average ')[-1].split(',')[0]} at the end)")
    print(f"{args.instances} instances, {args.rate} req/s, horizon {args.horizon:.0f} s, "
          f"{args.representatives} representatives, {args.requests} requests: {len(t)} decisions, "
          f"p50 {np.median(t):.3f} s, p99 {np.percentile(t, 99):.3f} s, max {t.max():.3f} s per decision "
          f"(target <= 1 s each){', every size run to the end' if args.exact else ''}; run wall {wall:.1f} s")
    c = np.array(cpu)
    print(f"  CPU time per decision (this process): p50 {np.median(c):.3f} s, max {c.max():.3f} s")
    print(f"  the run: SLO attainment {s['slo_attainment']:.1%}, {s['gpu_seconds']:.0f} GPU-s, final fleet "
          f"{s['fleet']['final_active']} (peak {s['fleet']['peak_active']}, max {args.instances + 4})")
    for k in sorted(set(tried)):
        sel = t[np.array(tried) == k]
        print(f"  {k} fleet size(s) forecast: {len(sel)} decisions, p50 {np.median(sel):.3f} s, "
              f"max {sel.max():.3f} s ({np.median(sel) / max(k, 1):.3f} s per look-ahead)")

if __name__ == "__main__":
    main()
