"""Live fidelity that does not move with the machine's speed: the server's own steps, replayed in the twin.

A worker started with a step log (`live.vllm_server.step_log_env`: vLLM loads the general plugin
live/vllm_plugins/llmtwin_steplog.py into EngineCore) writes every engine step's start, end and batch and
every request's entry into the scheduler, on the machine's monotonic clock. `twin observe` keeps the lines of
its own load (`steps.parquet`, `engine_requests.parquet` in the observation folder). Two figures come out:

- **Scheduling** (`replay_observation`, `scheduling_rows`): the twin runs the observed requests, each entering
  the engine when the server's scheduler took it in, and every step lasts what the server's step lasted
  (twin.perf.replay.ReplayStepModel). Its per-request engine TTFT (scheduler entry to the end of the step
  that emitted the first token) and E2E (to the end of the step that finished it) against the server's own.
  The machine's speed is on both sides, so this is the twin's scheduling error alone: a busy machine makes
  every step slower, not the replay wronger.
- **Step time** (`step_time_rows`): a step model (the profile `twin calibrate` fitted on client-side times,
  or `fit_steps` on the calibration load's measured steps) against each measured step. This one moves with
  the machine: `machine_drift` is how far the measured-to-model ratio of each load moved from the
  calibration load's.

How a step's duration and a request's entry are read off the log: twin.lab.steplog.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from twin.errors import TwinInputError
from twin.perf.base import StepBatch
from twin.lab.steplog import STEP_COLS, batch_of, engine_frames, read_step_log, request_tag  # noqa: F401 - re-exported
from twin.perf.replay import RecordedStep, ReplayStepModel

def recorded_steps(steps: pd.DataFrame) -> list[RecordedStep]:
    return [RecordedStep(StepBatch(**{c: (float(r[c]) if c == "prefill_attn_tokens" else int(r[c]))
                                      for c in STEP_COLS}), float(r["duration_s"]))
            for r in steps.to_dict("records")]


def batches(steps: pd.DataFrame) -> list[StepBatch]:
    return [s.batch for s in recorded_steps(steps)]


# -- the scheduling figure -------------------------------------------------------------------------------------

@dataclass
class Replay:
    """The twin's run with the server's step durations: per request engine times, and how steps matched."""

    requests: pd.DataFrame  # request_id, ttft_s, e2e_s (twin) and real_ttft_s, real_e2e_s (the server's)
    stats: dict


def read_engine(obs_path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    sp, rp = obs_path / "steps.parquet", obs_path / "engine_requests.parquet"
    if not sp.is_file() or not rp.is_file():
        raise TwinInputError(f"{obs_path}: no steps.parquet / engine_requests.parquet (observe a worker started "
                             "with a step log: VllmServer(step_log=True))")
    return pd.read_parquet(sp), pd.read_parquet(rp)


def engine_entry(steps: pd.DataFrame, queued: np.ndarray) -> np.ndarray:
    """When each request enters the twin's engine: where the period of the step that took it in began (see
    the module's note), just before the twin's scheduler decides that step. vLLM's loop takes new requests
    in between steps and drains its input queue before scheduling (vllm/v1/engine/core.py:
    `_process_input_queue`), so a request stamped in that gap, or one of a burst that reached an idle engine
    over ~0.2 ms, is in the same step as in the server. TTFT and E2E still count from the server's stamp."""
    out = np.asarray(queued, float).copy()
    if steps.empty:
        return out
    t0, begin = steps["start_s"].to_numpy(float), steps["replay_start_s"].to_numpy(float)
    j = np.searchsorted(t0, out, side="left")  # the first step that began at or after the stamp
    ok = j < len(t0)
    jj = np.minimum(j, len(t0) - 1)
    gap = ok & (out >= begin[jj] - 1e-9)
    out[gap] = begin[jj][gap] - ENTRY_LEAD_S
    return out


ENTRY_LEAD_S = 1e-9  # entered a hair before the step's period begins: the twin's scheduler sees it there


def replay_observation(obs, profile, match: str = "composition") -> Replay:
    """Run the observation's requests through the twin, each entering the engine at the server's scheduler
    stamp, every step as long as the server's (ReplayStepModel over the profile's fitted model); one worker."""
    from twin.lab.calibrate import API_KEYS, observed_stream, twin_scenario
    from twin.perf.fitted import FittedModel
    from twin.perf.registry import roofline
    from twin.sim.cluster import Cluster
    from twin.workload.stream import RequestStream

    if int(obs.meta.get("num_instances", 1)) != 1:
        raise TwinInputError(f"{obs.path}: the step replay covers one worker (this observation has "
                             f"{obs.meta.get('num_instances')})")
    steps, er = read_engine(obs.path)
    sc = twin_scenario(obs.meta, dict.fromkeys(API_KEYS, 0.0), 1).model_copy(deep=True)
    sc.sim.mode = "step"  # one step_time call per step: the replay's order is the server's
    sc.cluster.perf.api_queue = "off"  # entry at the scheduler stamp: no API server in between
    base = FittedModel(roofline(sc), profile.coefficients, source="calibration")
    model = ReplayStepModel(recorded_steps(steps), base, match=match)
    stream, ordered = observed_stream(obs)
    ok = er.dropna(subset=["first_token_s", "finish_s"]).set_index("request_id")
    ids = ordered["request_id"].to_numpy()
    keep = np.isin(ids, ok.index.to_numpy())
    queued = ok.loc[ids[keep], "queued_s"].to_numpy(float)
    arr = engine_entry(steps, queued)
    order = np.argsort(arr, kind="stable")
    sel = np.flatnonzero(keep)[order]
    hashes = None if stream.hash_ids is None else [stream.hash_ids[j] for j in sel]
    sid = None if stream.session_id is None else stream.session_id[sel]
    rs = RequestStream(arr[order], stream.prompt_tokens[sel], stream.output_tokens[sel], hashes,
                       stream.hash_block_size, hashes_cover_output=stream.hashes_cover_output, session_id=sid)
    cl = Cluster(sc, rs, perf=model)
    for inst in cl.instances:
        inst.perf = model
        inst.scheduler.perf = model
    res = cl.run()
    df = res.log.to_frame()
    rid = ids[sel]
    real = ok.loc[rid]
    q = real["queued_s"].to_numpy(float)  # both sides from the server's own stamp
    out = pd.DataFrame({"request_id": rid,
                        "ttft_s": df["first_token_s"].to_numpy(float) - q,
                        "e2e_s": df["finish_s"].to_numpy(float) - q,
                        "real_ttft_s": (real["first_token_s"] - real["queued_s"]).to_numpy(float),
                        "real_e2e_s": (real["finish_s"] - real["queued_s"]).to_numpy(float),
                        "finished": (df["status"] == "finished").to_numpy()})
    stats = {**model.stats(), "requests": int(len(out)), "twin_unfinished": int((~out["finished"]).sum())}
    return Replay(out, stats)


def _ape(sim: float, real: float) -> float:
    return abs(sim - real) / real * 100 if real > 0 else float("nan")


def scheduling_rows(name: str, rep: Replay) -> list[dict]:
    """Per metric (engine TTFT, E2E): the mean's absolute % error, the P90's, and the per-request mean abs %."""
    r = rep.requests[rep.requests["finished"]]
    rows = []
    for m in ("ttft", "e2e"):
        s, o = r[f"{m}_s"].to_numpy(float), r[f"real_{m}_s"].to_numpy(float)
        per = np.abs(s - o) / np.maximum(o, 1e-9) * 100
        rows.append({"slice": name, "metric": m, "real_mean_s": float(o.mean()), "twin_mean_s": float(s.mean()),
                     "mean_ape_pct": _ape(float(s.mean()), float(o.mean())),
                     "p90_ape_pct": _ape(float(np.percentile(s, 90)), float(np.percentile(o, 90))),
                     "per_request_mape_pct": float(per.mean()), "requests": int(len(r)),
                     "agreement": rep.stats["agreement"], "match": rep.stats["match"]})
    return rows


# -- the step-time figure ---------------------------------------------------------------------------------------

def step_time_rows(name: str, steps: pd.DataFrame, model, label: str) -> dict:
    """A step model against the measured steps of one load: per-step MAPE, the total's error, and the median
    measured / model ratio (drift's raw material). Durations as replayed (start to next start while busy)."""
    pred = np.array([model.step_time(b) for b in batches(steps)])
    meas = steps["duration_s"].to_numpy(float)
    ok = (pred > 0) & (meas > 0)
    ratio = meas[ok] / pred[ok]
    return {"slice": name, "model": label, "steps": int(ok.sum()),
            "step_mape_pct": float(np.mean(np.abs(pred[ok] - meas[ok]) / meas[ok]) * 100),
            "total_ape_pct": _ape(float(pred[ok].sum()), float(meas[ok].sum())),
            "median_ratio": float(np.median(ratio)), "measured_total_s": float(meas[ok].sum()),
            "median_step_ms": float(np.median(meas[ok]) * 1e3)}


def machine_drift(rows: list[dict], reference: str = "calibration") -> dict:
    """Per model: how far each load's median measured / model ratio moved from the reference load's (%); the
    model is the same throughout, so the movement is the machine's."""
    out: dict = {}
    for label in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == label]
        ref = next((r["median_ratio"] for r in mine if r["slice"] == reference), None)
        if not ref:
            continue
        per = {r["slice"]: (r["median_ratio"] / ref - 1) * 100 for r in mine}
        out[label] = {"per_slice_pct": per, "max_abs_pct": float(max(abs(v) for v in per.values()))}
    return out


def fit_steps(steps: pd.DataFrame, profile, meta: dict):
    """A fitted model (twin.perf.fitted's coefficients, the profile's layout) fitted directly on measured steps:
    non-negative least squares on relative errors over the basis `linear` (lm_head tied), `attn`, `step_s`,
    `per_request_s`; linear and attention at least 1 (the roofline floor). Returns (FittedModel, Profile)."""
    from twin.lab.calibrate import Profile, _StepRecorder, nnls, twin_scenario
    from twin.perf.fitted import FittedModel
    from twin.perf.registry import roofline

    roof = roofline(twin_scenario(meta))
    base = FittedModel(roof, profile.coefficients, source="calibration")
    rec = _StepRecorder(base, type("E", (), {"now": 0.0})())
    bs = batches(steps)
    for b in bs:
        rec.step_time(b)
    phi = np.array(rec.phi, float)
    const = np.array(rec.const, float)
    y = steps["duration_s"].to_numpy(float) - const
    ok = (y > 0) & (phi.sum(axis=1) > 0)
    w = 1.0 / y[ok]
    A, yy = phi[ok] * w[:, None], y[ok] * w
    floor = np.array([1.0, 1.0, 0.0, 0.0])
    z = nnls(A, yy - A @ floor) + floor
    p = {**profile.params(), "linear": float(z[0]), "attn": float(z[1]), "step_s": float(z[2]),
         "per_request_s": float(z[3])}
    prof = Profile.from_params(p, profile.coefficients)
    return FittedModel(roof, prof.coefficients, source="step fit"), prof
