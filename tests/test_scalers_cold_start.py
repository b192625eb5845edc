"""Scalers at the start of a run (issue 21): no forecast from bins never observed, no drain on a first reading."""

import numpy as np

from twin.sim.cluster import Cluster
from twin.policy.scalers import QueueScaler, ThroughputScaler
from twin.policy.signals import RecentWindow

from conftest import make_scenario, stream_of
from policy_fakes import fleet_of


def steady(n, rate, prompt, out):
    return stream_of(np.arange(n) / rate, [prompt] * n, [out] * n)


def window_of(rate, until, since=0.0):
    w = RecentWindow()
    for k in range(int((until - since) * rate)):
        w.arrived(since + k / rate, 100)
    return w


def test_the_arrival_series_starts_at_the_first_observed_arrival():
    w = window_of(10.0, 30.0)
    assert RecentWindow().arrival_series(30.0, 30.0, 20) == []  # nothing observed: no forecast
    assert w.arrival_series(30.0, 30.0, 20) == [10.0]  # not 19 zero bins before t = 0, then 10
    assert w.arrival_series(30.0, 10.0, 20) == [10.0, 10.0, 10.0]
    # a bin observed in part: its rate over the part seen (20 of 30 s), not over the whole bin
    assert w.arrival_series(30.0, 30.0 / 1.5, 20) == [10.0, 10.0]
    # under half a bin seen in all: too little to forecast from
    assert window_of(10.0, 10.0).arrival_series(10.0, 30.0, 5) == []
    # under half of the oldest bin seen: folded into the next one
    late = window_of(10.0, 60.0, since=25.0)
    assert late.arrival_series(60.0, 30.0, 5) == [10.0]
    # real idle bins after the first arrival still count as zeros
    gap = window_of(10.0, 30.0)
    assert gap.arrival_series(90.0, 30.0, 5) == [10.0, 0.0, 0.0]


def test_the_first_arrival_is_remembered_when_the_window_trims_it():
    w = RecentWindow(horizon_s=60.0)
    for k in range(3000):
        w.arrived(k * 0.1, 100)  # trims every 1024 arrivals
    assert w.arrivals[0][0] > 0.0 and w.first_arrival_s == 0.0
    series = w.arrival_series(300.0, 30.0, 20)
    assert len(series) == 10 and series[-1] == 10.0  # from t = 0 on (trimmed arrivals were seen), not 20 bins


def test_the_throughput_scaler_does_not_drain_at_its_first_decision_of_a_steady_load():
    s = ThroughputScaler(predictor="moving-average", capacity_req_s=3.0, headroom=0.0, interval_s=30.0)
    fleet = fleet_of(*({"id": f"i{k}"} for k in range(4)), now=30.0)
    fleet.signals = window_of(10.0, 30.0)
    assert s.decide(30.0, fleet).target is None  # ceil(10 / 3) = 4 already; was 1 (a 2 req/s forecast)
    assert s.last_forecast_req_s == 10.0
    fleet.signals = RecentWindow()
    assert s.decide(60.0, fleet).target is None  # nothing arrived yet: no forecast, no action


def first_decisions(name, params):
    # 10 req/s of 4,000-token prompts: one instance misses the 1 s TTFT for most requests, two meet it
    sc = make_scenario(**{"cluster.num_instances": 2, "cluster.max_instances": 4, "scaler.interval_s": 10.0,
                          "slo.ttft_s": 1.0, "scaler.name": name, "scaler.params": params})
    cl = Cluster(sc, steady(300, 10.0, 4000, 100))
    cl.run()
    return cl, [e for e in cl.fleet.events if e.action in ("start", "drain")]


def test_the_throughput_scaler_in_the_simulator_keeps_the_fleet_a_steady_load_needs():
    cl, acts = first_decisions("throughput", {"predictor": "moving-average", "interval_s": 10.0,
                                              "capacity_req_s": 6.0})
    assert not [e for e in acts if e.action == "drain"], acts  # ceil(10 x 1.1 / 6) = 2 from the first decision


def test_the_twin_scaler_in_the_simulator_does_not_drain_on_its_first_decision():
    cl, acts = first_decisions("twin", {"horizon_s": 30.0, "interval_s": 10.0})
    assert not [e for e in acts if e.action == "drain"], acts
    assert cl.fleet.scaler.last["rate"] == 10.0


def test_the_queue_scaler_does_not_drain_on_its_first_reading_as_the_hpa():
    s = QueueScaler(target_waiting=5, stabilization_s=300)
    idle = fleet_of(*({"id": f"i{k}", "waiting": 0} for k in range(4)))
    assert s.decide(30.0, idle).target is None  # nothing queued yet: the window holds the current 4
    assert s.decide(300.0, idle).target is None  # still within 300 s of the first reading
    assert s.decide(331.0, idle).target == 1  # the window is full of idle readings: now it drains


def test_the_queue_scaler_scales_up_at_most_as_fast_as_the_hpa_default():
    s = QueueScaler(target_waiting=5)
    fleet = fleet_of({"id": "a", "waiting": 200})
    assert s.decide(0.0, fleet).target == 5  # max(2 x 1, 1 + 4), not ceil(200 / 5) = 40
    five = fleet_of(*({"id": f"i{k}", "waiting": 200} for k in range(5)))
    assert s.decide(10.0, five).target is None  # within the 15 s period: the limit was spent on 1 -> 5
    assert s.decide(30.0, five).target == 10  # a new period: double
    assert QueueScaler(target_waiting=5, scale_up_percent=None).decide(0.0, fleet).target == 40


def test_bins_after_the_world_began_watching_count_even_without_arrivals():
    """A burst after a quiet spell: the quiet bins were observed (the controller, the simulation were running),
    so they are real zeros; only bins before the window began observing are left out."""
    from twin.policy.signals import RecentWindow

    watched = RecentWindow(observed_since=0.0)
    unseen = RecentWindow()
    for w in (watched, unseen):
        for i in range(40):
            w.arrived(56.0 + i * 0.01, 100)
    assert watched.arrival_series(60.0, 10.0, 10) == [0.0, 0.0, 0.0, 0.0, 0.0, 4.0]
    assert unseen.arrival_series(60.0, 10.0, 10) == []  # under half a bin since its first arrival: no forecast


def test_the_live_controller_and_the_simulation_watch_from_their_start():
    import pytest
    pytest.importorskip("aiohttp")  # the [live] extra (the compiled build's venv has none)
    from live.config import parse_config
    from live.controller import Controller
    from twin.sim.dispatcher import Dispatcher
    from twin.sim.environment import Environment

    ctl = Controller(parse_config({"workers": [{"url": "http://127.0.0.1:1"}]}))
    assert ctl.signals.observed_since is not None
    assert Dispatcher(Environment(), ctl.router, []).signals.observed_since == 0.0


def test_the_rate_is_over_the_part_of_its_window_observed():
    w = window_of(10.0, 10.0)  # 10 req/s for the first 10 s
    assert w.rate(10.0, 60.0) == 10.0  # was 100 / 60 = 1.7: the 50 s before the first arrival were never seen
    assert w.rate(10.0, 5.0) == 10.0  # a full window: over the window
    assert RecentWindow().rate(10.0, 60.0) == 0.0  # nothing observed yet
    watched = RecentWindow(observed_since=0.0)
    for k in range(50):
        watched.arrived(50.0 + k * 0.2, 100)  # watched from t = 0, the first arrival at 50 s
    assert watched.rate(60.0, 60.0) == 50 / 60.0  # the quiet 50 s were observed: real zeros
    assert watched.rate(60.0, 120.0) == 50 / 60.0  # but not the minute before the world began watching
    idle = window_of(10.0, 10.0)
    assert idle.rate(70.0, 60.0) == 0.0  # real idle time after the first arrival still counts
