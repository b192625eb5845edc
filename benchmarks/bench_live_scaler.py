#!/usr/bin/env python
"""Decision cost of the live controller's `twin` scaler: its look-ahead (`live.shadow.ShadowFleetForecaster`) on a
shadow window at the predicted rate, with each size's run stopped once its side of the target is known (as the
scaler asks it, `target=`), against every size run to its end (no target; the rule before 2026-12-07).

A window of `--requests` requests (the shadow's cap is 2,000) over `--window` seconds, arriving uniformly, with
ShareGPT-like lengths drawn here (prompts log-normal around 250 tokens, outputs around 200, capped: an ASSUMPTION
of the bench, not a trace), on `--workers` serving H100s with Llama-3-8B (the roofline's default profile), vLLM
0.32's defaults. A decision forecasts the sizes the scaler's outward search would (N, then down or up, at most 3);
the bench times that sequence both ways, alternating, `--repeat` times, and prints the wall time, each size's
attainment (a bound when stopped) and whether the choice is the same. No assertions.

  .venv/bin/python benchmarks/bench_live_scaler.py [--workers 4] [--rate 60] [--requests 2000] [--horizon 60]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=60.0, help="the predicted rate, req/s")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--horizon", type=float, default=60.0)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--ttft", type=float, default=1.0, help="SLO: TTFT bound, s")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from live.config import parse_config
    from live.shadow import ShadowFleetForecaster, Slot, WindowLoad, base_engine
    from twin.policy.views import InstanceConfig
    from twin.scenario import SLOSpec

    cfg = parse_config({"workers": [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(args.workers)],
                        "shadow": {"enabled": True, "hardware": "H100", "model": "llama-3-8b",
                                   "alternatives": False}})
    wcfg = InstanceConfig(num_gpu_blocks=0, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                          max_model_len=8192)
    eng = base_engine(cfg, wcfg)
    rng = np.random.default_rng(0)
    n = args.requests
    window = args.requests / args.rate
    load = WindowLoad(np.sort(rng.uniform(0, window, n)),
                      np.clip(rng.lognormal(np.log(250), 1.0, n), 4, 4000).astype(np.int64),
                      np.clip(rng.lognormal(np.log(200), 0.8, n), 1, 2000).astype(np.int64), window)
    slots = [Slot(f"w{i}") for i in range(args.workers)]
    slo = SLOSpec(ttft_s=args.ttft)

    def decide(target: float | None) -> tuple[float, dict, int]:
        f = ShadowFleetForecaster(cfg, eng, load, {}, 2000, slots)
        tried: dict[int, float] = {}

        def meets(c: int) -> bool:
            tried[c] = f.attainment(c, args.horizon, args.rate, slo, target=target)
            return tried[c] >= args.target

        t0 = time.perf_counter()
        w = args.workers
        if meets(w):
            choice = w
            if w > 1 and meets(w - 1):
                choice = w - 1
        else:
            choice = next((c for c in (w + 1, w + 2) if meets(c)), w + 2)
        return time.perf_counter() - t0, tried, choice

    print(f"{platform.node()} {platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.2f}; "
          f"{args.workers} x H100 Llama-3-8B, {n} requests at {args.rate:g} req/s, horizon {args.horizon:g} s, "
          f"SLO TTFT {args.ttft:g} s, target {args.target:g}")
    walls: dict[str, list[float]] = {"stopped early": [], "to the end": []}
    for _ in range(args.repeat):
        for label, target in (("stopped early", args.target), ("to the end", None)):
            wall, tried, choice = decide(target)
            walls[label].append(wall)
            att = ", ".join(f"{k}: {v:.3f}" for k, v in sorted(tried.items()))
            print(f"  {label:14s} {wall:6.2f} s  choice {choice}  attainment {{{att}}}")
    for label, w in walls.items():
        print(f"{label:14s} decision wall s: min {min(w):.2f}, median {float(np.median(w)):.2f}, max {max(w):.2f}")


if __name__ == "__main__":
    main()
