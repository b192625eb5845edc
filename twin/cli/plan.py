"""Engine-knob planning: `twin plan-chunk`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from twin.errors import TwinInputError, out_folder
from twin.cli.common import _fail, _fmt, app, err


@app.command("plan-chunk")
def plan_chunk(
    scenario: Path = typer.Argument(..., help="scenario YAML file (its workload and SLOs)"),
    candidates: Optional[str] = typer.Option(None, "--candidates",
                                             help="max_num_batched_tokens values (default 256,512,...,16384)"),
    max_num_seqs: Optional[str] = typer.Option(None, "--max-num-seqs", help="also try these max_num_seqs"),
    long_prefill: Optional[str] = typer.Option(None, "--long-prefill-token-threshold",
                                               help="also try these long_prefill_token_threshold values"),
    tie_tolerance: float = typer.Option(0.01, "--tie-tolerance",
                                        help="relative goodput within which settings tie (the smaller chunk wins)"),
    set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value (repeatable)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="override the scenario's seed"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for chunk_plan.csv and chunk_plan.png"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar; print only the choice"),
) -> None:
    """Choose max_num_batched_tokens (the prefill chunk) with the highest goodput under the scenario's SLOs."""
    from twin.analysis.planning import candidate_values, plan_frame, plot_plan, slo_of, twin_evaluator, window_of
    from twin.policy.chunk import DEFAULT_CHUNKS, ChunkPlanner
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    console = Console()
    try:
        if not tie_tolerance >= 0:  # NaN too
            raise TwinInputError(f"--tie-tolerance {tie_tolerance}: must be a number >= 0")
        chunks = candidate_values(candidates, "--candidates") or list(DEFAULT_CHUNKS)
        seqs = candidate_values(max_num_seqs, "--max-num-seqs")
        if seqs is not None and 0 in seqs:
            raise TwinInputError("--max-num-seqs: values must be > 0")
        lpt = candidate_values(long_prefill, "--long-prefill-token-threshold")
        sc = load_scenario(scenario, set_, seed)
        slo = slo_of(sc)
        if not slo.is_set():
            raise TwinInputError(f"{scenario}: no SLOs to plan for: set slo.ttft_s and/or slo.tpot_s "
                                 "(e.g. --set slo.ttft_s=1 --set slo.tpot_s=0.05)")
        stream = build_stream(sc)
        if out is not None:
            out_folder(out)  # before the candidates run
    except TwinInputError as e:
        _fail(str(e))
    planner = ChunkPlanner(twin_evaluator(sc), chunks, seqs or [None], lpt or [None], tie_tolerance)
    n = len(planner.candidates())
    if n == 0:
        _fail("no candidate left: every max_num_batched_tokens is below its max_num_seqs, which vLLM refuses")
    window = window_of(stream)
    if quiet:
        rows = planner.rank(window, slo)
    else:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("candidates", total=n)
            rows = planner.rank(window, slo, progress=lambda c: bar.update(task, advance=1))
    chosen = next((c for c in rows if c.chosen), None)
    if not quiet:
        t = Table(title=f"{sc.name}: {len(stream):,} requests, SLO "
                        + ", ".join(f"{k} {v:g} s" for k, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s),
                                                                  ("E2E", slo.e2e_s)) if v is not None))
        cols = ["max_num_batched_tokens"] + [c for c, vals in (("max_num_seqs", seqs),
                                                               ("long_prefill_token_threshold", lpt)) if vals]
        heads = {"max_num_batched_tokens": "chunk", "long_prefill_token_threshold": "long prefill"}
        for c in [*(heads.get(c, c) for c in cols), "goodput req/s", "SLO att.", "TTFT p99", "TPOT p99", "ITL p99", ""]:
            t.add_column(c, justify="right")
        for c in rows:
            args = c.knobs.as_engine_args()
            if c.error:
                t.add_row(*(str(args.get(k, "-")) for k in cols), f"[red]{c.error}[/]", "", "", "", "", "")
                continue
            att = "-" if c.slo_attainment is None else f"{c.slo_attainment:.1%}"
            t.add_row(*(str(args.get(k, "-")) for k in cols), f"{c.goodput_req_s:.2f}", att, _fmt(c.ttft_p99_s),
                      _fmt(c.tpot_p99_s), _fmt(c.itl_p99_s), "[bold green]chosen[/]" if c.chosen else "")
        console.print(t)
    if chosen is None:
        first = next((c.error for c in rows if c.error), "no candidate produced a goodput")
        _fail(f"no candidate could be evaluated: {first}")
    console.print(f"chosen: {chosen.knobs.label()} (goodput {chosen.goodput_req_s:.2f} req/s"
                  + (f", SLO attainment {chosen.slo_attainment:.1%}" if chosen.slo_attainment is not None else "")
                  + f"; ties within {tie_tolerance:.0%} go to the smaller chunk)")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plan_frame(rows).to_csv(out / "chunk_plan.csv", index=False)
        png = plot_plan(rows, slo, out / "chunk_plan.png", f"{sc.name}: goodput and p99 latency by chunk size")
        if not quiet:
            console.print(f"wrote {out / 'chunk_plan.csv'} and {png}")


# ---- output-length predictors: twin predictor train / eval ----
