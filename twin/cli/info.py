"""What the twin knows and can check: `twin specs`, `twin routers`, `twin scalers`, `twin check`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from twin.errors import TwinInputError
from twin.cli.common import _fail, app


@app.command()
def specs() -> None:
    """List the GPUs and models the twin knows, with the figures it sizes from and where each comes from."""
    from twin import specs as spec_tables
    from twin.specs.hardware import get_gpu, known_gpus
    from twin.specs.models import get_model, known_models

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
    from twin.analysis.physics import fmt_rate

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
    from twin.sim.cluster import build_perf, engine_config
    from twin.analysis.physics import ceilings, fmt_rate, judge, parse_claim, parse_mix

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
