"""What every command shares: the app, one-line errors, the summary table, the run-and-report path."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from twin.errors import TwinInputError


class _OneLineErrors(typer.core.TyperGroup):
    """Command-line mistakes (an unknown option, a value of the wrong type, a missing argument) as one `error:` line
    and exit 2, like every other bad input, rather than click's Usage text and a boxed Error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        click = getattr(typer.core, "_click", None) or __import__("click")  # typer 0.2x carries its own copy

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        exc = click.exceptions
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except exc.NoArgsIsHelpError:  # no arguments: the help, as before
            return super().main(args, prog_name, complete_var, standalone_mode=True, **extra)
        except exc.ClickException as e:
            from rich.markup import escape

            ctx = getattr(e, "ctx", None)
            where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            err.print(f"[bold red]error:[/] {escape(e.format_message() + where)}", highlight=False, soft_wrap=True)
            sys.exit(e.exit_code)
        except (typer.Abort, getattr(exc, "Abort", typer.Abort)):  # typer 0.2x's own click copy has no Abort
            err.print("aborted", highlight=False)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_OneLineErrors,
                  help="llmtwin: a digital twin of a vLLM serving cluster.")
err = Console(stderr=True)


def _router_failed(e: BaseException) -> None:
    """A router bug: the router's own traceback, then one line naming the request; exit 1."""
    import traceback

    from twin.sim.dispatcher import router_cause

    cause = router_cause(e)
    err.print("".join(traceback.format_exception(type(cause), cause, cause.__traceback__)), highlight=False,
              markup=False, end="")
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
    err.print("(set router.on_error: reject to count such requests as rejected and go on)", highlight=False)
    raise typer.Exit(1)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("llmtwin")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "unknown (not installed)"
        from twin.sim.events import BUILD

        typer.echo(f"llmtwin {v} ({BUILD} build)")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the installed llmtwin version and build and exit"),
          spec_files: List[Path] = typer.Option([], "--specs", metavar="FILE",
                                                help="your own GPU/model specs (YAML with hardware: and/or "
                                                     "models:), merged over the built-ins; repeatable; also "
                                                     "the LLMTWIN_SPECS environment variable")) -> None:
    """llmtwin: a digital twin of a vLLM serving cluster."""
    from twin import specs as spec_tables

    if spec_files:
        spec_tables.use_files([str(p) for p in spec_files])
    if spec_tables.user_files():
        try:  # a bad spec file is one line now, not an error at every field that looks a spec up
            spec_tables.load("hardware.yaml")
            spec_tables.load("models.yaml")
        except TwinInputError as e:
            _fail(f"{'--specs' if spec_files else spec_tables.ENV_VAR}: {e}")


def _fail(msg: str) -> None:
    from rich.markup import escape

    for line in str(msg).splitlines():  # the message is data: brackets in it are not rich markup
        err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _fmt(x, unit: str = "s") -> str:
    if x is None:
        return "-"
    if unit == "s":
        return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x:,.1f}"


SLOW_PURE_RUN_S = 30.0  # a pure-Python run this long is told of the compiled build


def print_summary(s: dict, console: Console) -> None:
    t = Table(title=f"{s['scenario']}: {s['requests_total']:,} requests", show_header=True)
    t.add_column("metric")
    for q in ("mean", "p50", "p90", "p99"):
        t.add_column(q, justify="right")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        d = s[key]
        t.add_row(label, *(_fmt(d[q]) for q in ("mean", "p50", "p90", "p99")))
    console.print(t)
    console.print(
        f"finished {s['requests_finished']:,}  rejected {s['requests_rejected']:,}  "
        f"still running {s['requests_running']:,}  not arrived {s['requests_not_arrived']:,}"
    )
    if s["reject_reasons"]:
        console.print("rejected because: " + ", ".join(f"{k} ({v})" for k, v in s["reject_reasons"].items()))
    console.print(
        f"throughput {s['throughput_output_tok_s']:,.0f} output tok/s, {s['throughput_req_s']:.2f} req/s; "
        f"goodput {s['goodput_req_s']:.2f} req/s; prefix-cache hit rate {s['prefix_cache_hit_rate']:.1%}; "
        f"preemptions {s['preemptions']:,}; KV use mean {s['kv_usage_mean']:.1%} peak {s['kv_usage_peak']:.1%}"
    )
    console.print(_slo_and_cost(s), highlight=False)
    for p, d in (s.get("by_priority") or {}).items():
        att = d["slo_attainment"]
        console.print(f"priority {p} ({s['engine']['scheduling_policy']}): {d['requests']:,} requests, TTFT p50 "
                      f"{_fmt(d['ttft_s']['p50'])} p99 {_fmt(d['ttft_s']['p99'])}, E2E p50 {_fmt(d['e2e_s']['p50'])}, "
                      f"goodput {d['goodput_req_s']:.2f} req/s" + (f" ({att:.1%} within the SLO)" if att is not None
                                                                   and any(s["slo"].values()) else ""),
                      highlight=False)
    for n in (s.get("workload") or {}).get("notes", []):
        if "scheduling_policy" in n:
            console.print(f"note: {n}", highlight=False)
    fleet = s.get("fleet")
    if fleet and (fleet["scaler"] != "none" or fleet["scale_events"]):
        ev = fleet["scale_events"]
        n_start, n_drain = (sum(e["action"] == a for e in ev) for a in ("start", "drain"))
        console.print(f"fleet ({fleet['scaler']} scaler, {fleet['decisions']} decisions): {fleet['initial_instances']} "
                      f"at the start, peak {fleet['peak_active']}, {fleet['final_active']} at the end; {n_start} "
                      f"started, {n_drain} drained (summary.json: fleet.scale_events, with each reason)",
                      highlight=False)
    build = s["build"]
    console.print(
        f"simulated {s['sim_time_s']:,.1f} s in {s['wall_time_s']:.2f} s wall "
        f"({s['sim_speedup'] or 0:,.0f}x real time, {s['requests_per_wall_s'] or 0:,.0f} requests/s, {build} build)"
    )
    if build == "pure Python" and s["wall_time_s"] >= SLOW_PURE_RUN_S:
        console.print("the compiled build runs the simulator about 6x faster: `make compiled` (README, Speed)")
    if not s["physics_ok"]:
        console.print("[bold red]WARNING: processed tokens/s exceed the hardware's roofline ceiling: a model bug[/]")
    if s.get("whatif"):
        pm = s["perf_model"]
        notes = [f"{k} ({v.get('predictor')} lengths)" if k == "semantic_batching" else k for k, v in s["whatif"].items()]
        assumed = [a for a in pm.get("assumptions", []) if a.startswith("whatif.")]
        acc = pm.get("whatif", {}).get("precision", {}).get("accuracy_note")
        console.print("what-if: " + ", ".join(notes) + "; accuracy not simulated"
                      + (f" (your note: {acc})" if acc else "")
                      + (f"; ASSUMPTIONS: {', '.join(assumed)}" if assumed else ""), highlight=False, soft_wrap=True)


def _slo_and_cost(s: dict) -> str:
    """SLO attainment against the bounds set, and the GPU time paid: what a fleet size or a scaler is judged on."""
    bounds = [f"{label} <= {_fmt(s['slo'][key])}" for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"),
                                                                     ("e2e_s", "E2E")) if s["slo"].get(key) is not None]
    att = s["slo_attainment"]
    head = (f"SLO attainment {att:.1%} of finished requests ({', '.join(bounds)})" if bounds and att is not None
            else "no SLO bound set" if not bounds else "SLO attainment: no request finished")
    gpu_s = s["gpu_seconds"]
    return f"{head}; {gpu_s / 3600:,.2f} GPU-hours ({gpu_s:,.0f} GPU-s)"


def default_out(name: str, root: Path = Path("runs")) -> Path:
    """runs/<scenario name>-<local time>, a new folder (a suffix when one of that second exists)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:80].rstrip("-.") or "run"  # a file name's limit: 255
    base = root / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, k = base, 2
    while out.exists():
        out, k = Path(f"{base}-{k}"), k + 1
    return out


def run_and_report(sc, stream, out: Optional[Path], quiet: bool, console: Console) -> dict:
    """Simulate with a live progress bar, print the summary, write the output files (to `default_out` when
    no folder is given; that folder is always printed, even with --quiet)."""
    from twin.sim.cluster import Cluster
    from twin.sim.dispatcher import RouterError

    cluster = Cluster(sc, stream)
    try:
        result = _run_with_bar(cluster, len(stream), quiet)
    except RouterError as e:
        _router_failed(e)
    return _report(sc, result, out, quiet, console)


def _run_with_bar(cluster, total: int, quiet: bool):
    if quiet:
        return cluster.run()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed:,}/{task.total:,} arrived"),
                  TextColumn("sim {task.fields[sim]:,.0f} s"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task("simulating", total=total, sim=0.0)
        return cluster.run(lambda now, arrived: bar.update(task, completed=arrived, sim=now))


def _report(sc, result, out: Optional[Path], quiet: bool, console: Console) -> dict:
    from twin.sim.metrics import summarize

    summary = summarize(result)
    if not quiet:
        print_summary(summary, console)
    chosen = out is None
    if chosen:
        out = default_out(sc.name)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
        names = [inst.id for inst in result.instances]
        result.log.to_frame(names).to_parquet(out / "requests.parquet", index=False)
        written = ["summary.json", "requests.parquet"]
        if result.timeline is not None:
            result.timeline.to_frame().to_parquet(out / "timeline.parquet", index=False)
            written.append("timeline.parquet")
    except OSError as e:
        raise TwinInputError(f"{'--out ' if not chosen else ''}{out}: cannot write the run's files: "
                             f"{e.strerror or e}") from None
    if not quiet or chosen:
        console.print(f"wrote {out / written[0]} and {', '.join(written[1:])} beside it"
                      + (" (no --out given)" if chosen else "") + f"; figures: twin plot {out}",
                      highlight=False, soft_wrap=True)
    if result.timeline is not None and result.timeline.note and not quiet:
        err.print("note: " + result.timeline.note, highlight=False, soft_wrap=True)
    hook_errors = (summary.get("router") or {}).get("hook_errors") or {}
    if hook_errors:  # a policy bug that dropped no request (twin.policy.host): said, never silent
        err.print("[bold yellow]warning:[/] policy errors during the run, no request dropped: "
                  + ", ".join(f"{k} raised {n:,}x" for k, n in sorted(hook_errors.items()))
                  + " (the first traceback of each is logged)", highlight=False, soft_wrap=True)
    if not summary["physics_ok"]:
        _physics_failed(summary, out)
    return summary


def _physics_failed(summary: dict, out: Path) -> None:
    """A run faster than its GPUs' roofline ceiling is a step-model bug, not a result: say so and exit 1."""
    err.print(f"[bold red]error:[/] the run processed {summary['processed_tok_s']:,.0f} tokens/s, above the "
              f"{summary['roofline_ceiling_tok_s']:,.0f} tokens/s its GPUs can compute at 100 % of peak FLOP/s: a "
              f"step-model bug, not a result (files kept in {out} for debugging; twin check shows the ceilings)",
              highlight=False, soft_wrap=True)
    raise typer.Exit(1)
