"""A fleet that grows and drains: start-up delay paid, drains lose nothing, scalers decide as their sources say."""

import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from twin.cli import app
from twin.errors import TwinInputError
from twin.sim.cluster import Cluster
from twin.policy.scalers import QueueScaler, ScaleAction, ThresholdScaler, ThroughputScaler, make_scaler
from twin.policy.signals import RecentWindow

from conftest import kv_blocks, make_scenario, run_checked, stream_of
from policy_fakes import fleet_of

ROOT = Path(__file__).resolve().parents[1]


class Script:
    """Test scaler: at given times ask for given targets."""

    name = "script"

    def __init__(self, plan):
        self.plan = list(plan)

    def decide(self, now, fleet, forecast=None):
        if self.plan and now >= self.plan[0][0]:
            return ScaleAction(self.plan.pop(0)[1], "scripted")
        return ScaleAction()


def run_with(sc, stream, scaler):
    cl = Cluster(sc, stream, scaler=scaler)
    res = cl.run()
    return cl, res


def steady(n=200, rate=20.0, prompt=200, out=100):
    return stream_of(np.arange(n) / rate, [prompt] * n, [out] * n)


@pytest.mark.parametrize("async_on", [False, True])
def test_draining_loses_nothing_and_stops_after_its_last_request(async_on):
    """Under async scheduling (vLLM's GPU default) the last requests keep their blocks one step longer:
    the instance must still stop then, not stay draining (and billed) to the end of the run."""
    sc = make_scenario(**{"cluster.num_instances": 2, "cluster.max_instances": 2, "scaler.interval_s": 1.0,
                          "cluster.engine.async_scheduling": async_on})
    cl, res = run_with(sc, steady(200), Script([(2.0, 1)]))
    log = res.log
    assert (log.status == 4).all()  # every request finished: none lost, none restarted
    assert int(log.preemptions.sum()) == 0
    drained = [e for e in cl.fleet.events if e.action == "drain"]
    stop = [e for e in cl.fleet.events if e.action == "stop"]
    assert len(drained) == 1 and len(stop) == 1
    gone = int(drained[0].instance.split("-")[1])
    t_drain, t_stop = drained[0].t, stop[0].t
    sent_after = (log.instance == gone) & (log.arrival_s > t_drain)
    assert not sent_after.any()  # no new requests after the drain
    on_it = log.instance == gone
    last = log.finish_s[on_it].max()
    if async_on:  # freed after the next step's decision: within a step (a decode step here is < 50 ms)
        assert last <= t_stop < last + 0.05 and t_stop < res.sim_time_s
    else:
        assert t_stop == pytest.approx(last)  # it stopped when its last request ended
    assert t_drain < t_stop


def test_a_new_instance_pays_the_start_up_delay_and_is_billed_for_it():
    sc = make_scenario(**{"cluster.num_instances": 1, "cluster.max_instances": 3, "cluster.startup_delay_s": 5.0,
                          "scaler.interval_s": 1.0})
    cl, res = run_with(sc, steady(400, rate=40), Script([(1.0, 2)]))
    start = next(e for e in cl.fleet.events if e.action == "start")
    ready = next(e for e in cl.fleet.events if e.action == "serving")
    assert ready.t - start.t == pytest.approx(5.0)
    new = int(start.instance.split("-")[1])
    log = res.log
    assert (log.instance == new).any()
    assert log.arrival_s[log.instance == new].min() >= ready.t  # nothing routed to it while starting
    from twin.sim.metrics import summarize

    s = summarize(res)
    assert s["gpu_seconds"] == pytest.approx(res.sim_time_s + (res.sim_time_s - start.t))
    assert s["fleet"]["peak_active"] == 2 and s["fleet"]["instances_ever"] == 2


def test_fleet_bounds_are_kept_and_checked():
    sc = make_scenario(**{"cluster.num_instances": 2, "cluster.min_instances": 2, "cluster.max_instances": 3,
                          "scaler.interval_s": 1.0})
    cl, _ = run_with(sc, steady(100), Script([(1.0, 10), (2.0, 0)]))
    assert max(e.fleet_active for e in cl.fleet.events) <= 3
    assert len(cl.fleet.active()) >= 2
    from twin.errors import TwinInputError

    with pytest.raises(TwinInputError, match="min_instances"):
        make_scenario(**{"cluster.num_instances": 1, "cluster.min_instances": 2})


def test_threshold_scaler_scales_up_after_the_burst_then_cools_down():
    w = RecentWindow()
    for k in range(50):
        w.finished(100.0 + k * 0.1, 0.5, 5.0, 100, 50)  # P99 E2E 5 s > 3 s
    fleet = fleet_of(*({"id": f"i{k}"} for k in range(10)), now=105.0)
    fleet.signals = w
    s = ThresholdScaler(metric="e2e_s", threshold_s=3.0)
    a = s.decide(105.0, fleet)
    assert a.target == 12  # +20 % of 10
    assert s.decide(200.0, fleet).target is None  # cool-down (300 s)
    calm = RecentWindow()
    for k in range(50):
        calm.finished(500.0 + k * 0.1, 0.1, 0.5, 100, 50)
    fleet.signals = calm
    assert s.decide(506.0, fleet).target == 9


def test_queue_scaler_follows_the_hpa_rule_with_tolerance_and_stabilisation():
    s = QueueScaler(target_waiting=5, stabilization_s=300)
    fleet = fleet_of(*({"id": f"i{k}", "waiting": 10} for k in range(4)))
    assert s.decide(0.0, fleet).target == 8  # ceil(4 x 10 / 5)
    near = fleet_of(*({"id": f"i{k}", "waiting": 6 if k == 0 else 5} for k in range(4)))
    assert s.decide(10.0, near).target is None  # a mean of 5.25 waiting: within 10 % (gauges are integers)
    idle = fleet_of(*({"id": f"i{k}", "waiting": 0} for k in range(8)))
    assert s.decide(20.0, idle).target is None  # the recent recommendation of 8 holds the fleet up
    assert s.decide(400.0, idle).target == 1


def test_throughput_scaler_divides_forecast_demand_by_capacity():
    w = RecentWindow()
    for k in range(600):
        w.arrived(k * 0.1, 100)  # 10 req/s
    s = ThroughputScaler(predictor="constant", capacity_req_s=3.0, headroom=0.0, interval_s=30.0)
    fleet = fleet_of({"id": "a"}, now=60.0)
    fleet.signals = w
    assert s.decide(60.0, fleet).target == math.ceil(10 / 3)
    with pytest.raises(TwinInputError, match="unknown scaler 'magic'"):  # one line, as every bad name
        make_scaler("magic")


def test_threshold_scaler_in_the_simulator_scales_after_a_burst():
    # calm, then a 10x burst: the reactive scaler acts only once latency has already degraded
    calm = np.arange(0, 60, 0.5)
    burst = 60 + np.arange(0, 60, 0.02)
    arr = np.concatenate([calm, burst])
    stream = stream_of(arr, [400] * len(arr), [200] * len(arr))
    sc = make_scenario(**{"cluster.num_instances": 1, "cluster.max_instances": 4, "cluster.startup_delay_s": 10.0,
                          "scaler.name": "threshold", "scaler.interval_s": 5.0,
                          "scaler.params": {"threshold_s": 3.0, "window_s": 20.0, "cooldown_s": 20.0}})
    cl, res = run_with(sc, stream, None)
    starts = [e.t for e in cl.fleet.events if e.action == "start"]
    assert starts and min(starts) > 60.0  # after the burst began, never before it
    assert (res.log.status == 4).all()


def test_throughput_scaler_measures_capacity_with_the_twin_when_not_given():
    sc = make_scenario(**{"cluster.num_instances": 1, "cluster.max_instances": 8, "scaler.name": "throughput",
                          "scaler.interval_s": 10.0, "slo.ttft_s": 0.5,
                          "scaler.params": {"predictor": "constant", "interval_s": 10.0}})
    cl, res = run_with(sc, steady(900, rate=30, prompt=1000, out=200), None)
    assert cl.capacity.req_s > 0 and cl.fleet.scaler.capacity_req_s == cl.capacity.req_s
    assert any(e.action == "start" for e in cl.fleet.events)


def test_scalers_command_lists_them():
    r = CliRunner().invoke(app, ["scalers"])
    assert r.exit_code == 0
    for name in ("none", "threshold", "queue", "throughput"):
        assert name in r.output


def burst_stream():
    calm = np.arange(0, 120, 0.5)
    burst = 120 + np.arange(0, 60, 0.02)
    arr = np.concatenate([calm, burst])
    return stream_of(arr, [400] * len(arr), [200] * len(arr))


def test_the_twin_scaler_scales_before_a_forecast_burst_the_threshold_scaler_after_it():
    base = {"cluster.num_instances": 1, "cluster.max_instances": 4, "cluster.startup_delay_s": 20.0,
            "scaler.interval_s": 10.0, "slo.ttft_s": 1.0}
    twin_sc = make_scenario(**base, **{"scaler.name": "twin",
                                       "scaler.params": {"horizon_s": 40.0, "oracle": True, "target": 0.9}})
    cl, res = run_with(twin_sc, burst_stream(), None)
    starts = [e.t for e in cl.fleet.events if e.action == "start"]
    assert starts and min(starts) < 120.0  # it saw the burst coming in its forecast window
    assert "oracle" in next(e.reason for e in cl.fleet.events if e.action == "start")
    thr_sc = make_scenario(**base, **{"scaler.name": "threshold",
                                      "scaler.params": {"metric": "ttft_s", "threshold_s": 1.0, "window_s": 10.0}})
    cl2, res2 = run_with(thr_sc, burst_stream(), None)
    starts2 = [e.t for e in cl2.fleet.events if e.action == "start"]
    assert starts2 and min(starts2) > 120.0
    from twin.sim.metrics import summarize

    assert summarize(res)["slo_attainment"] > summarize(res2)["slo_attainment"]


def test_the_twin_scaler_without_an_oracle_uses_the_measured_rate_and_holds_a_calm_fleet():
    sc = make_scenario(**{"cluster.num_instances": 2, "cluster.max_instances": 4, "scaler.interval_s": 10.0,
                          "slo.ttft_s": 1.0, "scaler.name": "twin", "scaler.params": {"horizon_s": 30.0}})
    cl, res = run_with(sc, steady(300, rate=5), None)
    assert cl.fleet.scaler.last["rate"] > 0
    assert len(cl.fleet.active()) >= 1 and (res.log.status == 4).all()


def test_the_online_chunk_planner_changes_the_chunk_when_long_prompts_arrive_and_new_instances_take_it():
    rng = np.random.default_rng(3)
    short = np.arange(0, 60, 0.1)  # short prompts, then a long-prompt phase
    long_ = 60 + np.arange(0, 60, 0.1)  # ~45k prompt tokens/s: more than 256-token steps can prefill
    arr = np.concatenate([short, long_])
    prompts = np.concatenate([rng.integers(50, 200, len(short)), rng.integers(3000, 6000, len(long_))])
    outs = np.concatenate([rng.integers(20, 60, len(short)), rng.integers(5, 20, len(long_))])
    sc = make_scenario(**{"cluster.num_instances": 1, "cluster.max_instances": 3, "cluster.startup_delay_s": 5.0,
                          "cluster.engine.max_num_batched_tokens": 256, "cluster.engine.max_num_seqs": 64,
                          "slo.ttft_s": 2.0, "scaler.name": "none"},
                       chunk_plan={"online": True, "interval_s": 20.0, "window_s": 30.0, "min_requests": 30,
                                   "candidates": [256, 2048, 8192], "apply": "all"})
    cl = Cluster(sc, stream_of(arr, prompts, outs))
    res = cl.run()
    changes = cl.fleet.chunk_planner.changes
    assert changes and changes[0][0] > 60.0  # it re-planned after the shift to long prompts
    assert changes[0][1].max_num_batched_tokens > 256
    restarted = [i for i in cl.instances if i.index > 0]
    assert restarted and all(i.config.max_num_batched_tokens == changes[0][1].max_num_batched_tokens
                             for i in restarted)
    assert cl.instances[0].state == "stopped"  # the old instance was drained after its requests
    assert (res.log.status == 4).all()


def test_load_predictors_follow_a_trend_and_fall_back_on_short_history():
    pytest.importorskip("statsmodels")  # the [plan] extra: in the test venv, not in the compiled one
    from twin.policy.forecast import make_load_predictor

    ramp = [10.0 + 2.0 * k for k in range(20)]  # +2 req/s per interval
    for name in ("holt-winters", "arima"):
        p = make_load_predictor(name)
        nxt = p.predict(ramp)
        assert nxt > ramp[-1] + 0.5, (name, nxt)  # it extrapolates the trend, unlike a moving average
        assert p.predict([5.0, 5.0]) == pytest.approx(5.0)  # too short or flat: the moving average
    assert make_load_predictor("moving-average", window=3).predict(ramp) == pytest.approx(sum(ramp[-3:]) / 3)
    assert make_load_predictor("constant").predict(ramp) == ramp[-1]


def test_capacity_of_short_requests_is_confirmed_with_full_length_probes():
    """Short requests at a high rate: the request cap made probes a few seconds long, too short for a slowly
    growing queue to show, and the rate came out about 25 % high. The measured rate must hold for a probe of the
    full length, and a rate 15 % above it must not."""
    from twin.sim.capacity import measure_capacity
    from twin.sim.cluster import simulate
    from twin.sim.metrics import slo_mask
    from twin.scenario import load_scenario
    from twin.workload import RequestStream

    sc = load_scenario(ROOT / "scenarios" / "quickstart.yaml", ["slo.ttft_s=0.5", "slo.tpot_s=0.05"])
    p, o = np.full(200, 60), np.full(200, 20)
    cap = measure_capacity(sc, p, o, probe_s=10.0, max_requests=500, simulate=simulate)
    assert any(n > 500 for n in (int(r * 10.0) for r, _ in cap.probes))  # full-length probes were run

    def later_half_attainment(rate: float) -> float:
        rng = np.random.default_rng(7)
        n = int(rate * 10.0)
        one = sc.model_copy(update={"cluster": sc.cluster.model_copy(update={"num_instances": 1})})
        log = Cluster(one, RequestStream(np.cumsum(rng.exponential(1 / rate, n)), p[:1].repeat(n),
                                         o[:1].repeat(n))).run().log
        return float(slo_mask(log, sc.slo)[n // 2:].mean())

    assert later_half_attainment(cap.req_s) >= 0.85
    assert later_half_attainment(cap.req_s * 1.15) < 0.9


@pytest.mark.parametrize("mode", ["fast", "step"])
@pytest.mark.parametrize("async_on", [True, False])
def test_the_timeline_is_what_a_poll_at_each_tick_saw(mode, async_on):
    """No sampling process runs: each tick's row must equal an eager poll just before it, through scale-ups
    and a drain (lifecycle states, in-flight counts, a decode run's blocks), and every tick must be there."""
    dt = 0.1
    rng = np.random.default_rng(5)
    n = 300
    stream = stream_of(np.cumsum(rng.exponential(0.02, n)), rng.integers(50, 900, n), rng.integers(5, 150, n))
    sc = make_scenario(**{"cluster.num_instances": 1, "cluster.max_instances": 3, "cluster.startup_delay_s": 0.5,
                          "scaler.interval_s": 0.5, "sim.timeline_interval_s": dt, "sim.mode": mode,
                          **kv_blocks(300),
                          "cluster.engine.async_scheduling": async_on})
    cl = Cluster(sc, stream, scaler=Script([(1.0, 3), (3.0, 2)]))
    polled = {}

    def poller():  # just before each tick: the state after every event before it
        env = cl.env
        k = 0
        while True:
            yield env.timeout(max(k * dt - 1e-9 - env.now, 0.0))
            loads = cl.dispatcher.bookkeeping.loads
            for inst in cl.instances:
                ld = loads.get(inst.id)
                polled[(k, inst.id)] = (inst.num_running, inst.num_waiting, inst.kv_usage,
                                        ld.requests if ld is not None else 0, inst.state)
            k += 1

    cl.env.process(poller())
    res = cl.run()
    assert (res.log.status == 4).all()
    tl = res.timeline.to_frame()
    assert {"starting", "serving", "draining", "stopped"} <= set(tl.state)
    assert (tl.waiting > 0).any() and (tl.inflight > 1).any()
    assert tl.t_s.is_monotonic_increasing
    for row in tl.itertuples():
        k = int(round(row.t_s / dt))
        assert row.t_s == pytest.approx(k * dt)
        running, waiting, kv, inflight, state = polled[(k, row.instance)]
        assert (row.running, row.waiting, row.inflight, row.state) == (running, waiting, inflight, state), row
        assert row.kv_usage == pytest.approx(kv, abs=1e-12), row
    last = int(res.sim_time_s / dt + 1e-9)  # every instance at every tick through the end, once
    want = {key for key in polled if key[0] <= last}
    got = {(int(round(t / dt)), i) for t, i in zip(tl.t_s, tl.instance)}
    assert got == want and len(tl) == len(want)
