"""Analytical step time: max(FLOPs / peak, bytes / bandwidth) + fixed overhead, per GPU, with TP."""

from __future__ import annotations

from dataclasses import dataclass

from twin.errors import TwinInputError
from twin.hardware import GPUSpec
from twin.models import DTYPE_BYTES, ModelSpec
from twin.perf.base import StepBatch


@dataclass
class RooflineModel:
    """Roofline step time with efficiency factors.

    With both efficiencies at 1.0 and no overhead this is the physical lower bound on a step: no real
    engine step can be faster. The defaults are measured or assumed corrections (see `describe`).
    """

    gpu: GPUSpec
    model: ModelSpec
    dtype: str = "bf16"
    kv_cache_dtype: str = "auto"
    tensor_parallel: int = 1
    compute_efficiency: float = 0.75  # measured: Vidur's H100 MLP profile reaches ~75 % of peak at 4k tokens
    memory_efficiency: float = 0.9  # measured: an H200 device copy moved ~4.3 of 4.8 TB/s
    step_overhead_s: float = 0.002  # ASSUMPTION: scheduler + launch + sampling per step; calibrate it
    allreduce_latency_s: float = 10e-6  # ASSUMPTION: fixed cost of one NVLink all-reduce

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise TwinInputError(f"dtype {self.dtype!r} unknown (known: {', '.join(DTYPE_BYTES)})")
        kv = "bf16" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        if kv not in DTYPE_BYTES:
            raise TwinInputError(f"kv_cache_dtype {self.kv_cache_dtype!r} unknown")
        for name in ("compute_efficiency", "memory_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise TwinInputError(f"perf.{name} must be in (0, 1], got {v}")
        if self.tensor_parallel < 1:
            raise TwinInputError("tensor_parallel must be >= 1")
        m, tp = self.model, self.tensor_parallel
        wb = DTYPE_BYTES[self.dtype]
        self._flops_peak = self.gpu.flops(self.dtype) * self.compute_efficiency
        self._bw = self.gpu.hbm_bandwidth * self.memory_efficiency
        # per-token and per-step constants, already divided by the TP degree
        self._flops_per_token = 2.0 * m.linear_params / tp
        self._flops_per_sample = 2.0 * m.lm_head_params / tp
        self._flops_per_attn = 4.0 * m.num_layers * m.num_heads * m.head_dim / tp
        self._weight_bytes = (m.linear_params + m.lm_head_params) * wb / tp
        self._act_bytes_per_token = 2.0 * m.hidden_size  # embedding row read
        self._kv_bytes_per_token = m.kv_bytes_per_token(DTYPE_BYTES[kv]) / tp
        if tp > 1:
            per_dir = self.gpu.nvlink_bandwidth / 2
            self._ar_bytes_per_token = 2 * m.num_layers * 2.0 * (tp - 1) / tp * m.hidden_size * 2 / per_dir
            self._ar_fixed = 2 * m.num_layers * self.allreduce_latency_s
        else:
            self._ar_bytes_per_token = 0.0
            self._ar_fixed = 0.0

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self._kv_bytes_per_token

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self._weight_bytes

    def ideal(self) -> "RooflineModel":
        """The physical floor: same hardware and model at 100 % efficiency and no overhead."""
        return RooflineModel(
            self.gpu, self.model, self.dtype, self.kv_cache_dtype, self.tensor_parallel,
            compute_efficiency=1.0, memory_efficiency=1.0, step_overhead_s=0.0, allreduce_latency_s=0.0,
        )

    def peak_tokens_per_s(self) -> float:
        """Tokens/s one instance (all its TP GPUs) could compute at peak FLOP/s, linear layers only."""
        return self.gpu.flops(self.dtype) / self._flops_per_token

    def step_time(self, b: StepBatch) -> float:
        t = b.num_prefill_tokens + b.num_decode_tokens
        if t == 0:
            return 0.0
        flops = (
            self._flops_per_token * t
            + self._flops_per_sample * (b.num_decode_tokens + b.num_prefill_sampled)
            + self._flops_per_attn * (b.prefill_attn_tokens + b.decode_context_tokens)
        )
        nbytes = (
            self._weight_bytes
            + self._act_bytes_per_token * t
            + self._kv_bytes_per_token * (b.prefill_kv_read_tokens + b.decode_context_tokens + t)
        )
        comm = self._ar_fixed + self._ar_bytes_per_token * t
        return max(flops / self._flops_peak, nbytes / self._bw) + comm + self.step_overhead_s

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        """k decode-only steps: each a max of two lines in the step index (compute, memory) + constants.

        Plain Python: runs are a handful of steps between events, where numpy's set-up costs more.
        """
        nd = num_decode
        f0 = (self._flops_per_token + self._flops_per_sample) * nd + self._flops_per_attn * context0
        b0 = self._weight_bytes + (self._act_bytes_per_token + self._kv_bytes_per_token) * nd \
            + self._kv_bytes_per_token * context0
        a, da = f0 / self._flops_peak, self._flops_per_attn * nd / self._flops_peak
        c, dc = b0 / self._bw, self._kv_bytes_per_token * nd / self._bw
        e = self._ar_fixed + self._ar_bytes_per_token * nd + self.step_overhead_s
        return [(a + da * s if a + da * s > c + dc * s else c + dc * s) + e for s in range(k)]

    def describe(self) -> dict:
        """Parameters and which of them are assumptions, for reports."""
        return {
            "kind": "roofline",
            "gpu": self.gpu.name,
            "model": self.model.name,
            "dtype": self.dtype,
            "tensor_parallel": self.tensor_parallel,
            "compute_efficiency": self.compute_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "step_overhead_s": self.step_overhead_s,
            "assumptions": ["step_overhead_s", "allreduce_latency_s"],
        }
