"""Fit a shipped step-time profile (twin.perf.fitted, `perf: {kind: fitted, profile: NAME}`) on measured
closed-loop GPU points (twin.analysis.gpu_fidelity), in basis terms that transfer across models, TP degrees and dtypes.

A point's measured mean TPOT and TTFT are written as linear in the coefficients through a steady-state picture
of the closed loop (N clients, mean prompt I, mean output O, the ideal roofline's group times of the point's own
model, GPU, dtype and TP as the basis):

- a decode step of the N requests at mean context I + O / 2: `D = f(decode N)`;
- each of the other N - 1 clients sends one request during a request's O - 1 decode steps, and its prefill of I
  tokens rides in one step with the N - 1 decodes, lengthening that step by `P = f(mixed) - f(decode N - 1)`;
- TPOT ~ D + (N - 1) / (O - 1) x P; TTFT ~ the API server's time + D (the step under way when it arrives) +
  f(mixed) + D (async scheduling hands the first token out one step later).

Each f is sum_g c_g T_g + per_layer_s x layers + allreduce_call_s x all-reduces + per_request_gpu_s x requests in
the step, the linear group with the GEMMs' measured last wave (`gemm_tail_tokens`, not fitted). An MoE model's linear
group is under its own coefficients, `moe_compute` where its FLOPs bound it at the floor (a prefill) and `moe_linear`
where its weight reads do (a decode); a dense model's likewise under `compute` (pinned at the GEMMs' measured
efficiency, `COMPUTE`) and `linear`.
The host terms (step_s, per_request_s) are hidden under the GPU by async scheduling and keep the roofline's defaults.
The coefficients are the non-negative least-squares fit of the relative errors (rows divided by the measured value). Points whose load
does not fit the KV cache (queueing and preemption the picture leaves out) are not fitted on, nor are bad runs. The picture is only
the fit's design matrix: the profile is then scored by simulating every point (`twin score`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from twin.analysis.gpu_fidelity import RANGE_RATIO, Point, bad_runs, point_scenario
from twin.perf.base import StepBatch
from twin.perf.fitted import BASIS
from twin.perf.roofline import GROUPS

FEATURES = (*GROUPS, "per_layer_s", "allreduce_call_s", "moe_linear", "moe_compute", "compute", "per_request_gpu_s")
# the GEMMs' partial last wave (twin.perf.roofline `gemm_tail_tokens`), measured on Vidur's H100 operators, not
# fitted: every point here runs max_num_batched_tokens 8192, which cannot tell it apart from the linear coefficient
GEMM_TAIL_TOKENS = 150.0
# a dense model's GEMMs on their compute side (twin.perf.fitted `compute`), pinned, not fitted: 1 / 0.78, the
# efficiency measured on Vidur's H100 BF16 GEMMs with the tail above (the roofline's `compute_efficiency`).
# ASSUMPTION: the FP8 GEMMs of the fitted dense model reach the same fraction of their own peak. Fitted freely, the
# term is not identifiable: the table's dense points at one TP trade it against the all-reduce and the per-layer time
# (fit on TP 2 + 8 it lands at 1.7-2.0; the picture's single-TP fits are degenerate), so the measured value is pinned
COMPUTE = 1.0 / 0.78
PINNED = {"compute": COMPUTE}
# the roofline's host terms, which async scheduling hides under the GPU: the profile keeps them, not fitted
HOST_TERMS = {"step_s": 0.002, "per_request_s": 4.0e-6}


def _features(g, b: StepBatch, layers: int, tp: int) -> np.ndarray:
    """The step's basis terms; the linear group goes to its compute-side column when its FLOPs bound it at the floor
    (a prefill: `moe_compute` for an MoE model, `compute` for a dense one), else to its weight-read column (a decode:
    `moe_linear`, `linear`; twin.perf.fitted)."""
    t = g.group_times(b)
    moe = g.model.is_moe
    lin = t["linear"]
    comp, mem = g.linear_sides(b.num_tokens, g.gemm_tail_tokens)
    column = ("moe_compute" if comp > mem else "moe_linear") if moe else ("compute" if comp > mem else "linear")
    cols = {**t, "linear": 0.0, "per_layer_s": float(layers), "allreduce_call_s": float(2 * layers if tp > 1 else 0),
            "moe_linear": 0.0, "moe_compute": 0.0, "compute": 0.0, "per_request_gpu_s": float(b.num_requests)}
    cols[column] = lin
    return np.array([cols[k] for k in FEATURES])


def point_features(p: Point, range_ratio: float = RANGE_RATIO) -> tuple[np.ndarray, np.ndarray, float, bool]:
    """(TPOT features, TTFT features, the TTFT's API-server seconds, whether the load fits the KV cache)."""
    from twin.sim.cluster import Cluster
    from twin.perf.registry import roofline
    from twin.workload import build_stream

    sc = point_scenario(p, 1, None, range_ratio)
    r = roofline(sc)
    g, m, tp = r.ideal(), r.model, r.tensor_parallel
    g.gemm_tail_tokens = GEMM_TAIL_TOKENS  # the fitted model's linear basis (twin.perf.fitted `gemm_tail_tokens`)
    n = p.concurrency
    i = (max(int(p.isl * range_ratio), 1) + p.isl) / 2
    o = p.mean_output(range_ratio)
    ctx = int(i + o / 2)

    def dec(k: int) -> StepBatch:
        return StepBatch(num_decode_tokens=k, decode_context_tokens=k * ctx)

    ii = int(i)
    mixed = StepBatch(num_prefill_tokens=ii, prefill_attn_tokens=ii * (ii + 1) / 2, prefill_kv_read_tokens=ii,
                      num_prefill_sampled=1, num_decode_tokens=n - 1, decode_context_tokens=(n - 1) * ctx,
                      num_prefill_reqs=1)
    f_dec = _features(g, dec(n), m.num_layers, tp)
    f_mix = _features(g, mixed, m.num_layers, tp)
    f_dec1 = _features(g, dec(n - 1), m.num_layers, tp) if n > 1 else np.zeros(len(FEATURES))
    tpot = f_dec + (n - 1) / max(o - 1, 1) * (f_mix - f_dec1)
    ttft = 2 * f_dec + f_mix
    api = r.api_request_s(ii) + r.api_token_s()
    cl = Cluster(sc, build_stream(sc))
    fits = cl.num_blocks * sc.cluster.engine.block_size >= n * (p.isl + p.osl)
    return tpot, ttft, api, fits


# bounds: a group's coefficient is its slowdown against the physical floor (>= 1: the ideal roofline is a lower
# bound); the fixed GPU costs (per layer, per all-reduce, per request) are between 0 and 1 ms
BOUNDS = {**{g: (1.0, 10.0) for g in GROUPS}, "prefill_attn": (1.0, 2.0), "per_layer_s": (0.0, 1e-3),
          "allreduce_call_s": (0.0, 1e-3), "moe_linear": (1.0, 10.0), "moe_compute": (1.0, 10.0),
          "compute": (1.0, 10.0), "per_request_gpu_s": (0.0, 1e-3)}


# TTFT rows' weight: the picture leaves out queueing behind other prefills. 0.25 (was 0.5) was chosen on the fit set
# alone: fitted on TP 2 and scored on TP 8 and the reverse (10 requests per client), 0.25 beat 0.5 on every metric in
# both directions (TTFT MAPE 111.3 / 13.8 against 112.5 / 23.4, TPOT 25.1 / 21.9 against 25.2 / 26.8). Checked
# again for `refine` the same way (2026-12-04): summed over both directions, 0.25 gives TTFT / TPOT / E2E MAPE
# 93.7 / 36.5 / 36.9, 0.5 gives 91.1 / 44.2 / 44.1, 1.0 gives 93.3 / 41.8 / 41.7: weighting TTFT more buys no TTFT
# and costs TPOT, so `refine` keeps 0.25
TTFT_WEIGHT = 0.25


def fit(points: Sequence[Point], range_ratio: float = RANGE_RATIO, ttft_weight: float = TTFT_WEIGHT,
        fixed: dict | None = None) -> dict:
    """Bounded least squares of the points' relative TPOT and TTFT errors (TTFT rows weighted `ttft_weight`), the
    coefficients in `fixed` (default `PINNED`) held at their values; the coefficients by name."""
    fixed = dict(PINNED if fixed is None else fixed)
    unknown = set(fixed) - set(FEATURES)
    if unknown:
        raise ValueError(f"cannot pin {sorted(unknown)}: the fitted terms are {FEATURES}")
    from scipy.optimize import lsq_linear

    rows, ys, used = [], [], []
    bad = bad_runs(list(points))
    for p in points:
        if p.line in bad:  # a disturbed run (twin.analysis.gpu_fidelity), not a load to fit
            continue
        tpot, ttft, api, fits = point_features(p, range_ratio)
        if not fits:
            continue
        used.append(p)
        rows.append(tpot / (p.tpot_ms / 1e3))
        ys.append(1.0)
        rows.append(ttft_weight * ttft / (p.ttft_ms / 1e3))
        ys.append(ttft_weight * (1.0 - api / (p.ttft_ms / 1e3)))
    x = np.array(rows)
    pin = np.array([k in fixed for k in FEATURES])
    y = np.array(ys) - x[:, pin] @ np.array([fixed[k] for k in FEATURES if k in fixed])  # the pinned terms' share
    free = x[:, ~pin]
    names = [k for k in FEATURES if k not in fixed]
    scale = np.maximum(np.abs(free).max(axis=0), 1e-30)  # columns of seconds and of counts, conditioned alike
    lo = np.array([BOUNDS[k][0] for k in names]) * scale
    hi = np.array([BOUNDS[k][1] for k in names]) * scale
    sol = dict(zip(names, (lsq_linear(free / scale, y, bounds=(lo, hi)).x / scale).tolist()))
    # a term no fitted point exercises (moe_linear, moe_compute without an MoE model, compute without a dense one) is
    # left out: the profile then falls back to `linear` for it, instead of carrying an arbitrary value
    coef = {k: float(fixed[k]) if k in fixed else sol[k] for k, seen in zip(FEATURES, np.any(x != 0, axis=0))
            if seen or k not in ("moe_linear", "moe_compute", "compute")}
    return {"coefficients": coef, "points_fitted": len(used), "points": used}


# refine(): the finite-difference step per coefficient, relative (5 %) with a floor: seconds terms 2 us, the rest 0.05
REFINE_STEP, REFINE_FLOOR_S, REFINE_FLOOR = 0.05, 2e-6, 0.05


def _simulated(job: tuple) -> tuple[float, float]:
    """(mean TTFT, mean TPOT) in ms of one point simulated on a profile file (a process pool's task)."""
    from twin.analysis.gpu_fidelity import predict

    p, path, rpc, range_ratio = job
    r = predict(p, rpc, ["cluster.perf.kind=fitted", f"cluster.perf.fit_path={path}"], range_ratio)
    return r["ttft_ms"], r["tpot_ms"]


def refine(points: Sequence[Point], coef: dict, requests_per_client: int = 10, iterations: int = 2, workers: int = 2,
           ttft_weight: float = TTFT_WEIGHT, range_ratio: float = RANGE_RATIO,
           progress: Callable[[str], None] | None = None, fixed: Sequence[str] | None = None) -> dict:
    """Refine `fit`'s coefficients on the points as the twin simulates them, not through the steady-state picture.

    The picture leaves out what a closed loop does to TTFT: several prompts queued behind one another, and the first
    wave of simultaneous requests. So each iteration simulates every point (`twin score`'s closed loop, deterministic),
    takes the same weighted relative TPOT and TTFT errors as `fit`, differentiates them by finite differences (one
    simulation per coefficient), and takes the bounded Gauss-Newton step (halved until the error falls, else it
    stops). The bounds are `fit`'s; the coefficients named in `fixed` (default those of `PINNED`) keep their values.
    Returns {"coefficients", "cost" (sum of squares) before and after, "evaluations", "start" (the coefficients
    given)}.
    About (coefficients + 2) x iterations simulations of the points, spread over `workers` processes."""
    import tempfile
    from concurrent.futures import ProcessPoolExecutor
    from pathlib import Path

    import yaml
    from scipy.optimize import lsq_linear

    held = set(PINNED if fixed is None else fixed)
    keys = [k for k in coef if k not in held]
    start_coef = dict(coef)
    pts = list(points)
    meas = np.array([[p.tpot_ms, p.ttft_ms] for p in pts])
    weights = np.array([1.0, ttft_weight])
    evaluations = 0
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(max(1, workers)) as pool:
        def residuals(c: dict) -> np.ndarray:
            nonlocal evaluations
            evaluations += 1
            path = Path(tmp) / f"profile-{evaluations}.yaml"
            path.write_text(yaml.safe_dump({"basis": BASIS, "coefficients": {
                **{k: float(v) for k, v in c.items()}, "gemm_tail_tokens": GEMM_TAIL_TOKENS, **HOST_TERMS}}))
            got = list(pool.map(_simulated, [(p, str(path), requests_per_client, range_ratio) for p in pts]))
            pred = np.array([[tpot, ttft] for ttft, tpot in got])
            return ((pred / meas - 1.0) * weights).ravel()

        r = residuals(coef)
        start = float(r @ r)
        if progress is not None:
            progress(f"start: cost {start:.4f}")
        for it in range(iterations):
            jac = np.zeros((len(r), len(keys)))
            for j, k in enumerate(keys):
                lo, hi = BOUNDS[k]
                h = max(abs(coef[k]) * REFINE_STEP, REFINE_FLOOR_S if k.endswith("_s") else REFINE_FLOOR)
                if coef[k] + h > hi:
                    h = -h
                jac[:, j] = (residuals({**coef, k: coef[k] + h}) - r) / h
            scale = np.maximum(np.abs(jac).max(axis=0), 1e-12)
            lo = np.array([BOUNDS[k][0] - coef[k] for k in keys]) * scale
            hi = np.array([BOUNDS[k][1] - coef[k] for k in keys]) * scale
            step = lsq_linear(jac / scale, -r, bounds=(lo, hi)).x / scale
            for lam in (1.0, 0.5, 0.25):
                trial = {**coef, **{k: float(np.clip(coef[k] + lam * d, *BOUNDS[k])) for k, d in zip(keys, step)}}
                r2 = residuals(trial)
                if r2 @ r2 < r @ r:
                    break
            else:
                if progress is not None:
                    progress(f"iteration {it + 1}: no step lowers the cost; stopped")
                break
            coef, r = trial, r2
            if progress is not None:
                progress(f"iteration {it + 1}: cost {float(r @ r):.4f}")
    return {"coefficients": coef, "cost": {"picture": round(start, 4), "refined": round(float(r @ r), 4)},
            "evaluations": evaluations, "start": start_coef}


def profile_document(coef: dict, fitted_on: str, held_out: str, data: str, host: dict,
                     default_for: Sequence[str] = (), refined: dict | None = None,
                     pinned: Sequence[str] = tuple(PINNED)) -> dict:
    """The profile file: the fitted GPU terms, the measured GEMM tail, the roofline's host terms, and where they came
    from; `default_for` the GPUs whose scenarios take it when `perf.kind` is `auto` (twin.perf.fitted); `refined`
    what `refine` reported, when it ran; `pinned` the terms held at their values (`fit(fixed=)`), not fitted."""
    method = ("twin.analysis.profile_fit: bounded least squares of relative TPOT and TTFT errors (TTFT rows weighted "
              f"{TTFT_WEIGHT}), steady-state closed loop")
    if refined is not None:
        method += (f", then refined on the simulated points (refine: {refined['iterations']} Gauss-Newton iterations "
                   f"at {refined['requests_per_client']} requests per client, cost {refined['cost']['picture']} -> "
                   f"{refined['cost']['refined']})")
    doc = {"basis": BASIS, **({"default_for": list(default_for)} if default_for else {}),
           "coefficients": {**{k: float(f"{v:.6g}") for k, v in coef.items()}, "gemm_tail_tokens": GEMM_TAIL_TOKENS,
                            **host},
           "fit": {"data": data, "fitted_on": fitted_on, "held_out": held_out,
                   "method": method + "; gemm_tail_tokens measured on Vidur's H100 operators, not fitted"
                   + ("; compute pinned at 1 / 0.78, the GEMMs' efficiency measured there (ASSUMPTION: FP8 reaches "
                      "the same fraction of its peak), not fitted" if "compute" in coef and "compute" in pinned else "")}}
    if refined is not None:  # where refine started: `fit` reproduces these in seconds (tests/test_h100_profile.py)
        doc["fit"]["picture_coefficients"] = {k: float(f"{v:.6g}") for k, v in refined["start"].items()}
    return doc


def split(points: Sequence[Point], train: Callable[[Point], bool]) -> tuple[list[Point], list[Point]]:
    return [p for p in points if train(p)], [p for p in points if not train(p)]
