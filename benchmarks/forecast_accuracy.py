#!/usr/bin/env python
"""How accurate is the twin scaler's look-ahead? `FleetForecaster.attainment` against what the run then did.

The `twin` scaler (`twin.policy.scalers.TwinScaler`) picks a fleet size from the forecast SLO attainment of
`twin.sim.forecaster.FleetForecaster.attainment(n, horizon_s, rate, slo, oracle)`. This script measures that
forecast's error on a FIXED fleet, so the realised outcome belongs to the size that was forecast:

- each workload runs once per mode with a probe scaler (`Probe`) that never scales: every `--interval` seconds
  it asks the forecaster for the attainment of the current active count over `--horizon` seconds, WITHOUT a
  `target` (exact values, no early stop), and returns `NO_CHANGE`;
- realised attainment of a decision at t: among the requests that arrived in [t, t + horizon), the share that
  met every SLO bound by `twin.sim.metrics.slo_mask` on the run's log (rejected or unfinished ones miss);
- only decisions whose whole window lies within the workload (t + horizon <= the last arrival) are scored:
  past it a rate predictor extrapolates load that never comes, an end-of-trace effect, not a forecast error;
- modes: `oracle` (the forecaster gets the workload's own future arrivals: the forecaster's model error alone:
  representatives, round-robin shares, the backlog rule, predicted lengths of the requests in flight) and the
  twin scaler's default moving average of the arrival rate (30 s bins, 10 of them, a 5-bin window: what
  `TwinScaler.decide` computes) with `poisson` and with `pattern` forecast arrivals (model error plus
  rate-prediction error); and `live`: the live controller's shadow twin (`live.shadow.ShadowFleetForecaster`)
  on the same state, fed what its proxy would have seen of the run (`live_attainment`: the last `--live-window`
  seconds replayed at the moving average's rate, the requests in flight carried on their workers, a decoding
  one's prompt KV placed in its instance's cache, `live.shadow.warm`), so both worlds' forecasts meet the same
  outcome;
- a check that the probe does not disturb the run: every probe run's log must equal a plain run's.

Workloads (fixed fleets, sizes where attainment is neither always 1 nor always 0, except `servegen/2`):

- `servegen/1`, `servegen/2`: `scenarios/servegen-autoscale.yaml` at `workload.trace.sample=0.05` (as
  `scaler_short.py`: a 10x time-compressed ServeGen burst, 31,459 requests, Qwen2.5-32B TP2 on H200) on 1
  instance (42 % overall: fine, then the burst overwhelms it) and on 2 (meets the SLOs throughout: a check that
  the forecast does not see misses that never happen);
- `servegen-x2/3`: the same trace at `sample=0.1` (62,634 requests) on 3 instances: more instances than the
  forecaster's 2 representatives;
- `poisson/2`: steady Poisson at `--poisson-rate` (16.5) req/s for 600 s, ShareGPT lengths, Llama-3-8B on 2
  H100s, SLO TTFT 1 s / TPOT 50 ms: near the fleet's capacity, so attainment wanders around 0.95.

Then, for what a forecast error costs, the twin scaler itself (its defaults, a 120 s horizon, decisions every
30 s, `poisson` and `pattern` arrivals) on the steady Poisson workload at `--scaler-rates` (12, 16.5 and 22 req/s,
from 2 instances): GPU-seconds and SLO attainment.

Per workload and mode it prints: decisions scored, mean forecast, mean realised, mean absolute error, bias
(forecast - realised: > 0 optimistic), the share of decisions on different sides of `--target` (0.95, the twin
scaler's default: what changes a decision; split into optimistic / pessimistic), and for the predicted modes the
rate error (predicted rate / the window's realised arrival rate - 1). Writes `forecast_accuracy.csv` (the table),
`decisions.csv` (every decision) and `forecast_accuracy.png` (forecast vs realised per mode, y = x). Decisions
overlap (a 120 s window every 10 s): they are not independent samples. No assertions. About 4 minutes in pure
Python on 2 cores.

  .venv/bin/python benchmarks/forecast_accuracy.py [--horizon 120] [--interval 10] [--only servegen/1,poisson/2]
      [--modes oracle,poisson,pattern,live] [--live-window 60] [--scaler-rates 12,16.5,22]
      [--out benchmarks/results/forecast_accuracy]
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODES = ("oracle", "poisson", "pattern", "live")
WORKLOADS = ("servegen/1", "servegen/2", "servegen-x2/3", "poisson/2")


class Probe:
    """A scaler that never scales: it records the forecast attainment of the current fleet at each decision.

    The rate is what `TwinScaler.decide` computes with its defaults (`fleet.signals.arrival_series` over
    `history` bins of `bin_s`, a moving average); the oracle mode passes it too, as the twin scaler does (the
    oracle draw ignores it). `slo`, `min_instances`, `max_instances` None: the fleet fills them in."""

    name = "probe"
    needs_forecaster = True

    def __init__(self, mode: str, horizon_s: float, bin_s: float, history: int) -> None:
        from twin.policy.forecast import make_load_predictor

        self.oracle = mode == "oracle"
        self.live = mode == "live"
        self.arrivals = "poisson" if self.oracle or self.live else mode
        self.shadow: tuple | None = None  # live: (LiveConfig, engine, start-up delay), set by `workload`
        self.horizon_s = horizon_s
        self.bin_s = bin_s
        self.history = history
        self.predictor = make_load_predictor("moving-average")
        self.slo = None
        self.min_instances = None
        self.max_instances = None
        self.records: list[tuple[float, int, float, float, float]] = []  # (t, n, rate, forecast, wall s)

    def decide(self, now, fleet, forecast=None):
        from twin.policy.scalers import NO_CHANGE, active_count

        series = fleet.signals.arrival_series(now, self.bin_s, self.history)
        if not series:
            return NO_CHANGE  # the twin scaler does not decide either: nothing to forecast from
        rate = self.predictor.predict(series)
        n = active_count(fleet)
        t0 = time.perf_counter()
        if self.live:
            a = live_attainment(forecast._cluster, now, n, self.horizon_s, rate, self.slo, *self.shadow)
        else:
            a = forecast.attainment(n, self.horizon_s, rate, self.slo, self.oracle)  # no target: exact
        self.records.append((now, n, rate, a, time.perf_counter() - t0))
        return NO_CHANGE


def shadow_of(sc, window_s: float) -> tuple:
    """The live controller's shadow twin for the scenario's fleet: (LiveConfig, engine settings, start-up delay)."""
    from live.config import parse_config
    from live.shadow import base_engine

    c = sc.cluster
    cfg = parse_config({"workers": [{"url": "http://127.0.0.1:1"}], "router": sc.router.model_dump(exclude_unset=True),
                        "shadow": {"enabled": True, "hardware": c.hardware, "model": c.model, "dtype": c.dtype,
                                   "kv_cache_dtype": c.kv_cache_dtype, "tensor_parallel": c.tensor_parallel,
                                   "engine": c.engine.model_dump(exclude_unset=True),
                                   "perf": c.perf.model_dump(exclude_unset=True),
                                   "slo": sc.slo.model_dump(), "window_s": window_s, "max_requests": 4000}})
    return cfg, base_engine(cfg, None), c.startup_delay_s


def live_attainment(cl, now: float, n: int, horizon_s: float, rate: float, slo, cfg, engine, delay) -> float:
    """What the live controller's shadow twin forecasts for `n` instances at `now`, fed what its proxy would have
    seen of this run (`live.shadow.Mirrored` records from the run's log so far: arrivals, workers, first tokens,
    finishes, output lengths): the last `shadow.window_s` replayed at `rate` (`reshape`), the requests in flight
    carried on their workers (`with_in_flight`, `placed`), a full twin `Cluster` with the configured router."""
    from types import SimpleNamespace

    from live.shadow import (Mirrored, ReplayLoad, ShadowFleetForecaster, fleet_slots, realised_metrics,
                             with_in_flight)

    lg = cl.log
    names = [inst.id for inst in cl.instances]
    cap = cl.max_tokens_cap

    def mirrored(i: int) -> Mirrored:
        ft, fin = float(lg.first_token_s[i]), float(lg.finish_s[i])
        done = not np.isnan(fin)
        return Mirrored(str(i), float(lg.arrival_s[i]), int(lg.prompt_tokens[i]), cap, (), 16, names[lg.instance[i]],
                        True, None if np.isnan(ft) else ft, fin if done else None,
                        int(lg.output_tokens[i]) if done else 0)

    seen = np.flatnonzero((lg.arrival_s <= now) & (lg.instance >= 0))
    window_s = cfg.shadow.window
    recs = [mirrored(i) for i in seen if lg.arrival_s[i] >= now - window_s]
    load = ReplayLoad().next_window(recs, now - window_s, window_s)
    load.tpot_s = realised_metrics(recs)["tpot_p50"]
    running = [mirrored(i) for i in seen if np.isnan(lg.finish_s[i]) and lg.status[i] != 5]
    load = with_in_flight(load, running, now, cfg.shadow.max_requests)
    books = cl.dispatcher.bookkeeping
    workers = [SimpleNamespace(id=inst.id, state=inst.state, routable=inst.state == "serving", started_at=0.0,
                               created_at=0.0) for inst in cl.instances if inst.state in ("serving", "starting")]
    slots = fleet_slots(workers, lambda wid: books.load(wid).requests, now, delay)
    return ShadowFleetForecaster(cfg, engine, load, {}, cfg.shadow.max_requests, slots, delay).attainment(
        n, horizon_s, rate, slo)


def workload(name: str, args):
    """(scenario, stream) with a fixed fleet; decisions every `args.interval` s (the scenario's scaler interval)."""
    from twin.scenario import load_scenario, parse_scenario
    from twin.workload import build_stream

    common = ["sim.timeline_interval_s=0", "scaler.name=none", f"scaler.interval_s={args.interval}"]
    if name.startswith("servegen"):
        sample, n = {"servegen/1": (0.05, 1), "servegen/2": (0.05, 2), "servegen-x2/3": (0.1, 3)}[name]
        sc = load_scenario(ROOT / "scenarios" / "servegen-autoscale.yaml",
                           [f"workload.trace.sample={sample}", f"cluster.num_instances={n}"] + common)
        return sc, build_stream(sc)
    if name == "poisson/2":
        rate = args.poisson_rate
        raw = {"name": "forecast-poisson", "seed": 0,
               "cluster": {"num_instances": 2, "min_instances": 1, "max_instances": 8, "startup_delay_s": 30.0,
                           "hardware": "H100-SXM-80GB", "model": "Llama-3-8B",
                           "engine": {"enable_prefix_caching": True}},
               "workload": {"num_requests": int(rate * 600), "arrival": {"process": "poisson", "rate": rate},
                            "lengths": {"kind": "trace", "path": str(ROOT / "traces" / "sharegpt_lengths.sample.csv"),
                                        "max_total_tokens": 8192}},
               "router": {"name": "least-outstanding"},
               "scaler": {"name": "none", "interval_s": args.interval},
               "slo": {"ttft_s": 1.0, "tpot_s": 0.05},
               "sim": {"timeline_interval_s": 0}}
        sc = parse_scenario(raw, name, ROOT)
        return sc, build_stream(sc)
    raise SystemExit(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


LOG_COLUMNS = ("status", "first_token_s", "finish_s", "output_tokens", "instance")


def same_log(a, b) -> bool:
    return all(np.array_equal(getattr(a, c), getattr(b, c), equal_nan=c.endswith("_s")) for c in LOG_COLUMNS)


def score(records, log, slo, horizon_s: float, last_arrival: float, target: float):
    """Per decision: (t, n, rate, forecast, realised, arrivals in the window, wall s), whole windows only."""
    from twin.sim.metrics import slo_mask

    ok = slo_mask(log, slo)
    arr = log.arrival_s
    order = np.argsort(arr, kind="stable")
    arr_sorted, ok_sorted = arr[order], ok[order]
    out = []
    for t, n, rate, fc, wall in records:
        if t + horizon_s > last_arrival:
            continue
        lo, hi = np.searchsorted(arr_sorted, [t, t + horizon_s])  # [t, t + horizon), as the oracle draw
        if hi <= lo:
            continue
        out.append((t, n, rate, fc, float(ok_sorted[lo:hi].mean()), int(hi - lo), wall))
    return out


def summary_row(wl: str, mode: str, dec, horizon_s: float, target: float, wall: float, identical: bool) -> dict:
    fc = np.array([d[3] for d in dec])
    re = np.array([d[4] for d in dec])
    rate = np.array([d[2] for d in dec])
    real_rate = np.array([d[5] / horizon_s for d in dec])
    opt = (fc >= target) & (re < target)
    pes = (fc < target) & (re >= target)
    k = len(dec)
    return {"workload": wl, "mode": mode, "decisions": k,
            "forecast_mean": round(float(fc.mean()), 4) if k else None,
            "realised_mean": round(float(re.mean()), 4) if k else None,
            "mae": round(float(np.abs(fc - re).mean()), 4) if k else None,
            "bias": round(float((fc - re).mean()), 4) if k else None,
            "wrong_side": round(float((opt | pes).mean()), 4) if k else None,
            "wrong_side_optimistic": round(float(opt.mean()), 4) if k else None,
            "wrong_side_pessimistic": round(float(pes.mean()), 4) if k else None,
            "rate_error": round(float((rate / real_rate - 1).mean()), 4) if k and mode != "oracle" else None,
            "forecast_wall_s_mean": round(float(np.mean([d[6] for d in dec])), 3) if k else None,
            "run_wall_s": round(wall, 1), "log_matches_plain_run": identical}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--horizon", type=float, default=120.0, help="forecast horizon, s (the twin scaler's horizon_s)")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between decisions (forecasts)")
    ap.add_argument("--rate-bin", type=float, default=30.0, help="the rate predictor's bin, s (TwinScaler.interval_s)")
    ap.add_argument("--history", type=int, default=10, help="bins of history (TwinScaler.history)")
    ap.add_argument("--target", type=float, default=0.95, help="the twin scaler's target: sides compared")
    ap.add_argument("--poisson-rate", type=float, default=16.5, help="req/s of the steady Poisson workload")
    ap.add_argument("--live-window", type=float, default=60.0, help="live mode: shadow.window_s, the window replayed")
    ap.add_argument("--scaler-rates", default="12,16.5,22", help="req/s of the twin scaler runs (empty: none)")
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="benchmarks/results/forecast_accuracy")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r} (known: {', '.join(MODES)})")

    from twin.sim.cluster import Cluster
    from twin.sim.events import BUILD

    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, {BUILD} build")
    print(f"horizon {args.horizon:g} s, a decision every {args.interval:g} s, target {args.target:g}")
    rows, decisions = [], []
    t_all = time.perf_counter()
    for wl in args.only.split(","):
        sc, stream = workload(wl, args)
        t0 = time.perf_counter()
        plain = Cluster(sc, stream).run()
        last = float(stream.arrival_s[-1])
        print(f"  {wl:<14} plain run: {len(stream)} requests, last arrival {last:.0f} s "
              f"({time.perf_counter() - t0:.1f} s wall)", flush=True)
        for mode in modes:
            t0 = time.perf_counter()
            probe = Probe(mode, args.horizon, args.rate_bin, args.history)
            if mode == "live":
                probe.shadow = shadow_of(sc, args.live_window)
            res = Cluster(sc, stream, scaler=probe).run()
            wall = time.perf_counter() - t0
            identical = same_log(res.log, plain.log)
            dec = score(probe.records, res.log, sc.slo, args.horizon, last, args.target)
            rows.append(summary_row(wl, mode, dec, args.horizon, args.target, wall, identical))
            decisions += [{"workload": wl, "mode": mode, "t": d[0], "instances": d[1], "rate": round(d[2], 3),
                           "window_rate": round(d[5] / args.horizon, 3), "forecast": round(d[3], 4),
                           "realised": round(d[4], 4), "window_requests": d[5], "forecast_wall_s": round(d[6], 3)}
                          for d in dec]
            r = rows[-1]
            print(f"  {wl:<14} {mode:<8} {r['decisions']:>3} decisions  forecast {r['forecast_mean']:.3f}  "
                  f"realised {r['realised_mean']:.3f}  MAE {r['mae']:.3f}  bias {r['bias']:+.3f}  "
                  f"({wall:.1f} s wall{'' if identical else ', LOG DIFFERS FROM THE PLAIN RUN'})", flush=True)

    print(f"\n{'workload':<14} {'mode':<8} {'dec':>4} {'forecast':>8} {'realised':>8} {'MAE':>6} {'bias':>7} "
          f"{'wrong side of ' + format(args.target, 'g') + ' (opt/pes)':>28} {'rate err':>8}")
    for r in rows:
        side = (f"{r['wrong_side']:6.1%} ({r['wrong_side_optimistic']:.1%}/{r['wrong_side_pessimistic']:.1%})"
                if r["decisions"] else "-")
        rerr = f"{r['rate_error']:+.1%}" if r["rate_error"] is not None else "-"
        print(f"{r['workload']:<14} {r['mode']:<8} {r['decisions']:>4} {r['forecast_mean']:>8.3f} "
              f"{r['realised_mean']:>8.3f} {r['mae']:>6.3f} {r['bias']:>+7.3f} {side:>28} {rerr:>8}")
    print(f"total {time.perf_counter() - t_all:.0f} s wall; every probe run's log equals its plain run's: "
          f"{all(r['log_matches_plain_run'] for r in rows)}")

    scaled = scaler_runs(args)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    for fname, table in (("forecast_accuracy.csv", rows), ("decisions.csv", decisions), ("twin_scaler.csv", scaled)):
        if not table:
            continue
        with open(out / fname, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes), figsize=(4.0 * len(modes), 3.9), squeeze=False)
    names = list(dict.fromkeys(d["workload"] for d in decisions))
    marks = ("o", "s", "^", "D", "v")
    for ax, mode in zip(axes[0], modes):
        for i, wl in enumerate(names):
            pts = [(d["forecast"], d["realised"]) for d in decisions if d["mode"] == mode and d["workload"] == wl]
            if pts:
                x, y = zip(*pts)
                ax.scatter(x, y, s=18, alpha=0.6, marker=marks[i % len(marks)], color=f"C{i}", label=wl)
        ax.plot([0, 1], [0, 1], color="0.3", lw=0.8)
        ax.axhline(args.target, color="0.6", lw=0.6, ls="--")
        ax.axvline(args.target, color="0.6", lw=0.6, ls="--")
        ax.set_xlim(-0.03, 1.03)
        ax.set_ylim(-0.03, 1.03)
        titles = {"oracle": "oracle", "live": "live shadow twin, moving average"}
        ax.set_title(titles.get(mode, f"moving average, {mode}"), fontsize=9)
        ax.set_xlabel("forecast attainment")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("realised attainment")
    fig.suptitle(f"Fleet forecasts (FleetForecaster; live: ShadowFleetForecaster) vs the run, fixed fleets, "
                 f"{args.horizon:g} s horizon", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "forecast_accuracy.png", dpi=110)
    print(f"wrote {out / 'forecast_accuracy.csv'}, {out / 'decisions.csv'} and {out / 'forecast_accuracy.png'}")


def scaler_runs(args) -> list[dict]:
    """The twin scaler on the steady Poisson workload: GPU-seconds and attainment per rate and arrivals."""
    from twin.sim.cluster import Cluster
    from twin.sim.metrics import slo_mask

    rates = [float(x) for x in args.scaler_rates.split(",") if x]
    if not rates:
        return []
    print("\nthe twin scaler (horizon 120 s, decisions every 30 s) on poisson/2's workload, from 2 instances:")
    out = []
    for rate in rates:
        sc, stream = workload("poisson/2", argparse.Namespace(poisson_rate=rate, interval=30.0))
        for arrivals in ("poisson", "pattern"):
            s2 = sc.model_copy(update={"scaler": sc.scaler.model_copy(update={
                "name": "twin", "interval_s": 30.0, "params": {"horizon_s": 120.0, "arrivals": arrivals}})})
            res = Cluster(s2, stream).run()
            row = {"rate": rate, "arrivals": arrivals, "gpu_s": round(res.fleet.gpu_seconds(res.sim_time_s), 1),
                   "attainment": round(float(slo_mask(res.log, s2.slo).mean()), 4),
                   "peak": max([e.fleet_active for e in res.fleet.events] + [2])}
            out.append(row)
            print(f"  {rate:5.1f} req/s  {arrivals:<8} {row['gpu_s']:7.0f} GPU-s  attainment {row['attainment']:.1%}"
                  f"  peak {row['peak']}", flush=True)
    return out


if __name__ == "__main__":
    main()
