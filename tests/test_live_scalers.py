"""The live controller runs the twin's own scalers: a twin ScaleAction(target) becomes starts or drains."""

from live.scaling import as_action, make_scaler
from twin.policy.scalers import QueueScaler, ScaleAction as TwinAction

from policy_fakes import fleet_of


def test_twin_scalers_load_by_name_in_the_live_controller():
    assert isinstance(make_scaler("queue", target_waiting=3), QueueScaler)
    assert make_scaler("none").decide(0.0, fleet_of({"id": "a"}), None).is_noop


def test_a_target_becomes_starts_or_drains_of_the_least_loaded():
    fleet = fleet_of({"id": "a", "inflight": 5}, {"id": "b", "inflight": 1}, {"id": "c", "inflight": 3})
    up = as_action(TwinAction(5, "more"), fleet)
    assert up.add == 2 and not up.drain and up.reason == "more"
    down = as_action(TwinAction(1, "less"), fleet)
    assert down.add == 0 and list(down.drain) == ["b", "c"]
    assert as_action(TwinAction(None), fleet).is_noop
    assert as_action(TwinAction(3), fleet).is_noop


def test_the_live_queue_scaler_reads_scraped_waiting_through_the_same_view():
    s = make_scaler("queue", target_waiting=2, scale_up_percent=None)  # no HPA rate limit: the plain rule
    fleet = fleet_of({"id": "a", "waiting": 8}, {"id": "b", "waiting": 8})
    assert as_action(s.decide(0.0, fleet, None), fleet).add == 6  # ceil(2 x 8 / 2) = 8 active wanted
