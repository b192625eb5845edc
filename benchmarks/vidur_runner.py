"""Run Vidur (PyPI `vidur`) offline on the issue-3 configuration; print one JSON line with its timings and metrics.

Runs INSIDE benchmarks/.vidur-venv (made by vidur_setup.sh); vidur_compare.py launches it. It imports
nothing from `twin`.

Why a substitute execution-time predictor. Vidur 0.0.26 (the PyPI release) gets its step-time model
from Hugging Face at run time: `SklearnExecutionTimePredictor._get_input_files` calls
`huggingface_hub.snapshot_download` for the profiling data sets (`project-vajra/...-llama-3-8b-h100`,
`...-h100-dgx`) and for precomputed predictions. This machine reaches no Hugging Face hub, and the
profiles in ../shared/profiles/vidur-h100 hold only the *linear-layer* operators of Llama-2-7B on H100
(from Vidur's repository; its attention profile was too large to copy). So, to run Vidur's simulator
at all, this script registers, in place of Vidur's random-forest predictor, a predictor that

  * takes every linear / norm / activation / rope / add operator time per layer from that measured
    Vidur H100 profile (median, by token count, TP 1), interpolated linearly over the token count --
    what Vidur's own predictor does with a random forest over the same kind of data;
  * models attention (prefill, decode, KV-cache save) analytically: roofline over FLOPs (H100 bf16,
    989 TFLOP/s x 0.75) and KV bytes moved (3.35 TB/s x 0.9), per layer, with Vidur's own
    decode-batching overhead factor (1 + 0.1 for batches > 1) and its KV-size rounding (256 tokens).

Everything else -- request generation, the LOR global scheduler, Vidur's vLLM replica scheduler,
its memory planner, event loop and metrics store -- is Vidur's unmodified code. The predictor is
called once per batch, like Vidur's (whose per-call cost is a handful of dict look-ups; ours is a
handful of list look-ups plus a loop over the batch's requests, the same loop Vidur does), so the wall
time measured is Vidur's simulation speed, minus the training / download of its predictor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def vmhwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# H100 SXM figures, the same the twin uses (twin/specs), and the twin's default efficiencies
H100_BF16_FLOPS = 989e12
H100_HBM_BW = 3.35e12
COMPUTE_EFF = 0.75
MEMORY_EFF = 0.9

LINEAR_OPS = {  # Vidur predictor method -> operator column in the profile
    "attn_pre_proj": "attn_pre_proj",
    "attn_post_proj": "attn_post_proj",
    "mlp_up_proj": "mlp_up_proj",
    "mlp_down_proj": "mlp_down_proj",
    "mlp_act": "mlp_act",
    "attn_rope": "attn_rope",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "add": "add",
}


def make_predictor_class(profile_csv: str):
    import numpy as np
    import pandas as pd

    from vidur.execution_time_predictor.base_execution_time_predictor import BaseExecutionTimePredictor

    class ProfiledLinearRooflineAttentionPredictor(BaseExecutionTimePredictor):
        """Linear ops from Vidur's measured H100 profile; attention by roofline. Times in ms per layer."""

        def __init__(self, predictor_config, replica_config, cache_config) -> None:
            super().__init__(predictor_config, replica_config, cache_config)
            m = self._model_config
            tp = replica_config.tensor_parallel_size
            df = pd.read_csv(profile_csv)
            df = df[(df["num_tensor_parallel_workers"] == tp) & (df["n_embd"] == m.embedding_dim)]
            if df.empty:
                raise SystemExit(f"{profile_csv}: no rows for TP {tp} and embedding {m.embedding_dim}")
            df = df.sort_values("num_tokens").drop_duplicates("num_tokens")
            self.profile_token_range = (int(df["num_tokens"].min()), int(df["num_tokens"].max()))
            self._max_tokens = max(8192, predictor_config.prediction_max_prefill_chunk_size)
            grid = np.arange(0, self._max_tokens + 9)
            self._tables = {}
            for name, col in LINEAR_OPS.items():
                y = df[f"time_stats.{col}.median"].to_numpy(dtype=float)
                self._tables[name] = np.interp(grid, df["num_tokens"].to_numpy(dtype=float), y).tolist()
            heads_per_worker = replica_config.q_heads_per_tensor_parallel_worker
            head_dim = replica_config.attention_head_dim
            kv_heads = replica_config.kv_heads_per_tensor_parallel_worker
            self._kv_bytes_per_token_layer = 2 * 2 * kv_heads * head_dim  # K and V, 2 bytes each
            self._attn_flops_per_qk = 4.0 * heads_per_worker * head_dim  # QK^T and PV, multiply-add = 2
            self._flops_rate = H100_BF16_FLOPS * COMPUTE_EFF / 1e3  # per ms
            self._bytes_rate = H100_HBM_BW * MEMORY_EFF / 1e3  # per ms
            self._gran = predictor_config.kv_cache_prediction_granularity
            self._decode_overhead = predictor_config.attention_decode_batching_overhead_fraction
            self.num_calls = 0

        # -- linear operators: table look-ups on the rounded token count, as Vidur does --------------
        def _lin(self, name, batch):
            return self._tables[name][batch._total_num_q_tokens_rounded]

        def _get_attention_layer_pre_proj_execution_time(self, batch):
            self.num_calls += 1
            return self._lin("attn_pre_proj", batch)

        def _get_attention_layer_post_proj_execution_time(self, batch):
            return self._lin("attn_post_proj", batch)

        def _get_mlp_layer_up_proj_execution_time(self, batch):
            return self._lin("mlp_up_proj", batch)

        def _get_mlp_layer_down_proj_execution_time(self, batch):
            return self._lin("mlp_down_proj", batch)

        def _get_mlp_layer_act_execution_time(self, batch):
            return self._lin("mlp_act", batch)

        def _get_attention_rope_execution_time(self, batch):
            return self._lin("attn_rope", batch)

        def _get_attn_norm_layer_act_execution_time(self, batch):
            return self._lin("input_layernorm", batch)

        def _get_mlp_norm_layer_act_execution_time(self, batch):
            if not self._model_config.post_attn_norm:
                return 0
            return self._lin("post_attention_layernorm", batch)

        def _get_add_layer_act_execution_time(self, batch):
            return self._lin("add", batch)

        # -- attention: roofline -----------------------------------------------------------------------
        def _get_attention_kv_cache_save_execution_time(self, batch):
            return batch._total_num_q_tokens * self._kv_bytes_per_token_layer / self._bytes_rate

        def _get_attention_decode_execution_time(self, batch):
            n = 0
            kv = 0
            for q, k in zip(batch.num_q_tokens, batch.num_kv_tokens):
                if q == 1:
                    n += 1
                    kv += k
            if n == 0:
                return 0.0
            g = self._gran
            avg = -(-(kv // n) // g) * g  # Vidur rounds the mean KV length up to its granularity
            nbytes = n * avg * self._kv_bytes_per_token_layer
            flops = n * avg * self._attn_flops_per_qk
            t = max(nbytes / self._bytes_rate, flops / self._flops_rate)
            return t * (1 + self._decode_overhead * (n > 1))

        def _get_attention_prefill_execution_time(self, batch):
            total = 0.0
            g = self._gran
            for q, k in zip(batch.num_q_tokens, batch.num_kv_tokens):
                if q == 1:
                    continue
                k = -(-k // g) * g
                q = -(-q // 32) * 32
                past = max(k - q, 0)
                flops = self._attn_flops_per_qk * q * (past + (q + 1) / 2)
                nbytes = (past + q) * self._kv_bytes_per_token_layer
                total += max(flops / self._flops_rate, nbytes / self._bytes_rate)
            return total

        # -- TP 1 / PP 1: no communication ---------------------------------------------------------
        def _get_tensor_parallel_communication_time(self, batch):
            return 0.0

        def _get_pipeline_parallel_communication_time(self, batch):
            return 0.0

        def _get_kv_parallel_communication_time(self, batch):
            return 0.0

    return ProfiledLinearRooflineAttentionPredictor


def patch_restart_bug() -> None:
    """Vidur 0.0.26: `Request.restart()` (a preemption by recompute, which its vLLM scheduler does when KV
    blocks run out) resets `_num_processed_tokens` but not `_num_stage_processed_tokens`, so the restarted
    request's re-prefill is counted twice and `on_batch_stage_end` fails its assertion
    `_num_stage_processed_tokens <= total_tokens` on the first preemption. Reset that counter too, as
    restart means: the request starts over from token 0."""
    from vidur.entities.request import Request

    orig = Request.restart

    def restart(self):
        orig(self)
        self._num_stage_processed_tokens = 0

    Request.restart = restart


def tiled_trace(trace: str, n: int, out_dir: Path) -> str:
    """Vidur's trace length generator draws rows without replacement (a shuffle, then in order) and fails
    past the end; for more requests than rows, repeat the file (each copy is shuffled anew by Vidur's
    single shuffle of the whole frame)."""
    import pandas as pd

    df = pd.read_csv(trace)
    if n <= len(df):
        return trace
    reps = -(-n // len(df))
    out = out_dir / f"{Path(trace).stem}.x{reps}.csv"
    pd.concat([df] * reps, ignore_index=True).to_csv(out, index=False)
    return str(out)


STEP_CASES = [  # (label, q tokens per request, kv tokens per request) for a step-time cross-check
    ("decode 1 x ctx 1000", [1], [1000]),
    ("decode 32 x ctx 1000", [1] * 32, [1000] * 32),
    ("decode 128 x ctx 800", [1] * 128, [800] * 128),
    ("prefill 1 x 1300", [1300], [1300]),
    ("prefill 3 x 1300", [1300] * 3, [1300] * 3),
]


def step_table(profile: str) -> dict:
    """Per-step model time (ms, all layers) the stand-in predictor gives a few batches."""
    import types

    from vidur.config import CacheConfig, RandomForrestExecutionTimePredictorConfig, ReplicaConfig

    rc = ReplicaConfig(model_name="meta-llama/Llama-2-7b-hf", tensor_parallel_size=1, num_pipeline_stages=1,
                       device="h100", network_device="h100_dgx")
    pred = make_predictor_class(profile)(RandomForrestExecutionTimePredictorConfig(), rc, CacheConfig())
    out = {}
    for label, q, kv in STEP_CASES:
        b = types.SimpleNamespace(num_q_tokens=q, num_kv_tokens=kv, _total_num_q_tokens=sum(q),
                                  _total_num_q_tokens_rounded=(sum(q) + 7) // 8 * 8)
        et = pred.get_execution_time(b, 0)
        out[label] = et.total_time * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-table", action="store_true", help="print the stand-in's step times and exit")
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--qps", type=float, default=160.0)
    ap.add_argument("--trace")
    ap.add_argument("--profile", required=True, help="Vidur H100 mlp.csv for Llama-2-7B")
    ap.add_argument("--out", help="folder for Vidur's output")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--chrome-trace", action="store_true", help="keep Vidur's default chrome trace on")
    args = ap.parse_args()
    if args.step_table:
        print("\n" + json.dumps(step_table(args.profile)))
        return

    t_proc0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = tiled_trace(args.trace, args.num_requests, out)

    from vidur.config import SimulationConfig
    from vidur.execution_time_predictor import ExecutionTimePredictorRegistry
    from vidur.simulator import Simulator
    from vidur.types import ExecutionTimePredictorType
    from vidur.utils.random import set_seeds

    t_import = time.perf_counter() - t_proc0
    patch_restart_bug()
    cls = make_predictor_class(args.profile)
    key = ExecutionTimePredictorType.RANDOM_FORREST
    ExecutionTimePredictorRegistry.unregister(key)
    ExecutionTimePredictorRegistry.register(key, cls)

    argv = [
        "vidur",
        "--seed", str(args.seed),
        "--replica_config_device", "h100",
        "--replica_config_network_device", "h100_dgx",
        "--replica_config_model_name", "meta-llama/Llama-2-7b-hf",
        "--replica_config_tensor_parallel_size", "1",
        "--replica_config_num_pipeline_stages", "1",
        "--cluster_config_num_replicas", str(args.replicas),
        "--global_scheduler_config_type", "lor",
        "--replica_scheduler_config_type", "vllm",
        "--vllm_scheduler_config_batch_size_cap", "128",
        "--vllm_scheduler_config_max_tokens_in_batch", "4096",
        "--cache_config_block_size", "16",
        "--request_generator_config_type", "synthetic",
        "--synthetic_request_generator_config_num_requests", str(args.num_requests),
        "--length_generator_config_type", "trace",
        "--trace_request_length_generator_config_trace_file", trace,
        "--trace_request_length_generator_config_max_tokens", "4096",
        "--interval_generator_config_type", "poisson",
        "--poisson_request_interval_generator_config_qps", str(args.qps),
        "--execution_time_predictor_config_type", "random_forrest",
        "--metrics_config_output_dir", str(out),
        "--no-metrics_config_store_plots",
    ]
    if not args.chrome_trace:
        argv.append("--no-metrics_config_enable_chrome_trace")
    sys.argv = argv

    t0 = time.perf_counter()
    config = SimulationConfig.create_from_cli_args()
    set_seeds(config.seed)
    sim = Simulator(config)  # builds the predictor, the replicas and generates all requests
    t_setup = time.perf_counter() - t0
    rss_setup = vmhwm_mib()

    marks = {}
    orig_write = sim._write_output

    def timed_write():
        marks["loop_end"] = time.perf_counter()
        orig_write()

    sim._write_output = timed_write
    t0 = time.perf_counter()
    sim.run()
    t_end = time.perf_counter()
    t_loop = marks["loop_end"] - t0
    t_write = t_end - marks["loop_end"]
    rss_end = vmhwm_mib()

    # Vidur writes request_metrics.csv under the timestamped output folder
    out_dir = Path(config.metrics_config.output_dir)
    found = list(out_dir.rglob("request_metrics.csv"))
    rec = {
        "simulator": "vidur",
        "requests": args.num_requests,
        "import_s": t_import,
        "setup_s": t_setup,
        "loop_s": t_loop,
        "write_s": t_write,
        "total_s": t_setup + t_loop + t_write,
        "sim_time_s": float(sim._time),
        "peak_rss_mib": rss_end,
        "rss_after_setup_mib": rss_setup,
        "request_metrics_csv": str(found[0]) if found else None,
        "output_dir": str(out_dir),
        "trace_used": trace,
        "chrome_trace": bool(args.chrome_trace),
        "num_blocks": int(config.cluster_config.cache_config.num_blocks),
        "predictor_calls": None,
    }
    try:
        pred = next(iter(sim.scheduler._replica_schedulers.values()))._execution_time_predictor
        rec["predictor_calls"] = pred.num_calls
    except Exception:  # noqa: BLE001 - informational
        pass
    if found:
        import pandas as pd

        df = pd.read_csv(found[0])
        rec["columns"] = list(df.columns)
        for col, key in (("prefill_e2e_time", "ttft"), ("request_e2e_time", "e2e"),
                         ("request_scheduling_delay", "sched_delay")):
            if col in df.columns:
                s = df[col].astype(float)
                rec[f"{key}_p50_s"] = float(s.median())
                rec[f"{key}_mean_s"] = float(s.mean())
                rec[f"{key}_p90_s"] = float(s.quantile(0.9))
                rec[f"{key}_p99_s"] = float(s.quantile(0.99))
        rec["finished"] = int(len(df))
        if "request_num_restarts" in df.columns:
            rec["restarts"] = int(df["request_num_restarts"].sum())
        for col in ("request_num_prefill_tokens", "request_num_decode_tokens"):
            if col in df.columns:
                rec[f"mean_{col}"] = float(df[col].mean())
    print("\n" + json.dumps(rec))


if __name__ == "__main__":
    main()
