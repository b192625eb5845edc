"""Closed-loop load (twin.workload.closed_loop): N clients keep exactly N requests in flight, think times hold,
bad sections are one line; per-level figures (twin.analysis.concurrency)."""

import numpy as np
import pytest

from twin.analysis.concurrency import COLUMNS, run_levels, write_levels
from twin.errors import TwinInputError
from twin.scenario import load_scenario
from twin.workload import build_stream

from conftest import make_scenario, run_checked


def closed(concurrency, n, think=0.0, think_kind="fixed", lengths=None, **extra):
    return make_scenario(**{"workload.arrival": None, "workload.num_requests": n,
                            "workload.closed_loop": {"concurrency": concurrency, "think_time_s": think,
                                                     "think": think_kind},
                            **({"workload.lengths": lengths} if lengths else {}), **extra})


def in_flight(log, t):
    """Requests sent by time t and not yet ended at t."""
    return int(((log.arrival_s <= t) & (log.finish_s > t)).sum())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_exactly_n_requests_are_in_flight_until_the_tail(async_scheduling):
    lengths = {"kind": "trace", "path": "traces/sharegpt_lengths.sample.csv", "max_total_tokens": 2048}
    sc = closed(8, 120, lengths=lengths, **{"cluster.engine.async_scheduling": async_scheduling})
    s = build_stream(sc)
    log = run_checked(sc, s).log
    assert (log.status == 4).all()
    # the tail starts when the first client's last request ends: from then on clients run out of requests
    last_of_client = np.flatnonzero(~np.isin(np.arange(len(s)), s.after))
    assert len(last_of_client) == 8
    tail = log.finish_s[last_of_client].min()
    times = np.unique(np.r_[log.arrival_s, log.finish_s])
    mids = (times[:-1] + times[1:]) / 2
    head = mids[mids < tail]
    assert len(head) > 50
    assert all(in_flight(log, t) == 8 for t in head)
    assert all(in_flight(log, t) <= 8 for t in mids)
    # client c's k-th request waits for its (k-1)-th
    later = np.flatnonzero(s.after >= 0)
    assert (s.after[later] == later - 8).all()
    assert (log.arrival_s[later] >= log.finish_s[s.after[later]]).all()


def test_think_time_is_respected_fixed_and_exponential():
    sc = closed(4, 40, think=0.5)
    s = build_stream(sc)
    log = run_checked(sc, s).log
    later = np.flatnonzero(s.after >= 0)
    np.testing.assert_allclose(log.arrival_s[later] - log.finish_s[s.after[later]], 0.5, rtol=1e-9)
    assert (log.arrival_s[:4] == 0).all()  # every client starts at once, as vllm bench serve does
    sc = closed(4, 400, think=0.5, think_kind="exponential")
    s = build_stream(sc)
    log = run_checked(sc, s).log
    later = np.flatnonzero(s.after >= 0)
    gaps = log.arrival_s[later] - log.finish_s[s.after[later]]
    np.testing.assert_allclose(gaps, s.think_s[later], rtol=1e-9, atol=1e-12)
    assert gaps.mean() == pytest.approx(0.5, rel=0.15) and gaps.std() > 0.3


def test_ramp_up_staggers_the_clients_starts():
    s = build_stream(closed(4, 8, **{"workload.closed_loop.ramp_up_s": 2.0}))
    np.testing.assert_allclose(s.arrival_s[:4], [0.0, 0.5, 1.0, 1.5])


@pytest.mark.parametrize("section,needle", [
    ({"concurrency": 0}, "workload.closed_loop.concurrency: Input should be greater than 0"),
    ({"concurrency": 4, "think_time_s": -1}, "workload.closed_loop.think_time_s: Input should be greater"),
    ({"concurrency": 4, "think": "poisson"}, "workload.closed_loop.think: Input should be 'fixed' or"),
    ({"concurrency": 4, "clients": 3}, "workload.closed_loop.clients: unknown key"),
])
def test_bad_closed_loop_sections_are_one_line(section, needle):
    with pytest.raises(TwinInputError) as e:
        make_scenario(**{"workload.arrival": None, "workload.closed_loop": section})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_closed_loop_with_an_arrival_process_or_sessions_is_refused():
    with pytest.raises(TwinInputError, match="closed_loop sends each request .*: drop arrival$"):
        make_scenario(**{"workload.closed_loop": {"concurrency": 4}})
    with pytest.raises(TwinInputError, match="closed_loop needs num_requests and lengths"):
        make_scenario(**{"workload.arrival": None, "workload.lengths": None, "workload.closed_loop": {"concurrency": 2}})


def test_levels_give_one_row_each_and_load_raises_latency(tmp_path):
    sc = load_scenario("scenarios/closed-loop.yaml")
    rows = run_levels(sc, [1, 4, 32], requests_per_client=3)
    assert [r["concurrency"] for r in rows] == [1, 4, 32] and [r["requests"] for r in rows] == [3, 12, 96]
    assert all(r["finished"] == r["requests"] for r in rows)
    tpot = [r["tpot_mean_ms"] for r in rows]
    thr = [r["throughput_output_tok_s"] for r in rows]
    assert tpot[0] < tpot[1] < tpot[2] and thr[0] < thr[1] < thr[2]
    assert all(r["ttft_p99_ms"] >= r["ttft_mean_ms"] for r in rows)
    out = write_levels(rows, tmp_path / "levels.csv")
    assert out.read_text().splitlines()[0] == ",".join(COLUMNS) and len(out.read_text().splitlines()) == 4
    with pytest.raises(TwinInputError, match="concurrency levels must be >= 1"):
        run_levels(sc, [0])
