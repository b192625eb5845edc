"""The simulator's speed shortcuts change no result: each run equals the same run without the shortcut."""

import numpy as np
import pytest

from twin.policy import make_router
from twin.policy.routers import LeastOutstanding
from twin.sim.cluster import Cluster

from conftest import make_scenario, run_checked, stream_of


def records(res):
    return res.log.to_frame().to_csv(index=False)


class GaugeKeeping(LeastOutstanding):
    """Least-outstanding by the books, but declaring that it reads gauges: the simulator keeps them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.reads_gauges = True


def poisson_stream(n=300, rate=40.0, seed=3):
    rng = np.random.default_rng(seed)
    return stream_of(np.cumsum(rng.exponential(1 / rate, n)), rng.integers(50, 900, n), rng.integers(5, 300, n))


@pytest.mark.parametrize("name,params,reads", [
    ("least-outstanding", {}, False),
    ("least-outstanding", {"signal": "gauges"}, True),
    ("round-robin", {}, False),
    ("random", {}, False),
    ("power-of-two", {}, False),
    ("least-kv", {}, True),
    ("lmetric", {}, True),
])
def test_routers_say_whether_they_read_gauges(name, params, reads):
    assert getattr(make_router(name, **params), "reads_gauges", True) is reads


def test_a_router_that_reads_no_gauges_gets_none_kept_and_the_same_run():
    sc = make_scenario(**{"cluster.num_instances": 3, "router.scrape_interval_s": 0.05})
    stream = poisson_stream()
    plain = Cluster(sc, stream, LeastOutstanding())
    assert all(inst.scrape_clock is None for inst in plain.instances)
    keeping = Cluster(sc, stream, GaugeKeeping())
    assert all(inst.scrape_clock is keeping.dispatcher.clock for inst in keeping.instances)
    a, b = plain.run(), keeping.run()
    assert records(a) == records(b)
    assert a.router_info["scrapes"] == b.router_info["scrapes"] > 0
    # the one that keeps gauges has them as of the last tick; the other's views were never brought up
    assert keeping.dispatcher._views_tick > 0 and plain.dispatcher._views_tick == 0


def test_a_scaled_fleet_without_gauge_readers_runs_as_with_them():
    """Instances added by the fleet get no scrape clock either; the scaler still scrapes for itself."""
    sc = make_scenario(**{"cluster.num_instances": 1, "cluster.min_instances": 1, "cluster.max_instances": 3,
                          "cluster.startup_delay_s": 0.5, "router.scrape_interval_s": 0.05,
                          "scaler.name": "queue", "scaler.interval_s": 1.0,
                          "scaler.params": {"target_waiting": 1.0}})
    stream = poisson_stream(n=400, rate=60.0)
    a = run_checked(sc, stream, LeastOutstanding())
    b = run_checked(sc, stream, GaugeKeeping())
    assert len(a.instances) > 1
    assert all(inst.scrape_clock is None for inst in a.instances)
    assert records(a) == records(b)


def count_runs_over_finishers(cluster):
    """Count the decode runs each async scheduler starts while the last step's finishers hold their blocks."""
    counts = []
    for inst in cluster.instances:
        sched = inst.scheduler
        n = [0]

        def plan(k, t0, _orig=sched.decode_run_plan, _s=sched, _n=n):
            _n[0] += bool(_s.finishing)
            return _orig(k, t0)

        try:
            sched.decode_run_plan = plan
        except AttributeError:  # the compiled build: native methods cannot be wrapped; records still compared
            return None
        counts.append(n)
    return counts


@pytest.mark.parametrize("caching", [True, False])
def test_a_decode_run_starts_over_pending_finishers_as_the_steps_would(caching):
    """Async: a decode run may start while the step before's finishers still hold their blocks (they are freed
    after its first decision): same records, steps, KV use and KV timeline as the step-by-step run."""
    from test_fast_forward import assert_same

    over = {"cluster.num_instances": 2, "sim.timeline_interval_s": 0.02, "cluster.engine.async_scheduling": True,
            "cluster.engine.enable_prefix_caching": caching}
    rng = np.random.default_rng(11)
    n = 120
    # sparse arrivals, spread-out lengths: finishers leave batches that go on decoding with nobody waiting
    stream = stream_of(np.sort(rng.uniform(0, 6.0, n)), rng.integers(20, 700, n), rng.integers(2, 400, n))
    results = {}
    for mode in ("fast", "step"):
        sc = make_scenario(**over, **{"sim.mode": mode})
        cl = Cluster(sc, stream)
        counts = count_runs_over_finishers(cl)
        results[mode] = cl.run()
        if mode == "fast" and counts is not None:
            assert sum(c[0] for c in counts) > 20
    fast, step = results["fast"], results["step"]
    assert_same(fast, step)
    np.testing.assert_array_equal(fast.timeline.to_frame()["kv_usage"].to_numpy(),
                                  step.timeline.to_frame()["kv_usage"].to_numpy())
    for inst in fast.instances:
        assert inst.pool.get_num_free_blocks() == inst.pool.num_usable_blocks


def test_a_process_waits_for_a_fresh_timer_instead_of_the_one_it_waited_on():
    from twin.sim.environment import Environment
    from twin.sim.events import Proc, Timer, run

    env = Environment()
    seen = []

    def loop():
        while True:
            v = yield Timer(env.clock, 10.0)
            seen.append((env.now, v))

    p = Proc(env, loop())
    Timer(env.clock, 1.0, callback=lambda _e: p.wait_instead(3.0))
    run(env, until=25.0)
    # resumed at 4 (not at 10, whose timer fired without it), then every 10 from there
    assert seen == [(4.0, None), (14.0, None), (24.0, None)]


def test_an_arrival_that_cuts_a_decode_run_resumes_the_loop_once_with_the_same_run(monkeypatch):
    """The loop waits out a cut run's last step without an interrupt first: same records and steps as when
    an interrupt resumed it at the arrival (the former path), and one wake-up fewer per cut."""
    import twin.sim.events
    from twin.sim.events import Proc

    if not twin.sim.events.__file__.endswith(".py"):
        pytest.skip("the compiled build: its native Proc cannot be patched back to the former path")
    sc = make_scenario(**{"cluster.num_instances": 2, "workload.num_requests": 200, "workload.arrival.rate": 30,
                          "workload.lengths.output_tokens": 200})
    from twin.workload import build_stream

    stream = build_stream(sc)
    new = run_checked(sc, stream)
    cuts = [0]

    def by_interrupt(self, delay):
        cuts[0] += 1
        self.interrupt()

    monkeypatch.setattr(Proc, "wait_instead", by_interrupt)
    old = run_checked(sc, stream)
    assert cuts[0] > 50
    assert records(new) == records(old)
    assert [i.core.steps for i in new.instances] == [i.core.steps for i in old.instances]
    assert sum(i.num_wakeups for i in old.instances) - sum(i.num_wakeups for i in new.instances) == cuts[0]


def test_run_index_is_bisect():
    """`run_index` (compiled: a typed search on a decode run's ends) equals `bisect_left` / `bisect_right`."""
    from bisect import bisect_left, bisect_right

    from twin.engine.core import run_index

    ends = [0.5, 1.0, 1.0, 1.0, 2.25, 3.0]
    for t in (0.0, 0.5, 0.75, 1.0, 1.5, 2.25, 3.0, 4.0):
        assert run_index(ends, t) == bisect_left(ends, t)
        assert run_index(ends, t, True) == bisect_right(ends, t)
    assert run_index([], 1.0) == 0 and run_index([], 1.0, True) == 0
