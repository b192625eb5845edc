"""Run the twin: `twin simulate`, `twin validate`, `twin replay`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from twin.errors import TwinInputError
from twin.cli.common import _fail, app, err, run_and_report


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


@app.command()
def simulate(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    set_: List[str] = typer.Option([], "--set", help="override a field: dotted.path=value (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for summary.json, requests.parquet "
                                                            "and timeline.parquet "
                                                            "(default: a new runs/<name>-<date>-<time>)"),
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
    from twin.sim.build import check_policies
    from twin.sim.metrics import resolved_engine
    from twin.scenario import load_scenario

    try:
        sc = load_scenario(scenario, set_)
        check_policies(sc)  # the router, scaler and predictor built: simulate refused a bad parameter, validate not
        out = {**sc.model_dump(), "resolved": {"engine": resolved_engine(sc)}}  # vLLM's defaults filled in
    except TwinInputError as e:
        _fail(str(e))
    typer.echo(json.dumps(out, indent=2))


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
    out: Optional[Path] = typer.Option(None, "--out", help="folder for summary.json, requests.parquet "
                                                            "and timeline.parquet "
                                                            "(default: a new runs/<name>-<date>-<time>)"),
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
            max_len = sc.cluster.max_model_len()
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
