#!/usr/bin/env python
"""Does bounding Block's forecasts (`max_forecasts: k`) cost decision quality? Block in full, Block with k
forecasts, and round-robin, on the same arrivals, near saturation.

The claim notebook's setting (notebooks/claim_block.ipynb: `scenarios/block-llama2-7b.yaml`, Block `ttft` with
oracle lengths), on a larger fleet so that k < the candidates: `--instances` (16) x H100, offered rate
`--util` x the fleet's saturation throughput (`--sat-per-instance` req/s an instance: 24.0 / 4, the notebook's
4-instance figure, scaled). Prints per seed and the mean change against round-robin with a 95 % t-interval
over seeds (paired: the same arrivals), and how often, in the full run's own states, each bounded router
chooses what the full one chose.
No assertions.

  .venv/bin/python benchmarks/block_quality.py --seeds 3 --requests 2000 --k 4,6
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def ci95(x):
    x = np.asarray(x, dtype=float)
    return x.mean(), (T975.get(len(x) - 1, 1.96) * x.std(ddof=1) / np.sqrt(len(x)) if len(x) > 1 else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--util", type=float, default=1.05)
    ap.add_argument("--sat-per-instance", type=float, default=24.0 / 4)
    ap.add_argument("--k", default="4,6")
    ap.add_argument("--objective", default="ttft")
    ap.add_argument("--agree", action="store_true", help="also decide with each bounded router in the full run's "
                    "states and count agreements (about twice the full run's time)")
    args = ap.parse_args()

    from twin.lab.machine import describe, machine
    from twin.policy.block import Block
    from twin.scenario import load_scenario
    from twin.sim.cluster import Cluster
    from twin.sim.metrics import summarize
    from twin.workload import build_stream

    class Beside(Block):
        """The full Block; at each decision the bounded ones decide too, on the same view with its random state."""

        def __init__(self, ks, **params) -> None:
            super().__init__(**params)
            self.others = {k: Block(**params, max_forecasts=k) for k in ks}
            self.same = {k: 0 for k in ks}
            self.n = 0

        def choose(self, req, fleet):
            state = self._rng.getstate()
            got = super().choose(req, fleet)
            after = self._rng.getstate()
            self.n += 1
            for k, b in self.others.items():
                b._rng.setstate(state)
                self.same[k] += b.choose(req, fleet) == got
            self._rng.setstate(after)
            return got

    rate = round(args.util * args.sat_per_instance * args.instances, 2)
    ks = [int(k) for k in args.k.split(",") if k]
    print(f"machine: {describe()}")
    print(f"block-llama2-7b.yaml on {args.instances} instances, {args.requests} requests at {rate} req/s "
          f"({args.util} x {args.sat_per_instance * args.instances:.1f} req/s saturation), oracle lengths, "
          f"objective {args.objective}, seeds 0..{args.seeds - 1}")
    block = ["router.name=block", f"router.params.objective={args.objective}", "router.params.horizon_s=60"]
    variants = {"round-robin": ["router.name=round-robin", "router.params={}"], "block": block}
    for k in ks:
        variants[f"block k={k}"] = block + [f"router.params.max_forecasts={k}"]
    rows: dict[str, list] = {v: [] for v in variants}
    for seed in range(args.seeds):
        over = [f"cluster.num_instances={args.instances}", f"workload.num_requests={args.requests}",
                f"workload.arrival.rate={rate}", f"seed={seed}"]
        stream = build_stream(load_scenario(ROOT / "scenarios" / "block-llama2-7b.yaml", over))
        for label, router in variants.items():
            sc = load_scenario(ROOT / "scenarios" / "block-llama2-7b.yaml", over + router)
            t0 = time.perf_counter()
            kw = {}
            if label == "block" and args.agree:  # the full router, and beside it each bounded one deciding in the same state
                kw["router"] = Beside(ks, **sc.router.params)
            res = Cluster(sc, stream, **kw).run()
            s = summarize(res)
            ttft, e2e = s["ttft_s"], s["e2e_s"]
            rows[label].append((ttft["mean"], e2e["mean"], ttft["p99"]))
            same = "" if "router" not in kw else "; in its states the bounded choose alike in " + ", ".join(
                f"{v / kw['router'].n:.1%} (k={k})" for k, v in kw["router"].same.items())
            print(f"  seed {seed} {label:12s} TTFT mean {ttft['mean'] * 1e3:8.1f} ms p99 {ttft['p99'] * 1e3:8.1f}"
                  f" E2E mean {e2e['mean']:7.3f} s ({time.perf_counter() - t0:.0f} s){same}", flush=True)
    print(f"{'router':12s} {'TTFT mean ms':>12s} {'vs RR':>16s} {'E2E mean s':>10s} {'vs RR':>16s} {'vs full Block TTFT':>20s}")
    rr = np.array(rows["round-robin"])
    full = np.array(rows["block"])
    for label, r in rows.items():
        r = np.array(r)
        m, h = ci95(r[:, 0] / rr[:, 0] - 1)
        me, he = ci95(r[:, 1] / rr[:, 1] - 1)
        mb, hb = ci95(r[:, 0] / full[:, 0] - 1)
        print(f"{label:12s} {r[:, 0].mean() * 1e3:12.1f} {m:+8.1%} ±{h:6.1%} {r[:, 1].mean():10.3f} {me:+8.1%} ±{he:6.1%}"
              f" {mb:+12.1%} ±{hb:6.1%}")
    print(f"load average at the end: {machine()['loadavg']}")


if __name__ == "__main__":
    main()
