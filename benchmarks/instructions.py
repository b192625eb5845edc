#!/usr/bin/env python
"""Instructions per replay, counted by valgrind: a figure that does not move with the machine's speed.

Wall-clock figures on a shared or virtual machine drift (this project's 2-core guest: up to 2x within minutes),
so two builds compared by req/s need many alternating rounds. Instructions retired by one `Cluster.run` are the
same on every run (PYTHONHASHSEED fixed) and compare two trees in one pass each:

  .venv-fast/bin/python benchmarks/instructions.py                      # the compiled build
  .venv/bin/python benchmarks/instructions.py --set cluster.num_instances=1
  PYTHONPATH=/path/to/other/tree .venv/bin/python benchmarks/instructions.py   # another tree, pure Python

Counts `runs` replays after one warm-up: the compiled build under callgrind, only inside `Cluster.run`
(`--toggle-collect`); pure Python under cachegrind, the whole process with `runs` replays minus with none.
Needs valgrind. Prints numbers, never fails on them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import sys
from twin.sim.cluster import Cluster, trace_key_runs
from twin.scenario import load_scenario
from twin.workload import build_stream
n = int(sys.argv[1]); path = sys.argv[2]; over = sys.argv[3:]
sc = load_scenario(path, over)
stream = build_stream(sc)
trace_key_runs(stream)
if n:
    Cluster(sc, stream).run()  # warm-up: imports, first-call costs
for _ in range(n):
    Cluster(sc, stream).run()
"""


def refs(cmd: list[str], env: dict) -> int:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    m = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if out.returncode != 0 or m is None:
        sys.exit(f"valgrind failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return int(m.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", default=str(ROOT / "scenarios" / "mooncake-replay.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="a scenario override")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed: this benchmark counts instructions with it")
    import twin.sim.cluster

    compiled = not twin.sim.cluster.__file__.endswith(".py")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as d:
        child = Path(d) / "child.py"
        child.write_text(CHILD)
        base = [sys.executable, str(child)]
        tail = [args.scenario, *args.set]
        if compiled:  # only inside Cluster.run: the warm-up's share is one run in runs + 1
            total = refs(["valgrind", "--tool=callgrind", "--toggle-collect=CPyDef_cluster___Cluster___run",
                          f"--callgrind-out-file={d}/cg.out", *base, str(args.runs), *tail], env)
            per_run = total / (args.runs + 1)
        else:
            cg = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
            with_runs = refs([*cg, *base, str(args.runs), *tail], env)
            without = refs([*cg, *base, "0", *tail], env)
            per_run = (with_runs - without) / (args.runs + 1)
    build = "compiled" if compiled else "pure Python"
    print(f"{build}: {per_run / 1e6:,.1f} M instructions per Cluster.run ({Path(args.scenario).name}"
          f"{' ' + ' '.join(args.set) if args.set else ''}; {twin.sim.cluster.__file__})")


if __name__ == "__main__":
    main()
