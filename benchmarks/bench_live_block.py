#!/usr/bin/env python
"""Decision latency of the Block router in the live controller (`live.shadow.ShadowInstanceForecaster`): each
decision simulates one twin instance per candidate worker, rebuilt from the controller's mirror of what is in flight
there, on the controller's routing thread (`Controller.choose`) while the event loop goes on relaying streams.

A controller with `--workers` serving workers (H100 / Llama-3-8B engine settings, the default fitted profile), a
mirrored last window of 600 finished requests and `--inflight` requests in flight on each worker (prompts 100-1,500
tokens, outputs 50-400: lengths drawn here, an ASSUMPTION of the bench), then `--decisions` Block decisions
(`objective: e2e`), each request dispatched where Block sends it. No HTTP: the router and forecaster are called as the
proxy calls them. Prints p50 / p90 / max per decision and per forecast, and how many scenarios the forecaster holds
(one per engine setting), and how late the event loop ran meanwhile: a ticker sleeping 1 ms at a time records
how much later than asked it woke (what a streamed chunk waits for the loop). `--on-loop` calls the router on the
loop, as the proxy did until 2026-12-07. No assertions.

  .venv/bin/python benchmarks/bench_live_block.py [--workers 16] [--inflight 20] [--decisions 40] [--max-candidates 8]
      [--on-loop]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=20)
    ap.add_argument("--decisions", type=int, default=40)
    ap.add_argument("--objective", default="e2e")
    ap.add_argument("--max-candidates", type=int, default=0, help="Block's max_candidates (0: every worker)")
    ap.add_argument("--on-loop", action="store_true", help="decide on the event loop (the proxy before 2026-12-07)")
    args = ap.parse_args()
    print(f"{platform.node()} {platform.machine()}, load {os.getloadavg()[0]:.2f}; {args.workers} workers, "
          f"{args.inflight} in flight each, Block objective {args.objective}, max_candidates {args.max_candidates}, "
          f"deciding {'on the event loop' if args.on_loop else 'on the routing thread'}")
    print(asyncio.run(run(args)))


async def run(args) -> str:
    from live.config import parse_config
    from live.controller import Controller
    from live.registry import Worker
    from twin.policy.views import InstanceConfig, RequestView

    n = args.workers
    cfg = parse_config({"workers": [{"url": "http://127.0.0.1:1"}],
                        "router": {"name": "block", "params": {"objective": args.objective,
                                                               "max_candidates": args.max_candidates}},
                        "shadow": {"enabled": True, "hardware": "H100", "model": "llama-3-8b", "interval_s": 10.0}})
    wcfg = InstanceConfig(num_gpu_blocks=30000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                          max_model_len=8192)
    ctl = Controller(cfg)
    for i in range(n):
        w = Worker(f"w{i}", f"http://127.0.0.1:{9000 + i}", state="starting")
        w.config = wcfg
        ctl.add_worker(w)
        ctl.registry.set_state(w, "serving", 0.0)
    rng = np.random.default_rng(0)
    now = time.monotonic()
    for i in range(600):  # the last window: finished requests
        t = now - 10.0 + i / 60.0
        req = RequestView(f"d{i}", t, int(rng.integers(100, 1500)), 400, (), 16)
        ctl.dispatched(req, f"w{i % n}", t)
        ctl.first_token(req, f"w{i % n}", t + 0.05)
        ctl.finished(req, f"w{i % n}", t + 3.0, int(rng.integers(50, 400)))
    for k in range(n * args.inflight):  # in flight now, decoding
        t = now - float(rng.uniform(0.0, 3.0))
        req = RequestView(f"f{k}", t, int(rng.integers(100, 1500)), 400, (), 16)
        ctl.dispatched(req, f"w{k % n}", t)
        ctl.first_token(req, f"w{k % n}", t + 0.05)
    fc = ctl.registry.fleet.forecaster
    import gc

    import twin.sim.cluster  # noqa: F401  (a forecast's first import)

    gc.freeze()  # as `llmtwin live` does at start: the collector's full passes skip what lives as long as it
    walls, calls, lags = [], [], []
    done = asyncio.Event()

    async def ticker() -> None:  # what a stream relayed meanwhile waits for the loop
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    for d in range(args.decisions):
        req = RequestView(f"p{d}", time.monotonic(), int(rng.integers(100, 1500)), 400, (), 16)
        async with ctl.routing():  # as the proxy routes (live.proxy)
            fleet = ctl.registry.fleet_view(time.monotonic())
            c0 = fc.calls
            t0 = time.perf_counter()
            target = ctl.host.choose(req, fleet) if args.on_loop else await ctl.choose(req, fleet)
            walls.append(time.perf_counter() - t0)
            calls.append(fc.calls - c0)
            ctl.dispatched(req, target, time.monotonic())
        ctl.first_token(req, target, time.monotonic())
        for _ in range(2):  # the next request is another task of the proxy's: the loop runs due timers between
            await asyncio.sleep(0)
    done.set()
    await tick
    await ctl.stop()
    w = np.array(walls) * 1e3
    per = w / np.maximum(calls, 1)
    lag = np.array(lags) * 1e3
    return (f"decision ms: p50 {np.median(w):.1f}, p90 {np.percentile(w, 90):.1f}, max {w.max():.1f}; "
            f"per forecast ms: p50 {np.median(per):.2f}; forecasts per decision {np.mean(calls):.1f}; "
            f"scenarios held {len(getattr(fc, '_scenarios', {}))}\n"
            f"event loop late by ms: p50 {np.median(lag):.2f}, p99 {np.percentile(lag, 99):.1f}, max {lag.max():.1f} "
            f"({len(lag)} ticks)")


if __name__ == "__main__":
    main()
