#!/usr/bin/env python
"""Side by side: Vidur (PyPI `vidur`, in its own venv) and the twin on the issue-3 configuration.

Llama-2-7B, one H100 per instance (TP 1), 16 instances, least-outstanding-requests, block 16,
max_num_seqs 128, 4096-token batches, Poisson 160 req/s, ShareGPT lengths from
../shared/traces/length_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv (total <= 4096), seed 42.

  bash benchmarks/vidur_setup.sh                          # once: benchmarks/.vidur-venv with vidur 0.0.26
  .venv/bin/python benchmarks/vidur_compare.py            # 10,000 requests, Vidur's own length capping
  .venv/bin/python benchmarks/vidur_compare.py --lengths matched --json benchmarks/results/vidur.json

Each simulator runs in its own process, one after the other; the script prints wall times, simulated
requests and simulated seconds per wall second, peak RSS (VmHWM) of each process, the speed ratio, and
median TTFT / E2E side by side, with the reasons they differ.

Vidur cannot run here exactly as published: see vidur_runner.py for the two things it needed (its
step-time profiles come from Hugging Face at run time, unreachable offline, so a predictor built from
the measured H100 linear-layer profile in ../shared/profiles plus a roofline attention model stands in;
and a one-line fix of a Request.restart() bug that makes any preemption crash).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV_PY = HERE / ".vidur-venv" / "bin" / "python"
WORK = HERE / ".vidur-work"
TRACE = ROOT.parent / "shared" / "traces" / "length_traces" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
PROFILE = ROOT.parent / "shared" / "profiles" / "vidur-h100" / "llama-2-7b.mlp.csv"
SCENARIO = ROOT / "scenarios" / "bench-16xh100.yaml"

EXPLANATION = """\
Why the latencies differ (same arrival process and length source, different engine models):
 1. Scheduler. Vidur's `vllm` replica scheduler is vLLM V0's: a batch holds either whole-prompt prefills
    (up to 4096 tokens) or decodes, never both, and waiting prompts go first. The twin models vLLM V1:
    running requests first (decodes, then the next prefill chunk), then new requests, mixed in one step
    under the 4096-token budget, with chunked prefill.
 2. Admission and KV. Vidur admits a request when its prompt's blocks fit (above a 1 % watermark) and
    grows it a block at a time, restarting the newest when blocks run out; the twin (as vLLM 0.32 with
    scheduler_reserve_full_isl) admits only when the whole prompt fits and pre-empts the most recently
    admitted request when a step's blocks run out. KV capacity differs too (see "KV blocks"): Vidur
    sizes it as 80 GiB x 0.9 - weights, the twin as 80 GB x 0.9 - weights - 2 GB of activations.
 3. Step time (see the step-time table). Here Vidur's linear layers are measured H100 operator times
    (its profile, interpolated by token count) and its attention a roofline stand-in, times 32 layers,
    with no per-step CPU overhead and no LM head. The twin's step is its H100 default, the shipped
    `h100-vllm` profile: each operator group's physical floor (linear layers with the GEMMs' measured
    150-token last wave, attention, LM head, KV reads) times a coefficient fitted on real vLLM H100
    serving, plus 43 us a layer of fixed GPU time, and 2 ms of host time a step that async scheduling
    hides behind the previous step's GPU time ("twin GPU" in the step-time table leaves it out). Vidur's
    measured operators are slower for big batches and prefills, so it serves fewer requests a second.
 4. Lengths (the "native" run). Vidur keeps every trace row and shrinks rows over 4096 tokens
    proportionally; the twin leaves such rows out of its sampling pool, so in a native run Vidur's
    requests are longer (see "mean prompt tokens"). `--lengths matched` gives Vidur the twin's pool.
 5. Overload. 160 req/s is past what 16 instances serve in either model (see "completed req /
    simulated s"), so queues grow through the run and TTFT is mostly queueing: a modest difference in
    service rate becomes a large difference in median TTFT and E2E. Neither figure is ground truth;
    only a measured vLLM run can say which model is closer."""


def run_json(cmd: list[str], cwd: Path, timeout: float, log: Path) -> tuple[dict, float]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = log.read_text().strip().splitlines()[-8:]
        raise SystemExit(f"{cmd[1]} failed (exit {p.returncode}); log {log}:\n  " + "\n  ".join(tail))
    return json.loads(p.stdout.strip().splitlines()[-1]), wall


STEP_CASES = [  # must match vidur_runner.STEP_CASES: (label, decode seqs, decode ctx, prefill seqs, prefill len)
    ("decode 1 x ctx 1000", 1, 1000, 0, 0),
    ("decode 32 x ctx 1000", 32, 1000, 0, 0),
    ("decode 128 x ctx 800", 128, 800, 0, 0),
    ("prefill 1 x 1300", 0, 0, 1, 1300),
    ("prefill 3 x 1300", 0, 0, 3, 1300),
]


def twin_step_table() -> dict:
    """The twin's step time (ms) for the same batches, from its public perf model."""
    from twin.sim.cluster import build_perf
    from twin.perf.base import StepBatch
    from twin.scenario import load_scenario

    perf = build_perf(load_scenario(SCENARIO))
    out = {}
    for label, nd, ctx, npf, plen in STEP_CASES:
        b = StepBatch(num_decode_tokens=nd, decode_context_tokens=nd * ctx, num_prefill_tokens=npf * plen,
                      prefill_attn_tokens=npf * plen * (plen + 1) / 2, prefill_kv_read_tokens=npf * plen,
                      num_prefill_sampled=npf)
        step = perf.step_time(b)
        out[label] = step * 1e3
        out[label + " (GPU)"] = (step - perf.host_time_s(nd + npf)) * 1e3
    return out


def matched_trace(path: Path, cap: int) -> Path:
    """The twin's sampling pool as a file: rows with prompt > 0 and prompt + max(output, 1) <= cap."""
    import pandas as pd

    df = pd.read_csv(path)
    keep = (df["num_prefill_tokens"] > 0) & (df["num_prefill_tokens"] + df["num_decode_tokens"].clip(lower=1) <= cap)
    out = WORK / f"{path.stem}.le{cap}.csv"
    df[keep].to_csv(out, index=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--lengths", choices=["native", "matched"], default="native",
                    help="native: Vidur reads the trace with its own capping (proportional shrink of rows over "
                         "4096); matched: Vidur gets the twin's pool (rows over 4096 left out)")
    ap.add_argument("--vidur-chrome-trace", action="store_true",
                    help="leave Vidur's chrome trace on (its default; off here, as the twin writes none)")
    ap.add_argument("--skip-vidur", action="store_true", help="run only the twin (e.g. no Vidur venv)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    WORK.mkdir(exist_ok=True)
    n = args.num_requests

    from bench_speed import machine_info  # same folder

    info = machine_info()
    print(f"machine: {info['cpu']}; {info['cores_usable']} usable cores; {info['python']}; {info['date']}")
    print(f"config: Llama-2-7B, 16 x H100 TP1, LOR, block 16, 128 seqs, 4096 tokens/batch, Poisson 160/s, "
          f"seed 42, {n:,} requests, lengths {TRACE.name} ({args.lengths})")

    # -- the twin ---------------------------------------------------------------------------------------
    print("running the twin ...", flush=True)
    twin, twin_proc = run_json(
        [sys.executable, str(HERE / "bench_speed.py"), "--child", "--scenario", str(SCENARIO), "--n", str(n),
         "--mode", "fast", "--trace", str(TRACE)], ROOT, args.timeout, WORK / "twin.log")
    twin["process_s"] = twin_proc

    # -- Vidur ------------------------------------------------------------------------------------------
    vidur = None
    blocker = None
    if args.skip_vidur:
        blocker = "skipped (--skip-vidur)"
    elif not VENV_PY.exists():
        blocker = f"no {VENV_PY}: run `bash benchmarks/vidur_setup.sh` first"
    elif not PROFILE.exists():
        blocker = f"no Vidur H100 profile at {PROFILE}"
    else:
        trace = TRACE if args.lengths == "native" else matched_trace(TRACE, 4096)
        print("running Vidur ...", flush=True)
        cmd = [str(VENV_PY), str(HERE / "vidur_runner.py"), "--num-requests", str(n), "--trace", str(trace),
               "--profile", str(PROFILE), "--out", str(WORK / "vidur_output"), "--replicas", "16", "--qps", "160"]
        if args.vidur_chrome_trace:
            cmd.append("--chrome-trace")
        vidur, vidur_proc = run_json(cmd, WORK, args.timeout, WORK / "vidur.log")
        vidur["process_s"] = vidur_proc
        vidur["step_ms"], _ = run_json([str(VENV_PY), str(HERE / "vidur_runner.py"), "--step-table", "--profile",
                                        str(PROFILE)], WORK, 600, WORK / "vidur_steps.log")
    twin["step_ms"] = twin_step_table()

    # -- table ------------------------------------------------------------------------------------------
    rows = []

    def add(label, t, v, fmt):
        rows.append((label, "-" if t is None else fmt.format(t), "-" if v is None else fmt.format(v)))

    tw_loop = twin["run_s"]
    tw_total = twin["total_s"]
    add("simulation loop wall s", tw_loop, vidur and vidur["loop_s"], "{:.2f}")
    add("setup + loop + output wall s", tw_total, vidur and vidur["total_s"], "{:.2f}")
    add("whole process wall s (incl. imports)", twin["process_s"], vidur and vidur["process_s"], "{:.2f}")
    add("simulated req / wall s (loop)", n / tw_loop, vidur and n / vidur["loop_s"], "{:,.0f}")
    add("simulated req / wall s (setup..output)", n / tw_total, vidur and n / vidur["total_s"], "{:,.0f}")
    add("simulated s", twin["sim_time_s"], vidur and vidur["sim_time_s"], "{:,.1f}")
    add("simulated s / wall s (loop)", twin["sim_time_s"] / tw_loop, vidur and vidur["sim_time_s"] / vidur["loop_s"],
        "{:,.1f}")
    add("peak RSS MiB", twin["peak_rss_mib"], vidur and vidur["peak_rss_mib"], "{:,.0f}")
    add("completed req / simulated s", twin["finished"] / twin["sim_time_s"],
        vidur and vidur.get("finished", 0) / vidur["sim_time_s"], "{:.1f}")
    add("finished requests", twin["finished"], vidur and vidur.get("finished"), "{:,}")
    add("mean prompt tokens", twin["mean_prompt_tokens"], vidur and vidur.get("mean_request_num_prefill_tokens"),
        "{:,.0f}")
    add("mean output tokens", twin["mean_output_tokens"], vidur and vidur.get("mean_request_num_decode_tokens"),
        "{:,.0f}")
    add("TTFT p50 s", twin["ttft_p50_s"], vidur and vidur.get("ttft_p50_s"), "{:.3f}")
    add("TTFT mean s", twin["ttft_mean_s"], vidur and vidur.get("ttft_mean_s"), "{:.3f}")
    add("E2E p50 s", twin["e2e_p50_s"], vidur and vidur.get("e2e_p50_s"), "{:.3f}")
    add("E2E mean s", twin["e2e_mean_s"], vidur and vidur.get("e2e_mean_s"), "{:.3f}")
    add("KV blocks per instance", twin["num_gpu_blocks"], vidur and vidur.get("num_blocks"), "{:,}")
    add("engine steps / batches", twin["engine_steps"], vidur and vidur.get("predictor_calls"), "{:,}")
    add("preemptions / restarts", twin["preemptions"], vidur and vidur.get("restarts"), "{:,}")
    w = max(len(r[0]) for r in rows)
    print()
    print(f"{'':{w}}  {'twin':>12}  {'Vidur 0.0.26':>12}")
    for label, a, b in rows:
        print(f"{label:{w}}  {a:>12}  {b:>12}")
    print()
    print("step time for the same batch, ms (model time; the twin's with its 2 ms host time a step, and its GPU time\n"
          "alone, what a busy engine shows: async scheduling hides the host time behind the previous step's GPU time):")
    print(f"{'':{w}}  {'twin':>12}  {'Vidur 0.0.26':>12}  {'twin GPU':>12}")
    for label, *_ in STEP_CASES:
        v = vidur["step_ms"].get(label) if vidur else None
        print(f"  {label:{w - 2}}  {twin['step_ms'][label]:>12.2f}  {'-' if v is None else f'{v:.2f}':>12}"
              f"  {twin['step_ms'][label + ' (GPU)']:>12.2f}")
    ratios = {}
    if vidur:
        ratios = {
            "loop": vidur["loop_s"] / tw_loop,
            "setup_to_output": vidur["total_s"] / tw_total,
            "process": vidur["process_s"] / twin["process_s"],
        }
        print()
        print(f"twin / Vidur speed: {ratios['loop']:.1f}x on the simulation loop, "
              f"{ratios['setup_to_output']:.1f}x setup..output, {ratios['process']:.1f}x whole process")
    else:
        print(f"\nVidur not run: {blocker}")
    print()
    print("Vidur here: vidur 0.0.26 from PyPI; step times from a stand-in predictor (measured H100 linear-layer "
          "profile + roofline attention; Vidur's own predictor downloads its profiles from Hugging Face, "
          "unreachable offline); Request.restart() bug patched; plots and chrome trace off; wandb disabled.")
    print(EXPLANATION)
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": info, "requests": n, "lengths": args.lengths, "twin": twin,
                                   "vidur": vidur, "vidur_blocker": blocker, "ratios": ratios}, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
