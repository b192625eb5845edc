#!/usr/bin/env python
"""Decision cost of the `twin` scaler: one look-ahead over a 5-minute horizon on a loaded 16-instance fleet.

Runs bench-16xh100 (ShareGPT lengths) with the twin scaler and times each `decide` call (which runs the
fleet forecaster for every candidate size). Prints p50/max wall time per decision. No assertions.

  .venv/bin/python benchmarks/bench_scaler.py [--rate 60] [--horizon 300] [--requests 6000]
"""

from __future__ import annotations

import argparse
import platform
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

    class Timed(TwinScaler):
        def decide(self, now, fleet, forecast=None):
            t0 = time.perf_counter()
            out = super().decide(now, fleet, forecast)
            times.append(time.perf_counter() - t0)
            return out

    scaler = Timed(horizon_s=args.horizon)
    scaler.slo = sc.slo
    cl = Cluster(sc, build_stream(sc), scaler=scaler)
    t0 = time.perf_counter()
    cl.run()
    wall = time.perf_counter() - t0
    t = np.array(times)
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"{args.instances} instances, {args.rate} req/s, horizon {args.horizon:.0f} s: {len(t)} decisions, "
          f"p50 {np.median(t):.3f} s, max {t.max():.3f} s per decision (target <= 1 s); run wall {wall:.1f} s")


if __name__ == "__main__":
    main()
