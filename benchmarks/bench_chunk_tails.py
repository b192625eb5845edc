"""Chunk size, engine generation and TTFT tails in the twin (issue 20, items 4 and 5). Prints figures, asserts nothing.

1. `max_num_batched_tokens` 1024 / 2048 / 8192 on prefill-heavy loads. Prints mean ITL, E2E, TTFT and P99 TTFT,
   the steps run, and where the GPU time went (each roofline group summed over the run's steps). From this
   the cost of many small prefill chunks mixed with decodes can be read off.
2. The engine generations (`engine.vllm_version`) on one load: ITL and E2E of V0 < 0.6, V0 0.6-0.7, V1 sync
   and V1 async.
3. The linear layers of the roofline against Vidur's measured H100 operators (Llama-2-7B, TP 1). Gives the
   measured / roofline ratio per token count, and the elementwise kernels (norms, RoPE, activation, residual
   adds) the roofline has no group for; then the GEMMs' last wave (`perf.gemm_tail_tokens`) fitted across
   Llama-2-7B and -70B at TP 1-8: what makes a step of T compute-bound tokens cost T + ~150 tokens' FLOPs, and so
   many small prefill chunks more than few large ones.
4. TTFT P99/mean under each candidate tail mechanism, one at a time, on a closed-loop multi-turn load
   (32 clients, shared prefixes), the kind of load the issue's real H100 runs used. The mechanisms: arrival
   jitter (think time), batch interference (length spread, mnbt), the API server (off, FIFO) and async
   scheduling. No factor is added for the tail: every figure is what the model produces.
5. The kernels' fixed time per layer (`perf.layer_overhead_s`, default 0) as fitted on Vidur's profile, and
   what setting it does to ITL (async and sync; an 8B and a 34B model) and to the mnbt effect.

Run from the repository root: `.venv/bin/python benchmarks/bench_chunk_tails.py [--vidur PATH] [--n N]
[--profile h100-vllm]` (section 1 with the shipped fitted profile instead of the roofline's defaults).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np

from twin.sim.cluster import Cluster
from twin.specs.hardware import get_gpu
from twin.specs.models import get_model
from twin.perf.registry import build_perf
from twin.perf.roofline import RooflineModel
from twin.scenario import parse_scenario
from twin.workload import RequestStream

BASE = {
    "name": "bench-chunk-tails", "seed": 1,
    "cluster": {"num_instances": 1, "hardware": "H100", "model": "Llama-3-8B",
                "engine": {"max_num_seqs": 256}},
    "workload": {"num_requests": 10, "arrival": {"process": "poisson", "rate": 5},
                 "lengths": {"kind": "fixed", "prompt_tokens": 100, "output_tokens": 20}},
}


def scenario(**over):
    raw = copy.deepcopy(BASE)
    for path, v in over.items():
        node = raw
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = v
    return parse_scenario(raw, "bench")


class GroupRecorder:
    """The scenario's step model, summing each group's time over every step it prices."""

    def __init__(self, base) -> None:
        self.base = base
        self.sums: dict[str, float] = {}
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.__dict__["base"], name)

    def _add(self, b) -> None:
        for k, v in self.base.group_times(b).items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.steps += 1

    def step_time(self, b):
        self._add(b)
        return self.base.step_time(b)

    def decode_run_times(self, nd, ctx0, k):
        from twin.perf.base import StepBatch

        for s in range(k):
            self._add(StepBatch(num_decode_tokens=nd, decode_context_tokens=ctx0 + s * nd))
        return self.base.decode_run_times(nd, ctx0, k)


def arrivals(kind: str, n: int, rate: float, rng) -> np.ndarray:
    if kind == "uniform":
        return np.arange(n) / rate
    if kind == "poisson":
        return np.cumsum(rng.exponential(1 / rate, n))
    cv = float(kind.split("-")[1])  # gamma-<cv>
    k = 1 / cv ** 2
    return np.cumsum(rng.gamma(k, 1 / (rate * k), n))


def run(sc, arr, prompts, outputs, record=False):
    stream = RequestStream(np.asarray(arr, float), np.asarray(prompts), np.asarray(outputs), None)
    perf = GroupRecorder(build_perf(sc)) if record else None
    res = Cluster(sc, stream, perf=perf).run()
    log = res.log
    itl_v, itl_n = res.instances[0].scheduler.stats.itl.arrays()
    ttft = log.first_token_s - log.arrival_s
    out = {"itl_ms": 1e3 * float(np.sum(itl_v * itl_n) / np.sum(itl_n)),
           "e2e_s": float(np.mean(log.finish_s - log.arrival_s)), "ttft_ms": 1e3 * float(np.mean(ttft)),
           "p99_ttft_ms": 1e3 * float(np.percentile(ttft, 99)),
           "p99/mean": float(np.percentile(ttft, 99) / np.mean(ttft)),
           "steps": res.instances[0].scheduler.stats.num_steps}
    if record:
        out["groups_s"] = {k: round(v, 2) for k, v in perf.sums.items() if v}
    return out


def chunk_sizes(n: int, profile: str | None = None) -> None:
    # the roofline explicitly (its groups are what the breakdown prints); H100's default is the fitted profile
    perf = {"cluster.perf": {"kind": "fitted", "profile": profile}} if profile else {"cluster.perf.kind": "roofline"}
    print("## 1. max_num_batched_tokens on prefill-heavy loads (Llama-3-8B, 1x H100, async, Poisson; step model: "
          f"{'profile ' + profile if profile else 'roofline defaults'})")
    rng = np.random.default_rng(0)
    for prompt, out, rate in [(4096, 128, 6.0), (2048, 256, 10.0), (1024, 1024, 8.0)]:
        arr = arrivals("poisson", n, rate, rng)
        base = None
        for mnbt in (8192, 2048, 1024):
            r = run(scenario(**{"cluster.engine.max_num_batched_tokens": mnbt, **perf}), arr, [prompt] * n, [out] * n,
                    not profile)
            base = base or r
            rel = {k: f"{r[k] / base[k] - 1:+.1%}" for k in ("itl_ms", "e2e_s", "ttft_ms", "p99_ttft_ms")}
            print(f"  in {prompt} out {out} at {rate}/s, mnbt {mnbt:5d}: ITL {r['itl_ms']:.2f} ms, "
                  f"E2E {r['e2e_s']:.3f} s,"
                  f" TTFT {r['ttft_ms']:.1f} ms (P99 {r['p99_ttft_ms']:.1f}), steps {r['steps']}; vs 8192 {rel}")
            if "groups_s" in r:
                print(f"      time by group summed over steps (s; `cpu` is hidden under async up to the GPU time): "
                      f"{r['groups_s']}")


def generations(n: int) -> None:
    print("## 2. engine generation (vllm_version; in 300 out 64 at 40/s)")
    arr = np.arange(n) / 40.0
    for v in ("0.5.4", "0.7", "0.12", "0.32"):
        r = run(scenario(**{"cluster.engine.vllm_version": v, "cluster.engine.max_num_seqs": None}), arr,
                [300] * n, [64] * n)
        print(f"  vllm {v:6s}: ITL {r['itl_ms']:.2f} ms, E2E {r['e2e_s']:.3f} s, TTFT {r['ttft_ms']:.1f} ms")
    print("   saturated (in 1000 out 200, all at t=0; 256 seqs): output tokens/s")
    m = 2 * n
    tput = {}
    for v in ("0.5.4", "0.7", "0.12", "0.32"):
        sc = scenario(**{"cluster.engine.vllm_version": v, "cluster.engine.max_num_seqs": 256})
        res = Cluster(sc, RequestStream(np.zeros(m), np.full(m, 1000), np.full(m, 200), None)).run()
        tput[v] = 200 * m / float(np.nanmax(res.log.finish_s))
    print("  " + ", ".join(f"vllm {v}: {t:,.0f}" for v, t in tput.items())
          + f"; 0.32 / 0.5.4 = {tput['0.32'] / tput['0.5.4']:.2f}x")


def vidur(path: Path) -> None:
    print(f"## 3. linear layers: Vidur's measured H100 Llama-2-7B operators vs the roofline ({path.name})")
    if not path.exists():
        print(f"  {path}: not found, skipped")
        return
    import pandas as pd

    d = pd.read_csv(path)
    d = d[d.num_tensor_parallel_workers == 1]
    m = get_model("Llama-2-7B")
    roof = RooflineModel(get_gpu("H100"), m)
    lin = ["attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"]
    elem = ["input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add"]
    for t in (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        row = d[d.num_tokens == t]
        if row.empty:
            continue
        row = row.iloc[0]
        meas = sum(row[f"time_stats.{k}.median"] for k in lin) * 1e-3
        el = sum(row[f"time_stats.{k}.median"] for k in elem) * 1e-3
        # the roofline's linear group without the embedding gather, per layer (the profile's unit)
        r = (roof._linear(t) - roof._act_s * t) / m.num_layers
        print(f"  {t:5d} tokens: measured {meas * 1e3:.3f} ms/layer, roofline {r * 1e3:.3f} (x{meas / r:.2f});"
              f" elementwise kernels {el * 1e3:.3f} ms/layer (+{el / r:.0%} of the roofline)")
    gemm_tail(path)


def gemm_tail(path: Path) -> None:
    """The GEMMs' last wave (perf.gemm_tail_tokens): each model and TP degree's 4 GEMMs a layer at 512-4096 tokens
    fit as a x T + b; across them b = fixed + tail x a (the tail in tokens of compute)."""
    import pandas as pd

    lin = ["attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"]
    ab = []
    for csv in (path, path.with_name("llama-2-70b.mlp.csv")):
        if not csv.exists():
            continue
        d = pd.read_csv(csv)
        for tp in sorted(d.num_tensor_parallel_workers.unique()):
            x = d[(d.num_tensor_parallel_workers == tp) & (d.num_tokens >= 512)]
            t = x[[f"time_stats.{k}.median" for k in lin]].sum(axis=1).to_numpy() * 1e-3
            (a, b), *_ = np.linalg.lstsq(np.c_[x.num_tokens.to_numpy(), np.ones(len(t))], t, rcond=None)
            ab.append((a, b))
            print(f"  {csv.name.split('.')[0]} TP {tp}: {a * 1e9:.1f} ns/token + {b * 1e6:.1f} us a layer "
                  f"(= {b / a:.0f} tokens of compute)")
    if len(ab) >= 3:
        a, b = np.array(ab).T
        (fixed, tail), *_ = np.linalg.lstsq(np.c_[np.ones(len(a)), a], b, rcond=None)
        print(f"  across them: b = {fixed * 1e6:.1f} us + {tail:.0f} tokens x a (max residual "
              f"{np.max(np.abs(fixed + tail * a - b)) * 1e6:.1f} us): perf.gemm_tail_tokens defaults to 150")


def closed_loop(clients: int, rounds: int, turns: int, msg, out, think_s, rng, block: int = 16,
                ramp_s: float = 2.0) -> RequestStream:
    """`clients` closed-loop users (as `vllm bench serve --max-concurrency`), each running conversations of
    `turns` turns back to back: turn k's prompt is the conversation so far plus a new message (a shared
    prefix), sent `think_s()` after the previous answer ends. `msg` / `out` draw a message / answer length."""
    arr, pr, ou, hashes, after, think = [], [], [], [], [], []
    last = [-1] * clients
    ctx = [0] * clients
    conv = [0] * clients
    for k in range(rounds):
        for c in range(clients):
            if k % turns == 0:
                ctx[c] = 0
                conv[c] += 1
            p_tok = ctx[c] + int(msg())
            o_tok = int(out())
            base = ((c << 12) + conv[c]) << 20
            # round 0 spread over `ramp_s` (clients start one by one, as a benchmark's do; started together
            # with equal lengths they would stay in lockstep); later rounds: the closed loop sets the times
            arr.append((k + c / clients) * ramp_s)
            pr.append(p_tok)
            ou.append(o_tok)
            hashes.append(list(range(base, base + -(-(p_tok + o_tok) // block))))
            after.append(last[c])
            think.append(think_s() if last[c] >= 0 else 0.0)
            last[c] = len(arr) - 1
            ctx[c] = p_tok + o_tok
    return RequestStream(np.array(arr), np.array(pr), np.array(ou), hashes, block, hashes_cover_output=True,
                         after=np.array(after), think_s=np.array(think))


def tails(n: int) -> None:
    print("## 4. TTFT P99/mean by mechanism: closed loop, multi-turn shared prefix (Llama-3-8B, 1x H100, async)")
    print("   (the issue's real H100 runs: 1.18-1.99; the twin there: 1.10-1.13)")
    clients = 32
    rounds = max(n // clients, 8)
    fixed = lambda v: (lambda: v)  # noqa: E731

    def lognorm(rng, mu, sig, lo, hi):
        return lambda: float(np.clip(rng.lognormal(np.log(mu), sig), lo, hi))

    def case(name, over=None, msg=None, out=None, think=None, turns=4):
        rng = np.random.default_rng(7)
        stream = closed_loop(clients, rounds, turns, msg or fixed(400), out or fixed(200), think or fixed(0.0), rng)
        sc = scenario(**(over or {}))
        res = Cluster(sc, stream).run()
        log = res.log
        ttft = (log.first_token_s - log.arrival_s)[clients:]  # past the simultaneous first round
        ttft = ttft[np.isfinite(ttft)]
        m, p99 = float(np.mean(ttft)), float(np.percentile(ttft, 99))
        print(f"  {name:44s}: TTFT mean {1e3 * m:7.1f} ms, P99 {1e3 * p99:7.1f} ms, P99/mean {p99 / m:.2f}")

    case("fixed lengths, no think time (baseline)")
    case("think time exp(1 s) (arrival jitter)", think=lambda r=np.random.default_rng(3): float(r.exponential(1.0)))
    case("message lengths lognormal (sigma 1)", msg=lognorm(np.random.default_rng(4), 400, 1.0, 8, 3000))
    case("answer lengths lognormal (sigma 1)", out=lognorm(np.random.default_rng(5), 200, 1.0, 2, 1500))
    case("both lengths lognormal", msg=lognorm(np.random.default_rng(4), 400, 1.0, 8, 3000),
         out=lognorm(np.random.default_rng(5), 200, 1.0, 2, 1500))
    case("mnbt 1024 (more prefill/decode interleaving)", {"cluster.engine.max_num_batched_tokens": 1024})
    case("mnbt 16384", {"cluster.engine.max_num_batched_tokens": 16384})
    case("API server off", {"cluster.perf.api_request_overhead_s": 0.0, "cluster.perf.api_prompt_token_s": 0.0,
                            "cluster.perf.api_output_token_s": 0.0})
    case("API server FIFO", {"cluster.perf.api_queue": "fifo"})
    case("async scheduling off", {"cluster.engine.async_scheduling": False})
    case("1 turn per conversation (no prefix hits)", turns=1)
    case("8 turns per conversation", turns=8)


def layer_overhead(n: int, path: Path) -> None:
    print("## 5. the kernels' fixed time per layer (perf.layer_overhead_s): its fit, and what it moves")
    if path.exists():
        import pandas as pd

        pts = []
        for name, csv in (("Llama-2-7B", path), ("Llama-2-70B", path.with_name("llama-2-70b.mlp.csv"))):
            if not csv.exists():
                continue
            d = pd.read_csv(csv)
            d = d[(d.num_tensor_parallel_workers == 1) & (d.num_tokens <= 64)]
            m = get_model(name)
            w = RooflineModel(get_gpu("H100"), m)._lin_w / m.num_layers * get_gpu("H100").hbm_bandwidth * 0.9
            g = d[[f"time_stats.{k}.median" for k in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj",
                                                       "mlp_down_proj")]].sum(axis=1).median() * 1e-3
            e = d[[f"time_stats.{k}.median" for k in ("input_layernorm", "attn_rope", "post_attention_layernorm",
                                                       "mlp_act", "add")]].sum(axis=1).median() * 1e-3
            pts.append((w, g, e))
        if len(pts) == 2:
            (w1, g1, e1), (w2, g2, e2) = pts
            slope = (g2 - g1) / (w2 - w1)
            print(f"  GEMMs at 1-64 tokens: {1 / slope / 1e12:.2f} TB/s + {1e6 * (g1 - slope * w1):.1f} us a layer; "
                  f"elementwise kernels {1e6 * e1:.1f} us (7B) / {1e6 * e2:.1f} us (70B) a layer")
    rng = np.random.default_rng(0)
    arr = np.cumsum(rng.exponential(1 / 4.0, n))
    for lo in (0.0, 20e-6, 40e-6):
        row = []
        for model, tp in (("Llama-3-8B", 1), ("CodeLlama-34B", 2)):
            r = {}
            for asy in (True, False):
                sc = scenario(**{"cluster.model": model, "cluster.tensor_parallel": tp,
                                 "cluster.perf.layer_overhead_s": lo, "cluster.engine.async_scheduling": asy})
                r[asy] = run(sc, arr, [1000] * n, [300] * n)["itl_ms"]
            row.append(f"{model} TP{tp}: ITL async {r[True]:.2f} ms, sync {r[False]:.2f} ms")
        print(f"  layer_overhead_s {1e6 * lo:4.0f} us: " + "; ".join(row))
    for lo in (0.0, 40e-6):
        res = {}
        for mnbt in (1024, 8192):
            sc = scenario(**{"cluster.engine.max_num_batched_tokens": mnbt, "cluster.perf.layer_overhead_s": lo})
            res[mnbt] = run(sc, np.cumsum(np.random.default_rng(0).exponential(1 / 6.0, n)), [4096] * n, [128] * n)
        itl = res[1024]["itl_ms"] / res[8192]["itl_ms"] - 1
        e2e = res[1024]["e2e_s"] / res[8192]["e2e_s"] - 1
        print(f"  layer_overhead_s {1e6 * lo:4.0f} us, in 4096 out 128: mnbt 1024 vs 8192: ITL {itl:+.1%}, E2E {e2e:+.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="requests per run")
    ap.add_argument("--vidur", type=Path, default=Path("../shared/profiles/vidur-h100/llama-2-7b.mlp.csv"))
    ap.add_argument("--only", default="12345")
    ap.add_argument("--profile", default=None, help="section 1 with a shipped fitted profile (e.g. h100-vllm)")
    a = ap.parse_args()
    if "1" in a.only:
        chunk_sizes(a.n, a.profile)
    if "2" in a.only:
        generations(min(a.n, 200))
    if "3" in a.only:
        vidur(a.vidur)
    if "4" in a.only:
        tails(a.n)
    if "5" in a.only:
        layer_overhead(min(a.n, 200), a.vidur)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
