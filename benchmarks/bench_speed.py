#!/usr/bin/env python
"""Simulator speed on the issue-3 reference scenarios: requests and simulated seconds per wall second, peak RSS.

Each (scenario, size, mode) runs in a fresh Python subprocess, so its peak RSS (VmHWM) is its own. Inside the child
the phases are timed separately:

  build   load_scenario + build_stream (sampling arrivals and lengths)
  setup   Cluster(sc, stream)            (engines, request log)
  run     Cluster.run(progress)          (the simulation itself: this is the "sim" figure)
  report  summarize(result)              (quantiles, counters)

"sim req/s" is requests / run-wall; "e2e req/s" is requests / (build + setup + run + report), what a user
of `twin simulate -q` waits for minus interpreter start-up and imports (reported as "proc s": the whole
child process, start to exit, as seen by the parent).

Usage (from the repository root):

  .venv/bin/python benchmarks/bench_speed.py                      # both scenarios, 10k + 100k, +1M on 16x
  .venv/bin/python benchmarks/bench_speed.py --sizes 10000,100000 --mode both
  .venv/bin/python benchmarks/bench_speed.py --scenarios scenarios/bench-16xh100.yaml --sizes 1000000 --bar
  .venv/bin/python benchmarks/bench_speed.py --trace full --json benchmarks/results/speed.json

Only the public API is used (twin.scenario.load_scenario, twin.workload.build_stream, twin.sim.cluster.Cluster,
twin.sim.metrics.summarize), so the script measures whatever the engine under twin/ currently is.
No timed assertions: this prints numbers, it never fails on them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIOS = [ROOT / "scenarios" / "bench-16xh100.yaml", ROOT / "scenarios" / "bench-1xh100.yaml"]
# The length trace the issue names (Vidur's ShareGPT stats file); the scenarios ship a 10k-row sample of it.
FULL_TRACE = ROOT.parent / "shared" / "traces" / "length_traces" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
MILLION = 1_000_000


# ---------------------------------------------------------------------------------------------------
# machine description
# ---------------------------------------------------------------------------------------------------
def machine_info() -> dict:
    from twin.lab.machine import machine  # twin/__init__.py is empty: this imports nothing else of twin

    m = machine()
    cpu, usable, mem_gib = m["cpu"], m["usable_cores"], m["mem_gib"]
    commit = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "twin"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        if dirty:
            commit += " (+ uncommitted changes under twin/)"
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for mod in ("simpy", "numpy", "pandas", "pydantic"):  # by metadata: the parent must stay small (see _peak_rss_mib)
        try:
            versions[mod] = version(mod)
        except PackageNotFoundError:
            versions[mod] = "?"
    import importlib.util

    spec = importlib.util.find_spec("twin.engine.scheduler")  # finds the module file without importing twin
    build = "mypyc-compiled" if spec and spec.origin and spec.origin.endswith(".so") else "pure Python"
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "twin_build": build,
        "cpu": cpu,
        "cores_logical": os.cpu_count(),
        "cores_usable": usable,
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "commit": commit,
        "versions": versions,
    }


def _maxrss_mib() -> float:
    """Peak resident set of this process so far, MiB.

    On Linux this is VmHWM from /proc/self/status: the high-water mark of this process's own address space,
    which exec starts afresh. `getrusage(RUSAGE_SELF).ru_maxrss` is not used there because Linux carries the
    parent's peak over a fork + exec into it (the child would report at least what the parent had).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024.0 if sys.platform != "darwin" else r / 2**20  # Linux: KiB; macOS: bytes


def _loadavg() -> float | None:
    """The 1-minute load average: a figure from a busy machine says so."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def run_config(sc, cluster) -> dict:
    """What a run simulated that changes its speed: engine generation, async scheduling, the API server's
    queue and times, the mode, router and fleet (read off the constructed Cluster, defaults resolved)."""
    perf = cluster.perf
    return {
        "vllm_version": sc.cluster.engine.vllm_version,
        "async_scheduling": bool(cluster.engine_config.async_scheduling),
        "api_queue": cluster.api_discipline if cluster.api_cap is not None else "off",
        "api_request_overhead_s": getattr(getattr(perf, "roofline", perf), "api_request_overhead_s", None),
        "api_prompt_token_s": getattr(getattr(perf, "roofline", perf), "api_prompt_token_s", None),
        "api_output_token_s": getattr(getattr(perf, "roofline", perf), "api_output_token_s", None),
        "mode": sc.sim.mode,
        "router": cluster.router_info()["name"],
        "instances": len(cluster.instances),
        "num_gpu_blocks": cluster.num_blocks,
    }


def config_label(c: dict) -> str:
    """The configuration in a few words, printed with each figure."""
    api = "API server off"
    if c["api_queue"] != "off" or c.get("api_request_overhead_s"):
        api = (f"API {c['api_queue']} {1e3 * (c['api_request_overhead_s'] or 0):g} ms/req "
               f"{1e6 * (c['api_output_token_s'] or 0):g} us/out-tok")
    return (f"vLLM {c['vllm_version']}, async {'on' if c['async_scheduling'] else 'off'}, {api}, "
            f"{c['router']}, {c['instances']} inst")


# ---------------------------------------------------------------------------------------------------
# the child: one run, JSON on the last line of stdout
# ---------------------------------------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    t_proc0 = time.perf_counter()
    rss0 = _maxrss_mib()
    from twin.sim.cluster import Cluster
    from twin.sim.metrics import summarize
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    t_import = time.perf_counter() - t_proc0
    rss_import = _maxrss_mib()

    overrides = [f"workload.num_requests={args.n}", f"sim.mode={args.mode}", *args.set]
    if args.trace:
        overrides.append(f"workload.lengths.path={args.trace}")

    t0 = time.perf_counter()
    sc = load_scenario(args.scenario, overrides)
    stream = build_stream(sc)
    t_build = time.perf_counter() - t0
    rss_build = _maxrss_mib()

    t0 = time.perf_counter()
    cluster = Cluster(sc, stream)
    t_setup = time.perf_counter() - t0
    config = run_config(sc, cluster)
    load_before = _loadavg()
    import gc

    if args.gc == "disable":  # an experiment: how much of the run is the cyclic garbage collector?
        gc.disable()
    elif args.gc == "freeze":
        gc.collect()
        gc.freeze()
    # time spent in the cyclic GC during the run (callbacks fire only around collections: negligible cost)
    gc_time = [0.0, 0.0, 0.0]
    gc_count = [0, 0, 0]
    gc_t0 = [0.0]

    def gc_cb(phase: str, info: dict) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            g = info.get("generation", 0)
            gc_time[g] += time.perf_counter() - gc_t0[0]
            gc_count[g] += 1

    gc.callbacks.append(gc_cb)

    n_progress = 0
    if args.bar:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                      TextColumn("{task.completed:,}/{task.total:,} arrived"),
                      TextColumn("sim {task.fields[sim]:,.0f} s"), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(f"{sc.name} {args.n:,}", total=len(stream), sim=0.0)

            def progress(now: float, arrived: int) -> None:
                nonlocal n_progress
                n_progress += 1
                bar.update(task, completed=arrived, sim=now)

            t0 = time.perf_counter()
            result = cluster.run(progress)
            t_run = time.perf_counter() - t0
    else:
        def progress(now: float, arrived: int) -> None:  # as cheap as a callback gets; counts the slices
            nonlocal n_progress
            n_progress += 1

        t0 = time.perf_counter()
        result = cluster.run(progress)
        t_run = time.perf_counter() - t0
    rss_run = _maxrss_mib()
    load_after = _loadavg()
    # what simulation cost grows with: the engines' step-loop wake-ups and the events scheduled (SimPy's event ids)
    wakeups = sum(inst.num_wakeups for inst in cluster.instances)
    events = next(cluster.env._eid)
    gc.callbacks.remove(gc_cb)

    t0 = time.perf_counter()
    s = summarize(result)
    t_report = time.perf_counter() - t0
    rss_end = _maxrss_mib()

    n = len(stream)
    total = t_build + t_setup + t_run + t_report

    def q(key: str, which: str):
        d = s.get(key) or {}
        return d.get(which)

    rec = {
        "scenario": sc.name,
        "scenario_file": str(args.scenario),
        "mode": sc.sim.mode,
        "requests": n,
        "config": config,
        "config_label": config_label(config),
        "loadavg_1m": {"before_run": load_before, "after_run": load_after},
        "trace": str(sc.resolve_path(sc.workload.lengths.path)) if sc.workload.lengths.path else None,
        "import_s": t_import,
        "build_s": t_build,
        "setup_s": t_setup,
        "run_s": t_run,
        "report_s": t_report,
        "total_s": total,
        "sim_time_s": result.sim_time_s,
        "sim_req_per_wall_s": n / t_run if t_run > 0 else None,
        "e2e_req_per_wall_s": n / total if total > 0 else None,
        "sim_s_per_wall_s": result.sim_time_s / t_run if t_run > 0 else None,
        "e2e_sim_s_per_wall_s": result.sim_time_s / total if total > 0 else None,
        "peak_rss_mib": rss_end,
        "rss_mib": {"start": rss0, "after_import": rss_import, "after_build": rss_build, "after_run": rss_run,
                    "after_report": rss_end},
        "progress_calls": n_progress,
        "gc": args.gc,
        "gc_s": sum(gc_time),
        "gc_s_by_generation": gc_time,
        "gc_collections": gc_count,
        "engine_steps": s.get("engine_steps"),
        "wakeups_per_req": wakeups / n if n else None,
        "events_per_req": events / n if n else None,
        "num_gpu_blocks": s.get("num_gpu_blocks"),
        "finished": s.get("requests_finished"),
        "rejected": s.get("requests_rejected"),
        "preemptions": s.get("preemptions"),
        "ttft_p50_s": q("ttft_s", "p50"),
        "e2e_p50_s": q("e2e_s", "p50"),
        "tpot_p50_s": q("tpot_s", "p50"),
        "throughput_req_s": s.get("throughput_req_s"),
        "ttft_mean_s": q("ttft_s", "mean"),
        "e2e_mean_s": q("e2e_s", "mean"),
        "ttft_p90_s": q("ttft_s", "p90"),
        "e2e_p90_s": q("e2e_s", "p90"),
        "ttft_p99_s": q("ttft_s", "p99"),
        "e2e_p99_s": q("e2e_s", "p99"),
        "mean_prompt_tokens": float(stream.prompt_tokens.mean()) if n else None,
        "mean_output_tokens": float(stream.output_tokens.mean()) if n else None,
    }
    sys.stdout.write("\n" + json.dumps(rec) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------------
# the parent: plan runs, launch children, print the table
# ---------------------------------------------------------------------------------------------------
def run_child(scenario: Path, n: int, mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--scenario", str(scenario),
           "--n", str(n), "--mode", mode]
    if args.trace:
        cmd += ["--trace", args.trace]
    for s in args.set:
        cmd += ["--set", s]
    if args.bar:
        cmd.append("--bar")
    if args.gc != "default":
        cmd += ["--gc", args.gc]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=None if args.bar else subprocess.PIPE,
                           text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"scenario": scenario.stem, "requests": n, "mode": mode, "error": f"timeout after {args.timeout} s"}
    proc_s = time.perf_counter() - t0
    if p.returncode != 0:
        tail = (p.stderr or "").strip().splitlines()[-5:]
        return {"scenario": scenario.stem, "requests": n, "mode": mode,
                "error": f"exit {p.returncode}: " + " | ".join(tail)}
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    rec["process_s"] = proc_s
    return rec


def plan(args: argparse.Namespace) -> list[tuple[Path, int, str]]:
    scenarios = [Path(s).resolve() for s in args.scenarios] if args.scenarios else DEFAULT_SCENARIOS
    modes = ["fast", "step"] if args.mode == "both" else [args.mode]
    runs = []
    for sc in scenarios:
        if args.sizes:
            sizes = [int(x.replace("_", "")) for x in args.sizes.split(",") if x.strip()]
        else:
            sizes = [10_000, 100_000]
            # 1M by default for the 16-instance scenario (the 60 s target), unless --no-million
            if not args.no_million and ("16x" in sc.stem or args.million_all):
                sizes.append(MILLION)
        for n in sizes:
            for m in modes:
                if m == "step" and n > args.step_max:
                    continue  # step mode at 1M takes long; raise --step-max to include it
                runs.append((sc, n, m))
    return runs


def fmt_table(rows: list[dict]) -> str:
    cols = [
        ("scenario", "scenario", "{}"),
        ("mode", "mode", "{}"),
        ("requests", "requests", "{:,}"),
        ("build_s", "build s", "{:.2f}"),
        ("run_s", "run s", "{:.2f}"),
        ("total_s", "total s", "{:.2f}"),
        ("process_s", "proc s", "{:.2f}"),
        ("sim_req_per_wall_s", "sim req/s", "{:,.0f}"),
        ("median_req_per_wall_s", "median req/s", "{:,.0f}"),
        ("repeats", "runs", "{}"),
        ("load_max", "load", "{:.1f}"),
        ("e2e_req_per_wall_s", "e2e req/s", "{:,.0f}"),
        ("sim_time_s", "sim-time s", "{:,.0f}"),
        ("sim_s_per_wall_s", "sim-s/wall-s", "{:,.0f}"),
        ("peak_rss_mib", "peak RSS MiB", "{:,.0f}"),
        ("gc_s", "GC s", "{:.2f}"),
        ("engine_steps", "steps", "{:,}"),
        ("wakeups_per_req", "wake/req", "{:.2f}"),
        ("events_per_req", "events/req", "{:.2f}"),
        ("step_vs_fast", "fast gain", "{:.1f}x"),
    ]
    table = [[h for _, h, _ in cols]]
    for r in rows:
        if "error" in r:
            table.append([str(r.get("scenario")), r.get("mode", ""), f"{r.get('requests', 0):,}",
                          "ERROR: " + r["error"]] + [""] * (len(cols) - 4))
            continue
        line = []
        for key, _, f in cols:
            v = r.get(key)
            line.append("-" if v is None else f.format(v))
        table.append(line)
    widths = [max(len(row[i]) for row in table if i < len(row)) for i in range(len(cols))]
    out = []
    for j, row in enumerate(table):
        if len(row) > len(cols):
            row = row[:len(cols)]
        if row and row[3].startswith("ERROR"):
            out.append("  ".join(row[:3]) + "  " + row[3])
            continue
        out.append("  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="*", help="scenario YAML files (default: the two bench-*.yaml)")
    ap.add_argument("--sizes", help="comma-separated request counts (default 10000,100000 and 1000000 for 16x)")
    ap.add_argument("--no-million", action="store_true", help="drop the default 1M run of the 16x scenario")
    ap.add_argument("--million-all", action="store_true", help="default sizes include 1M for every scenario")
    ap.add_argument("--mode", choices=["fast", "step", "both"], default="fast",
                    help="sim.mode: fast (decode fast-forward, the default), step (one event per step), both")
    ap.add_argument("--step-max", type=int, default=100_000, help="largest size to run in step mode (default 100000)")
    ap.add_argument("--trace", help="length trace path for workload.lengths.path ('full' = the issue's ShareGPT "
                                    "file under ../shared; default: the scenario's own)")
    ap.add_argument("--set", action="append", default=[], help="extra scenario override dotted.path=value")
    ap.add_argument("--bar", action="store_true", help="draw the live rich progress bar (stderr) during runs")
    ap.add_argument("--gc", choices=["default", "disable", "freeze"], default="default",
                    help="experiment: run with Python's cyclic GC disabled, or gc.freeze() after setup")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration; the table shows the fastest")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before a run is abandoned")
    ap.add_argument("--json", dest="json_out", help="write machine info and all runs to this JSON file")
    # child-only
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.trace == "full":
        args.trace = str(FULL_TRACE)
    if args.trace:
        args.trace = str(Path(args.trace).resolve())
    if args.child:
        child(args)
        return 0

    info = machine_info()
    print(f"machine: {info['cpu']}; {info['cores_usable']} usable of {info['cores_logical']} logical cores; "
          f"{info['memory_gib']} GiB; {info['python']}; {info['platform']}")
    print(f"twin build: {info['twin_build']}; date {info['date']}; commit {info['commit']}; "
          + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    runs = plan(args)
    print(f"{len(runs)} run(s), each in its own subprocess, one at a time"
          + (f"; gc {args.gc} (an experiment, not the default)" if args.gc != "default" else "")
          + (f"; lengths from {args.trace}" if args.trace else "; lengths as in each scenario"))
    rows: list[dict] = []
    all_runs: list[dict] = []
    for sc, n, mode in runs:
        best = None
        these: list[dict] = []  # this configuration's runs
        for rep in range(max(args.repeat, 1)):
            print(f"  {sc.stem} {n:,} {mode}" + (f" (repeat {rep + 1})" if args.repeat > 1 else "") + " ...",
                  end="", flush=True)
            rec = run_child(sc, n, mode, args)
            rec["repeat"] = rep
            all_runs.append(rec)
            these.append(rec)
            if "error" in rec:
                print(" " + rec["error"])
                best = best or rec
                break
            print(f" run {rec['run_s']:.2f} s, {rec['sim_req_per_wall_s']:,.0f} req/s, "
                  f"{rec['peak_rss_mib']:,.0f} MiB; load {rec['loadavg_1m']['before_run']}"
                  f"->{rec['loadavg_1m']['after_run']}; {rec['config_label']}")
            if best is None or "error" in best or rec["run_s"] < best["run_s"]:
                best = rec
        if best is not None and "error" not in best:
            ok = sorted(r["run_s"] for r in these if "error" not in r)
            med = ok[len(ok) // 2] if len(ok) % 2 else (ok[len(ok) // 2 - 1] + ok[len(ok) // 2]) / 2
            best["median_run_s"] = med
            best["median_req_per_wall_s"] = best["requests"] / med if med > 0 else None
            best["repeats"] = len(ok)
            best["load_max"] = max((r["loadavg_1m"]["after_run"] or 0.0) for r in these if "error" not in r)
        rows.append(best)
    # fast-vs-step gain where both ran
    by_key = {(r.get("scenario"), r.get("requests"), r.get("mode")): r for r in rows if "error" not in r}
    for r in rows:
        if "error" in r or r["mode"] != "fast":
            continue
        st = by_key.get((r["scenario"], r["requests"], "step"))
        if st:
            r["step_vs_fast"] = st["run_s"] / r["run_s"]
            st["same_result"] = (st["finished"] == r["finished"] and st["engine_steps"] == r["engine_steps"]
                                 and math.isclose(st["ttft_p50_s"], r["ttft_p50_s"], rel_tol=1e-9, abs_tol=1e-9)
                                 and math.isclose(st["e2e_p50_s"], r["e2e_p50_s"], rel_tol=1e-9, abs_tol=1e-9))
    print()
    print(fmt_table(rows))
    print()
    print(f"machine: {info['cpu']}, {info['cores_usable']} usable cores, {info['python']}, {info['twin_build']}, "
          f"commit {info['commit']}")
    for r in rows:
        if "error" not in r:
            print(f"  {r['scenario']} {r['requests']:,} {r['mode']}: {r['config_label']}")
    print("sim req/s = requests / fastest run s (Cluster.run only), median req/s = over --repeat runs, "
          "load = highest 1-minute load average after a run (a busy machine's figures are slow); e2e req/s = requests / total s "
          "(build + setup + run + summarize); proc s = whole child process incl. interpreter start and imports.")
    print("sim-s/wall-s = simulated seconds / run s; peak RSS = VmHWM (peak resident set) of the child process; "
          "fast gain = step-mode run s / fast-mode run s; "
          "GC s = time in Python's cyclic garbage collector during the run (part of run s); wake/req = engine step-loop "
          "wake-ups per request, events/req = simulation events scheduled per request (what the run's cost grows with).")
    for r in rows:
        if "error" in r:
            continue
        print(f"  {r['scenario']} {r['requests']:,} {r['mode']}: finished {r['finished']:,}, rejected {r['rejected']:,}, "
              f"preemptions {r['preemptions']:,}, TTFT p50 {r['ttft_p50_s']:.3f} s, E2E p50 {r['e2e_p50_s']:.3f} s"
              + (f", same result as fast (to 1e-9): {r['same_result']}" if "same_result" in r else ""))
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": info, "argv": sys.argv[1:], "runs": all_runs, "table": rows},
                                  indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
