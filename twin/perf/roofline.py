"""Analytical step time, priced per operator group: each group's own max(compute, memory), summed.

A step runs its kernels one after another, so a single max(FLOPs / peak, bytes / bandwidth) over the whole
mixed batch hides the memory-bound decode attention under the compute-bound matmuls. Here each group is
its own roofline, on one GPU's share of the work (tensor parallel degree `tp`):

- `linear`: every matmul of the layers (QKV, output, MLP or the touched experts, router), over all T tokens
  of the step. FLOPs 2 x active params x T at the weights' dtype peak; bytes: the weights read once (MoE:
  only the experts the batch touches, see below) plus the embedding rows gathered.
- `prefill_attn`: attention of the prefill chunks: 4 x layers x heads x head_dim FLOPs per (query, key)
  pair at the 16-bit peak; bytes: the KV the chunks read and write.
- `decode_attn`: the same for the decoding requests: memory-bound, it reads every request's whole context.
- `lm_head`: the vocabulary projection for the sampled tokens (chunks that end a prompt, and decodes) at the
  16-bit peak, reading the 16-bit LM head once; nothing when no token is sampled.
- `allreduce`: tensor parallelism's two all-reduces per layer (after attention and after the MLP), a ring
  over NVLink: 2 (tp - 1) / tp x hidden x 2 bytes per token at the per-direction bandwidth, plus a fixed
  latency each.
- CPU: `step_overhead_s` per step plus `per_request_overhead_s` per scheduled request (input preparation,
  sampling and output handling grow with the batch).
- The GEMMs' last wave: `gemm_tail_tokens` (default 150, measured). A compute-bound GEMM runs its output tiles in
  waves over the SMs, and its last wave is partial, so its time is not FLOPs / peak but about (T + tail) rows' worth:
  Vidur's H100 operators (`../shared/profiles/vidur-h100`, Llama-2-7B and -70B at TP 1, 2, 4 and 8, 512-4096 tokens)
  fit per layer as `a x T + b` with `b` ~ 47 us + the compute time of ~150 tokens (residuals within 31 us). So the
  linear group's compute side is `(T + gemm_tail_tokens)` tokens' FLOPs (an MoE model's experts excepted: only its
  dense projections pay it); the memory side (the weights read) is
  unchanged, so a decode step, memory-bound, pays nothing more. This is what makes many small prefill chunks cost more
  than few large ones (`max_num_batched_tokens` 1024 against 8192): each compute-bound step pays the tail once, so
  a 4096-token prompt in 1024-token chunks pays it four times, against once. `ideal()` keeps 0: a floor.
- Kernels' fixed time: `layer_overhead_s` per layer per step, on the GPU, priced with the linear group.
  A kernel has a cost that does not scale with its bytes or FLOPs (grid launch, ramp-up, the last partial
  wave, the dependency on the kernel before). A step pays it once per layer, however few tokens the step
  has, so it weighs most on small steps and small per-GPU layers. Async scheduling never hides it.
  Default 0, which keeps the pure roofline. Measured in Vidur's H100 operator profile
  (`../shared/profiles/vidur-h100`, eager kernels timed with CUDA events) at 1-64 tokens:
  - the 4 GEMMs of a layer take weight bytes / 3.0 TB/s + ~25 us. That is the roofline's 90 %-of-bandwidth
    slope, fitted across Llama-2-7B TP 1 and Llama-2-70B TP 1 (405 and 1711 MB a layer);
  - the 5 elementwise kernels (2 RMSNorms, RoPE, SiLU-and-mul, residual adds) take ~21 us more (7B);
  - so ~45 us a layer in eager mode. ASSUMPTION: vLLM's CUDA graphs replay the decode kernels without CPU
    launches, so the GPU-side share is smaller. Calibrate it; `benchmarks/bench_chunk_tails.py` prints the fit.

The overlap split (`host_time_s`): under vLLM's async scheduling the CPU term above runs while the GPU
computes the previous step (scheduling, input preparation and output processing of step k+1 overlap step k;
`EngineCore.step_with_batch_queue`), so the engine (twin.engine.scheduler `step_duration`) hides it up to the
previous step's GPU time: only its excess over that, or all of it after an idle engine, stays on the critical
path. Everything else (the five groups) is GPU time and never overlaps. ASSUMPTION: the whole CPU term is host
work that can overlap; with CUDA graphs a decode step's launches are one graph replay.

`dtype: mxfp4` (gpt-oss): the MoE experts' weights are 4.25 bits (twin.specs.models.MXFP4_BYTES), everything else
BF16, and every matmul runs at the 16-bit peak (weight-only quantisation on Hopper).

Attention and the LM head stay 16-bit when the weights are FP8 (vLLM's FP8 quantisation covers the linear
layers only; the KV cache is FP8 only with `kv_cache_dtype: fp8`, which halves the KV bytes).

MoE: FLOPs follow the active parameters (top-k experts per token). Weight bytes follow the experts a step
actually touches: with T tokens each routed to k of E experts, ASSUMING uniform independent routing, a layer
touches E (1 - (1 - k/E)^T) experts in expectation; a single decode reads k experts per layer, a large
prefill reads them all.

With efficiencies 1.0 and no overheads (`ideal()`) each group is its physical floor. Measured kernels are
slower: `compute_efficiency` and `memory_efficiency` are measured corrections; the overheads and the
all-reduce latency are ASSUMPTIONS (see `describe`).
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.errors import TwinInputError
from twin.specs.hardware import GPUSpec
from twin.specs.models import DTYPE_BYTES, MXFP4_BYTES, ModelSpec
from twin.perf.base import StepBatch

GROUPS = ("linear", "prefill_attn", "decode_attn", "lm_head", "allreduce")


@dataclass
class RooflineModel:
    """Per-group roofline step time with efficiency factors and CPU overheads."""

    gpu: GPUSpec
    model: ModelSpec
    dtype: str = "bf16"
    kv_cache_dtype: str = "auto"
    tensor_parallel: int = 1
    # measured: Vidur's H100 Llama-2-7B TP 1 GEMMs at 512-4096 tokens fit as 78 % of peak plus the last wave below
    compute_efficiency: float = 0.78
    memory_efficiency: float = 0.9  # measured: an H200 device copy moved ~4.3 of 4.8 TB/s
    step_overhead_s: float = 0.002  # ASSUMPTION: scheduler + launch + sampling per step; calibrate it
    per_request_overhead_s: float = 4e-6  # ASSUMPTION: CPU work per scheduled request per step
    allreduce_latency_s: float = 10e-6  # ASSUMPTION: fixed cost of one NVLink all-reduce
    layer_overhead_s: float = 0.0  # ASSUMPTION: kernels' fixed GPU time per layer per step (see the docstring)
    gemm_tail_tokens: float = 150.0  # measured (Vidur H100): the GEMMs' partial last wave, in tokens (docstring)
    api_request_overhead_s: float = 0.003  # ASSUMPTION: API server per request before the engine
    api_prompt_token_s: float = 1e-6  # ASSUMPTION: tokenization per prompt token
    api_output_token_s: float = 46e-6  # ASSUMPTION: detokenize + stream per output token
    # the API server as one server shared by requests and streamed tokens (twin.sim.api_server), its requests
    # in processor sharing ("ps") or one at a time ("fifo"); "off": the three terms are fixed delays. The cap
    # on the token stream's share of the server: ASSUMPTION
    api_queue: str = "ps"  # "ps" (processor sharing), "fifo", or "off"
    api_rho_cap: float = 0.9
    api_handoff_s: float = 0.0  # latency between the API server and EngineCore that holds no server (ZMQ, polling)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES and self.dtype != "mxfp4":
            raise TwinInputError(f"dtype {self.dtype!r} unknown (known: {', '.join(DTYPE_BYTES)}, mxfp4)")
        kv = "bf16" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        if kv not in DTYPE_BYTES:
            raise TwinInputError(f"kv_cache_dtype {self.kv_cache_dtype!r} unknown")
        for name in ("compute_efficiency", "memory_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise TwinInputError(f"perf.{name} must be in (0, 1], got {v}")
        if not self.gemm_tail_tokens >= 0:
            raise TwinInputError(f"perf.gemm_tail_tokens must be >= 0, got {self.gemm_tail_tokens}")
        if self.tensor_parallel < 1:
            raise TwinInputError("tensor_parallel must be >= 1")
        if self.api_queue not in ("ps", "fifo", "off"):
            raise TwinInputError(f"perf.api_queue must be 'ps', 'fifo' or 'off', got {self.api_queue!r}")
        if not 0 <= self.api_rho_cap < 1:
            raise TwinInputError(f"perf.api_rho_cap must be in [0, 1), got {self.api_rho_cap}")
        m, tp = self.model, self.tensor_parallel
        mx = self.dtype == "mxfp4"  # MoE experts at 4.25 bits, weight-only: the rest BF16, compute at 16 bits
        if mx and not m.is_moe:  # it ran exactly as bf16 without a word
            raise TwinInputError(f"dtype mxfp4 quantizes MoE experts only (gpt-oss); {m.name} has none: use bf16, "
                                 "fp16 or fp8")
        wb = 2 if mx else DTYPE_BYTES[self.dtype]
        eb = MXFP4_BYTES if mx and m.is_moe else wb  # bytes per expert weight
        attn_dtype = "fp16" if self.dtype == "fp16" else "bf16"  # attention and LM head: 16-bit
        self._compute_dtype = "bf16" if mx else self.dtype
        peak = self.gpu.flops(self._compute_dtype) * self.compute_efficiency
        peak16 = self.gpu.flops(attn_dtype) * self.compute_efficiency
        bw = self.gpu.hbm_bandwidth * self.memory_efficiency
        # per-GPU sizes (divided by the TP degree); KV heads are replicated when tp exceeds them (vLLM)
        kv_heads = m.num_kv_heads / tp if m.num_kv_heads >= tp else 1.0
        self._kv_bytes_per_token = 2.0 * m.num_layers * kv_heads * m.head_dim * DTYPE_BYTES[kv]
        experts = m.num_layers * m.num_experts * m.expert_params if m.is_moe else 0
        self._weight_bytes = ((m.linear_params - experts) * wb + experts * eb + m.vocab_params * 2.0) / tp
        self._flops_per_token = 2.0 * m.active_linear_params / tp  # linear layers
        # seconds per unit, per group (compute side, memory side)
        self._lin_s = self._flops_per_token / peak  # per token
        # the share of those FLOPs the GEMMs' last-wave tail applies to: all of a dense model's; an MoE model's
        # attention projections and router only (its experts run as one grouped GEMM over many small per-expert
        # GEMMs, whose tiling the dense operators' measured tail does not describe: the fitted `moe_compute` prices it)
        dense_flops = 2.0 * m.num_layers * (m.layer_attn_params + m.router_params) / tp if m.is_moe \
            else self._flops_per_token
        self._tail_s = dense_flops / peak  # per tail token
        self._act_s = 2.0 * m.hidden_size / bw  # embedding row gathered, per token
        self._moe = m.is_moe
        if m.is_moe:
            dense = m.num_layers * (m.layer_attn_params + m.router_params) * wb / tp
            self._lin_w = dense / bw  # always read
            self._expert_w = experts * eb / tp / bw  # all experts
            self._keep = 1.0 - m.num_experts_per_tok / m.num_experts  # P(an expert skips one token)
        else:
            self._lin_w = m.linear_params * wb / tp / bw
            self._expert_w = 0.0
            self._keep = 0.0
        self._attn_s = 4.0 * m.num_layers * m.num_heads * m.head_dim / tp / peak16  # per (query, key) pair
        self._kv_s = self._kv_bytes_per_token / bw  # per KV token read or written
        self._lm_s = 2.0 * m.lm_head_params / tp / peak16  # per sampled token
        self._lm_w = m.lm_head_params * 2.0 / tp / bw  # 16-bit LM head read once
        self._layer_fixed = m.num_layers * self.layer_overhead_s  # every TP rank runs every layer
        if tp > 1:
            per_dir = self.gpu.nvlink_bandwidth / 2
            self._ar_s = 2 * m.num_layers * 2.0 * (tp - 1) / tp * m.hidden_size * 2 / per_dir
            self._ar_fixed = 2 * m.num_layers * self.allreduce_latency_s
        else:
            self._ar_s = 0.0
            self._ar_fixed = 0.0

    # -- sizes the engine and metrics use -------------------------------------------------------------
    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self._kv_bytes_per_token

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Every stored weight on one GPU, embedding and LM head included (what vLLM's sizing subtracts)."""
        return self._weight_bytes

    def ideal(self) -> "RooflineModel":
        """The physical floor: same hardware and model at 100 % efficiency and no overhead."""
        return RooflineModel(
            self.gpu, self.model, self.dtype, self.kv_cache_dtype, self.tensor_parallel,
            compute_efficiency=1.0, memory_efficiency=1.0, step_overhead_s=0.0, per_request_overhead_s=0.0,
            allreduce_latency_s=0.0, layer_overhead_s=0.0, gemm_tail_tokens=0.0, api_request_overhead_s=0.0,
            api_prompt_token_s=0.0, api_output_token_s=0.0,
            api_queue=self.api_queue, api_rho_cap=self.api_rho_cap, api_handoff_s=0.0,
        )

    def peak_tokens_per_s(self) -> float:
        """Tokens/s one instance (all its TP GPUs) could compute at peak FLOP/s, linear layers only."""
        return self.gpu.flops(self._compute_dtype) / self._flops_per_token

    # -- time outside the engine step (the API server) ------------------------------------------------
    def api_request_s(self, prompt_tokens: int) -> float:
        """API-server time before a request reaches the engine: HTTP, chat template, tokenization."""
        return self.api_request_overhead_s + self.api_prompt_token_s * prompt_tokens

    def api_token_s(self) -> float:
        """API-server time per output token: incremental detokenization and the streamed chunk."""
        return self.api_output_token_s

    def api_queue_settings(self) -> tuple[float | None, float, str]:
        """(the cap on the token stream's share of the API server when it is a queue, twin.sim.api_server, or None:
        its terms are fixed delays; the hand-off latency to the engine that holds no server; the discipline)."""
        return (None if self.api_queue == "off" else self.api_rho_cap), self.api_handoff_s, self.api_queue

    # -- step time --------------------------------------------------------------------------------------
    def host_time_s(self, num_requests: int) -> float:
        """The CPU part of a step's time (what async scheduling overlaps with the previous step's GPU time)."""
        return self.step_overhead_s + self.per_request_overhead_s * num_requests

    def _linear(self, t: int) -> float:
        """Linear-layer group time for t tokens (t > 0), the GEMMs' last wave included."""
        return self.linear_time(t, self.gemm_tail_tokens)

    def linear_time(self, t: int, tail: float) -> float:
        """Linear-layer group time for t tokens (t > 0) when the GEMMs' partial last wave is worth `tail` tokens of
        compute (the fitted model prices it over the ideal floor with its own tail)."""
        c, m = self.linear_sides(t, tail)
        return c if c > m else m

    def linear_sides(self, t: int, tail: float) -> tuple[float, float]:
        """The linear group's (compute, memory) times for t tokens: FLOPs of t + `tail` tokens at the peak, and the
        weights the step touches plus the embedding rows, at the bandwidth."""
        w = self._lin_w
        if self._moe:
            w += self._expert_w * (1.0 - self._keep ** t)  # expected fraction of experts touched
        return self._lin_s * t + self._tail_s * tail, w + self._act_s * t

    def _rest(self, t: int, sampled: int, reqs: int) -> float:
        """Everything but attention: linear (+ the kernels' fixed time) + LM head + all-reduce + CPU, in one
        fixed order."""
        x = self._linear(t)
        if self._layer_fixed > 0.0:
            x += self._layer_fixed
        if sampled > 0:
            c = self._lm_s * sampled
            x += c if c > self._lm_w else self._lm_w
        if self._ar_fixed > 0.0 or self._ar_s > 0.0:
            x += self._ar_fixed + self._ar_s * t
        return x + (self.step_overhead_s + self.per_request_overhead_s * reqs)

    def group_times(self, b: StepBatch) -> dict[str, float]:
        """Each operator group's time (s) for this batch, and the CPU overhead: what `step_time` sums."""
        t = b.num_prefill_tokens + b.num_decode_tokens
        sampled = b.num_decode_tokens + b.num_prefill_sampled
        out = {g: 0.0 for g in GROUPS}
        out["cpu"] = 0.0
        if t == 0:
            return out
        out["linear"] = self._linear(t) + self._layer_fixed
        if b.num_prefill_tokens > 0:
            out["prefill_attn"] = max(self._attn_s * b.prefill_attn_tokens,
                                      self._kv_s * (b.prefill_kv_read_tokens + b.num_prefill_tokens))
        if b.num_decode_tokens > 0:
            out["decode_attn"] = max(self._attn_s * b.decode_context_tokens,
                                     self._kv_s * (b.decode_context_tokens + b.num_decode_tokens))
        if sampled > 0:
            out["lm_head"] = max(self._lm_s * sampled, self._lm_w)
        out["allreduce"] = self._ar_fixed + self._ar_s * t
        out["cpu"] = self.step_overhead_s + self.per_request_overhead_s * b.num_requests
        return out

    def step_time(self, b: StepBatch) -> float:
        nd = b.num_decode_tokens
        t = b.num_prefill_tokens + nd
        if t == 0:
            return 0.0
        pre = 0.0
        if b.num_prefill_tokens > 0:
            a = self._attn_s * b.prefill_attn_tokens
            c = self._kv_s * (b.prefill_kv_read_tokens + b.num_prefill_tokens)
            pre = a if a > c else c
        dec = 0.0
        if nd > 0:
            ctx = b.decode_context_tokens
            a = self._attn_s * ctx
            c = self._kv_s * (ctx + nd)
            dec = a if a > c else c
        return (pre + dec) + self._rest(t, nd + b.num_prefill_sampled, nd + b.num_prefill_reqs)

    def decode_params(self, num_decode: int) -> tuple[float, float, float, float]:
        """(attn_s, kv_s, 1.0, rest): a decode-only step is (0.0 + 1.0 x max(attn_s x ctx, kv_s x (ctx + n))) + rest,
        to the bit as `step_time` computes it (x 1.0 changes no float; twin.perf.fitted `closed_form_decode`)."""
        return self._attn_s, self._kv_s, 1.0, self._rest(num_decode, num_decode, num_decode)

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        """k decode-only steps: the constant groups once, then decode attention per step, as `step_time`
        computes it (same operations in the same order, so the results are equal to the bit).

        Plain Python: runs are a handful of steps between events, where numpy's set-up costs more.
        """
        nd = num_decode
        if nd <= 0:
            return [0.0] * k
        rest = self._rest(nd, nd, nd)
        attn_s, kv_s = self._attn_s, self._kv_s
        out = []
        for s in range(k):
            ctx = context0 + s * nd
            a = attn_s * ctx
            c = kv_s * (ctx + nd)
            out.append((0.0 + (a if a > c else c)) + rest)
        return out

    def describe(self) -> dict:
        """Parameters and which of them are assumptions, for reports."""
        return {
            "kind": "roofline",
            "gpu": self.gpu.name,
            "model": self.model.name,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "tensor_parallel": self.tensor_parallel,
            "groups": list(GROUPS),
            "compute_efficiency": self.compute_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "step_overhead_s": self.step_overhead_s,
            "per_request_overhead_s": self.per_request_overhead_s,
            "allreduce_latency_s": self.allreduce_latency_s,
            "layer_overhead_s": self.layer_overhead_s,
            "gemm_tail_tokens": self.gemm_tail_tokens,
            "api_request_overhead_s": self.api_request_overhead_s,
            "api_prompt_token_s": self.api_prompt_token_s,
            "api_output_token_s": self.api_output_token_s,
            "api_queue": self.api_queue,
            "api_rho_cap": self.api_rho_cap,
            "api_handoff_s": self.api_handoff_s,
            "moe_routing": "uniform (ASSUMPTION)" if self.model.is_moe else None,
            "assumptions": ["step_overhead_s", "per_request_overhead_s", "allreduce_latency_s", "layer_overhead_s",
                            "api_request_overhead_s", "api_prompt_token_s", "api_output_token_s", "api_queue",
                            "api_rho_cap", "api_handoff_s"]
                           + (["moe_routing"] if self.model.is_moe else []),
        }
