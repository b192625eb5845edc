"""The step-time effects of the what-if actions: a `StepTimeModel` wrapped around the roofline (or a fitted model).

`build_perf` wraps the scenario's step model in `WhatIfModel` when `whatif.precision`, `whatif.partial_kv` or
`whatif.early_exit` is on, so the engine is untouched. The effect models, group by group (the groups of
twin.perf.roofline; a fitted model's coefficients multiply the same ideal groups):

Precision schedule (`precision`)
    The layers split into classes by dtype. A class of share s of the layers costs s x the whole model's linear
    group computed at that dtype: FP8 layers at the GPU's FP8 peak with 1-byte weights, the others at 16 bits.
    Each class is its own max(compute, memory), as each layer is. Weights shrink accordingly (more KV blocks).
    `kv_cache_fp8` prices the KV cache at 1 byte per element: half the KV bytes per token (about twice the
    blocks) and half the attention's KV reads. Attention and the LM head stay 16-bit, as in vLLM's FP8 path.
    Accuracy is NOT simulated; the user's `accuracy_note` is copied to the report, or "none given".

Partial KV loading (`partial_kv`), per request and per layer: hot h in HBM at full precision, warm w in host
memory at `warm_bits`, cold 1 - h - w dropped. With q = warm_bits / (8 x KV-element bytes):
    HBM per token      = B x (h + w x hit_rate x q)        the hot KV and the warm KV staged in HBM (hits)
    attended per token = h + fetch_share x w               (cold never; warm only on steps that fetch)
    KV read per token  = B x (h + fetch_share x w x q)
    transfer per step  = fetch_share x (1 - hit_rate) x w x q x B x decode context / link bandwidth
                         + w x q x B x prefill tokens / link bandwidth (the warm KV written out once)
                         x (1 - overlap)
B is the KV bytes per token per GPU at the cache dtype; the link is the GPU's host link (hardware.yaml) or a
named one (PCIe Gen5 x16 64 GB/s, NVLink-C2C 450 GB/s per direction). Prefill attends its whole prompt (the
selection happens after it). ASSUMPTIONS: hit_rate, fetch_share, overlap; the transient buffer a fetch lands
in fits in the activation reserve; dequantisation costs nothing; host memory is large enough.
Capacity (the engine's block count) grows by 1 / (h + w x hit_rate x q): close to 1/h, less the staged warm share.

Early exit (`early_exit`): a share t of decode tokens skips the last round(l x layers) layers. Those layers
compute (1 - t) of the decode tokens; their weights are still read unless every token of the step exits
(expected share read 1 - t^n for n decode tokens and no prefill), so a memory-bound decode gains little and a
compute-bound one gains up to t x l. Decode attention, KV writes and all-reduce bytes of the exiting tokens
shrink by l. ASSUMPTIONS: the token and layer shares (papers report them per task); the exit decision costs
nothing; the skipped layers' KV for an exiting token is filled at no cost (CALM's state propagation).
"""

from __future__ import annotations

from dataclasses import dataclass

from twin.errors import TwinInputError
from twin.specs.models import DTYPE_BYTES
from twin.perf.base import StepBatch, StepTimeModel
from twin.perf.fitted import FittedModel
from twin.perf.roofline import GROUPS, RooflineModel
from twin.whatif.spec import HOST_LINKS

WHATIF_GROUPS = (*GROUPS, "kv_transfer")

# the claims engineers bring, for the report's context only: the twin cannot verify any of them
CLAIM_CONTEXT = {
    "precision": "per-layer FP8 schedules are claimed to give ~2x linear-layer compute (FP8 tensor-core peak)",
    "partial_kv": "loading only the hot 2.5k tokens of a 128k context is claimed to cut KV memory ~4x "
                  "(e.g. InfiniGen, Quest, ShadowKV keep a selected share of the KV on the GPU)",
    "early_exit": "early exit is claimed to skip e.g. 8 of 20 layers for confident tokens (CALM, LayerSkip)",
}


def _roofline_like(r: RooflineModel, dtype: str, kv_cache_dtype: str) -> RooflineModel:
    """The same roofline (efficiencies, overheads) at another weight and KV dtype."""
    return RooflineModel(
        r.gpu, r.model, dtype, kv_cache_dtype, r.tensor_parallel, compute_efficiency=r.compute_efficiency,
        memory_efficiency=r.memory_efficiency, step_overhead_s=r.step_overhead_s,
        per_request_overhead_s=r.per_request_overhead_s, allreduce_latency_s=r.allreduce_latency_s,
        layer_overhead_s=r.layer_overhead_s, gemm_tail_tokens=r.gemm_tail_tokens,
        api_request_overhead_s=r.api_request_overhead_s, api_prompt_token_s=r.api_prompt_token_s,
        api_output_token_s=r.api_output_token_s, api_queue=r.api_queue, api_rho_cap=r.api_rho_cap,
        api_handoff_s=r.api_handoff_s)


@dataclass(frozen=True)
class LayerClass:
    """Layers that cost the same: one dtype, skipped or not by early-exiting tokens."""

    share: float  # of all layers
    roofline: RooflineModel  # the whole model at this class's dtype
    skipped: bool


class WhatIfModel:
    """A step model with the what-if actions' effects on top of a roofline or fitted model (`StepTimeModel`)."""

    def __init__(self, base: StepTimeModel, whatif) -> None:
        self.base = base
        self.whatif = whatif
        if isinstance(base, RooflineModel):
            basis, coef = base, {g: 1.0 for g in GROUPS}
            self._step_s, self._req_s = base.step_overhead_s, base.per_request_overhead_s
        elif isinstance(base, FittedModel):
            basis, coef = base.basis, base.coefficients
            self._step_s, self._req_s = coef["step_s"], coef["per_request_s"]
        else:
            raise TwinInputError(f"whatif: needs a roofline or fitted step model, got {type(base).__name__}")
        self.basis = basis
        self.gpu = base.gpu
        m = basis.model
        self.model = m
        self._c = {g: float(coef[g]) for g in GROUPS}
        self._layer_fixed = getattr(base, "layer_overhead_s", 0.0) * m.num_layers  # the roofline's kernels' fixed time
        # the GEMMs' last wave in tokens of compute (twin.perf.roofline gemm_tail_tokens; a fitted model's own)
        self._tail = base.gemm_tail_tokens if isinstance(base, RooflineModel) else base._tail
        pr, pk, ee = whatif.precision, whatif.partial_kv, whatif.early_exit
        kv_dtype = "fp8" if pr.enabled and pr.kv_cache_fp8 else basis.kv_cache_dtype
        L = m.num_layers
        # which layers run FP8
        fp8: set[int] = set()
        if pr.enabled:
            if pr.fp8_layers is not None:
                bad = [i for i in pr.fp8_layers if i >= L]
                if bad:
                    raise TwinInputError(f"whatif.precision.fp8_layers: {m.name} has {L} layers (0..{L - 1}), "
                                         f"got {bad}")
                fp8 = set(pr.fp8_layers)
            else:
                n = round(pr.fp8_fraction * L)
                fp8 = {int((i + 0.5) * L / n) for i in range(n)} if n else set()  # evenly spread
            if fp8:
                self.gpu.flops("fp8")  # one line if the GPU has no FP8 tensor cores
        d16 = basis.dtype if basis.dtype in ("bf16", "fp16") else "bf16"
        if not pr.enabled:
            d16 = basis.dtype  # no schedule: the scenario's dtype for every layer
        skipped: set[int] = set()
        self._exit_share = 0.0
        if ee.enabled and ee.token_share > 0:
            k = min(round(ee.layer_share * L), L - 1)  # a token exits after one layer at least: never all skipped
            skipped = set(range(L - k, L))
            self._exit_share = ee.token_share
        self.fp8_layers = sorted(fp8)
        self.skipped_layers = sorted(skipped)
        r16 = _roofline_like(basis, d16, kv_dtype)
        r8 = _roofline_like(basis, "fp8", kv_dtype) if fp8 else r16
        counts: dict[tuple[bool, bool], int] = {}
        for i in range(L):
            key = (i in fp8, i in skipped)
            counts[key] = counts.get(key, 0) + 1
        self.classes = [LayerClass(n / L, r8 if f else r16, s) for (f, s), n in sorted(counts.items())]
        self._r16 = r16
        self._fp8_share = len(fp8) / L
        self._skip_share = len(skipped) / L
        # partial KV
        self._pk = pk.enabled
        b = r16.kv_bytes_per_token_per_gpu
        self._kv_full_bytes = b
        if pk.enabled:
            q = pk.warm_bits / (8.0 * DTYPE_BYTES["bf16" if kv_dtype == "auto" else kv_dtype])
            self._q = q
            self._hbm_share = pk.hot_fraction + pk.warm_fraction * pk.hit_rate * q
            self._attend = pk.hot_fraction + pk.fetch_share * pk.warm_fraction
            self._read = pk.hot_fraction + pk.fetch_share * pk.warm_fraction * q
            self.link_name, bw = self._link(pk)
            self.link_bandwidth = bw
            keep = 1.0 - pk.overlap
            self._fetch_s = pk.fetch_share * (1 - pk.hit_rate) * pk.warm_fraction * q * b / bw * keep
            self._offload_s = pk.warm_fraction * q * b / bw * keep
        else:
            self._q, self._hbm_share, self._attend, self._read = 1.0, 1.0, 1.0, 1.0
            self.link_name, self.link_bandwidth = "", 0.0
            self._fetch_s = self._offload_s = 0.0
        # per-token unit costs of the attention side (16-bit attention, KV at the cache dtype)
        self._attn_s = r16._attn_s
        self._kv_s = r16._kv_s
        self._lm_s, self._lm_w = r16._lm_s, r16._lm_w
        self._ar_s, self._ar_fixed = r16._ar_s, r16._ar_fixed

    def _link(self, pk) -> tuple[str, float]:
        """The host link's name and bytes/s per direction."""
        if pk.link_bandwidth_gbs is not None:
            return "link_bandwidth_gbs", pk.link_bandwidth_gbs * 1e9
        if pk.link != "spec":
            return pk.link, HOST_LINKS[pk.link]
        if self.gpu.host_link_bandwidth <= 0:
            raise TwinInputError(f"whatif.partial_kv: {self.gpu.name} has no host_link_bandwidth in hardware.yaml; "
                                 f"set partial_kv.link ({', '.join(HOST_LINKS)}) or link_bandwidth_gbs")
        return self.gpu.host_link or "spec", self.gpu.host_link_bandwidth

    # -- sizes and bounds ---------------------------------------------------------------------------------
    @property
    def weight_bytes_per_gpu(self) -> float:
        return sum(c.share * c.roofline.weight_bytes_per_gpu for c in self.classes)

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        """HBM bytes one token of context takes: the full KV, or its hot and staged-warm share (partial KV)."""
        return self._kv_full_bytes * self._hbm_share

    def peak_tokens_per_s(self) -> float:
        """Tokens/s at 100 % of each class's peak FLOP/s, linear layers only, with every exit taken: a hard bound."""
        per_token = sum(c.share / c.roofline.peak_tokens_per_s() * (1.0 - self._exit_share if c.skipped else 1.0)
                        for c in self.classes)
        return 1.0 / per_token

    def ideal(self) -> "WhatIfModel":
        """The same actions on the physical floor (100 % efficiency, no overheads)."""
        return WhatIfModel(self.basis.ideal(), self.whatif)

    def api_request_s(self, prompt_tokens: int) -> float:
        return self.base.api_request_s(prompt_tokens)

    def api_token_s(self) -> float:
        return self.base.api_token_s()

    def api_queue_settings(self) -> tuple[float | None, float, str]:
        fn = getattr(self.base, "api_queue_settings", None)
        return fn() if fn is not None else (None, 0.0, "off")

    # -- groups ---------------------------------------------------------------------------------------------
    def _linear(self, t_pre: int, nd: int) -> float:
        """Each layer class's max(compute, memory) for the tokens that pass through it, summed."""
        x = 0.0
        for c in self.classes:
            r = c.roofline
            n: float = t_pre + nd
            read = 1.0
            if c.skipped:
                n = t_pre + nd * (1.0 - self._exit_share)
                if t_pre == 0:
                    read = 1.0 - self._exit_share ** nd  # skipped only when every token of the step exits
            comp = c.share * (r._lin_s * n + r._tail_s * self._tail)
            mem = c.share * (r._lin_w * read + (r._expert_w * (1.0 - r._keep ** n) if r._moe else 0.0)
                             + r._act_s * (t_pre + nd))
            x += comp if comp > mem else mem
        return x

    def _dec(self, ctx: int, nd: int) -> float:
        """Decode attention (attended share of the context, KV read at the stored precision) + fetch time."""
        if nd <= 0:
            return 0.0
        kept = 1.0 - self._exit_share * self._skip_share
        a = self._attn_s * ctx * self._attend * kept
        c = self._kv_s * (ctx * self._read + nd) * kept
        return self._c["decode_attn"] * (a if a > c else c) + self._fetch_s * ctx * kept

    def _pre(self, b: StepBatch) -> float:
        if b.num_prefill_tokens <= 0:
            return 0.0
        a = self._attn_s * b.prefill_attn_tokens
        c = self._kv_s * (b.prefill_kv_read_tokens + b.num_prefill_tokens)
        return self._c["prefill_attn"] * (a if a > c else c) + self._offload_s * b.num_prefill_tokens

    def _ar(self, t_pre: int, nd: int) -> float:
        if self._ar_s == 0.0 and self._ar_fixed == 0.0:
            return 0.0
        q = self._skip_share
        read = 1.0 if t_pre > 0 else 1.0 - self._exit_share ** nd
        tokens = t_pre + nd * (1.0 - self._exit_share * q)
        return self._c["allreduce"] * (self._ar_fixed * (1.0 - q + q * read) + self._ar_s * tokens)

    def host_time_s(self, num_requests: int) -> float:
        """The CPU terms (what async scheduling overlaps with the GPU; twin.perf.roofline)."""
        return self._step_s + self._req_s * num_requests

    def _rest(self, t_pre: int, nd: int, sampled: int, reqs: int) -> float:
        """Linear + LM head + all-reduce + CPU, in one fixed order (as the roofline's `_rest`)."""
        x = self._c["linear"] * self._linear(t_pre, nd)
        if self._layer_fixed > 0.0:
            x += self._layer_fixed
        if sampled > 0:
            c = self._lm_s * sampled
            x += self._c["lm_head"] * (c if c > self._lm_w else self._lm_w)
        x += self._ar(t_pre, nd)
        return x + (self._step_s + self._req_s * reqs)

    def group_times(self, b: StepBatch) -> dict[str, float]:
        """Each group's time (s) for this batch, `kv_transfer` (host link) apart: what `step_time` sums."""
        out = {g: 0.0 for g in WHATIF_GROUPS}
        out["cpu"] = 0.0
        nd, tp = b.num_decode_tokens, b.num_prefill_tokens
        if tp + nd == 0:
            return out
        kept = 1.0 - self._exit_share * self._skip_share
        out["linear"] = self._c["linear"] * self._linear(tp, nd) + self._layer_fixed
        out["prefill_attn"] = self._pre(b) - self._offload_s * tp
        out["decode_attn"] = self._dec(b.decode_context_tokens, nd) - self._fetch_s * b.decode_context_tokens * kept
        out["kv_transfer"] = self._offload_s * tp + (self._fetch_s * b.decode_context_tokens * kept if nd else 0.0)
        sampled = nd + b.num_prefill_sampled
        if sampled > 0:
            out["lm_head"] = self._c["lm_head"] * max(self._lm_s * sampled, self._lm_w)
        out["allreduce"] = self._ar(tp, nd)
        out["cpu"] = self._step_s + self._req_s * b.num_requests
        return out

    def step_time(self, b: StepBatch) -> float:
        nd = b.num_decode_tokens
        t = b.num_prefill_tokens + nd
        if t == 0:
            return 0.0
        x = self._pre(b) + self._dec(b.decode_context_tokens, nd)
        return x + self._rest(b.num_prefill_tokens, nd, nd + b.num_prefill_sampled, nd + b.num_prefill_reqs)

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        """k decode-only steps, each computed exactly as `step_time` computes it."""
        nd = num_decode
        if nd <= 0:
            return [0.0] * k
        rest = self._rest(0, nd, nd, nd)
        return [(0.0 + self._dec(context0 + s * nd, nd)) + rest for s in range(k)]

    # -- report -----------------------------------------------------------------------------------------------
    def describe(self) -> dict:
        """The base model's description plus each action's effect parameters, and which are assumptions."""
        d = dict(self.base.describe())
        w = self.whatif
        actions: dict = {}
        assumptions = list(d.get("assumptions", []))
        if w.precision.enabled:
            p = w.precision
            actions["precision"] = {
                "fp8_layers": self.fp8_layers, "fp8_share": self._fp8_share, "kv_cache_fp8": p.kv_cache_fp8,
                "other_layers_dtype": self._r16.dtype,
                "accuracy": "not simulated",
                "accuracy_note": p.accuracy_note or "none given (the twin does not invent one)",
                "claim_context": CLAIM_CONTEXT["precision"],
            }
        if w.partial_kv.enabled:
            k = w.partial_kv
            actions["partial_kv"] = {
                "hot_fraction": k.hot_fraction, "warm_fraction": k.warm_fraction,
                "cold_fraction": max(0.0, 1 - k.hot_fraction - k.warm_fraction), "warm_bits": k.warm_bits,
                "hit_rate": k.hit_rate, "fetch_share": k.fetch_share, "overlap": k.overlap,
                "link": self.link_name, "link_bandwidth_bytes_s": self.link_bandwidth,
                "hbm_bytes_per_token_share": self._hbm_share, "capacity_factor": 1.0 / self._hbm_share,
                "host_bytes_per_token_per_gpu": self._kv_full_bytes * k.warm_fraction * self._q,
                "accuracy": "not simulated (the cold share is dropped)",
                "claim_context": CLAIM_CONTEXT["partial_kv"],
            }
            assumptions += ["whatif.partial_kv.hit_rate", "whatif.partial_kv.fetch_share",
                            "whatif.partial_kv.overlap"]
        if w.early_exit.enabled:
            e = w.early_exit
            actions["early_exit"] = {
                "token_share": e.token_share, "layer_share": e.layer_share, "skipped_layers": self.skipped_layers,
                "accuracy": "not simulated", "claim_context": CLAIM_CONTEXT["early_exit"],
            }
            assumptions += ["whatif.early_exit.token_share", "whatif.early_exit.layer_share"]
        d["kind"] = f"whatif({d.get('kind', '?')})"
        d["whatif"] = actions
        d["assumptions"] = assumptions
        return d
