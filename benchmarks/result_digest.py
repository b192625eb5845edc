#!/usr/bin/env python
"""Are a speed change's results the same to the bit? One line per scenario: a hash of every request's arrival,
first token, finish and output length, and the engines' step count, ITL sum and count, KV block-seconds and busy
time, printed to full precision.

  .venv/bin/python benchmarks/result_digest.py                 # this tree (pure Python)
  .venv-fast/bin/python benchmarks/result_digest.py            # this tree, the compiled build
  .venv/bin/python benchmarks/result_digest.py --rev 45b6a98   # this tree against a git revision (pure Python)

The scenarios reach the paths a speed change touches: served and overloaded async load, the synchronous engine,
the roofline at TP 1 and at TP 8 (where a decode step's GPU time is below the CPU time async scheduling hides),
a closed loop, the prefix-heavy Mooncake replay on 4 instances and 1 (block keys as runs), and the cache-aware
router on a trace with prompt texts and no hash ids (its prefixes made from the texts). With `--rev` the
revision is checked out in a temporary git worktree and digested in its own process, its source ahead of any
installed build; the lines are compared and the first difference named. Both trees run with PYTHONHASHSEED=0.
Prints, and exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES: list[tuple[str, list[str]]] = [  # a "+texts" override: the stream gets prompt texts and loses its hash ids
    ("scenarios/bench-16xh100.yaml", ["workload.arrival.rate=80", "workload.num_requests=4000"]),
    ("scenarios/bench-16xh100.yaml", ["workload.num_requests=4000"]),
    ("scenarios/quickstart.yaml", []),
    ("scenarios/bench-16xh100.yaml", ["workload.num_requests=3000", "cluster.perf.kind=roofline"]),
    ("scenarios/bench-16xh100.yaml", ["workload.num_requests=2000", "cluster.engine.async_scheduling=false"]),
    ("scenarios/bench-16xh100.yaml", ["workload.num_requests=3000", "cluster.perf.kind=roofline",
                                      "cluster.tensor_parallel=8", "workload.arrival.rate=40"]),
    ("scenarios/closed-loop.yaml", ["cluster.tensor_parallel=4"]),
    ("scenarios/mooncake-replay.yaml", []),
    ("scenarios/mooncake-replay.yaml", ["cluster.num_instances=1"]),
    ("scenarios/quickstart.yaml", ["router.name=cache-aware", "+texts"]),
]
TEXTS = "+texts"


def with_texts(stream: object) -> None:
    """Prompt texts over 20 shared documents (a fixed seed), about 4 characters a prompt token, and no hash ids:
    what a text-only trace gives the twin (`with_text_prefixes` then makes the prefixes from the texts)."""
    import numpy as np

    rng = np.random.default_rng(0)
    docs = ["".join(chr(97 + x) for x in rng.integers(0, 26, 16_000)) for _ in range(20)]
    prompts = stream.prompt_tokens  # type: ignore[attr-defined]
    texts = []
    for i in range(len(prompts)):
        n = 4 * int(prompts[i])
        q = f" Question {i}."
        texts.append(docs[i % 20][:max(n - len(q), 0)] + q)
    stream.texts = texts  # type: ignore[attr-defined]
    stream.hash_ids = None  # type: ignore[attr-defined]


def digest_lines(root: Path) -> list[str]:
    """The digest of each case, run on the `twin` this process imports; scenario paths under `root`."""
    import numpy as np

    from twin.scenario import load_scenario
    from twin.sim.cluster import Cluster
    from twin.workload import build_stream

    lines = []
    for path, over in CASES:
        sc = load_scenario(root / path, [o for o in over if o != TEXTS])
        stream = build_stream(sc)
        if TEXTS in over:
            with_texts(stream)
        cl = Cluster(sc, stream)
        cl.run()
        h = hashlib.sha1()
        for name in ("arrival_s", "first_token_s", "finish_s", "output_tokens"):
            h.update(np.ascontiguousarray(getattr(cl.log, name)).tobytes())
        stats = [i.scheduler.stats for i in cl.instances]
        itl = [s.itl.arrays() for s in stats]
        lines.append(" ".join([
            path, ",".join(over) or "-", h.hexdigest()[:16],
            f"steps={sum(s.num_steps for s in stats)}",
            f"itl_sum={sum(float((v * w).sum()) for v, w in itl)!r}",
            f"itl_n={sum(int(w.sum()) for v, w in itl)}",
            f"kv_block_s={sum(s.kv_used_block_seconds for s in stats)!r}",
            f"busy_s={sum(s.busy_time_s for s in stats)!r}"]))
    return lines


def _child_lines(root: str, env: dict[str, str], what: str) -> list[str]:
    """The digest lines of the tree at `root`, in a process of this interpreter with str hashing fixed
    (PYTHONHASHSEED=0), so a revision whose results followed the salted hash still compares with this one;
    `tests/test_reproducible.py` checks that today's results do not."""
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", root],
                         env={**os.environ, **env, "PYTHONHASHSEED": "0"}, capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    if run.returncode:
        sys.exit(f"result_digest: {what} failed: {run.stderr.strip().splitlines()[-1] if run.stderr else run.returncode}")
    return run.stdout.strip().splitlines()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", help="compare with this git revision (pure Python, in a temporary worktree)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the tree to digest, in a subprocess
    args = ap.parse_args()
    if args.child:
        print("\n".join(digest_lines(Path(args.child))))
        return 0
    import twin.sim.cluster

    build = "pure Python" if twin.sim.cluster.__file__.endswith(".py") else "compiled"
    mine = _child_lines(str(ROOT), {}, "this tree")
    print(f"this tree ({build}):")
    print("\n".join("  " + line for line in mine))
    if not args.rev:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "rev"
        out = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(wt), args.rev],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"result_digest: cannot check out {args.rev!r}: {out.stderr.strip()}")
        try:
            theirs = _child_lines(str(wt), {"PYTHONPATH": str(wt)}, args.rev)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], capture_output=True)
    print(f"{args.rev} (pure Python):")
    print("\n".join("  " + line for line in theirs))
    for a, b in zip(mine, theirs):
        if a != b:
            print(f"DIFFERENT: {a.split(' ')[0]} {a.split(' ')[1]}")
            return 1
    if len(mine) != len(theirs):
        print("DIFFERENT: the revision gave a different number of lines")
        return 1
    print(f"identical: {len(mine)} scenarios")
    return 0


if __name__ == "__main__":
    sys.exit(main())
