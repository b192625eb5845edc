"""Sweeps: the cross product of scenario settings, each point a full simulation, run in parallel and resumable.

A point is the base scenario with one value per grid key (dotted paths, as `--set` takes them). Every point is
validated before anything runs; each finished point is written to DIR/points/<key>.json, so a rerun skips it.
Points run on a backend: a local process pool (spawn-safe) or Ray (`pip install 'llmtwin[ray]'`).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import pandas as pd
import yaml

from twin.errors import TwinInputError
from twin.scenario import apply_overrides, parse_scenario

STATUS_OK, STATUS_FAILED, STATUS_INVALID = "ok", "failed", "invalid"
LATENCIES = (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("itl_s", "itl"), ("e2e_s", "e2e"))
SCALARS = ("goodput_req_s", "slo_attainment", "throughput_req_s", "throughput_output_tok_s", "prefix_cache_hit_rate",
           "preemptions", "requests_total", "requests_finished", "requests_rejected", "requests_running",
           "kv_usage_peak", "sim_time_s", "wall_time_s", "physics_ok")


# ---------------------------------------------------------------- the grid

def split_values(text: str) -> list[str]:
    """Comma-separated values, keeping commas inside [...] and {...} (YAML lists and mappings)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts]


def parse_value(text: str) -> Any:
    """A grid value as `--set` reads it: YAML (numbers, bools, lists), else the plain string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_grid(items: Sequence[str]) -> dict[str, list]:
    """`key=v1,v2,...` options -> {key: [values]} in the order given; a malformed option is one error line."""
    grid: dict[str, list] = {}
    for item in items:
        if "=" not in item:
            raise TwinInputError(f"--grid {item!r}: expected dotted.path=v1,v2,...")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key or any(not k for k in key.split(".")):
            raise TwinInputError(f"--grid {item!r}: empty key or path part")
        if key in grid:
            raise TwinInputError(f"--grid {key}: given twice (list all its values in one --grid)")
        raw_values = split_values(text)
        if any(v == "" for v in raw_values):
            raise TwinInputError(f"--grid {item!r}: empty value (values are comma-separated)")
        values = [parse_value(v) for v in raw_values]
        seen = set()
        for v in values:
            tag = json.dumps(v, sort_keys=True, default=str)
            if tag in seen:
                raise TwinInputError(f"--grid {key}: value {v!r} listed twice")
            seen.add(tag)
        grid[key] = values
    return grid


def build_grid(grid_items: Sequence[str], routers: Optional[str] = None, seeds: int = 1,
               base_seed: int = 0) -> dict[str, list]:
    """The grid from the CLI's options: --grid ..., --routers a,b (router.name), --seeds N (seed)."""
    grid = parse_grid(grid_items)
    if routers:
        if "router.name" in grid:
            raise TwinInputError("give routers either as --routers or as --grid router.name=..., not both")
        names = split_values(routers)
        if any(not n for n in names) or len(set(names)) != len(names):
            raise TwinInputError(f"--routers {routers!r}: give distinct names separated by commas")
        grid["router.name"] = names
    if seeds < 1:
        raise TwinInputError(f"--seeds {seeds}: must be >= 1")
    if seeds > 1:
        if "seed" in grid:
            raise TwinInputError("give seeds either as --seeds N or as --grid seed=..., not both")
        grid["seed"] = [base_seed + k for k in range(seeds)]
    return grid


def expand(grid: dict[str, list]) -> list[dict[str, Any]]:
    """The cross product, the last key varying fastest; an empty grid is the base scenario alone."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def override(key: str, value: Any) -> str:
    """`key=value` for `apply_overrides` (JSON is YAML, so the value parses back to itself)."""
    return f"{key}={json.dumps(value)}"


def point_key(scenario_dump: dict) -> str:
    """A point's identity: its fully resolved scenario, so a changed base scenario reruns, while a point that
    another grid (or a rerun with more keys) reaches with the same settings is found again."""
    blob = json.dumps(scenario_dump, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def describe_params(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "(base scenario)"


# ---------------------------------------------------------------- planning the points

@dataclass
class Point:
    """One point of the grid: its values, its scenario mapping and its key (None scenario: invalid)."""

    params: dict[str, Any]
    raw: dict
    key: str
    error: Optional[str] = None  # why the point's scenario is invalid


@dataclass
class SweepPlan:
    source: str
    base_dir: str
    grid: dict[str, list]
    points: list[Point]

    @property
    def param_keys(self) -> list[str]:
        return list(self.grid)


def plan_sweep(base_raw: dict, grid: dict[str, list], source: str, base_dir: str | Path,
               skip_invalid: bool = False) -> SweepPlan:
    """Validate every point's scenario before anything runs: a bad key or value is one line naming it.

    Each grid value is checked alone on the base scenario first (a bad key or value, one line each); then
    every point, where values that are fine alone can clash (e.g. a budget below max_num_seqs). Such points
    are an error, or with `skip_invalid` recorded as invalid and left out of the run.
    """
    base_dir = str(base_dir)
    parse_scenario(copy.deepcopy(base_raw), source, base_dir)  # the base itself, with its own file name
    problems = []
    for key, values in grid.items():
        for v in values:
            raw = apply_overrides(copy.deepcopy(base_raw), [override(key, v)])
            try:
                parse_scenario(raw, f"--grid {key}={v}", base_dir)
            except TwinInputError as e:
                problems.append(str(e).splitlines()[0])
    if problems:
        raise TwinInputError("\n".join(problems))
    from twin.engine.config import num_gpu_blocks
    from twin.perf.registry import build_perf
    from twin.sim.cluster import build_router, engine_config

    points, invalid = [], []
    # router and cluster blocks built once already: a bad router parameter, or a KV cache vLLM would refuse
    # (short of one max_model_len request), is found before any run
    routers_ok: set[str] = set()
    clusters_ok: set[str] = set()
    for params in expand(grid):
        raw = apply_overrides(copy.deepcopy(base_raw), [override(k, v) for k, v in params.items()])
        try:
            sc = parse_scenario(raw, "point", base_dir)
            key = sc.router.model_dump_json()
            if key not in routers_ok:
                build_router(sc)
                routers_ok.add(key)
            key = sc.cluster.model_dump_json()
            if key not in clusters_ok:
                perf = build_perf(sc)
                num_gpu_blocks(engine_config(sc), perf.gpu.device_memory, perf.weight_bytes_per_gpu,
                               perf.kv_bytes_per_token_per_gpu)
                clusters_ok.add(key)
        except TwinInputError as e:
            msg = str(e).splitlines()[0].removeprefix("point: ")
            p = Point(params, raw, point_key({"invalid": raw}), msg)
            invalid.append(p)
            points.append(p)
            continue
        points.append(Point(params, raw, point_key(sc.model_dump(mode="json"))))
    if invalid and not skip_invalid:
        first = invalid[0]
        raise TwinInputError(f"sweep point {describe_params(first.params)}: {first.error} "
                             f"({len(invalid)} of {len(points)} points invalid; --skip-invalid runs the others)")
    return SweepPlan(source, base_dir, grid, points)


# ---------------------------------------------------------------- running one point

@dataclass
class PointTask:
    """What a worker needs to run a point: plain data, picklable for spawn and Ray."""

    key: str
    params: dict
    raw: dict
    source: str
    base_dir: str


def gpu_seconds(summary: dict, sc) -> tuple[float, str]:
    """GPU-seconds of a run: the fleet's own account when the summary has it, else a fixed fleet's."""
    if summary.get("gpu_seconds") is not None:
        return float(summary["gpu_seconds"]), "fleet"
    return (sc.cluster.num_instances * sc.cluster.tensor_parallel * float(summary["sim_time_s"]),
            "num_instances x tensor_parallel x sim_time_s")


def flatten(summary: dict, sc) -> dict[str, Any]:
    """The results-table columns of one run's summary."""
    row: dict[str, Any] = {}
    for key, label in LATENCIES:
        d = summary.get(key) or {}
        for q in ("mean", "p50", "p99"):
            v = d.get(q)
            row[f"{label}_{q}_s"] = math.nan if v is None else float(v)
    for k in SCALARS:
        v = summary.get(k)
        row[k] = math.nan if v is None else v
    for p, d in (summary.get("by_priority") or {}).items():  # workload.priorities: each class's own latency
        for key, label in (("ttft_s", "ttft"), ("e2e_s", "e2e")):
            for q in ("p50", "p99"):
                v = d[key].get(q)
                row[f"priority_{p}_{label}_{q}_s"] = math.nan if v is None else float(v)
        row[f"priority_{p}_goodput_req_s"] = d["goodput_req_s"]
    row["gpu_seconds"], row["gpu_seconds_source"] = gpu_seconds(summary, sc)
    row["num_gpus"] = sc.cluster.num_instances * sc.cluster.tensor_parallel
    return row


def run_point(task: PointTask) -> dict:
    """Simulate one point; any error becomes the record's error, never an exception (a worker never dies of it)."""
    t0 = time.perf_counter()
    record = {"key": task.key, "params": task.params, "status": STATUS_OK, "error": None}
    try:
        from twin.sim.cluster import Cluster
        from twin.sim.metrics import summarize
        from twin.workload import build_stream

        sc = parse_scenario(task.raw, task.source, task.base_dir)
        summary = summarize(Cluster(sc, build_stream(sc)).run())
        record["metrics"] = flatten(summary, sc)
        record["summary"] = summary
    except Exception as e:  # recorded with the point; the sweep goes on
        text = str(e).strip().splitlines()
        msg = text[0] if text else ""
        record["status"] = STATUS_FAILED
        record["error"] = msg if isinstance(e, TwinInputError) else f"{type(e).__name__}: {msg}"
    record["point_wall_s"] = time.perf_counter() - t0
    return record


# ---------------------------------------------------------------- backends

class LocalBackend:
    """A process pool on this machine (spawn: safe with threads, the same on Linux and macOS); 1 worker runs
    in this process."""

    name = "local"

    def __init__(self, workers: Optional[int] = None) -> None:
        if workers is not None and workers < 1:
            raise TwinInputError(f"--workers {workers}: must be >= 1")
        self.workers = workers or max(1, os.cpu_count() or 1)

    def describe(self, n: int) -> str:
        w = min(self.workers, n)
        return f"{w} local worker{'s' if w != 1 else ''}" + (" (in this process)" if w == 1 else "")

    def map(self, fn: Callable[[PointTask], dict], tasks: Sequence[PointTask]) -> Iterator[tuple[int, dict]]:
        """(index, record) as each point finishes; a worker process that dies fails its points, not the sweep."""
        if min(self.workers, len(tasks)) <= 1:
            for i, t in enumerate(tasks):
                yield i, fn(t)
            return
        with ProcessPoolExecutor(max_workers=min(self.workers, len(tasks)), mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(fn, t): i for i, t in enumerate(tasks)}
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    yield i, fut.result()
                except Exception as e:  # BrokenProcessPool (a worker killed, e.g. out of memory)
                    yield i, failed_record(tasks[i], f"worker process failed: {type(e).__name__}: {e}")


class RayBackend:
    """Points as Ray tasks: a local Ray instance, or an existing cluster at `address` (`ray://host:10001` or
    `auto`). The cluster's workers need llmtwin installed and the scenario's trace files at the same paths."""

    name = "ray"

    def __init__(self, address: Optional[str] = None, init_kwargs: Optional[dict] = None) -> None:
        self.address = address
        self.init_kwargs = dict(init_kwargs or {})

    @staticmethod
    def load():
        try:
            import ray
        except ImportError:
            raise TwinInputError("--backend ray needs Ray: pip install 'llmtwin[ray]' (or use --backend local)") from None
        return ray

    def describe(self, n: int) -> str:
        return f"Ray at {self.address}" if self.address else "a local Ray instance"

    def map(self, fn: Callable[[PointTask], dict], tasks: Sequence[PointTask]) -> Iterator[tuple[int, dict]]:
        ray = self.load()
        started = not ray.is_initialized()
        if started:
            kw = {"include_dashboard": False, "log_to_driver": False, **self.init_kwargs}
            try:
                ray.init(address=self.address, **kw)
            except Exception as e:  # a wrong address, a cluster that is down
                raise TwinInputError(f"--backend ray: cannot start or reach Ray"
                                     f"{' at ' + self.address if self.address else ''}: {e}") from None
        try:
            remote = ray.remote(fn)
            refs = {remote.remote(t): i for i, t in enumerate(tasks)}
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    i = refs[ref]
                    try:
                        yield i, ray.get(ref)
                    except Exception as e:  # the task's worker died
                        yield i, failed_record(tasks[i], f"Ray task failed: {type(e).__name__}: {e}")
        finally:
            if started:
                ray.shutdown()


def make_backend(name: str, workers: Optional[int] = None, address: Optional[str] = None):
    if name == "local":
        if address:
            raise TwinInputError("--address is for --backend ray")
        return LocalBackend(workers)
    if name == "ray":
        RayBackend.load()  # a missing Ray is one line before anything runs
        return RayBackend(address, {"num_cpus": workers} if workers and not address else None)
    raise TwinInputError(f"--backend {name!r}: expected local or ray")


def failed_record(task: PointTask, error: str) -> dict:
    return {"key": task.key, "params": task.params, "status": STATUS_FAILED, "error": error}


# ---------------------------------------------------------------- the sweep folder

def point_path(out: Path, key: str) -> Path:
    return out / "points" / f"{key}.json"


def write_point(out: Path, record: dict) -> None:
    """Atomically: a sweep interrupted mid-write leaves no half file that a rerun would trust."""
    path = point_path(out, record["key"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return str(x)


def read_point(out: Path, key: str) -> Optional[dict]:
    """A finished point's record, or None (absent, unreadable, or not from this point)."""
    path = point_path(out, key)
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable, not JSON, or not UTF-8 text (UnicodeDecodeError): run it again
        return None
    return rec if isinstance(rec, dict) and rec.get("key") == key else None


@dataclass
class SweepOutcome:
    """What a sweep did and where it put it."""

    table: pd.DataFrame
    ran: int = 0
    skipped: int = 0
    retried: int = 0  # failed points from an earlier run, run again
    failed: int = 0
    invalid: int = 0
    files: list[Path] = field(default_factory=list)


def run_sweep(plan: SweepPlan, out: Path, backend, progress: Optional[Callable[[dict], None]] = None,
              on_start: Optional[Callable[[int, int, int], None]] = None) -> SweepOutcome:
    """Run the plan's points not yet finished in `out`, write each as it ends, then the table and the plots.

    `on_start(to_run, skipped, retried)` is called once before the first point runs; `progress(record)` after
    each point.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict] = {}
    tasks: list[PointTask] = []
    skipped = retried = 0
    for p in plan.points:
        if p.key in records:
            continue  # the same settings reached twice (e.g. a router by its alias): run once
        if p.error is not None:
            records[p.key] = {"key": p.key, "params": p.params, "status": STATUS_INVALID, "error": p.error}
            continue
        old = read_point(out, p.key)
        if old is not None and old.get("status") == STATUS_OK:
            records[p.key] = old
            skipped += 1
            continue
        retried += old is not None
        tasks.append(PointTask(p.key, p.params, p.raw, plan.source, plan.base_dir))
    (out / "sweep.json").write_text(json.dumps(
        {"scenario": plan.source, "grid": plan.grid, "points": len(plan.points)}, indent=1, default=str) + "\n")
    if on_start is not None:
        on_start(len(tasks), skipped, retried)
    for _, rec in backend.map(run_point, tasks):
        write_point(out, rec)
        records[rec["key"]] = rec
        if progress is not None:
            progress(rec)
    ordered = [{**records[p.key], "params": p.params} for p in plan.points]
    table = mark_pareto(results_frame(ordered, plan.param_keys), plan.param_keys)
    files = write_results(table, out, plan.param_keys, title=Path(plan.source).stem)
    st = table.status
    return SweepOutcome(table, len(tasks), skipped, retried, int((st == STATUS_FAILED).sum()),
                        int((st == STATUS_INVALID).sum()), files)


# ---------------------------------------------------------------- results and Pareto fronts

def _column_safe(values: list) -> list:
    """Parquet columns hold one type: lists and mappings become JSON, a mixed column becomes text."""
    vals = [json.dumps(v) if isinstance(v, (list, dict)) else v for v in values]
    kinds = {type(v) for v in vals if v is not None}
    if len(kinds) > 1 and not kinds <= {int, float}:
        vals = [None if v is None else str(v) for v in vals]
    return vals


def results_frame(records: Sequence[dict], param_keys: Sequence[str]) -> pd.DataFrame:
    """One row per point, in grid order: key, status, error, the grid values, the flattened summary."""
    rows = []
    for rec in records:
        row = {"point": rec["key"], "status": rec["status"], "error": rec.get("error")}
        for k in param_keys:
            row[k] = rec["params"].get(k)
        row.update(rec.get("metrics") or {})
        rows.append(row)
    df = pd.DataFrame(rows)
    for k in param_keys:
        df[k] = _column_safe(list(df[k]))
    return df


def pareto_mask(cost: Sequence[float], value: Sequence[float]) -> np.ndarray:
    """Points no other point dominates (cost no higher and value no lower, one of them strictly). NaN: never."""
    x = np.asarray(cost, dtype=np.float64)
    y = np.asarray(value, dtype=np.float64)
    on = np.zeros(len(x), dtype=bool)
    ok = np.flatnonzero(~(np.isnan(x) | np.isnan(y)))
    if not len(ok):
        return on
    order = ok[np.lexsort((-y[ok], x[ok]))]  # cost ascending, value descending
    best_before = -np.inf  # the highest value at any strictly lower cost
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and x[order[j]] == x[order[i]]:
            j += 1
        group = order[i:j]
        top = y[group[0]]
        for g in group:
            on[g] = y[g] == top and y[g] > best_before
        best_before = max(best_before, top)
        i = j
    return on


def config_frame(table: pd.DataFrame, param_keys: Sequence[str]) -> pd.DataFrame:
    """Finished points, averaged over seeds when seed is a grid key (each configuration once)."""
    ok = table[table.status == STATUS_OK].copy()
    if "seed" not in param_keys or ok.empty:
        return ok
    by = [k for k in param_keys if k != "seed"]
    skip = {*param_keys, "point", "status", "error", "gpu_seconds_source", "pareto_goodput", "pareto_slo"}
    metrics = [c for c in ok.columns if c not in skip]
    for c in metrics:
        ok[c] = pd.to_numeric(ok[c], errors="coerce")
    if not by:
        agg = ok[metrics].mean().to_frame().T
        agg["seeds"] = len(ok)
        return agg
    agg = ok.groupby(by, dropna=False, sort=False)[metrics].mean().reset_index()
    agg["seeds"] = ok.groupby(by, dropna=False, sort=False).size().to_numpy()
    return agg


PARETO = (("goodput_req_s", "goodput (req/s within SLO)", "pareto_goodput"),
          ("slo_attainment", "SLO attainment (fraction of finished)", "pareto_slo"))


def mark_pareto(table: pd.DataFrame, param_keys: Sequence[str]) -> pd.DataFrame:
    """Adds pareto_goodput and pareto_slo: on the front of that metric against GPU-seconds (per configuration
    when averaged over seeds)."""
    table = table.copy()
    conf = config_frame(table, param_keys)
    by = [k for k in param_keys if k != "seed"] if "seed" in param_keys else None
    for metric, _, col in PARETO:
        table[col] = False
        if conf.empty or metric not in conf:
            continue
        front = pareto_mask(pd.to_numeric(conf.gpu_seconds, errors="coerce"),
                            pd.to_numeric(conf[metric], errors="coerce"))
        if by is None:
            table.loc[conf.index[front], col] = True
        elif by:
            keys = {tuple(r) for r in conf.loc[front, by].itertuples(index=False, name=None)}
            table[col] = [tuple(r) in keys and s == STATUS_OK
                          for r, s in zip(table[by].itertuples(index=False, name=None), table.status)]
        else:
            table[col] = bool(front.any()) & (table.status == STATUS_OK)
    return table


def short_name(key: str) -> str:
    """A grid key as a column or label head: its last path part (router.name: router)."""
    return "router" if key == "router.name" else key.split(".")[-1]


def _label(row: pd.Series, keys: Sequence[str]) -> str:
    return ", ".join(f"{short_name(k)}={row[k]}" for k in keys)


def plot_pareto(table: pd.DataFrame, out: Path, param_keys: Sequence[str], title: str) -> list[Path]:
    """One PNG per metric: every configuration against GPU-seconds, the Pareto front drawn, numbered and
    listed under the plot (up to 12 front points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conf = config_frame(table, param_keys)
    keys = [k for k in param_keys if k != "seed"] if "seeds" in conf else list(param_keys)
    paths = []
    for metric, ylabel, name in PARETO:
        lines: list[str] = []
        x = pd.to_numeric(conf.gpu_seconds, errors="coerce").to_numpy() if len(conf) else np.empty(0)
        y = pd.to_numeric(conf[metric], errors="coerce").to_numpy() if len(conf) else np.empty(0)
        front = pareto_mask(x, y)
        listed = keys and 0 < front.sum() <= 12
        fig = plt.figure(figsize=(7.5, 5 + (0.18 * front.sum() + 0.3 if listed else 0)))
        ax = fig.add_subplot(111)
        if len(conf):
            ax.scatter(x[~front], y[~front], c="0.6", s=25, label="dominated")
            order = np.argsort(x[front], kind="stable")
            fx, fy = x[front][order], y[front][order]
            ax.plot(fx, fy, "o", color="C3", ms=7, label="Pareto front")
            ax.plot(fx, fy, "-", color="C3", drawstyle="steps-post", lw=1)
            if listed:
                rows = conf[front].iloc[order]
                spots: dict[tuple, list[str]] = {}
                for n, ((_, row), xi, yi) in enumerate(zip(rows.iterrows(), fx, fy), 1):
                    spots.setdefault((xi, yi), []).append(str(n))
                    lines.append(f"{n}: {_label(row, keys)}")
                for (xi, yi), ns in spots.items():
                    ax.annotate(",".join(ns), (xi, yi), fontsize=8, xytext=(5, -11), textcoords="offset points",
                                color="C3")
            finite = x[np.isfinite(x) & (x > 0)]
            if len(finite) and finite.max() > 10 * finite.min():
                ax.set_xscale("log")
        seeds = f", mean of {int(conf.seeds.iloc[0])} seeds" if "seeds" in conf and len(conf) else ""
        ax.set_xlabel("GPU-seconds")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {ylabel.split(' (')[0]} vs cost{seeds}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if lines:
            bottom = (0.14 * len(lines) + 0.3) / fig.get_figheight()
            fig.text(0.02, 0.01, "\n".join(lines), fontsize=7.5, va="bottom", family="monospace")
            fig.tight_layout(rect=(0, bottom, 1, 1))
        else:
            fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_results(table: pd.DataFrame, out: Path, param_keys: Sequence[str], title: str) -> list[Path]:
    """results.parquet and results.csv (every point, Pareto membership marked) and the Pareto PNGs."""
    if "pareto_goodput" not in table:
        table = mark_pareto(table, param_keys)
    table.to_parquet(out / "results.parquet", index=False)
    table.to_csv(out / "results.csv", index=False)
    return [out / "results.parquet", out / "results.csv", *plot_pareto(table, out, param_keys, title)]


def read_results(out: Path) -> pd.DataFrame:
    return pd.read_parquet(Path(out) / "results.parquet")


__all__ = ["LocalBackend", "Point", "PointTask", "RayBackend", "SweepOutcome", "SweepPlan", "build_grid", "expand",
           "flatten", "make_backend", "mark_pareto", "parse_grid", "pareto_mask", "plan_sweep", "point_key",
           "read_results", "results_frame", "run_point", "run_sweep", "write_results"]
