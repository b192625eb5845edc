"""Measure GEMM and attention times on a GPU over the bundled models' shapes; write Vidur-style operator CSVs.

For when a GPU machine is at hand (never imported by the tests; nothing here runs on a CPU). Per model in
twin/specs/models.yaml (dense ones; `--models` to choose), per tensor-parallel degree and token count, it times
the linear layers of one decoder layer as vLLM runs them (QKV projection `attn_pre_proj`, output projection
`attn_post_proj`, gate+up `mlp_up_proj`, `mlp_act` (SiLU x mul), `mlp_down_proj`, the two RMSNorms and the
residual add) in BF16 with torch, and in FP8 with Transformer Engine where it is installed (`--fp8`), and
writes `<model>.mlp.csv` in the columns of ../shared/profiles/vidur-h100/ (`time_stats.<op>.<stat>` in
milliseconds, then `n_head, n_kv_head, n_embd, n_expanded_embd, vocab_size, use_gated_mlp, num_tokens,
num_tensor_parallel_workers`), so `twin calibrate FILE --hardware GPU --out PROFILE` fits it directly.
Attention (`<model>.attention.csv`): prefill with torch's scaled_dot_product_attention (causal) over prompt
lengths, and decode as one query against a KV context over batch x context, with their roofline FLOPs and bytes.

Timing: CUDA events around `--reps` calls after `--warmup` calls; min/max/mean/median/std over the reps. A
default run (4 models x 1 TP degree x 14 token counts, plus attention) takes a few minutes on an H100.

Usage:  python scripts/profile_gpu.py --out profiles/h100 [--models Llama-3-8B,Qwen2.5-32B] [--tp 1,2] [--fp8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFILL_LENS = (128, 512, 1024, 2048, 4096)
DECODE = ((1, 1024), (8, 1024), (32, 1024), (64, 2048), (128, 2048), (256, 4096))


def timer(fn, warmup: int, reps: int):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))  # ms
    return out


def stats(prefix: str, ms: list) -> dict:
    import statistics

    return {f"time_stats.{prefix}.min": min(ms), f"time_stats.{prefix}.max": max(ms),
            f"time_stats.{prefix}.mean": statistics.fmean(ms), f"time_stats.{prefix}.median": statistics.median(ms),
            f"time_stats.{prefix}.std": statistics.pstdev(ms)}


def linear_ops(m, tp: int, t: int, fp8: bool, warmup: int, reps: int) -> dict:
    """One layer's non-attention operators for t tokens on one GPU's share (weights split by tp)."""
    import torch

    dev, dt = "cuda", torch.bfloat16
    h, hd = m.hidden_size, m.head_dim
    q = m.num_heads * hd // tp
    kv = max(m.num_kv_heads // tp, 1) * hd
    inter = m.intermediate_size // tp
    x = torch.randn(t, h, device=dev, dtype=dt)
    shapes = {"attn_pre_proj": (h, q + 2 * kv), "attn_post_proj": (q, h), "mlp_up_proj": (h, 2 * inter),
              "mlp_down_proj": (inter, h)}
    row = {}
    te = None
    if fp8:
        try:
            import transformer_engine.pytorch as te  # noqa: F811
            from transformer_engine.common.recipe import DelayedScaling
        except ImportError:
            te = None
    for op, (k, n) in shapes.items():
        a = torch.randn(t, k, device=dev, dtype=dt)
        if te is not None:
            layer = te.Linear(k, n, bias=False, params_dtype=dt).to(dev)
            recipe = DelayedScaling()

            def f(layer=layer, a=a, recipe=recipe):
                with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                    layer(a)
        else:
            w = torch.randn(k, n, device=dev, dtype=dt)

            def f(a=a, w=w):
                a @ w
        row.update(stats(op, timer(f, warmup, reps)))
    g = torch.randn(t, 2 * inter, device=dev, dtype=dt)
    row.update(stats("mlp_act", timer(lambda: torch.nn.functional.silu(g[:, :inter]) * g[:, inter:], warmup, reps)))
    w = torch.ones(h, device=dev, dtype=dt)
    norm = lambda: torch.nn.functional.rms_norm(x, (h,), w)  # noqa: E731
    row.update(stats("input_layernorm", timer(norm, warmup, reps)))
    row.update(stats("post_attention_layernorm", timer(norm, warmup, reps)))
    row.update(stats("add", timer(lambda: x + x, warmup, reps)))
    ids = torch.randint(0, m.vocab_size, (t,), device=dev)
    emb = torch.randn(m.vocab_size, h, device=dev, dtype=dt)
    row.update(stats("emb", timer(lambda: emb[ids], warmup, reps)))
    row.update({"n_head": m.num_heads, "n_kv_head": m.num_kv_heads, "n_embd": h, "n_expanded_embd": m.intermediate_size,
                "vocab_size": m.vocab_size, "use_gated_mlp": True, "num_tokens": t, "num_tensor_parallel_workers": tp,
                "dtype": "fp8" if te is not None else "bf16"})
    return row


def attention_rows(m, tp: int, warmup: int, reps: int) -> list:
    import torch

    dev, dt = "cuda", torch.bfloat16
    heads, kvh, hd = m.num_heads // tp, max(m.num_kv_heads // tp, 1), m.head_dim
    rows = []
    for p in PREFILL_LENS:
        q = torch.randn(1, heads, p, hd, device=dev, dtype=dt)
        k = torch.randn(1, heads, p, hd, device=dev, dtype=dt)
        f = lambda q=q, k=k: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)  # noqa: E731
        rows.append({"phase": "prefill", "batch": 1, "context": p, **stats("attention", timer(f, warmup, reps)),
                     "flops": 4.0 * heads * hd * p * (p + 1) / 2, "kv_bytes": 2.0 * kvh * hd * 2 * p,
                     "n_head": m.num_heads, "n_kv_head": m.num_kv_heads, "head_dim": hd,
                     "num_tensor_parallel_workers": tp})
    for b, ctx in DECODE:
        q = torch.randn(b, heads, 1, hd, device=dev, dtype=dt)
        k = torch.randn(b, heads, ctx, hd, device=dev, dtype=dt)  # GQA expanded: an upper bound on bytes read
        f = lambda q=q, k=k: torch.nn.functional.scaled_dot_product_attention(q, k, k)  # noqa: E731
        rows.append({"phase": "decode", "batch": b, "context": ctx, **stats("attention", timer(f, warmup, reps)),
                     "flops": 4.0 * heads * hd * ctx * b, "kv_bytes": 2.0 * kvh * hd * 2 * ctx * b,
                     "n_head": m.num_heads, "n_kv_head": m.num_kv_heads, "head_dim": hd,
                     "num_tensor_parallel_workers": tp})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="Llama-2-7B,Llama-3-8B,Llama-2-70B,Llama-3-70B")
    ap.add_argument("--tp", default="1")
    ap.add_argument("--fp8", action="store_true", help="FP8 GEMMs with Transformer Engine (where installed)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    import pandas as pd
    import torch

    from twin.specs.models import get_model

    if not torch.cuda.is_available():
        print("error: no CUDA device: this script measures a GPU (the fitted CSV format is in its docstring)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name in [s.strip() for s in args.models.split(",") if s.strip()]:
        m = get_model(name)
        if m.is_moe:
            print(f"skip {m.name}: MoE experts are not profiled by this script")
            continue
        rows, attn = [], []
        for tp in (int(x) for x in args.tp.split(",")):
            if m.num_heads % tp:
                continue
            for t in (x for x in TOKENS if x <= args.max_tokens):
                rows.append(linear_ops(m, tp, t, args.fp8, args.warmup, args.reps))
            attn += attention_rows(m, tp, args.warmup, args.reps)
            torch.cuda.empty_cache()
        stem = m.name.lower()
        pd.DataFrame(rows).to_csv(args.out / f"{stem}.mlp.csv", index=False)
        pd.DataFrame(attn).to_csv(args.out / f"{stem}.attention.csv", index=False)
        print(f"{m.name}: {len(rows)} linear rows, {len(attn)} attention rows ({time.time() - t0:.0f} s so far)")
    (args.out / "README.md").write_text(
        f"Measured by scripts/profile_gpu.py on {torch.cuda.get_device_name()} (torch {torch.__version__}), "
        f"{time.strftime('%Y-%m-%d')}; {'FP8 (Transformer Engine)' if args.fp8 else 'BF16'} GEMMs; times in ms.\n")
    print(f"wrote {args.out} in {time.time() - t0:.0f} s; fit with: twin calibrate {args.out}/<model>.mlp.csv "
          "--hardware <GPU> --out profile.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
