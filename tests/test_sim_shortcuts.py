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
