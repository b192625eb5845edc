"""The `twin` command: simulate a scenario, print a summary, write summary.json and requests.parquet."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from twin.errors import TwinInputError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="llmtwin: a digital twin of a vLLM serving cluster.")
err = Console(stderr=True)


def _fail(msg: str) -> None:
    for line in str(msg).splitlines():
        err.print(f"[bold red]error:[/] {line}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _fmt(x, unit: str = "s") -> str:
    if x is None:
        return "-"
    if unit == "s":
        return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x:,.1f}"


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
    console.print(
        f"simulated {s['sim_time_s']:,.1f} s in {s['wall_time_s']:.2f} s wall "
        f"({s['sim_speedup'] or 0:,.0f}x real time, {s['requests_per_wall_s'] or 0:,.0f} requests/s)"
    )
    if not s["physics_ok"]:
        console.print("[bold red]WARNING: processed tokens/s exceed the hardware's roofline ceiling: a model bug[/]")


def run_and_report(sc, stream, out: Optional[Path], quiet: bool, console: Console) -> dict:
    """Simulate with a live progress bar, print the summary, write the output files."""
    from twin.cluster import Cluster
    from twin.metrics import summarize

    cluster = Cluster(sc, stream)
    total = len(stream)
    if quiet:
        result = cluster.run()
    else:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} arrived"),
                      TextColumn("sim {task.fields[sim]:,.0f} s"), TimeElapsedColumn(), console=err,
                      transient=True) as bar:
            task = bar.add_task("simulating", total=total, sim=0.0)
            result = cluster.run(lambda now, arrived: bar.update(task, completed=arrived, sim=now))
    summary = summarize(result)
    if not quiet:
        print_summary(summary, console)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
        names = [inst.id for inst in result.instances]
        result.log.to_frame(names).to_parquet(out / "requests.parquet", index=False)
        if not quiet:
            console.print(f"wrote {out / 'summary.json'} and {out / 'requests.parquet'}")
    return summary


@app.command()
def simulate(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for summary.json and requests.parquet"),
    seed: Optional[int] = typer.Option(None, "--seed", help="override the scenario's seed"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
) -> None:
    """Simulate SCENARIO and report TTFT, TPOT, ITL, E2E, goodput and KV use."""
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    console = Console()
    try:
        sc = load_scenario(scenario, set_, seed)
        stream = build_stream(sc)
        run_and_report(sc, stream, out, quiet, console)
    except TwinInputError as e:
        _fail(str(e))


@app.command()
def validate(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value"),
) -> None:
    """Check a scenario without running it; print the fully resolved scenario."""
    from twin.scenario import load_scenario

    try:
        sc = load_scenario(scenario, set_)
    except TwinInputError as e:
        _fail(str(e))
    typer.echo(json.dumps(sc.model_dump(), indent=2))


@app.command()
def specs() -> None:
    """List the GPUs and models the twin knows."""
    from twin.hardware import get_gpu, known_gpus
    from twin.models import get_model, known_models

    console = Console()
    t = Table(title="GPUs")
    for c in ("name", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB", "HBM TB/s"):
        t.add_column(c)
    for n in known_gpus():
        g = get_gpu(n)
        fp8 = g.peak_flops.get("fp8")
        t.add_row(n, f"{g.peak_flops['bf16'] / 1e12:.0f}", f"{fp8 / 1e12:.0f}" if fp8 else "-",
                  f"{g.hbm_bytes / 1e9:.0f}", f"{g.hbm_bandwidth / 1e12:.2f}")
    console.print(t)
    t = Table(title="Models")
    for c in ("name", "layers", "hidden", "heads/kv", "params", "KV KiB/token (16-bit)"):
        t.add_column(c)
    for n in known_models():
        m = get_model(n)
        t.add_row(n, str(m.num_layers), str(m.hidden_size), f"{m.num_heads}/{m.num_kv_heads}",
                  f"{m.num_params / 1e9:.1f} B", f"{m.kv_bytes_per_token() // 1024}")
    console.print(t)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
