#!/usr/bin/env python
"""Where a simulation's wall time goes: cProfile, pyinstrument and py-spy over one `Cluster.run`.

  .venv/bin/python benchmarks/profile_engine.py                       # bench-16xh100, 10k, all tools available
  .venv/bin/python benchmarks/profile_engine.py --tool cprofile --n 100000 --top 30
  .venv/bin/python benchmarks/profile_engine.py --scenario scenarios/bench-1xh100.yaml --mode step

Only the run is profiled (the workload is built and the Cluster constructed first, outside the profile).
cProfile is deterministic but adds a fixed cost to every Python call, so it over-weights small, often-called
functions; pyinstrument and py-spy sample the stack (every 1 ms here) and show truer shares.
pyinstrument and py-spy are optional: `.venv/bin/pip install pyinstrument py-spy` (not project dependencies).
py-spy needs ptrace (root, or CAP_SYS_PTRACE); it profiles this script in a child process.

Outputs go to --out (default benchmarks/results/profile/): run.prof (cProfile, for snakeviz / pstats),
pyinstrument.html, py-spy.svg (flame graph) and py-spy.txt (collapsed stacks).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIO = ROOT / "scenarios" / "bench-16xh100.yaml"


def build(args):
    from twin.sim.cluster import Cluster
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    overrides = [f"workload.num_requests={args.n}", f"sim.mode={args.mode}", *args.set]
    sc = load_scenario(args.scenario, overrides)
    stream = build_stream(sc)
    return Cluster(sc, stream)


def short(path: str) -> str:
    """A readable file name: relative to the repo, or from site-packages on, or the stdlib module."""
    p = str(path)
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in p:
            return p.split(marker, 1)[1]
    if p.startswith("<") or p == "~" or not Path(p).is_absolute():
        return p
    return "/".join(Path(p).parts[-2:])


def label(func: tuple) -> str:
    file, line, name = func
    if file == "~":  # builtins: ('~', 0, "<method 'append' of 'list' objects>")
        return name
    return f"{short(file)}:{line}({name})"


# ---------------------------------------------------------------------------------------------------
def run_cprofile(args, out: Path) -> None:
    cluster = build(args)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    result = cluster.run(lambda now, arrived: None)
    prof.disable()
    wall = time.perf_counter() - t0
    prof.dump_stats(out / "run.prof")
    st = pstats.Stats(prof, stream=io.StringIO())
    total = sum(v[2] for v in st.stats.values())  # sum of self times = profiled time
    n = len(cluster.stream)
    print(f"\n== cProfile: {n:,} requests, run {wall:.2f} s under the profiler "
          f"(profiled self time {total:.2f} s; simulated {result.sim_time_s:,.0f} s) ==")
    rows = [(func, cc, nc, tt, ct) for func, (cc, nc, tt, ct, _callers) in st.stats.items()]

    def table(key, title):
        print(f"\n-- top {args.top} by {title} --")
        print(f"{'share':>6} {'self s':>7} {'cum s':>7} {'calls':>11}  function")
        for func, cc, nc, tt, ct in sorted(rows, key=key, reverse=True)[:args.top]:
            share = (ct if title.startswith("cumulative") else tt) / total if total else 0.0
            calls = f"{nc:,}" if cc == nc else f"{nc:,}/{cc:,}"
            print(f"{share:6.1%} {tt:7.3f} {ct:7.3f} {calls:>11}  {label(func)}")

    table(lambda r: r[4], "cumulative time")
    table(lambda r: r[3], "self time")

    by_file = defaultdict(float)
    for func, cc, nc, tt, ct in rows:
        f = func[0]
        if f == "~":
            by_file["(builtins / C functions)"] += tt
        else:
            by_file[short(f)] += tt
    print("\n-- self time by file --")
    for f, tt in sorted(by_file.items(), key=lambda kv: kv[1], reverse=True)[:15]:
        print(f"{tt / total:6.1%} {tt:7.3f}  {f}")
    print(f"\nwrote {out / 'run.prof'} (view: .venv/bin/python -m pstats {out / 'run.prof'})")


# ---------------------------------------------------------------------------------------------------
def run_pyinstrument(args, out: Path) -> None:
    try:
        from pyinstrument import Profiler
    except ImportError:
        print("\n== pyinstrument: not installed (.venv/bin/pip install pyinstrument) ==")
        return
    cluster = build(args)
    prof = Profiler(interval=0.001)
    t0 = time.perf_counter()
    prof.start()
    cluster.run(lambda now, arrived: None)
    prof.stop()
    wall = time.perf_counter() - t0
    print(f"\n== pyinstrument (1 ms sampling): run {wall:.2f} s ==")
    text = prof.output_text(unicode=False, color=False, show_all=False)
    lines = text.splitlines()
    # the call tree, trimmed to the first lines (the full tree is in the HTML file)
    keep = [ln for ln in lines if ln.strip()][: args.tree_lines]
    print("\n".join(keep))
    (out / "pyinstrument.html").write_text(prof.output_html())
    (out / "pyinstrument.txt").write_text(text)
    print(f"\nwrote {out / 'pyinstrument.html'} and pyinstrument.txt")


# ---------------------------------------------------------------------------------------------------
def run_pyspy(args, out: Path) -> None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        print("\n== py-spy: not installed (.venv/bin/pip install py-spy) ==")
        return
    child = [sys.executable, str(Path(__file__).resolve()), "--tool", "none", "--scenario", str(args.scenario),
             "--n", str(args.n), "--mode", args.mode, "--out", str(out)]
    for s in args.set:
        child += ["--set", s]
    raw = out / "py-spy.txt"
    cmd = [exe, "record", "--rate", "500", "--format", "raw", "--output", str(raw), "--"] + child
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or not raw.exists():
        print(f"\n== py-spy: failed (exit {p.returncode}): {(p.stderr or '').strip().splitlines()[-1:]} ==")
        return
    svg = out / "py-spy.svg"
    subprocess.run([exe, "record", "--rate", "500", "--format", "flamegraph", "--output", str(svg), "--"] + child,
                   capture_output=True, text=True)
    # collapsed stacks "f1;f2;...;leaf count": self = leaf counts, inclusive = each distinct frame of a stack
    # Only samples inside Cluster.run count, so start-up and workload building do not dilute the shares.
    self_t = defaultdict(int)
    incl = defaultdict(int)
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # frames look like "Cluster.run (twin/sim/cluster.py:157)": drop the line number, keep the function
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        idx = next((i for i, f in enumerate(frames) if f.startswith("Cluster.run (")), None)
        if idx is None:
            continue
        c = int(count)
        total += c
        frames = frames[idx:]
        self_t[frames[-1]] += c
        for f in set(frames):
            incl[f] += c
    print(f"\n== py-spy (500 Hz sampling, samples inside Cluster.run: {total:,}) ==")
    if not total:
        return

    def fmt(f: str) -> str:  # "name (path/to/file.py:123)" -> shorter path
        name, _, rest = f.partition(" (")
        return f"{name} ({short(rest.rstrip(')'))})" if rest else f

    print(f"\n-- top {args.top} by self (leaf) samples --")
    for f, c in sorted(self_t.items(), key=lambda kv: kv[1], reverse=True)[:args.top]:
        print(f"{c / total:6.1%}  {fmt(f)}")
    print(f"\n-- top {args.top} by inclusive samples --")
    for f, c in sorted(incl.items(), key=lambda kv: kv[1], reverse=True)[:args.top]:
        print(f"{c / total:6.1%}  {fmt(f)}")
    print(f"\nwrote {raw} and {svg}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=str(DEFAULT_SCENARIO))
    ap.add_argument("--n", type=int, default=10_000, help="workload.num_requests (default 10000)")
    ap.add_argument("--mode", choices=["fast", "step"], default="fast")
    ap.add_argument("--set", action="append", default=[], help="extra scenario override dotted.path=value")
    ap.add_argument("--tool", choices=["all", "cprofile", "pyinstrument", "pyspy", "none"], default="all")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--tree-lines", type=int, default=60, help="lines of pyinstrument's call tree to print")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.tool == "none":  # the py-spy child: just run
        cluster = build(args)
        cluster.run(lambda now, arrived: None)
        return 0
    print(f"profiling {Path(args.scenario).name} with {args.n:,} requests, mode {args.mode}; "
          f"python {sys.version.split()[0]}, pid {os.getpid()}")
    if args.tool in ("all", "cprofile"):
        run_cprofile(args, out)
    if args.tool in ("all", "pyinstrument"):
        run_pyinstrument(args, out)
    if args.tool in ("all", "pyspy"):
        run_pyspy(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
