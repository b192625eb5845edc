"""Side by side: `twin compare`, `twin plot`, `twin sweep`, and `twin score` (the twin against measured GPU points)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from twin.errors import TwinInputError, out_folder
from twin.cli.common import _fail, _fmt, _router_failed, app, err


@app.command()
def compare(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    routers: Optional[str] = typer.Option(None, "--routers", help="comma-separated router names"),
    router: List[str] = typer.Option([], "--router", help=(
        "a contender as inline YAML: '{label: lm-stale, name: lmetric, scrape_interval_s: 0.1, "
        "prefix_index: precise, params: {...}, set: \\[cluster.num_instances=8]}' (repeatable)")),
    set_: List[str] = typer.Option([], "--set", help="override a scenario field for every run: dotted.path=value"),
    seeds: int = typer.Option(1, "--seeds", min=1, help="repeat on this many seeds (scenario seed, +1, ...)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="the first seed (default: the scenario's)"),
    out: Path = typer.Option(..., "--out", help="folder for comparison.csv, figures and per-request tables"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
) -> None:
    """Replay the same arrivals under several routers; write a table (CSV) and figures (PNG)."""
    from twin.analysis.compare import compare as run_compare
    from twin.analysis.compare import parse_variant, write
    from twin.sim.dispatcher import RouterError

    console = Console(width=max(Console().width, 150))
    try:
        variants = [parse_variant(n) for n in (routers or "").split(",") if n.strip()]
        variants += [parse_variant(r) for r in router]
        out_folder(out)  # before the runs: a folder that cannot be made fails now, not after them
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True, disable=quiet) as bar:
            task = bar.add_task("comparing", total=len(variants) * seeds)
            started: list[str] = []

            def step(label: str) -> None:
                bar.update(task, description=label, completed=len(started))
                started.append(label)

            cmp = run_compare(scenario, variants, set_, seeds, seed, step)
            bar.update(task, completed=len(variants) * seeds)
        files = write(cmp, out, scenario.stem)
    except TwinInputError as e:
        _fail(str(e))
    except RouterError as e:
        _router_failed(e)
    if not quiet:
        t = Table(title=f"{scenario.stem}: {len(variants)} routers x {seeds} seed(s), means")
        cols = [("label", "router"), ("ttft_mean_s", "TTFT mean"), ("ttft_p99_s", "TTFT p99"),
                ("tpot_mean_s", "TPOT mean"), ("e2e_mean_s", "E2E mean"), ("e2e_p99_s", "E2E p99"),
                ("goodput_req_s", "goodput req/s"), ("prefix_hit_rate", "prefix hits"),
                ("load_imbalance", "imbalance"), ("preemptions", "preempt.")]
        for _, name in cols:
            t.add_column(name, justify="right" if name != "router" else "left")
        for _, r in cmp.mean.iterrows():
            cells = []
            for key, _ in cols:
                v = r[key]
                if key == "label":
                    cells.append(str(v))
                elif key.endswith("_s") and not key.startswith("goodput"):
                    cells.append(_fmt(v))
                elif key == "prefix_hit_rate":
                    cells.append(f"{v:.1%}")
                else:
                    cells.append(f"{v:,.2f}")
            t.add_row(*cells)
        console.print(t)
        console.print(f"wrote {', '.join(f.name for f in files)} to {out}")


@app.command()
def plot(
    run_dir: Path = typer.Argument(..., help="a run folder (from simulate, replay or compare --out)"),
    out: Optional[Path] = typer.Option(None, "--out", help="where to write the PNGs (default: the run folder)"),
) -> None:
    """Draw latency CDFs and per-instance timelines of a finished run."""
    from twin.analysis.report import plot_run

    try:
        files = plot_run(run_dir, out)
    except TwinInputError as e:
        _fail(str(e))
    Console().print("wrote " + ", ".join(str(f) for f in files))


@app.command()
def sweep(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    grid: List[str] = typer.Option([], "--grid", help="dotted.path=v1,v2,... (repeatable; the cross product runs)"),
    routers: Optional[str] = typer.Option(None, "--routers", help="router names, comma-separated (router.name)"),
    set_: List[str] = typer.Option([], "--set", help="override a field for every point: dotted.path=value"),
    seeds: int = typer.Option(1, "--seeds", help="run each point with N seeds (the scenario's seed, +1, ...)"),
    workers: Optional[int] = typer.Option(None, "--workers", help="parallel points (default: CPU count)"),
    backend: str = typer.Option("local", "--backend", help="local (process pool) or ray"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address (ray://host:10001, auto)"),
    out: Path = typer.Option(..., "--out", help="sweep folder: points/, results.parquet/.csv, Pareto PNGs"),
    skip_invalid: bool = typer.Option(False, "--skip-invalid",
                                      help="record points whose values clash as invalid and run the others"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
) -> None:
    """Run SCENARIO over the cross product of --grid values; resumable: points already in --out are skipped.

    Exits 1 when a point failed (its error is in the results' error column), 2 on bad input.
    """
    from twin.scenario import apply_overrides, read_scenario_yaml
    from twin.analysis.sweep import (STATUS_FAILED, build_grid, config_frame, describe_params, make_backend, pareto_mask,
                            plan_sweep, run_sweep, short_name)

    console = Console()
    try:
        raw = apply_overrides(read_scenario_yaml(scenario), set_)
        base_seed = raw.get("seed", 0) if isinstance(raw.get("seed", 0), int) else 0
        g = build_grid(grid, routers, seeds, base_seed)
        plan = plan_sweep(raw, g, str(scenario), scenario.parent, skip_invalid)
        runner_ = make_backend(backend, workers, address)
        out_folder(out)  # before the points run
    except TwinInputError as e:
        _fail(str(e))
    n = len(plan.points)

    def started(to_run: int, skipped: int, retried: int) -> None:
        if quiet:
            return
        keys = ", ".join(plan.param_keys) or "no grid keys"
        err.print(f"sweep {scenario}: {n:,} point{'s' if n != 1 else ''} ({keys})", highlight=False)
        if skipped:
            err.print(f"skipped {skipped:,} point{'s' if skipped != 1 else ''} already finished in {out}",
                      highlight=False)
        if retried:
            err.print(f"rerunning {retried:,} point{'s' if retried != 1 else ''} that failed before", highlight=False)
        if to_run:
            err.print(f"running {to_run:,} on {runner_.describe(to_run)}", highlight=False)

    try:
        if quiet:
            outcome = run_sweep(plan, out, runner_, on_start=started)
        else:
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                          TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), console=err,
                          transient=True) as bar:
                task = None

                def on_start(to_run: int, skipped: int, retried: int) -> None:
                    nonlocal task
                    started(to_run, skipped, retried)
                    task = bar.add_task("points", total=to_run, failed=0)

                def on_point(rec: dict) -> None:
                    f = bar.tasks[task].fields["failed"] + (rec["status"] == STATUS_FAILED)
                    bar.update(task, advance=1, failed=f)
                    if rec["status"] == STATUS_FAILED:
                        err.print(f"[red]point failed[/] {describe_params(rec['params'])}: {rec['error']}",
                                  highlight=False, soft_wrap=True)

                outcome = run_sweep(plan, out, runner_, progress=on_point, on_start=on_start)
    except TwinInputError as e:
        _fail(str(e))
    t = outcome.table
    if not quiet:
        conf = config_frame(t, plan.param_keys)
        front = conf[pareto_mask(conf.gpu_seconds, conf.goodput_req_s)] if len(conf) else conf
        keys = [k for k in plan.param_keys if k != "seed" or "seeds" not in conf]
        if len(front):
            seeds_note = f" (mean of {int(conf.seeds.iloc[0])} seeds)" if "seeds" in conf else ""
            table = Table(title="Pareto front: goodput against GPU-seconds" + seeds_note)
            heads = [short_name(k) for k in keys]
            for c in [*heads, "GPU-s", "goodput req/s", "SLO att.", "TTFT p99", "TPOT p99"]:
                table.add_column(c, justify="right")
            for _, r in front.sort_values("gpu_seconds").iterrows():
                att = r.slo_attainment
                table.add_row(*(str(r[k]) for k in keys), f"{r.gpu_seconds:,.0f}",
                              f"{r.goodput_req_s:.2f}", "-" if att != att else f"{att:.1%}",
                              _fmt(r.ttft_p99_s if r.ttft_p99_s == r.ttft_p99_s else None),
                              _fmt(r.tpot_p99_s if r.tpot_p99_s == r.tpot_p99_s else None))
            console.print(table)
        console.print(f"{len(t):,} point{'s' if len(t) != 1 else ''}: {int((t.status == 'ok').sum()):,} ok, "
                      f"{outcome.failed:,} failed"
                      + (f", {outcome.invalid:,} invalid" if outcome.invalid else "")
                      + f" ({outcome.ran:,} run now, {outcome.skipped:,} skipped as already finished)")
        console.print("wrote " + ", ".join(str(p) for p in outcome.files))
    if outcome.failed:
        if quiet:  # the progress lines named each failure; quiet, the exit status alone would say nothing
            row = t[t.status == STATUS_FAILED].iloc[0]
            first = describe_params({k: row[k] for k in plan.param_keys if k in row.index})
            from rich.markup import escape

            err.print(f"[red]{outcome.failed:,} point{'s' if outcome.failed != 1 else ''} failed[/]; the first, "
                      + escape(f"{first}: {row['error']} (the results in {out} have each)"), highlight=False,
                      soft_wrap=True, emoji=False)
        raise typer.Exit(1)


@app.command()
def score(
    against: Path = typer.Argument(..., help="CSV of measured points (e.g. tests/data/inferencex-h100-vllm.csv)"),
    out: Path = typer.Option(Path("runs/score"), "--out", help="folder for score_points.csv, score_summary.csv, score.png"),
    requests_per_client: int = typer.Option(10, "--requests-per-client", help="closed-loop requests per client "
                                                                            "(InferenceMAX sends 10)"),
    set_: List[str] = typer.Option([], "--set", help="dotted.path=value on every point's scenario (repeatable)"),
) -> None:
    """Score the twin offline on measured GPU serving points: MAPE and signed error per metric and point."""
    from twin.analysis.gpu_fidelity import print_score, run_score

    try:
        result = run_score(against, out, requests_per_client, set_)
    except TwinInputError as e:
        _fail(str(e))
    print_score(result, Console(width=max(Console().width, 110)))
