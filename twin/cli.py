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


def _router_failed(e: BaseException) -> None:
    """A router bug: the router's own traceback, then one line naming the request; exit 1."""
    import traceback

    from twin.dispatcher import router_cause

    cause = router_cause(e)
    err.print("".join(traceback.format_exception(type(cause), cause, cause.__traceback__)), highlight=False,
              markup=False, end="")
    err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
    err.print("(set router.on_error: reject to count such requests as rejected and go on)", highlight=False)
    raise typer.Exit(1)


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
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
        names = [inst.id for inst in result.instances]
        result.log.to_frame(names).to_parquet(out / "requests.parquet", index=False)
        written = ["summary.json", "requests.parquet"]
        if result.timeline is not None:
            result.timeline.to_frame().to_parquet(out / "timeline.parquet", index=False)
            written.append("timeline.parquet")
        if not quiet:
            console.print(f"wrote {', '.join(written)} to {out} (figures: twin plot {out})")
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


def _replay_scenario(scenario: Path, set_: List[str], seed: Optional[int], trace: dict, keep_arrival: bool):
    """The scenario's cluster, router and SLOs with `trace` as its workload (its other workload keys dropped,
    except on_too_long, and arrival when `keep_arrival`: for traces without timestamps)."""
    from twin.scenario import apply_overrides, parse_scenario, read_scenario_yaml

    raw = apply_overrides(read_scenario_yaml(scenario), set_)
    old = raw.get("workload") if isinstance(raw.get("workload"), dict) else {}
    workload = {k: old[k] for k in ("on_too_long", "arrival") if k in old and (k != "arrival" or keep_arrival)}
    if "arrival" in trace:
        workload["arrival"] = trace.pop("arrival")
    workload["trace"] = trace
    raw["workload"] = workload
    if seed is not None:
        raw["seed"] = seed
    return parse_scenario(raw, str(scenario), scenario.parent)


@app.command()
def replay(
    trace: Path = typer.Argument(..., help="trace file (or ServeGen model folder)"),
    format_: str = typer.Option("auto", "--format", help="auto|sharegpt|burstgpt|azure|mooncake|servegen|lengths"),
    scenario: Path = typer.Option(..., "--scenario",
                                  help="scenario YAML: cluster, router, SLOs (its workload is replaced)"),
    set_: List[str] = typer.Option([], "--set", help="override a scenario field: dotted.path=value (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for summary.json and requests.parquet"),
    seed: Optional[int] = typer.Option(None, "--seed", help="override the scenario's seed (sampling, arrivals)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or table"),
    start: Optional[float] = typer.Option(None, "--start", help="window start, s on the trace's own clock"),
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
    from twin.workload.formats import MOONCAKE_BLOCK, UNTIMED, detect_format, ideal_block_reuse
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
    if rate is not None or arrival is not None or cv is not None:
        if rate is None:
            _fail("--arrival/--cv need --rate (requests/s)")
        if fmt not in UNTIMED:
            _fail(f"--rate/--arrival/--cv apply to traces without timestamps (sharegpt, lengths); {fmt} traces "
                  "have their own: change their rate with --rate-scale or --target-rate")
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


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
