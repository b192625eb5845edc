#!/usr/bin/env python
"""How tight Block's lower bounds are, and that they hold, on whole scenarios: at every decision, every candidate's
`finish_bound` (objective `e2e`) or `first_token_bound` (`ttft`) against its fork's own forecast run to the end.

Prints, per configuration, the candidates checked, the bound's violations (a bound above the forecast: a bug that
could change Block's choice; 0 expected) and the slack (forecast - bound) / forecast at its median and 90th
percentile: the smaller, the more forks a decision skips. No assertions: figures only (the suite's
tests/test_block_prune.py asserts the bounds on small loads).

  .venv/bin/python benchmarks/block_bounds.py [--objective e2e] [--requests 600] [bench120 bench160 ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    "bench120": ("bench-16xh100.yaml", ["workload.arrival.rate=120"]),
    "bench160": ("bench-16xh100.yaml", ["workload.arrival.rate=160"]),
    "bench-lpt": ("bench-16xh100.yaml", ["workload.arrival.rate=140", "cluster.engine.long_prefill_token_threshold=256"]),
    "bench-sync": ("bench-16xh100.yaml", ["workload.arrival.rate=120", "cluster.engine.async_scheduling=false"]),
    "bench-nochunk": ("bench-16xh100.yaml", ["workload.arrival.rate=120", "cluster.engine.enable_chunked_prefill=false"]),
    "bench-roofline": ("bench-16xh100.yaml", ["workload.arrival.rate=150", "cluster.perf.kind=roofline"]),
    "bench-moe": ("bench-16xh100.yaml", ["workload.arrival.rate=60", "cluster.model=Qwen3-30B-A3B", "cluster.dtype=bf16"]),
    "quickstart": ("quickstart.yaml", ["workload.arrival.rate=60"]),
    "mooncake": ("mooncake-replay.yaml", []),  # a trace: --requests caps it
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=list(CONFIGS), help=", ".join(CONFIGS))
    ap.add_argument("--objective", choices=("e2e", "ttft"), default="e2e")
    ap.add_argument("--requests", type=int, default=600)
    args = ap.parse_args()

    from twin.lab.machine import describe
    from twin.policy.block import Block
    from twin.scenario import load_scenario
    from twin.sim.cluster import Cluster
    from twin.workload import build_stream

    print(f"machine: {describe()}")
    print(f"objective {args.objective}, {args.requests} requests a configuration, the default step model unless named")
    print(f"{'configuration':16s} {'checks':>7s} {'violations':>10s} {'slack p50':>10s} {'slack p90':>10s}")
    for name in args.configs:
        f, over = CONFIGS[name]
        cap = [f"workload.trace.max_requests={args.requests}"] if name == "mooncake" else [
            f"workload.num_requests={args.requests}"]
        sc = load_scenario(ROOT / "scenarios" / f, over + cap + ["sim.timeline_interval_s=0"])
        stream = build_stream(sc)
        slack: list[float] = []
        bad = [0]
        until = "finish" if args.objective == "e2e" else "first_token"

        class Check(Block):
            def choose(self, req, fleet):
                fc = fleet.forecaster
                now, shift = fc._cluster.env.now, fc._cluster.api_token_s()
                for v in fleet.instances:
                    b = (fc.finish_bound if until == "finish" else fc.first_token_bound)(v.id, req)
                    got = fc.forecast(v.id, req, None, until)  # no horizon: run to the end
                    x = got.e2e_s if until == "finish" else got.ttft_s
                    if x is None:
                        continue
                    t = x + now - shift
                    bad[0] += t < b
                    slack.append((t - b) / max(1e-9, t - now))
                return super().choose(req, fleet)

        Cluster(sc, stream, router=Check(objective=args.objective)).run()
        print(f"{name:16s} {len(slack):7d} {bad[0]:10d} {np.median(slack):10.4f} {np.percentile(slack, 90):10.4f}",
              flush=True)


if __name__ == "__main__":
    main()
