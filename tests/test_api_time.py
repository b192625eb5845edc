"""Time outside the engine step: the API server's per-request work before the engine, per-token after it."""

import pytest

from twin.sim.cluster import build_perf

from conftest import make_scenario, run_checked, stream_of

API = {"cluster.perf.api_request_overhead_s": 0.004, "cluster.perf.api_prompt_token_s": 2e-6,
       "cluster.perf.api_output_token_s": 5e-5}


def test_ttft_and_e2e_include_api_server_time_and_itl_does_not_change():
    stream = stream_of([0.5], [1000], [20])
    plain = run_checked(make_scenario(), stream)
    api = run_checked(make_scenario(**API), stream)
    before = 0.004 + 1000 * 2e-6
    after = 5e-5
    t0 = plain.log.first_token_s[0] - plain.log.arrival_s[0]
    t1 = api.log.first_token_s[0] - api.log.arrival_s[0]
    assert t1 == pytest.approx(t0 + before + after, rel=1e-9)
    e0 = plain.log.finish_s[0] - plain.log.arrival_s[0]
    e1 = api.log.finish_s[0] - api.log.arrival_s[0]
    assert e1 == pytest.approx(e0 + before + after, rel=1e-9)
    assert api.log.scheduled_s[0] == pytest.approx(api.log.arrival_s[0] + before)  # the engine saw it later
    i0, _ = plain.instances[0].scheduler.stats.itl.arrays()
    i1, _ = api.instances[0].scheduler.stats.itl.arrays()
    assert list(i0) == pytest.approx(list(i1))
    perf = build_perf(make_scenario(**API))
    assert perf.api_request_s(1000) == pytest.approx(before) and perf.api_token_s() == after


def test_requests_in_the_api_server_are_accounted_and_a_draining_instance_waits_for_them():
    sc = make_scenario(**{**API, "cluster.perf.api_request_overhead_s": 0.5, "cluster.num_instances": 1})
    res = run_checked(sc, stream_of([0.0, 0.1], [100, 100], [5, 5]))
    assert (res.log.status == 4).all()
