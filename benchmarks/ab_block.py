#!/usr/bin/env python
"""Block's decision latency, this tree against a git revision, in one process, and whether every decision is the same.

One simulation (bench-16xh100 with ShareGPT lengths, this tree's engine) is driven by this tree's Block router.
At every decision the revision's Block (its `twin/policy/block.py`, and its look-ahead: `twin/sim/forecaster.py`'s
`SimForecaster` over its `twin/engine/fork.py`, read with `git show` and loaded beside this tree's) decides too,
on the same fleet at the same instant, with its own random stream seeded alike; the two alternate which goes
first, so the machine's load (this project's shared 2-core boxes move figures by 2x within minutes) hits both
alike. Prints p50/p99/mean of each and the number of decisions that differ (0 for a pure speed change). The
revision's code runs on this tree's engine, so it must fork this tree's scheduler fields. No assertions.

  .venv/bin/python benchmarks/ab_block.py --rev main --instances 16 --requests 1500 --objective ttft
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from revision import load_rev  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="main")
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=120.0)
    ap.add_argument("--objective", default="ttft")
    ap.add_argument("--candidates", type=int, default=0)
    ap.add_argument("--params", default="", help="extra Block params for this tree's router, k=v,k=v (ints/floats)")
    args = ap.parse_args()

    from twin.lab.machine import describe, machine
    from twin.policy.block import Block
    from twin.scenario import load_scenario
    from twin.sim.cluster import Cluster
    from twin.workload import build_stream

    extra = {}
    for kv in filter(None, args.params.split(",")):
        k, v = kv.split("=")
        extra[k] = int(v) if v.lstrip("-").isdigit() else float(v) if v.replace(".", "", 1).isdigit() else v

    tmp = Path(tempfile.mkdtemp(prefix="ab_block_"))
    rev_fork = load_rev(args.rev, "twin/engine/fork.py", "_rev_fork", tmp)
    rev_fc = load_rev(args.rev, "twin/sim/forecaster.py", "_rev_forecaster", tmp, {"twin.engine.fork": rev_fork})
    rev_block = load_rev(args.rev, "twin/policy/block.py", "_rev_block", tmp)

    sc = load_scenario(ROOT / "scenarios" / "bench-16xh100.yaml", [
        f"cluster.num_instances={args.instances}", f"workload.num_requests={args.requests}",
        f"workload.arrival.rate={args.rate}", "sim.timeline_interval_s=0"])
    stream = build_stream(sc)
    old = rev_block.Block(objective=args.objective, max_candidates=args.candidates)
    times = {"this": [], args.rev: []}
    differ = [0]
    clock = time.perf_counter_ns

    class Driver(Block):
        """This tree's Block, deciding; the revision's decides beside it on the same view."""

        n = 0
        old_fc = None

        def choose(self, req, fleet):
            if Driver.old_fc is None:
                Driver.old_fc = rev_fc.SimForecaster(fleet.forecaster._cluster)
            mine = fleet.forecaster
            Driver.n += 1
            for side in ((0, 1) if Driver.n % 2 else (1, 0)):
                if side == 0:
                    t0 = clock()
                    got = super().choose(req, fleet)
                    times["this"].append(clock() - t0)
                else:
                    fleet.forecaster = Driver.old_fc
                    try:
                        t0 = clock()
                        want = old.choose(req, fleet)
                        times[args.rev].append(clock() - t0)
                    finally:
                        fleet.forecaster = mine
            differ[0] += got != want
            return got

    print(f"machine: {describe()}")
    load0 = machine()["loadavg"]
    print(f"{args.instances} instances, {args.requests} requests at {args.rate} req/s (bench-16xh100, ShareGPT "
          f"lengths), objective {args.objective}, candidates {args.candidates or args.instances}; this tree "
          f"{extra or ''} vs {args.rev}, alternating per decision")
    t0 = time.perf_counter()
    Cluster(sc, stream, router=Driver(objective=args.objective, max_candidates=args.candidates, **extra)).run()
    print(f"{'tree':>10s} {'decisions':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'mean ms':>8s}")
    for k, v in times.items():
        t = np.array(v) / 1e6
        print(f"{k:>10s} {len(t):9d} {np.percentile(t, 50):8.3f} {np.percentile(t, 99):8.3f} {t.mean():8.3f}")
    a, b = np.array(times["this"]), np.array(times[args.rev])
    print(f"p50 ratio this/{args.rev}: {np.median(a) / np.median(b):.3f}; per-decision ratio median "
          f"{np.median(a / b):.3f}; decisions that differ: {differ[0]} of {len(a)}; wall {time.perf_counter() - t0:.0f} s; "
          f"load average {load0} at the start, {machine()['loadavg']} at the end")


if __name__ == "__main__":
    main()
