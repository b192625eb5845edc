"""The timeline's rows stay within memory on traces whose arrivals span months (a year's gap at 1 s ran out of it)."""

from __future__ import annotations

from conftest import make_scenario, stream_of
from twin.sim.cluster import Cluster
from twin.sim.timeline import MAX_ROWS, timeline_interval


def test_a_month_long_gap_coarsens_the_timeline_and_says_so():
    sc = make_scenario(**{"cluster.num_instances": 2})
    month = 30 * 86400.0
    stream = stream_of([0.0, month], [100, 100], [10, 10])
    res = Cluster(sc, stream).run()
    tl = res.timeline
    assert tl.interval_s > sc.sim.timeline_interval_s == 1.0
    assert len(tl.t) <= MAX_ROWS and len(tl.to_frame()) == len(tl.t)
    assert any(n.startswith(f"timeline every {tl.interval_s:g} s") for n in res.stream_stats["notes"])
    assert tl.note in res.stream_stats["notes"]
    assert (res.log.status == 4).all()  # both requests served


def test_a_short_run_keeps_its_interval():
    sc = make_scenario(**{"cluster.num_instances": 2})
    res = Cluster(sc, stream_of([0.0, 50.0], [100, 100], [10, 10])).run()
    assert res.timeline.interval_s == 1.0 and res.timeline.note is None
    assert not any(n.startswith("timeline every") for n in res.stream_stats["notes"])


def test_the_interval_is_the_first_round_one_within_the_budget():
    assert timeline_interval(1.0, 3600.0, 16) == (1.0, None)
    new, note = timeline_interval(1.0, 30 * 86400.0, 4)  # 10.4 M rows at 1 s, 2.1 M at 5 s
    assert new == 10.0 and 30 * 86400 / new * 4 <= MAX_ROWS and "sim.timeline_interval_s" in note
    assert timeline_interval(1.0, 1.7e9, 64)[0] >= 1.7e9 * 64 / MAX_ROWS  # an epoch-ms time in a relative trace
