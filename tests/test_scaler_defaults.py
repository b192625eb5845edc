"""The threshold scaler's defaults come from the scenario's SLO (issue 21), in the simulator and live alike."""

import pytest

from twin.sim.cluster import Cluster
from twin.errors import TwinInputError
from twin.policy.scalers import ThresholdScaler
from twin.policy.signals import RecentWindow
from twin.scenario import SLOSpec

from conftest import make_scenario, stream_of
from policy_fakes import fleet_of


def long_answers(n=50, t0=100.0):
    # TTFT 0.2 s, 2,000-token answers at 15 ms a token: E2E 30 s, far above the old 3 s E2E default
    w = RecentWindow()
    for k in range(n):
        w.finished(t0 + k * 0.1, 0.2, 0.2 + 1999 * 0.015, 500, 2000)
    return w


def test_without_metric_or_threshold_it_takes_the_slos_ttft_then_tpot_then_e2e():
    s = ThresholdScaler(slo=SLOSpec(ttft_s=0.5, e2e_s=60.0))
    assert (s.metric, s.threshold_s) == ("ttft_s", 0.5)
    assert (ThresholdScaler(slo=SLOSpec(tpot_s=0.05, e2e_s=60.0)).metric,
            ThresholdScaler(slo={"e2e_s": 60.0}).metric) == ("tpot_s", "e2e_s")
    s = ThresholdScaler(metric="tpot_s", slo=SLOSpec(ttft_s=0.5, tpot_s=0.05))
    assert (s.metric, s.threshold_s) == ("tpot_s", 0.05)
    s = ThresholdScaler(threshold_s=2.0, slo=SLOSpec(ttft_s=0.5))  # a given threshold wins, on the SLO's metric
    assert (s.metric, s.threshold_s) == ("ttft_s", 2.0)
    assert (ThresholdScaler(threshold_s=3.0).metric, ThresholdScaler(threshold_s=3.0).threshold_s) == ("e2e_s", 3.0)
    with pytest.raises(ValueError, match="SLO bound on e2e_s"):
        ThresholdScaler(metric="e2e_s", slo=SLOSpec(ttft_s=0.5))
    with pytest.raises(ValueError, match="threshold_s"):
        ThresholdScaler(slo=SLOSpec())


def test_long_answers_within_the_ttft_slo_do_not_scale_up():
    fleet = fleet_of(*({"id": f"i{k}"} for k in range(4)), now=105.0)
    fleet.signals = long_answers()
    assert ThresholdScaler(metric="e2e_s", threshold_s=3.0).decide(105.0, fleet).target == 5  # the old default
    s = ThresholdScaler(slo=SLOSpec(ttft_s=1.0))
    assert s.decide(105.0, fleet).target == 3  # P99 TTFT 0.2 s < 0.3 x 1 s: one fewer, not more
    slow = RecentWindow()
    for k in range(50):
        slow.finished(500.0 + k * 0.1, 2.0, 10.0, 500, 100)
    fleet.signals = slow
    assert ThresholdScaler(slo=SLOSpec(ttft_s=1.0)).decide(506.0, fleet).target == 5  # TTFT 2 s > 1 s: up


def test_the_simulator_gives_the_threshold_scaler_the_scenarios_slo():
    import numpy as np

    stream = stream_of(np.arange(20) / 5.0, [100] * 20, [20] * 20)
    sc = make_scenario(**{"scaler.name": "threshold", "slo.tpot_s": 0.1, "cluster.max_instances": 2})
    s = Cluster(sc, stream).fleet.scaler
    assert (s.metric, s.threshold_s) == ("tpot_s", 0.1)
    with pytest.raises(TwinInputError, match="scaler.params: threshold scaler: give threshold_s"):
        Cluster(make_scenario(**{"scaler.name": "threshold", "cluster.max_instances": 2}), stream)


def test_the_live_controller_gives_it_shadow_slo_and_refuses_none():
    pytest.importorskip("aiohttp")
    from live.config import parse_config
    from live.controller import Controller

    ok = {"workers": [{"url": "http://x:1"}], "scaler": {"name": "threshold"}}
    ctl = Controller(parse_config({**ok, "shadow": {"slo": {"ttft_s": 0.8}}}))
    assert (ctl.scaler.metric, ctl.scaler.threshold_s) == ("ttft_s", 0.8)
    with pytest.raises(TwinInputError, match="give shadow.slo.ttft_s"):
        parse_config({**ok, "scaler": {"name": "threshold", "params": {"metric": "ttft_s"}}}, "live.yaml")
    with pytest.raises(TwinInputError, match="give shadow.slo.e2e_s"):
        parse_config(ok, "live.yaml")
    ctl = Controller(parse_config({**ok, "scaler": {"name": "threshold", "params": {"threshold_s": 4.0}}}))
    assert (ctl.scaler.metric, ctl.scaler.threshold_s) == ("e2e_s", 4.0)
