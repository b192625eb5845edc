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
  the machine: `machine_drift` is how far the same decode steps' durations moved from the calibration
  load's (no model in it).

How a step's duration and a request's entry are read off the log: twin.lab.steplog.
"""

from __future__ import annotations

import json
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
    stats = {**model.stats(), "requests": int(len(out)), "twin_unfinished": int((~out["finished"]).sum()),
             "twin_preemptions": int(res.log.preemptions.sum())}
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


def machine_drift(frames: dict[str, pd.DataFrame], reference: str = "calibration", min_steps: int = 5) -> dict:
    """How far the machine's speed moved from the reference load's, with no model in between: decode-only
    steps of the same batch size (the commonest shape, seen in every load) in each load against the same
    batch size in the reference load; the load's figure is the median over its matched steps of duration /
    the reference's median duration for that batch size, minus 1 (%). Only batch sizes with `min_steps` steps
    in both loads count (`matched_steps` says how many)."""
    ref = frames.get(reference)
    if ref is None or ref.empty:
        return {}

    def decodes(f: pd.DataFrame) -> pd.DataFrame:
        return f[(f["num_prefill_tokens"] == 0) & (f["num_decode_tokens"] > 0)]

    rd = decodes(ref)
    ref_med = rd.groupby("num_decode_tokens")["duration_s"].median()
    ref_n = rd.groupby("num_decode_tokens").size()
    per, matched = {}, {}
    for name, f in frames.items():
        d = decodes(f)
        n = d.groupby("num_decode_tokens").size()
        ok = [b for b in n.index if n[b] >= min_steps and ref_n.get(b, 0) >= min_steps]
        m = d[d["num_decode_tokens"].isin(ok)]
        matched[name] = int(len(m))
        per[name] = float((np.median(m["duration_s"].to_numpy() / ref_med.loc[m["num_decode_tokens"]].to_numpy())
                           - 1) * 100) if len(m) else float("nan")
    vals = [abs(v) for v in per.values() if v == v]
    return {"per_slice_pct": per, "matched_steps": matched, "max_abs_pct": float(max(vals)) if vals else float("nan"),
            "reference": reference, "basis": "decode-only steps, same batch size, median duration ratio"}


def fit_steps(steps: pd.DataFrame, profile, meta: dict):
    """A fitted model (twin.perf.fitted's coefficients, the profile's layout) fitted directly on measured steps:
    non-negative least squares on relative errors over the basis `linear` (lm_head tied), `attn`, `step_s`,
    `per_request_s`; linear and attention at least 1 (the roofline floor). Returns (FittedModel, Profile)."""
    from twin.lab.calibrate import Profile, nnls, twin_scenario
    from twin.perf.fitted import FittedModel
    from twin.perf.registry import roofline

    roof = roofline(twin_scenario(meta))
    base = FittedModel(roof, profile.coefficients, source="calibration")
    terms = [base.basis_terms(b) for b in batches(steps)]  # each step's basis vector and constant part
    phi = np.array([t[0] for t in terms], float).reshape(-1, 4)
    const = np.array([t[1] for t in terms], float)
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


# -- the client's view, with the measured steps -------------------------------------------------------------------

def client_rows(name: str, obs, profile) -> list[dict]:
    """The client-side mean TTFT and E2E error twice: the twin with the calibrated step model (the published
    table's) and with the server's measured steps (composition-matched; the API server's fitted terms in both).
    What the measured steps leave is the API server's and the client's own share, which the engine log cannot
    see; what they remove is the step model's."""
    from twin.lab.calibrate import Simulated, observed_stream, request_errors, simulate_observation, twin_scenario
    from twin.perf.fitted import FittedModel
    from twin.perf.registry import roofline
    from twin.sim.cluster import Cluster

    steps, _ = read_engine(Path(obs.path))
    sc = twin_scenario(obs.meta, profile.api, 1).model_copy(deep=True)
    sc.sim.mode = "step"
    model = ReplayStepModel(recorded_steps(steps), FittedModel(roofline(sc), profile.coefficients))
    stream, ordered = observed_stream(obs)
    cl = Cluster(sc, stream, perf=model)
    for inst in cl.instances:
        inst.perf = inst.scheduler.perf = model
    df = cl.run().log.to_frame()
    df["request_id"] = ordered["request_id"].to_numpy()
    runs = {"measured steps": Simulated(df, np.empty(0), np.empty(0), 0.0),
            "calibrated model": simulate_observation(obs, profile)}
    rows = []
    for label, sim in runs.items():
        e = request_errors(obs, sim)
        for m in ("ttft", "e2e"):
            v = e[m][np.all(np.isfinite(e[m]), axis=1)]
            rows.append({"slice": name, "steps": label, "metric": m, "observed_mean_s": float(v[:, 0].mean()),
                         "twin_mean_s": float(v[:, 1].mean()), "mean_ape_pct": _ape(float(v[:, 1].mean()),
                                                                                     float(v[:, 0].mean())),
                         "agreement": model.stats()["agreement"] if label == "measured steps" else float("nan")})
    return rows


# -- both figures for a run's observations ---------------------------------------------------------------------

def has_steps(obs) -> bool:
    return obs.path is not None and (Path(obs.path) / "steps.parquet").is_file()


def live_fidelity(observations: dict, profile, out: Path | None = None, calibrate_on: str = "calibration") -> dict:
    """The scheduling figure (every observation with a step log, replayed with its measured steps) and the
    step-time figure (the calibrated profile, and a step fit on `calibrate_on`'s measured steps, against every
    observation's steps) with the machine's drift; `out/live_fidelity.csv` and `.json` when `out` is given."""
    from twin.lab.calibrate import twin_scenario
    from twin.perf.fitted import FittedModel
    from twin.perf.registry import roofline

    obs = {k: o for k, o in observations.items() if has_steps(o) and int(o.meta.get("num_instances", 1)) == 1}
    if not obs:
        return {}
    sched, steps_rows, agree, client = [], [], {}, []
    frames = {k: read_engine(Path(o.path))[0] for k, o in obs.items()}
    first = next(iter(obs.values()))
    calibrated = FittedModel(roofline(twin_scenario(first.meta)), profile.coefficients, source="calibration")
    models = [("calibrated", calibrated)]
    if calibrate_on in frames:
        models.append(("step fit", fit_steps(frames[calibrate_on], profile, obs[calibrate_on].meta)[0]))
    for name, o in obs.items():
        rep = replay_observation(o, profile, "composition")
        order = replay_observation(o, profile, "order")
        sched += scheduling_rows(name, rep)  # no fit in it (the profile prices only unmatched steps): every load counts
        agree[name] = {"composition": rep.stats, "order_agreement": order.stats["agreement"],
                       "order_mean_e2e_ape_pct": scheduling_rows(name, order)[1]["mean_ape_pct"]}
        for label, m in models:
            steps_rows.append({**step_time_rows(name, frames[name], m, label),
                               "fitted_on": name == calibrate_on})
        client += [{**r, "fitted_on": name == calibrate_on} for r in client_rows(name, o, profile)]
    summary = {
        "scheduling": {"rows": sched, "matching": agree,
                       "max_mean_ape_pct": {m: float(max(r["mean_ape_pct"] for r in sched if r["metric"] == m))
                                            for m in ("ttft", "e2e")},
                       "max_per_request_mape_pct": {m: float(max(r["per_request_mape_pct"] for r in sched
                                                                 if r["metric"] == m)) for m in ("ttft", "e2e")}},
        "step_time": {"rows": steps_rows,
                      "held_out_step_mape_pct": {lab: float(np.mean([r["step_mape_pct"] for r in steps_rows
                                                                      if r["model"] == lab and not r["fitted_on"]]
                                                                     or [np.nan])) for lab, _ in models},
                      "held_out_total_ape_pct": {lab: float(np.mean([r["total_ape_pct"] for r in steps_rows
                                                                      if r["model"] == lab and not r["fitted_on"]]
                                                                     or [np.nan])) for lab, _ in models}},
        "machine_drift": machine_drift(frames, calibrate_on),
        "client": {"rows": client, "held_out_mean_ape_pct": {
            f"{lab} {m}": float(np.mean([r["mean_ape_pct"] for r in client if r["steps"] == lab and r["metric"] == m
                                         and not r["fitted_on"]] or [np.nan]))
            for lab in ("calibrated model", "measured steps") for m in ("ttft", "e2e")}},
    }
    if out is not None:
        out = Path(out)
        pd.DataFrame(sched).to_csv(out / "live_fidelity_scheduling.csv", index=False)
        pd.DataFrame(steps_rows).to_csv(out / "live_fidelity_steps.csv", index=False)
        pd.DataFrame(client).to_csv(out / "live_fidelity_client.csv", index=False)
        (out / "live_fidelity.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return summary


def describe_live(summary: dict) -> list[str]:
    """The two figures in a few lines, for `twin fidelity` and the heavy test's output."""
    if not summary:
        return []
    s, t, d = summary["scheduling"], summary["step_time"], summary["machine_drift"]
    lines = ["scheduling (twin with the server's measured steps vs the server, engine TTFT / E2E, mean abs % "
             "error per slice): " + ", ".join(f"{r['slice']} {r['metric']} {r['mean_ape_pct']:.2f}"
                                                for r in s["rows"])]
    for lab in t["held_out_step_mape_pct"]:
        lines.append(f"step time ({lab} model vs measured steps, held out): per-step MAPE "
                     f"{t['held_out_step_mape_pct'][lab]:.1f} %, total {t['held_out_total_ape_pct'][lab]:.1f} %")
    c = summary.get("client", {}).get("held_out_mean_ape_pct", {})
    if c:
        lines.append("client side, held out, mean abs % error (TTFT / E2E): calibrated model "
                     f"{c['calibrated model ttft']:.1f} / {c['calibrated model e2e']:.1f}, measured steps "
                     f"{c['measured steps ttft']:.1f} / {c['measured steps e2e']:.1f} (the rest: API server, client)")
    if d:
        lines.append("machine drift (same-size decode steps against the calibration load's): " + ", ".join(
            f"{k} {v:+.1f} %" for k, v in d["per_slice_pct"].items()))
    return lines
