"""A fitted step model: seconds = a linear combination of the roofline's per-group floors, plus CPU terms.

    step_time = c_prefill_attn * T_prefill_attn + c_decode_attn * T_decode_attn
              + c_linear * T_linear + c_lm_head * T_lm_head + c_allreduce * T_allreduce
              + step_s + per_request_s * n_requests                  (for a step with work; 0 otherwise)

Each T_g is the ideal roofline time of operator group g for the step's batch (`RooflineModel.ideal()`:
100 % of peak FLOP/s and bandwidth, no overheads; the groups are described in twin.perf.roofline), and
n_requests is the number of requests scheduled in the step. A coefficient c_g is then the measured slowdown
of that group against its physical floor (1 / efficiency), and `step_s`, `per_request_s` the CPU time per
step and per scheduled request. The calibration work fits these by least squares on measured step times.

File format (YAML or JSON; `perf.kind: fitted`, `perf.fit_path: FILE`, relative to the scenario file):

    basis: roofline-groups/1        # required: this basis, versioned
    hardware: H100-SXM-80GB         # optional: if given, must match the scenario's cluster
    model: Llama-3-8B               # optional, same
    dtype: bf16                     # optional, same
    tensor_parallel: 1              # optional, same
    coefficients:                   # required, every key below, numbers >= 0
      linear: 1.33
      prefill_attn: 1.4
      decode_attn: 1.9
      lm_head: 1.2
      allreduce: 1.0
      step_s: 0.0012
      per_request_s: 4.0e-6
      per_layer_s: 2.0e-5           # optional (0): GPU time per layer per step, not hidden by async scheduling
      allreduce_call_s: 1.0e-5      # optional (0): GPU time per TP all-reduce, two per layer when TP > 1
      per_request_gpu_s: 1.5e-5     # optional (0): GPU time per scheduled request per step, not hidden by async
      compute: 1.28                 # optional (linear): a dense model's linear group on its compute side (below)
      gemm_tail_tokens: 150         # optional (0): the GEMMs' partial last wave, in tokens of compute per step
                                    # (twin.perf.roofline; the linear group's compute side is T + tail tokens)
    fit: {data: ..., date: ..., mape: ...}   # optional, free-form provenance, shown in describe()

Shipped profiles (`perf.profile: NAME`, twin/perf/profiles/NAME.yaml) name no model, dtype or TP: their basis
terms are roofline times of the scenario's own model and GPU, so one profile prices every model on that GPU
generation, and another GPU through its own datasheet numbers. A shipped profile's `default_for: [GPU, ...]`
makes it the step model of every scenario on those GPUs that leaves `perf.kind` at `auto` (twin.scenario).

The API-server times (`api_request_s`, `api_token_s`, and the queue's `api_queue_settings`, twin.sim.api_server) are not
part of the step model; they come from `perf:` in the scenario as for the roofline.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from twin.errors import TwinInputError
from twin.specs.hardware import get_gpu
from twin.specs.models import get_model
from twin.perf.base import StepBatch, StepTimeModel
from twin.perf.roofline import GROUPS, RooflineModel

BASIS = "roofline-groups/1"
COEFFICIENTS = (*GROUPS, "step_s", "per_request_s")
# optional GPU-side fixed costs (0 when absent), which async scheduling does not hide: `per_layer_s` per layer per
# step (small-kernel and launch latency inside the CUDA graph: norms, rope, activation, MoE routing),
# `allreduce_call_s` per tensor-parallel all-reduce (two per layer when TP > 1), and `per_request_gpu_s` per request
# scheduled in the step (a decode or a prefill chunk: work per sequence rather than per token or per layer, e.g. the
# sampler's, which sorts the whole vocabulary per request for top-p, `apply_top_k_top_p` in
# `vllm/v1/sample/ops/topk_topp_sampler.py`, when FlashInfer's sampler is not used; fitted, its cause not established)
# the coefficients that scale an ideal group time: slowdowns against 100 % of the hardware's peak, never below 1
SLOWDOWNS = (*GROUPS, "moe_linear", "moe_compute", "compute")
OPTIONAL = ("per_layer_s", "allreduce_call_s", "per_request_gpu_s", "moe_linear", "moe_compute", "compute",
            "gemm_tail_tokens")
# `moe_linear` (optional, default `linear`): the linear group's coefficient for MoE models, whose grouped expert
# kernels (and MXFP4 weight-only dequantisation) run further from the floor than dense GEMMs. `moe_compute`
# (optional, default `moe_linear`): the same group's compute side alone, so an MoE step is
# max(moe_compute x FLOP time, moe_linear x weight-read time). One coefficient cannot price both: a decode reads the
# touched experts' 4.25-bit weights near the bandwidth, while a prefill's grouped expert GEMMs dequantise MXFP4 to
# BF16 in the kernel (Hopper has no FP4 tensor cores) and split the tokens over many experts (small GEMMs each), far
# from the 16-bit peak. `compute` (optional, default `linear`): a dense model's compute side alone, so a dense step is
# max(compute x FLOP time, linear x weight-read time): the shipped profile pins it at the GEMMs' measured efficiency
# (twin.analysis.profile_fit `COMPUTE`) instead of letting the weight-read-bound decodes set it.


PROFILES = Path(__file__).resolve().parent / "profiles"


def known_profiles() -> list[str]:
    """The shipped profiles' names (twin/perf/profiles/*.yaml)."""
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))


@lru_cache(maxsize=None)
def default_profile(gpu_name: str) -> str | None:
    """The shipped profile whose `default_for` lists this GPU (its canonical name), or None: `perf.kind: auto`."""
    for name in known_profiles():
        raw = yaml.safe_load((PROFILES / f"{name}.yaml").read_text()) or {}
        if gpu_name in (raw.get("default_for") or ()):
            return name
    return None


def profile_path(name: str) -> Path:
    if name not in known_profiles():
        raise TwinInputError(f"unknown profile {name!r} (shipped: {', '.join(known_profiles())})")
    return PROFILES / f"{name}.yaml"


def read_fit(path: str | Path) -> dict:
    """A coefficients file as a mapping, or one TwinInputError line naming the file and the problem.

    Parsed once per file version (path, size, modification time) and handed out as a copy: every `Cluster` of a
    fitted scenario reads it, and the live Block router builds one per candidate per decision, where parsing the
    shipped profile's YAML was half of a forecast's 10 ms."""
    path = Path(path)
    if not path.is_file():
        raise TwinInputError(f"perf.fit_path: {path} is not a file")
    try:
        st = path.stat()
    except OSError as e:
        raise TwinInputError(f"{path}: not a valid YAML/JSON coefficients file ({type(e).__name__})") from None
    return copy.deepcopy(_read_fit(str(path), str(path.resolve()), st.st_size, st.st_mtime_ns))


@lru_cache(maxsize=64)
def _read_fit(shown: str, resolved: str, size: int, mtime_ns: int) -> dict:
    """`read_fit` of one file version (the size and time are the cache's key only); errors name `shown`."""
    path = Path(shown)
    try:
        text = Path(resolved).read_text()
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        raise TwinInputError(f"{path}: not a valid YAML/JSON coefficients file ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise TwinInputError(f"{path}: a coefficients file must be a mapping")
    if raw.get("basis") != BASIS:
        raise TwinInputError(f"{path}: basis must be {BASIS!r}, got {raw.get('basis')!r}")
    coef = raw.get("coefficients")
    if not isinstance(coef, dict):
        raise TwinInputError(f"{path}: coefficients: missing (a mapping of {', '.join(COEFFICIENTS)})")
    missing = [k for k in COEFFICIENTS if k not in coef]
    unknown = [k for k in coef if k not in COEFFICIENTS + OPTIONAL]
    if missing or unknown:
        what = (f"missing {', '.join(missing)}" if missing else "") + ("; " if missing and unknown else "") \
            + (f"unknown {', '.join(map(str, unknown))}" if unknown else "")
        raise TwinInputError(f"{path}: coefficients: {what}")
    for k in (*COEFFICIENTS, *(o for o in OPTIONAL if o in coef)):
        v = coef[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise TwinInputError(f"{path}: coefficients.{k} must be a number >= 0, got {v!r}")
        if k in SLOWDOWNS and v < 1:  # physics first: no group runs faster than the hardware's peak
            raise TwinInputError(f"{path}: coefficients.{k} is a slowdown over the ideal roofline time, at least 1 "
                                 f"(faster than the hardware can run), got {v!r}")
    return raw


class FittedModel:
    """Fitted coefficients over an ideal roofline's group times; satisfies `StepTimeModel`."""

    def __init__(self, roofline: RooflineModel, coefficients: dict[str, float], fit: Any = None,
                 source: str = "") -> None:
        self.roofline = roofline  # gives the sizes, the API-server times and the ideal floor
        self.basis = roofline.ideal()
        self.gpu = roofline.gpu
        self.coefficients = {k: float(coefficients[k]) for k in COEFFICIENTS}
        self.coefficients.update({k: float(coefficients[k]) for k in OPTIONAL if k in coefficients})
        self.fit = fit
        self.source = source
        c = self.coefficients
        self._c_lin, self._c_pre, self._c_dec = c["linear"], c["prefill_attn"], c["decode_attn"]
        if roofline.model.is_moe and "moe_linear" in c:
            self._c_lin = c["moe_linear"]
        if roofline.model.is_moe:
            self._c_lin_c = c.get("moe_compute", self._c_lin)
        else:
            self._c_lin_c = c.get("compute", self._c_lin)
        # which sides of the linear group the `linear` coefficient itself scales (basis_terms): not one that
        # `moe_linear`, `moe_compute` or `compute` prices instead
        self._mem_tied = not (roofline.model.is_moe and "moe_linear" in c)
        self._comp_tied = self._mem_tied and ("moe_compute" if roofline.model.is_moe else "compute") not in c
        self._c_lm, self._c_ar = c["lm_head"], c["allreduce"]
        self._step_s, self._req_s = c["step_s"], c["per_request_s"]
        m, tp = roofline.model, roofline.tensor_parallel
        # fixed GPU time of any step with work: per layer, and per all-reduce (twin.perf.roofline's two per layer)
        layer_s, call_s = c.get("per_layer_s", 0.0), c.get("allreduce_call_s", 0.0)
        self._fixed_gpu = m.num_layers * layer_s + (2 * m.num_layers * call_s if tp > 1 else 0.0)
        self._req_gpu = c.get("per_request_gpu_s", 0.0)  # GPU time per scheduled request per step
        self._tail = c.get("gemm_tail_tokens", 0.0)  # the GEMMs' last wave (twin.perf.roofline), on the compute side

    @classmethod
    def from_file(cls, roofline: RooflineModel, path: str | Path) -> "FittedModel":
        raw = read_fit(path)
        canonical = {"hardware": lambda v: get_gpu(str(v)).name, "model": lambda v: get_model(str(v)).name}
        for key, want in (("hardware", roofline.gpu.name), ("model", roofline.model.name),
                          ("dtype", roofline.dtype), ("tensor_parallel", roofline.tensor_parallel)):
            if key in raw and canonical.get(key, lambda v: v)(raw[key]) != want:
                raise TwinInputError(f"{path}: fitted for {key} {raw[key]!r}, but the scenario has {want!r}")
        return cls(roofline, raw["coefficients"], raw.get("fit"), str(path))

    # -- sizes, bounds and API-server time: those of the roofline it is fitted over ---------------------
    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.roofline.weight_bytes_per_gpu

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self.roofline.kv_bytes_per_token_per_gpu

    def peak_tokens_per_s(self) -> float:
        return self.roofline.peak_tokens_per_s()

    def ideal(self) -> RooflineModel:
        return self.basis

    def api_request_s(self, prompt_tokens: int) -> float:
        return self.roofline.api_request_s(prompt_tokens)

    def api_token_s(self) -> float:
        return self.roofline.api_token_s()

    def api_queue_settings(self) -> tuple[float | None, float, str]:
        return self.roofline.api_queue_settings()

    # -- step time ------------------------------------------------------------------------------------------
    def host_time_s(self, num_requests: int) -> float:
        """The CPU terms (what async scheduling overlaps with the GPU; twin.perf.roofline)."""
        return self._step_s + self._req_s * num_requests

    def _rest(self, t: int, sampled: int, reqs: int) -> float:
        g = self.basis
        comp, mem = g.linear_sides(t, self._tail)
        comp *= self._c_lin_c
        mem *= self._c_lin
        x = comp if comp > mem else mem  # = linear x max(compute, memory) when the two coefficients are equal
        if sampled > 0:
            c = g._lm_s * sampled
            x += self._c_lm * (c if c > g._lm_w else g._lm_w)
        x += self._c_ar * (g._ar_s * t) + self._fixed_gpu + self._req_gpu * reqs
        return x + (self._step_s + self._req_s * reqs)

    def _dec(self, ctx: int, nd: int) -> float:
        g = self.basis
        a = g._attn_s * ctx
        c = g._kv_s * (ctx + nd)
        return self._c_dec * (a if a > c else c)

    def step_time(self, b: StepBatch) -> float:
        nd = b.num_decode_tokens
        t = b.num_prefill_tokens + nd
        if t == 0:
            return 0.0
        g = self.basis
        pre = 0.0
        if b.num_prefill_tokens > 0:
            a = g._attn_s * b.prefill_attn_tokens
            c = g._kv_s * (b.prefill_kv_read_tokens + b.num_prefill_tokens)
            pre = self._c_pre * (a if a > c else c)
        dec = self._dec(b.decode_context_tokens, nd) if nd > 0 else 0.0
        return (pre + dec) + self._rest(t, nd + b.num_prefill_sampled, nd + b.num_prefill_reqs)

    def basis_terms(self, b: StepBatch) -> tuple[tuple[float, float, float, float], float]:
        """A step's terms as calibration fits them (linear + lm_head, attention, per step, per request) and its
        constant part, so that `step_time` = linear x terms[0] + prefill_attn x terms[1] + step_s + per_request_s x
        terms[3] + constant when lm_head = linear and decode_attn = prefill_attn, the ties calibration keeps
        (twin.lab.calibrate `_TIES`). The constant holds what those four coefficients do not scale: the
        all-reduce, the optional GPU terms (`per_layer_s`, `allreduce_call_s`, `per_request_gpu_s`), and a side
        of the linear group priced by its own coefficient (`compute`, `moe_compute`, `moe_linear`) at its
        current value, so the identity is exact for any profile and locally exact in `linear` (twin.lab.steps,
        twin.lab.calibrate)."""
        g = self.basis
        nd = b.num_decode_tokens
        t = b.num_prefill_tokens + nd
        if t == 0:
            return (0.0, 0.0, 0.0, 0.0), 0.0
        sampled = nd + b.num_prefill_sampled
        reqs = nd + b.num_prefill_reqs
        const = self.coefficients["allreduce"] * g._ar_s * t + self._fixed_gpu + self._req_gpu * reqs
        comp, mem = g.linear_sides(t, self._tail)
        if comp * self._c_lin_c > mem * self._c_lin:  # the side `_rest` takes
            lin, tied, c = comp, self._comp_tied, self._c_lin_c
        else:
            lin, tied, c = mem, self._mem_tied, self._c_lin
        if not tied:
            const += c * lin
            lin = 0.0
        if sampled > 0:
            lin += max(g._lm_s * sampled, g._lm_w)
        attn = 0.0
        if b.num_prefill_tokens > 0:
            attn += max(g._attn_s * b.prefill_attn_tokens, g._kv_s * (b.prefill_kv_read_tokens + b.num_prefill_tokens))
        if nd > 0:
            ctx = b.decode_context_tokens
            attn += max(g._attn_s * ctx, g._kv_s * (ctx + nd))
        return (lin, attn, 1.0, float(reqs)), const

    def decode_params(self, num_decode: int) -> tuple[float, float, float, float]:
        """(attn_s, kv_s, c, rest) such that a decode-only step of `num_decode` members attending ctx tokens takes
        (0.0 + c x max(attn_s x ctx, kv_s x (ctx + num_decode))) + rest, to the bit as `step_time` computes it: the
        engine's decode runs compute their end times from these without a list per run (`closed_form_decode`)."""
        g = self.basis
        return g._attn_s, g._kv_s, self._c_dec, self._rest(num_decode, num_decode, num_decode)

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        """k decode-only steps, each exactly as `step_time` computes it."""
        nd = num_decode
        if nd <= 0:
            return [0.0] * k
        attn_s, kv_s, cd, rest = self.decode_params(nd)
        out = []
        ctx = context0
        for _s in range(k):  # `_dec` inlined: the same operations in the same order, so equal to the bit
            a = attn_s * ctx
            c = kv_s * (ctx + nd)
            out.append((0.0 + cd * (a if a > c else c)) + rest)
            ctx += nd
        return out

    def describe(self) -> dict:
        return {
            "kind": "fitted",
            "basis": BASIS,
            "source": self.source,
            "gpu": self.gpu.name,
            "model": self.roofline.model.name,
            "dtype": self.roofline.dtype,
            "tensor_parallel": self.roofline.tensor_parallel,
            "coefficients": dict(self.coefficients),
            "fit": self.fit,
            "api_request_overhead_s": self.roofline.api_request_overhead_s,
            "api_prompt_token_s": self.roofline.api_prompt_token_s,
            "api_output_token_s": self.roofline.api_output_token_s,
            "api_queue": self.roofline.api_queue,
            "api_rho_cap": self.roofline.api_rho_cap,
            "api_handoff_s": self.roofline.api_handoff_s,
            "assumptions": ["api_request_overhead_s", "api_prompt_token_s", "api_output_token_s", "api_queue",
                           "api_rho_cap", "api_handoff_s"]
                           + (["moe_routing"] if self.roofline.model.is_moe else [])
                           # the pinned GEMM efficiency, measured on BF16, assumed for other dtypes
                           + (["compute"] if "compute" in self.coefficients and not self.roofline.model.is_moe
                              and self.roofline.dtype != "bf16" else []),
        }


def closed_form_decode(model: StepTimeModel) -> bool:
    """Does `model.decode_params(n)` give its decode-only steps in closed form, (attn_s, kv_s, c, rest) with a step
    = (0.0 + c x max(attn_s x ctx, kv_s x (ctx + n))) + rest to the bit (`FittedModel.decode_params`)? True only for
    exactly a fitted or a roofline model; the engine calls any other's `decode_run_times`. An exact type check, not
    an attribute lookup: wrappers forward unknown attributes to the model they wrap, whose closed form would leave
    out their own terms, and a subclass may price steps its own way."""
    t = type(model)
    return t is FittedModel or t is RooflineModel
