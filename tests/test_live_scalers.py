"""One scaler registry, one ScaleAction and one planner for both worlds (twin.policy.scalers): the live
controller runs the twin's own scalers, and a target becomes starts or drains as in the simulator's fleet."""

import asyncio

import pytest

from live.scaling import make_scaler, plan_scale
from twin.errors import TwinInputError
from twin.policy.scalers import QueueScaler, ScaleAction, StaticScaler

from policy_fakes import fleet_of


def test_twin_scalers_load_by_name_in_the_live_controller():
    assert isinstance(make_scaler("queue", target_waiting=3), QueueScaler)
    assert make_scaler("none").decide(0.0, fleet_of({"id": "a"}), None).is_noop
    assert isinstance(make_scaler("static", target=2), StaticScaler)


def test_bad_scaler_names_and_parameters_are_one_line():
    with pytest.raises(TwinInputError, match="unknown scaler 'nope'"):
        make_scaler("nope")
    with pytest.raises(TwinInputError, match="scaler.params"):
        make_scaler("queue", target_waiting=-1)


def test_a_target_becomes_starts_or_drains_of_the_least_loaded():
    fleet = fleet_of({"id": "a", "inflight": 5}, {"id": "b", "inflight": 1}, {"id": "c", "inflight": 3})
    up = plan_scale(ScaleAction(5, "more"), fleet)
    assert up.start == 2 and not up.drain and up.reason == "more"
    down = plan_scale(ScaleAction(1, "less"), fleet)
    assert down.start == 0 and list(down.drain) == ["b", "c"]
    assert plan_scale(ScaleAction(None), fleet).is_noop
    assert plan_scale(ScaleAction(3), fleet).is_noop
    assert plan_scale(None, fleet).is_noop


def test_the_planner_clamps_to_min_and_max_and_caps_explicit_adds():
    fleet = fleet_of({"id": "a", "inflight": 5}, {"id": "b", "inflight": 1})
    assert plan_scale(ScaleAction(10), fleet, 1, 4).start == 2
    assert list(plan_scale(ScaleAction(0), fleet, 1, 4).drain) == ["b"]
    assert plan_scale(ScaleAction(add=5, engine_args={"max_num_batched_tokens": 512}), fleet, 0, 3).start == 1
    assert plan_scale(ScaleAction(add=1, engine_args={"max_num_batched_tokens": 512}), fleet).engine_args == {
        "max_num_batched_tokens": 512}
    assert list(plan_scale(ScaleAction(drain=("a",)), fleet).drain) == ["a"]


def test_starting_instances_are_cancelled_before_serving_ones_drain():
    fleet = fleet_of({"id": "a", "inflight": 0}, {"id": "b", "state": "starting"}, {"id": "c", "state": "starting"})
    assert list(plan_scale(ScaleAction(1), fleet).drain) == ["c", "b"]  # the newest starting one first


def test_the_live_queue_scaler_reads_scraped_waiting_through_the_same_view():
    s = make_scaler("queue", target_waiting=2, scale_up_percent=None)  # no HPA rate limit: the plain rule
    fleet = fleet_of({"id": "a", "waiting": 8}, {"id": "b", "waiting": 8})
    assert plan_scale(s.decide(0.0, fleet, None), fleet).start == 6  # ceil(2 x 8 / 2) = 8 active wanted


def test_a_scale_up_that_fails_is_logged_with_its_reason(caplog):
    """Found by a fuzzing pass: the scaler's starts were gathered with return_exceptions and the results dropped,
    so a worker that never came up (its LaunchError carries the end of its log) left no error in the log."""
    pytest.importorskip("aiohttp")
    from live.config import parse_config
    from live.controller import Controller
    from live.launcher import LaunchError

    class Failing:
        async def start(self, spec):
            raise LaunchError("worker local-0 exited with 1 while starting:\nbad engine argument")

    cfg = parse_config({"workers": [{"url": "http://127.0.0.1:9"}], "scaler": {"name": "static",
                                                                            "params": {"target": 1}}})
    ctl = Controller(cfg)
    ctl.actuator = Failing()
    with caplog.at_level("ERROR", logger="llmtwin.live"):
        plan = asyncio.run(ctl.scale_once())
    assert plan.start == 1
    assert "exited with 1 while starting" in caplog.text and "bad engine argument" in caplog.text
