"""The API server as a queue (twin.sim.api_server): bursts wait for each other, the token stream stretches
pre-processing, tokens wait behind queued requests, and without API time nothing changes."""

from __future__ import annotations

import numpy as np
import pytest

from twin.sim.api_server import ApiServer
from twin.sim.cluster import Cluster

from conftest import make_scenario, run_checked, stream_of

REQ = 0.004  # seconds of pre-processing per request
API = {"cluster.perf.api_request_overhead_s": REQ, "cluster.perf.api_prompt_token_s": 0.0,
       "cluster.perf.api_output_token_s": 0.0}


def entries(res) -> np.ndarray:
    """Each request's time from arrival to its first schedule (the engine took it at once: it was idle)."""
    return res.log.scheduled_s - res.log.arrival_s


def test_processor_sharing_ends_a_burst_together_and_short_requests_first():
    srv = ApiServer(discipline="ps")
    for i in range(4):
        srv.arrive(0.0, 0.01, 0, 0.0, 0.0, i)
    assert srv.next_done() == pytest.approx(0.04)  # four share the loop: each ends after all four's work
    assert srv.pop_done(0.0399) == []
    assert sorted(srv.pop_done(0.04)) == [0, 1, 2, 3]
    srv = ApiServer(discipline="ps")
    srv.arrive(0.0, 0.01, 0, 0.0, 0.0, 0)
    srv.arrive(0.0, 0.03, 0, 0.0, 0.0, 1)
    assert srv.next_done() == pytest.approx(0.02)  # the short one: 0.01 each at half speed
    assert srv.pop_done(0.02) == [0]
    assert srv.next_done() == pytest.approx(0.04)  # then the long one alone: its last 0.02
    assert srv.backlog_end()[0] == pytest.approx(0.04)


def test_fifo_gives_a_burst_increasing_waits():
    srv = ApiServer(discipline="fifo")
    ends = [srv.preprocess(0.0, 0.01, 0, 0.0, 0.0, i) for i in range(4)]
    assert ends == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert srv.delivery_wait(0.015) == pytest.approx(0.025)  # a token at 15 ms waits for the rest's parsing
    assert srv.delivery_wait(0.05) == 0.0


@pytest.mark.parametrize("discipline", ["ps", "fifo"])
def test_a_larger_burst_waits_longer_in_the_api_server(discipline):
    sc = make_scenario(**API, **{"cluster.perf.api_queue": discipline})
    n = 8
    res = run_checked(sc, stream_of([0.0] * n + [5.0], [100] * (n + 1), [4] * (n + 1)))
    alone = entries(res)[n]
    assert alone == pytest.approx(REQ)  # one request alone: its own pre-processing
    burst = np.sort(entries(res)[:n])
    if discipline == "fifo":  # one at a time: the k-th enters the engine after k requests' work
        assert burst[0] == pytest.approx(REQ) and burst[-1] >= n * REQ - 1e-9
        assert np.all(np.diff(burst) >= 0) and burst[-1] > burst[0]
    else:  # the loop interleaves them: all enter after the burst's whole work
        assert burst == pytest.approx([n * REQ] * n)
    # the first token of a burst's first request waits for the rest's pre-processing
    ttft = res.log.first_token_s[:n] - res.log.arrival_s[:n]
    assert np.min(ttft) >= n * REQ - 1e-9


def test_decode_load_stretches_pre_processing():
    tok = 1e-4
    sc = make_scenario(**{**API, "cluster.perf.api_output_token_s": tok, "cluster.perf.api_rho_cap": 0.95})
    # 32 long decodes, then one request arriving while they stream tokens
    stream = stream_of([0.0] * 32 + [1.0], [64] * 32 + [100], [4000] * 32 + [4])
    cl = Cluster(sc, stream)
    cl.api_record = True
    cl.env.run(until=1.0)
    rate = cl.instances[0].token_rate()
    assert rate > 1000  # tokens per second out of the decode batch in progress
    rho = rate * tok
    assert 0.1 < rho < 0.95
    cl.run()
    entry = cl.api_servers["instance-0"].record[32][0][0]
    assert entry == pytest.approx(1.0 + REQ / (1.0 - rho), rel=1e-9)  # its service, stretched by the stream
    # the cap bounds the stretch
    srv = ApiServer(rho_cap=0.5, discipline="fifo")
    assert srv.preprocess(0.0, 0.01, 0, 1.0, 1e6, 0) == pytest.approx(0.02)


def test_zero_api_terms_run_exactly_as_without_an_api_server():
    stream = stream_of([0.0, 0.0, 0.01, 0.3, 0.31], [100, 200, 50, 400, 10], [20, 5, 30, 8, 12])
    base = {"cluster.perf.api_request_overhead_s": 0.0, "cluster.perf.api_prompt_token_s": 0.0,
            "cluster.perf.api_output_token_s": 0.0}
    runs = [run_checked(make_scenario(**base, **{"cluster.perf.api_queue": q}), stream) for q in ("ps", "fifo", "off")]
    for res in runs[1:]:
        for col in ("scheduled_s", "first_token_s", "finish_s"):
            assert np.array_equal(getattr(res.log, col), getattr(runs[0].log, col)), col


def test_isolated_requests_see_the_same_times_as_fixed_delays():
    """No two requests in the API server at once and no token stream during pre-processing: the queue is the
    old fixed delay (per request, per prompt token, per streamed token)."""
    stream = stream_of([0.0, 1.0, 2.0], [100, 300, 50], [10, 10, 10])
    terms = {"cluster.perf.api_request_overhead_s": 0.003, "cluster.perf.api_prompt_token_s": 2e-6,
             "cluster.perf.api_output_token_s": 5e-5}
    ps = run_checked(make_scenario(**terms), stream)
    off = run_checked(make_scenario(**terms, **{"cluster.perf.api_queue": "off"}), stream)
    for col in ("scheduled_s", "first_token_s", "finish_s"):
        assert getattr(ps.log, col) == pytest.approx(getattr(off.log, col), rel=1e-12, abs=1e-12), col


def test_the_hand_off_delays_the_engine_without_holding_the_server():
    sc = make_scenario(**API, **{"cluster.perf.api_handoff_s": 0.01})
    res = run_checked(sc, stream_of([0.0, 0.0], [100, 100], [4, 4]))
    assert entries(res) == pytest.approx([2 * REQ + 0.01] * 2)


def test_bad_api_queue_settings_are_one_line():
    from twin.errors import TwinInputError

    with pytest.raises((TwinInputError, ValueError), match="api_queue|api_rho_cap"):
        make_scenario(**{"cluster.perf.api_queue": "lifo"})
    with pytest.raises((TwinInputError, ValueError), match="api_rho_cap"):
        make_scenario(**{"cluster.perf.api_rho_cap": 1.0})


def test_a_bare_yaml_off_turns_the_queue_off():
    assert make_scenario(**{"cluster.perf.api_queue": False}).cluster.perf.api_queue == "off"  # YAML `off`
    assert make_scenario().cluster.perf.api_queue == "ps"
