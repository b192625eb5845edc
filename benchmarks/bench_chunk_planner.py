#!/usr/bin/env python
"""Chunk planners in and out of sample: plan on the first part of a trace, apply the pick to the rest.

For each Azure LLM 2023 trace (conversation, code; the heads in /work/shared/traces/azure_llm_2023, or the
1,000-row samples in traces/ with --samples), on one H100 with Llama-3.1-8B and vLLM's defaults otherwise:
the first `--split` of the requests is the planning window, the rest the held-out window. Every candidate chunk
is run on both with the twin, so any pick's goodput is known on each. Planners:

- `offline`: `ChunkPlanner` on the whole planning window (highest goodput, ties within 1 % to the smaller chunk).
- `robust`: `RobustChunkPlanner` on the planning window's last `--recent` fraction, moving-block bootstrap
  (`--blocks`, `--resamples`), vLLM's default kept unless a chunk beats it by 2 % on 80 % of the resamples.

Gain = the pick's goodput / the default's - 1, in sample (planning window) and out of sample (held-out window).
Prints the table, writes chunk_planner.csv (+ the per-chunk tables) and chunk_planner.png to --out.

  .venv/bin/python benchmarks/bench_chunk_planner.py [--rate-scale conv=3,code=3] [--out /tmp/chunk-bench]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path("/work/shared/traces/azure_llm_2023")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default="conv,code")
    ap.add_argument("--rate-scale", default="conv=3,code=3", help="replay each trace k times as fast")
    ap.add_argument("--split", type=float, default=0.5)
    ap.add_argument("--recent", type=float, default=0.5, help="fraction of the planning window the robust planner uses")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--resamples", type=int, default=8)
    ap.add_argument("--ttft", type=float, default=2.0)
    ap.add_argument("--tpot", type=float, default=0.03)
    ap.add_argument("--samples", action="store_true", help="the 1,000-row samples in traces/ instead of the heads")
    ap.add_argument("--out", type=Path, default=Path("/tmp/chunk-bench"))
    args = ap.parse_args()

    import pandas as pd

    from twin.engine.defaults import batch_defaults
    from twin.specs.hardware import get_gpu
    from twin.analysis.planning import plan_frame, slo_of, twin_evaluator
    from twin.policy.chunk import DEFAULT_CHUNKS, ChunkPlanner, EngineKnobs, WorkloadWindow
    from twin.policy.robust_chunk import RobustChunkPlanner
    from twin.scenario import parse_scenario
    from twin.workload import build_stream

    scales = dict(kv.split("=") for kv in args.rate_scale.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, load {load[0]:.1f}/{load[1]:.1f}, "
          f"Python {platform.python_version()}")
    rows, curves = [], []
    for kind in args.traces.split(","):
        path = (ROOT / "traces" / f"azure_{kind}.sample.csv" if args.samples
                else SHARED / f"AzureLLMInferenceTrace_{kind}.head.csv")
        raw = {"name": f"azure-{kind}", "seed": 0,
               "cluster": {"num_instances": 1, "hardware": "H100-SXM-80GB", "model": "Llama-3.1-8B",
                           "dtype": "bf16", "tensor_parallel": 1, "engine": {"enable_prefix_caching": True}},
               "workload": {"trace": {"path": str(path), "format": "azure", "rate_scale": float(scales[kind])},
                            "on_too_long": "reject"},
               "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot}, "sim": {"timeline_interval_s": 0}}
        sc = parse_scenario(raw, f"azure-{kind}", str(ROOT))
        slo = slo_of(sc)
        st = build_stream(sc)
        default = EngineKnobs(batch_defaults(get_gpu(sc.cluster.hardware))[0])
        n = len(st)
        h = int(n * args.split)

        def part(lo: int, hi: int) -> WorkloadWindow:
            a = st.arrival_s[lo:hi]
            return WorkloadWindow(a - a[0], st.prompt_tokens[lo:hi], st.output_tokens[lo:hi])

        plan_w, held_w = part(0, h), part(h, n)
        ev = twin_evaluator(sc)
        t0 = time.perf_counter()
        offline = ChunkPlanner(ev, DEFAULT_CHUNKS)
        ins = {c.knobs.max_num_batched_tokens: c.goodput_req_s for c in offline.rank(plan_w, slo)}
        pick_off = next(c.knobs for c in offline.table if c.chosen)
        t1 = time.perf_counter()
        robust = RobustChunkPlanner(ev, default, DEFAULT_CHUNKS, recent_s=args.recent * plan_w.duration_s,
                                    blocks=args.blocks, resamples=args.resamples)
        pick_rob = robust.plan(plan_w, slo)
        t2 = time.perf_counter()
        held = ChunkPlanner(ev, DEFAULT_CHUNKS)
        held.rank(held_w, slo)
        oos = {c.knobs.max_num_batched_tokens: c.goodput_req_s for c in held.table}
        for name, table in (("planning", offline.table), ("held_out", held.table), ("robust_mean", robust.table)):
            f = plan_frame(table)
            f.insert(0, "window", name)
            f.insert(0, "trace", kind)
            curves.append(f)
        d = default.max_num_batched_tokens
        print(f"\n{kind}: {n} requests x{scales[kind]} ({plan_w.rate:.1f} req/s planning, {held_w.rate:.1f} held out), "
              f"SLO TTFT {args.ttft} s TPOT {args.tpot * 1e3:.0f} ms, default {d}; "
              f"wall: offline {t1 - t0:.0f} s, robust {t2 - t1:.0f} s")
        print("  chunk       " + " ".join(f"{c:>7d}" for c in sorted(ins)))
        print("  planning    " + " ".join(f"{ins[c]:7.2f}" for c in sorted(ins)))
        print("  held out    " + " ".join(f"{oos[c]:7.2f}" for c in sorted(oos)))
        print("  robust wins " + " ".join(f"{robust.wins.get(EngineKnobs(c), float('nan')):7.2f}" for c in sorted(ins)))
        for name, k, extra in (("offline", pick_off, ""),
                               ("robust", pick_rob, f"wins {robust.wins[pick_rob]:.2f}, median resample gain "
                                                    f"{robust.gains[pick_rob]:+.1%}")):
            c = k.max_num_batched_tokens
            g_in = ins[c] / ins[d] - 1 if ins[d] > 0 else float("nan")
            g_out = oos[c] / oos[d] - 1 if oos[d] > 0 else float("nan")
            rows.append({"trace": kind, "rate_scale": float(scales[kind]), "planner": name, "pick": c, "default": d,
                         "goodput_in": ins[c], "default_in": ins[d], "gain_in": g_in,
                         "goodput_out": oos[c], "default_out": oos[d], "gain_out": g_out,
                         "best_out": max(oos, key=oos.get), "note": extra})
    df = pd.DataFrame(rows)
    print()
    print(df.drop(columns=["note"]).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    df.to_csv(args.out / "chunk_planner.csv", index=False)
    pd.concat(curves).to_csv(args.out / "chunk_planner_tables.csv", index=False)
    plot(pd.concat(curves), df, args.out / "chunk_planner.png")
    print(f"\nwrote {args.out / 'chunk_planner.csv'}, chunk_planner_tables.csv, chunk_planner.png")


def plot(curves, picks, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(curves.trace))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4), squeeze=False)
    for ax, kind in zip(axes[0], traces):
        for win, style in (("planning", "o-"), ("held_out", "s--"), ("robust_mean", "^:")):
            g = curves[(curves.trace == kind) & (curves.window == win)].sort_values("max_num_batched_tokens")
            ax.plot(g.max_num_batched_tokens, g.goodput_req_s, style, label=win.replace("_", " "))
        for _, r in picks[picks.trace == kind].iterrows():
            ax.axvline(r.pick, color="red" if r.planner == "offline" else "green", lw=1, alpha=0.7,
                       label=f"{r.planner} pick {r.pick} ({r.gain_out:+.0%} held out)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_batched_tokens")
        ax.set_ylabel("goodput (req/s within SLO)")
        ax.set_title(f"Azure {kind} 2023")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
