"""Physical ceilings of one serving configuration, and verdicts on throughput claims (`twin check`).

Every figure is the step model's own `ideal()` (100 % of peak FLOP/s and HBM bandwidth, no CPU overhead; the
per-group roofline of twin.perf.roofline, with any what-if actions applied), so no simulation can beat it:

- compute-bound ceiling: the linear layers' FLOPs per token at peak FLOP/s (`peak_tokens_per_s`), the bound
  for any traffic;
- prefill at context N: prompts of N tokens, batched until the weight reads are amortised (attention grows
  with N);
- decode at context N: every sequence attends N tokens; memory-bound at batch 1 (weights and KV read per
  token), and at the largest batch the KV cache holds at that context (the best decode can do);
- the crossover batch: the token count at which the linear layers' FLOPs take as long as reading their
  weights (below it a step is memory-bound, above it compute-bound);
- mixed traffic: prompt and output tokens in the ratio P:D, prefill and decode time-shared (harmonic mean
  of the two ceilings); co-batching cannot beat the compute-bound ceiling either.

Per GPU is per instance divided by the tensor-parallel degree. KV capacity is vLLM's block count for the
scenario's engine settings (twin.engine.config.num_gpu_blocks).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from twin.engine.config import EngineConfig, num_gpu_blocks
from twin.errors import TwinInputError
from twin.perf.base import StepBatch, StepTimeModel

PREFILL_BATCH_TOKENS = 1 << 16  # enough prompt tokens per step that the weight reads are amortised


@dataclass
class Ceilings:
    """Tokens/s per GPU that the hardware cannot exceed for one model, dtype and context length."""

    gpu: str
    model: str
    dtype: str
    kv_cache_dtype: str
    tensor_parallel: int
    context: int
    compute_tok_s: float  # linear layers at peak FLOP/s: the bound for any traffic
    crossover_batch: int | None  # tokens per step where linear compute = weight reads
    prefill_tok_s: float  # prompts of `context` tokens, large batches
    decode_batch1_tok_s: float  # one sequence at `context`: memory-bound
    decode_tok_s: float  # the largest batch the KV cache holds at `context`
    max_concurrent_seqs: int  # sequences of `context` tokens the KV cache holds
    max_num_seqs: int  # the engine's own cap (vLLM's max_num_seqs)
    kv_capacity_tokens: int
    num_gpu_blocks: int
    block_size: int
    mix: tuple[float, float]  # prompt : output tokens
    mixed_tok_s: float
    decode_bound: str = ""  # what limits decode at the largest batch: KV reads, weight reads or compute
    notes: list[str] = field(default_factory=list)

    def per_traffic(self) -> dict[str, float]:
        """The ceiling a claim is judged against, by traffic kind (tokens/s per GPU)."""
        return {"prefill": self.prefill_tok_s, "decode": self.decode_tok_s, "mixed": self.mixed_tok_s}


def _decode_tok_s(ideal: StepTimeModel, batch: int, context: int) -> float:
    t = ideal.step_time(StepBatch(num_decode_tokens=batch, decode_context_tokens=batch * context))
    return batch / t if t > 0 else math.inf


def _prefill_tok_s(ideal: StepTimeModel, context: int) -> float:
    k = max(1, math.ceil(PREFILL_BATCH_TOKENS / context))
    n = k * context
    b = StepBatch(num_prefill_tokens=n, prefill_attn_tokens=k * context * (context + 1) / 2,
                  prefill_kv_read_tokens=n, num_prefill_sampled=k, num_prefill_reqs=k)
    t = ideal.step_time(b)
    return n / t if t > 0 else math.inf


def crossover_batch(ideal: StepTimeModel) -> int | None:
    """Smallest token count at which the linear group is compute-bound (None: the model has no groups)."""
    groups = getattr(ideal, "group_times", None)
    if groups is None:
        return None

    def lin(t: int) -> float:
        return groups(StepBatch(num_prefill_tokens=t))["linear"]

    big = 1 << 24
    per_token = lin(big) / big  # compute-bound: linear in t
    if lin(1) <= per_token * (1 + 1e-9):
        return 1
    lo, hi = 1, big  # lin(lo) memory-bound, lin(hi) compute-bound
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if lin(mid) <= mid * per_token * (1 + 1e-9):
            hi = mid
        else:
            lo = mid
    return hi


def ceilings(perf: StepTimeModel, cfg: EngineConfig, context: int, mix: tuple[float, float] = (5.0, 1.0),
             names: tuple[str, str, str, str, int] | None = None) -> Ceilings:
    """The ceilings of `perf` (a step model of one instance) with `cfg`'s KV sizing, at `context` tokens."""
    if context < 1:
        raise TwinInputError(f"--context {context}: must be >= 1 token")
    if cfg.max_model_len and context > cfg.max_model_len:  # ceilings for sequences the engine would refuse
        raise TwinInputError(f"--context {context}: above max_model_len ({cfg.max_model_len:,}); raise "
                             "cluster.engine.max_model_len (--set) or lower --context")
    ideal = perf.ideal()
    d = perf.describe()
    gpu, model = perf.gpu.name, str(d.get("model", "?"))
    dtype, kv_dtype, tp = str(d.get("dtype", "?")), str(d.get("kv_cache_dtype", "auto")), int(d.get("tensor_parallel", 1))
    if names is not None:
        gpu, model, dtype, kv_dtype, tp = names
    blocks = num_gpu_blocks(cfg, perf.gpu.device_memory, perf.weight_bytes_per_gpu, perf.kv_bytes_per_token_per_gpu)
    bs = cfg.block_size
    max_seqs = blocks // math.ceil(context / bs)
    notes = []
    compute = perf.peak_tokens_per_s() / tp
    prefill = min(_prefill_tok_s(ideal, context), perf.peak_tokens_per_s()) / tp
    batch1 = _decode_tok_s(ideal, 1, context) / tp
    if max_seqs >= 1:
        decode = min(_decode_tok_s(ideal, max_seqs, context), perf.peak_tokens_per_s()) / tp
    else:
        decode = 0.0
        notes.append(f"a sequence of {context:,} tokens does not fit the KV cache ({blocks * bs:,} tokens)")
    bound = "no sequence fits"
    groups = getattr(ideal, "group_times", None)
    if max_seqs >= 1 and groups is not None:
        g = groups(StepBatch(num_decode_tokens=max_seqs, decode_context_tokens=max_seqs * context))
        cross = crossover_batch(ideal) or 0
        bound = ("memory (KV reads)" if g["decode_attn"] > g["linear"] else
                 "compute" if max_seqs >= cross else "memory (weight reads)")
    p, o = mix
    top = max(p, o)  # shares of the larger: 1e308 + 1e308 overflows to inf
    p1, o1 = p / top, o / top
    share_p, share_o = p1 / (p1 + o1), o1 / (p1 + o1)
    if decode > 0:
        mixed = 1.0 / (share_p / prefill + share_o / decode)
    else:
        mixed = prefill if share_o == 0 else 0.0
    return Ceilings(gpu, model, dtype, kv_dtype, tp, context, compute, crossover_batch(ideal), prefill, batch1,
                    decode, max_seqs, cfg.max_num_seqs, blocks * bs, blocks, bs, (p, o), mixed, bound, notes)


def parse_mix(text: str) -> tuple[float, float]:
    """'P:D' (prompt : output tokens) as two numbers, one line if malformed."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*:\s*([0-9.]+(?:e[+-]?\d+)?)\s*", text, re.I)
    try:
        p, o = (float(m.group(1)), float(m.group(2))) if m else (-1.0, -1.0)
    except ValueError:
        p, o = -1.0, -1.0
    if p < 0 or o < 0 or p + o <= 0 or not (math.isfinite(p) and math.isfinite(o)):
        raise TwinInputError(f"--mix {text!r}: expected PROMPT:OUTPUT token ratio, e.g. 5:1")
    return p, o


# ---- claims ------------------------------------------------------------------------------------------------
_MULT = {"": 1.0, "k": 1e3, "thousand": 1e3, "m": 1e6, "million": 1e6, "mn": 1e6, "b": 1e9, "bn": 1e9, "g": 1e9,
         "billion": 1e9, "t": 1e12, "trillion": 1e12}
_TIME = {"s": 1.0, "sec": 1.0, "second": 1.0, "min": 60.0, "minute": 60.0, "m": 60.0, "h": 3600.0, "hr": 3600.0,
         "hour": 3600.0, "d": 86400.0, "day": 86400.0}
_PER_GPU = {"gpu", "device", "card", "chip", "accelerator"}
_PER_INSTANCE = {"instance", "replica", "server", "engine", "node", "deployment"}
_CLAIM = re.compile(
    r"^\s*(?:(?:more|greater|higher)\s+than|over|above|at\s+least|up\s+to|about|around|approximately|~|>=?|≥)?\s*"
    r"(?P<num>\d[\d,_]*(?:\.\d+)?(?:e[+-]?\d+)?)\s*(?P<mult>[a-z]*)\s*"
    r"(?:(?:output|input|generated|prompt)\s+)?(?:tokens?|toks?|tk)\s*"
    r"(?:/|per|a|an|each|every)\s*(?P<time>[a-z]+?)s?\s*"
    r"(?:(?:/|per|a|an|each|every)\s*(?:an?\s+)?(?P<per>[a-z0-9][a-z0-9 ._-]*?))?\s*$", re.I)


@dataclass(frozen=True)
class Claim:
    """A throughput claim in tokens/s, per GPU or per instance."""

    text: str
    tokens_per_s: float
    per: str  # "gpu" | "instance"
    per_named: str = ""  # the GPU the claim names ("H100"), if any

    def per_gpu(self, tensor_parallel: int) -> float:
        return self.tokens_per_s / tensor_parallel if self.per == "instance" else self.tokens_per_s


def parse_claim(text: str) -> Claim:
    """'1e9 tokens/min/GPU', '1 billion tokens per minute per H100', '20k tok/s per instance'; one line if not."""
    bad = (f"--claim {text!r}: expected NUMBER tokens per TIME, then per GPU or per instance, e.g. "
           "'1e9 tokens/min/GPU' or '20k tok/s per instance'")
    m = _CLAIM.match(text or "")
    if m is None:
        raise TwinInputError(bad)
    mult = m.group("mult").lower()
    unit = m.group("time").lower()
    if mult not in _MULT or unit not in _TIME:
        raise TwinInputError(bad)
    try:
        value = float(m.group("num").replace(",", "").replace("_", "")) * _MULT[mult]
    except ValueError:
        raise TwinInputError(bad) from None
    if not (value > 0 and math.isfinite(value)):
        raise TwinInputError(f"--claim {text!r}: the throughput must be a positive number")
    per_raw = (m.group("per") or "").strip().lower()
    named = ""
    if per_raw in ("",) or per_raw in _PER_GPU:
        per = "gpu"
    elif per_raw in _PER_INSTANCE:
        per = "instance"
    else:
        from twin.specs.hardware import get_gpu

        try:
            named = get_gpu(per_raw).name
        except TwinInputError:
            raise TwinInputError(f"--claim {text!r}: 'per {per_raw}' is neither a GPU nor an instance") from None
        per = "gpu"
    return Claim(text.strip(), value / _TIME[unit], per, named)


@dataclass(frozen=True)
class Verdict:
    traffic: str
    ceiling_tok_s: float
    factor: float  # claim / ceiling: > 1 means physically impossible

    @property
    def reachable(self) -> bool:
        return self.factor <= 1.0


def judge(claim: Claim, c: Ceilings) -> list[Verdict]:
    """The claim against the ceiling of each traffic kind (per GPU)."""
    want = claim.per_gpu(c.tensor_parallel)
    return [Verdict(k, v, want / v if v > 0 else math.inf) for k, v in c.per_traffic().items()]


def fmt_rate(x: float) -> str:
    """Tokens/s in engineering units (12.3k, 4.56M)."""
    if not math.isfinite(x):
        return "inf"
    for unit, f in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:,.3g}{unit}"
    return f"{x:,.3g}"
