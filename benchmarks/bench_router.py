#!/usr/bin/env python
"""Router decision latency (issue 7, section 4): p50 / p99 of one `choose` call, with realistic prefix state.

A Mooncake-like prefix population (thousands of chained prefixes of ~50-800 blocks sharing a few dozen
heads, Zipf popularity) is placed on the fleet, as the router would have placed it, in both prefix indexes:
an `ApproxPrefixIndex` (fed by dispatches) and a `PreciseIndex` (fed by the equivalent `BlockStored` events).
The fleet's views carry random gauges and books. Each router then decides for requests drawn from the same
population (plus a unique tail); every `choose` call is timed alone with `perf_counter_ns`.

Targets (issue 7): p50 <= 20 us at 16 instances and <= 200 us at 256 for `lmetric` and `weighted`.
No timed assertions: this prints figures, it never fails on them.

Usage (from the repository root):

  .venv/bin/python benchmarks/bench_router.py                       # 16 and 256 instances, both indexes
  .venv/bin/python benchmarks/bench_router.py --sizes 16 --decisions 5000 --csv benchmarks/results/router.csv
  .venv/bin/python benchmarks/bench_router.py --profile lmetric --sizes 256   # cProfile of one router
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import gc
import pstats
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from twin.policy import (ApproxPrefixIndex, BlockStored, Bookkeeping, FleetView, Gauges,  # noqa: E402
                         InstanceConfig, InstanceView, PreciseIndex, RequestView, make_router)

ROUTERS = [
    ("round-robin", {}),
    ("least-outstanding", {}),
    ("lmetric", {}),
    ("weighted", {}),
    ("kv-cost", {}),
    ("cache-aware", {}),
    ("session-affinity", {"inner": {"name": "lmetric"}}),
]
TARGET_US = {16: 20.0, 256: 200.0}


def machine_info() -> str:
    from twin.lab.machine import describe

    return describe()


def reference_loop_us(n: int) -> float:
    """p50 of one plain list comprehension over n views (`[v.load.requests for v in insts]`): the floor any
    router that looks at every instance pays, to scale the table to another (or a less busy) machine."""
    fleet = fleet_for([f"r{k}" for k in range(n)], None, random.Random(0))
    insts = fleet.instances
    ts = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        [v.load.requests for v in insts]
        ts.append((time.perf_counter_ns() - t0) / 1000.0)
    return pct(ts, 0.5)


def population(rng: random.Random, n_prefixes: int, n_heads: int) -> tuple[list[list[int]], list[float]]:
    """Chained prefixes of 50-800 blocks over shared heads (system prompts, documents), Zipf weights."""
    heads = []
    for k in range(n_heads):
        n = rng.randint(10, 400)
        heads.append([hash(("head", k, j)) for j in range(n)])
    prefixes = []
    for k in range(n_prefixes):
        h = heads[min(int(rng.paretovariate(1.0)) - 1, n_heads - 1)]  # a few heads carry most prefixes
        length = rng.randint(50, 800)
        cut = min(len(h), rng.randint(1, length))
        tail = [hash(("tail", k, j)) for j in range(length - cut)]
        prefixes.append(h[:cut] + tail)
    weights = [1.0 / (r + 1) ** 0.8 for r in range(n_prefixes)]
    return prefixes, weights


def build_indexes(prefixes, weights, n_inst: int, placements: int, rng: random.Random):
    """Both indexes holding the same placements (each a prefix sent to one instance)."""
    approx = ApproxPrefixIndex()  # llm-d-like LRU of 100k blocks per instance
    precise = PreciseIndex()
    ids = [f"inst-{k}" for k in range(n_inst)]
    home = {k: rng.sample(ids, min(len(ids), 1 + int(rng.expovariate(0.7)))) for k in range(len(prefixes))}
    picks = rng.choices(range(len(prefixes)), weights, k=placements)
    for k in picks:
        inst = rng.choice(home[k])
        p = prefixes[k]
        approx.on_dispatch(p, inst)
        precise.apply(inst, BlockStored(p))
    return ids, approx, precise


def fleet_for(ids, index, rng: random.Random) -> FleetView:
    books = Bookkeeping()
    views = []
    for i in ids:
        ld = books.load(i)
        ld.requests = rng.randint(0, 40)
        ld.prompt_tokens = rng.randint(0, 8) * 2000
        ld.decode_tokens = ld.requests * 3000
        g = Gauges(rng.randint(0, 32), rng.randint(0, 8), rng.random(), 0.0)
        views.append(InstanceView(i, "serving", g, InstanceConfig(50_000, 16, 256, 8192, 32768), ld, 0.0))
    return FleetView(10.0, views, books, index, all_instances=views)


def requests(prefixes, weights, n: int, rng: random.Random) -> list[RequestView]:
    out = []
    for k, pk in enumerate(rng.choices(range(len(prefixes)), weights, k=n)):
        p = prefixes[pk] + [hash(("q", k, j)) for j in range(rng.randint(0, 8))]
        out.append(RequestView(str(k), 10.0, len(p) * 16 + rng.randint(0, 15), None, tuple(p), 16,
                               f"s{rng.randrange(5000)}"))
    return out


def time_router(router, reqs, fleet, warmup: int) -> list[float]:
    choose = router.choose
    for r in reqs[:warmup]:
        choose(r, fleet)
    clock = time.perf_counter_ns
    out = []
    gc.disable()
    try:
        for r in reqs[warmup:]:
            t0 = clock()
            choose(r, fleet)
            out.append((clock() - t0) / 1000.0)
    finally:
        gc.enable()
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,256", help="fleet sizes (instances), comma-separated")
    ap.add_argument("--prefixes", type=int, default=4000, help="distinct prefixes in the population")
    ap.add_argument("--heads", type=int, default=40, help="shared heads the prefixes start from")
    ap.add_argument("--placements", type=int, default=12000, help="dispatches that fill the indexes")
    ap.add_argument("--decisions", type=int, default=3000, help="timed decisions per router and index")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--routers", default=None, help="names to run (default: all prefix-aware and two load-only)")
    ap.add_argument("--profile", default=None, help="cProfile this router (approximate index) instead of timing")
    ap.add_argument("--csv", default=None, help="also write the table as CSV here")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    routers = ROUTERS if not args.routers else [(n, p) for n, p in ROUTERS if n in args.routers.split(",")]
    if args.profile:
        routers = [(n, p) for n, p in ROUTERS if n == args.profile] or [(args.profile, {})]
    rng = random.Random(args.seed)
    prefixes, weights = population(rng, args.prefixes, args.heads)
    mean_len = sum(map(len, prefixes)) / len(prefixes)
    console.print(f"machine: {machine_info()}")
    console.print(f"population: {len(prefixes)} prefixes over {args.heads} heads, mean {mean_len:.0f} blocks; "
                  f"{args.placements} placements; {args.decisions} timed decisions per cell")
    rows = []
    for n_inst in sizes:
        t0 = time.perf_counter()
        ids, approx, precise = build_indexes(prefixes, weights, n_inst, args.placements, random.Random(args.seed + 1))
        reqs = requests(prefixes, weights, args.decisions + args.warmup, random.Random(args.seed + 2))
        console.print(f"{n_inst} instances: indexes built in {time.perf_counter() - t0:.1f} s "
                      f"({len(approx._holders)} distinct blocks held); reference loop over the instances "
                      f"{reference_loop_us(n_inst):.1f} us")
        for kind, index in (("approximate", approx), ("precise", precise)):
            fleet = fleet_for(ids, index, random.Random(args.seed + 3))
            for name, params in routers:
                router = make_router(name, seed=args.seed, **params)
                if args.profile:
                    if kind != "approximate":
                        continue
                    prof = cProfile.Profile()
                    prof.enable()
                    for r in reqs:
                        router.choose(r, fleet)
                    prof.disable()
                    console.print(f"[bold]{name}, {n_inst} instances, {kind} index[/bold]")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
                    continue
                us = time_router(router, reqs, fleet, args.warmup)
                rows.append({"instances": n_inst, "index": kind, "router": name,
                             "p50_us": pct(us, 0.5), "p99_us": pct(us, 0.99), "max_us": max(us),
                             "mean_us": sum(us) / len(us)})
    if args.profile:
        return
    table = Table(title="router decision latency (one choose call)")
    for col in ("instances", "index", "router", "p50 us", "p99 us", "max us", "mean us", "target p50"):
        table.add_column(col, justify="right" if col not in ("index", "router") else "left")
    for r in rows:
        target = TARGET_US.get(r["instances"]) if r["router"] in ("lmetric", "weighted") else None
        mark = "" if target is None else (f"<= {target:.0f} ok" if r["p50_us"] <= target else f"<= {target:.0f} MISS")
        table.add_row(str(r["instances"]), r["index"], r["router"], f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}",
                      f"{r['max_us']:.1f}", f"{r['mean_us']:.1f}", mark)
    console.print(table)
    console.print(f"machine at the end: {machine_info()}")
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        console.print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
