#!/usr/bin/env python
"""Decision latency of the Block router (fork + look-ahead per candidate) on a loaded 16-instance fleet.

Runs the ShareGPT-length bench scenario with the Block router and times every `choose` call with
perf_counter_ns. Prints p50/p99/max per objective, per candidate bound (`max_candidates`, the k fewest in
flight) and per forecast bound (`max_forecasts`, the k lowest estimates; 0: all, the exact default), the forks
made per decision (forecasts less those the first-token bound answered without one), with the machine and its
load (at the start and after each row: the figures move with it). No assertions: figures only.

  .venv/bin/python benchmarks/bench_block.py [--instances 16] [--requests 3000] [--rate 120] [--forecasts 0,4]
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
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=120.0)
    ap.add_argument("--objectives", default="ttft,e2e")
    ap.add_argument("--candidates", default="0,4")
    ap.add_argument("--forecasts", default="0", help="max_forecasts values (each with --candidates 0)")
    args = ap.parse_args()

    from twin.sim.cluster import Cluster
    from twin.policy.block import Block
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    from twin.lab.machine import describe, machine

    print(f"machine: {describe()}")
    print(f"{args.instances} instances, {args.requests} requests at {args.rate} req/s (bench-16xh100, ShareGPT lengths)")
    print(f"{'objective':10s} {'cands':>5s} {'fcasts':>6s} {'decisions':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s} "
          f"{'mean ms':>8s} {'forks/dec':>9s} {'fork steps p50':>14s} {'run wall s':>10s}")
    rows = [(c, 0) for c in (int(c) for c in args.candidates.split(","))]
    rows += [(0, k) for k in (int(k) for k in args.forecasts.split(",")) if k]
    for objective in args.objectives.split(","):
        for cands, fcasts in rows:
            sc = load_scenario(ROOT / "scenarios" / "bench-16xh100.yaml", [
                f"cluster.num_instances={args.instances}", f"workload.num_requests={args.requests}",
                f"workload.arrival.rate={args.rate}", "sim.timeline_interval_s=0"])
            stream = build_stream(sc)
            times: list[int] = []
            steps: list[int] = []

            class Timed(Block):
                def choose(self, req, fleet):
                    t0 = time.perf_counter_ns()
                    out = super().choose(req, fleet)
                    times.append(time.perf_counter_ns() - t0)
                    return out

            router = Timed(objective=objective, max_candidates=cands, max_forecasts=fcasts)
            cl = Cluster(sc, stream, router=router)
            orig = cl.dispatcher.fleet.forecaster.forecast

            def counted(*a, **k):
                fc = orig(*a, **k)
                steps.append(fc.steps)
                return fc

            fc = cl.dispatcher.fleet.forecaster
            fc.forecast = counted
            t0 = time.perf_counter()
            cl.run()
            wall = time.perf_counter() - t0
            t = np.array(times) / 1e6
            forks = (fc.calls - getattr(fc, "cut_short", 0)) / max(1, len(t))
            print(f"{objective:10s} {cands or args.instances:5d} {fcasts or cands or args.instances:6d} {len(t):9d} "
                  f"{np.percentile(t, 50):8.2f} {np.percentile(t, 99):8.2f} {t.max():8.2f} {t.mean():8.2f} {forks:9.1f} "
                  f"{int(np.median(steps)):14d} {wall:10.1f}")
            print(f"{'':10s} load average after this row: {machine()['loadavg']}")


if __name__ == "__main__":
    main()
