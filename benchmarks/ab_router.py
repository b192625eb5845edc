#!/usr/bin/env python
"""Router decision latency, this tree against a git revision, in one process: blocks of decisions alternate
between the two, on the same indexes, fleet and requests, so machine load (this project's shared 2-core boxes
move figures by 2x within minutes) hits both alike. Also says whether every decision was the same.

The revision's `twin/policy/prefix_routers.py`, `scorers.py` and `prefix_index.py` are read with `git show`
and loaded beside this tree's (its routers import its scorers; the rest of twin.policy is this tree's); its
index's `match` runs on this tree's index data, so a change to the index's layout needs a plain
bench_router.py run per tree instead. Population and fleet are
bench_router.py's. No assertions: figures only.

  .venv/bin/python benchmarks/ab_router.py --rev main --sizes 16,256 --routers lmetric,weighted
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_router as B  # noqa: E402
from revision import load_rev  # noqa: E402
import twin.policy.prefix_routers as NEW  # noqa: E402

CLASSES = {"lmetric": "LMetric", "weighted": "Weighted", "kv-cost": "KVCost", "cache-aware": "CacheAware"}


class RevIndex:
    """This tree's index answering `match` with the revision's code: its `_Chains.match` (which its index
    classes' `match` called) on this tree's chains; the wrapper stands for the revision's index method."""

    def __init__(self, idx, rev_index_module) -> None:
        self.idx = idx
        self.kind = idx.kind
        self._match = rev_index_module._Chains.match

    def match(self, prefix, ids):
        return self._match(self.idx._chains, prefix, ids)

    def __getattr__(self, a):
        return getattr(self.idx, a)


class SameIndex(RevIndex):
    """This tree's index through its own `match`, behind the same wrapper layer."""

    def __init__(self, idx) -> None:
        self.idx = idx
        self.kind = idx.kind
        self._match = type(idx).match

    def match(self, prefix, ids):
        return self._match(self.idx, prefix, ids)


def timed(router, fleet, reqs):
    us, chosen = [], []
    choose, clock = router.choose, time.perf_counter_ns
    gc.disable()
    try:
        for r in reqs:
            t0 = clock()
            chosen.append(choose(r, fleet))
            us.append((clock() - t0) / 1000.0)
    finally:
        gc.enable()
    return us, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="git revision to compare against (default HEAD)")
    ap.add_argument("--sizes", default="16,256")
    ap.add_argument("--routers", default="lmetric,weighted", help=f"from {', '.join(CLASSES)}")
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--block", type=int, default=300, help="decisions per block; the first block is warm-up")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = [n for n in args.routers.split(",") if n]
    bad = [n for n in names if n not in CLASSES]
    if bad:
        raise SystemExit(f"ab_router: unknown router(s) {', '.join(bad)} (known: {', '.join(CLASSES)})")
    with tempfile.TemporaryDirectory() as tmp:
        scorers = sys.modules["twin.policy.scorers"]
        sys.modules["twin.policy.scorers"] = load_rev(args.rev, "twin/policy/scorers.py", "rev_scorers", Path(tmp))
        try:  # the revision's routers bind the revision's scorers
            old = load_rev(args.rev, "twin/policy/prefix_routers.py", "rev_prefix_routers", Path(tmp))
        finally:
            sys.modules["twin.policy.scorers"] = scorers
        old_index = load_rev(args.rev, "twin/policy/prefix_index.py", "rev_prefix_index", Path(tmp))
    print(f"machine: {B.machine_info()}; this tree against {args.rev}")
    rng = random.Random(args.seed)
    prefixes, weights = B.population(rng, 4000, 40)
    for n in (int(s) for s in args.sizes.split(",") if s):
        ids, approx, precise = B.build_indexes(prefixes, weights, n, 12000, random.Random(args.seed + 1))
        reqs = B.requests(prefixes, weights, args.decisions + args.block, random.Random(args.seed + 2))
        for kind, idx in (("approximate", approx), ("precise", precise)):
            for name in names:
                sides = {"rev": (getattr(old, CLASSES[name])(seed=args.seed),
                                 B.fleet_for(ids, RevIndex(idx, old_index), random.Random(args.seed + 3))),
                         "tree": (getattr(NEW, CLASSES[name])(seed=args.seed),
                                  B.fleet_for(ids, SameIndex(idx), random.Random(args.seed + 3)))}
                us = {"rev": [], "tree": []}
                chosen = {"rev": [], "tree": []}
                ratios = []  # tree p50 / rev p50, block by block: both sides under the same load
                for b, at in enumerate(range(0, len(reqs), args.block)):
                    p50 = {}
                    for side in (("rev", "tree") if b % 2 == 0 else ("tree", "rev")):
                        t, c = timed(*sides[side], reqs[at:at + args.block])
                        chosen[side] += c
                        if b:
                            us[side] += t
                            p50[side] = B.pct(t, 0.5)
                    if b:
                        ratios.append(p50["tree"] / p50["rev"])
                row = [f"{n:4d} {kind:11s} {name:11s}"]
                for side in ("rev", "tree"):
                    xs = us[side]
                    row.append(f"{side} p50 {B.pct(xs, 0.5):7.1f} p99 {B.pct(xs, 0.99):7.1f} max {max(xs):8.1f} us")
                row.append(f"tree/rev p50 per block: median {B.pct(ratios, 0.5):.3f}")
                row.append(f"same decisions: {chosen['rev'] == chosen['tree']}")
                print(" | ".join(row))
    print(f"machine at the end: {B.machine_info()}")


if __name__ == "__main__":
    main()
