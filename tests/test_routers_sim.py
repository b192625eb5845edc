"""The prefix- and load-aware routers in the simulator: cache hits on shared prefixes, no herding on stale gauges."""

import numpy as np
import pytest

from twin.policy import make_router

from conftest import make_scenario, run_checked, stream_of

PREFIX_ROUTERS = {
    "lmetric": {},
    "weighted": {},
    "kv-cost": {},
    "cache-aware": {},
    "session-affinity": {"inner": {"name": "lmetric"}},
}


def shared_prefix_stream(n=240, docs=40, doc_blocks=64, gap_s=0.05, seed=0):
    """Requests over `docs` long shared documents (16-token ids), each with a short unique question."""
    rng = np.random.default_rng(seed)
    doc = rng.integers(0, docs, n)
    hash_ids = [[int(d) * 10_000 + j for j in range(doc_blocks)] + [10_000_000 + i * 10 + j for j in range(6)]
                for i, d in enumerate(doc)]
    prompts = [doc_blocks * 16 + 96] * n
    return stream_of(np.arange(n) * gap_s, prompts, [16] * n, hash_ids, hash_block_size=16, session_id=doc)


def hit_rate(res):
    log = res.log
    return log.cached_tokens.sum() / log.prompt_tokens.sum()


@pytest.mark.parametrize("name", sorted(PREFIX_ROUTERS))
def test_prefix_aware_routing_raises_the_hit_rate_over_round_robin(name):
    stream = shared_prefix_stream()
    base = {"cluster.num_instances": 4, "router.scrape_interval_s": 0.1}
    rr = hit_rate(run_checked(make_scenario(**base, **{"router.name": "round-robin"}), stream))
    sc = make_scenario(**base, **{"router.name": name, "router.params": PREFIX_ROUTERS[name]})
    res = run_checked(sc, stream)
    # each document's first request misses wherever it goes; round-robin misses it once per instance
    assert hit_rate(res) > rr + 0.15, (hit_rate(res), rr)
    assert len(set(res.log.instance.tolist())) == 4  # and the load still reaches every instance


@pytest.mark.parametrize("name", sorted(PREFIX_ROUTERS))
def test_prefix_aware_routers_run_on_the_precise_index_with_stale_gauges(name):
    stream = shared_prefix_stream(n=80)
    sc = make_scenario(**{"cluster.num_instances": 3, "router.name": name, "router.params": PREFIX_ROUTERS[name],
                          "router.prefix_index": "precise", "router.scrape_interval_s": 0.2,
                          "router.kv_event_delay_s": 0.01})
    res = run_checked(sc, stream)
    assert (res.log.status == 4).all()


def burst_stream(n_burst=40):
    """A first wave that leaves unequal load, then a burst inside one 100 ms scrape interval."""
    wave = 6
    arrivals = [0.0] * wave + [0.25 + 1e-5 * k for k in range(n_burst)]
    prompts = [200] * wave + [200] * n_burst
    outputs = [400] * wave + [50] * n_burst
    return stream_of(arrivals, prompts, outputs), wave


@pytest.mark.parametrize("name,params,herds", [
    ("least-outstanding", {"signal": "gauges"}, True),
    ("least-kv", {}, True),
    ("least-outstanding", {}, False),
    ("lmetric", {}, False),
    ("kv-cost", {}, False),
])
def test_gauge_only_routers_herd_in_a_burst_bookkeeping_scores_do_not(name, params, herds):
    stream, wave = burst_stream()
    sc = make_scenario(**{"cluster.num_instances": 4, "router.name": name, "router.params": params,
                          "router.scrape_interval_s": 0.1})
    res = run_checked(sc, stream)
    counts = np.bincount(res.log.instance[wave:], minlength=4)
    if herds:  # the last scrape's least-loaded instances take the whole burst, the others none of it
        assert counts.min() == 0 and counts.max() >= 0.45 * counts.sum(), counts
    else:  # fresh books: about a quarter each
        assert counts.min() >= 0.15 * counts.sum() and counts.max() <= 0.35 * counts.sum(), counts


def test_lmetric_hotspot_guard_in_the_simulator_spreads_one_hot_document():
    n = 200
    hash_ids = [[7_000 + j for j in range(128)] + [10_000_000 + i] for i in range(n)]
    stream = stream_of(np.arange(n) * 0.02, [128 * 16 + 16] * n, [8] * n, hash_ids, hash_block_size=16)
    sc = make_scenario(**{"cluster.num_instances": 4, "router.name": "lmetric"})
    plain = make_router("lmetric", hotspot=False)
    guarded = make_router("lmetric")
    a = run_checked(sc, stream, router=plain)
    b = run_checked(sc, stream, router=guarded)
    assert guarded.hotspot_spreads > 0 and plain.hotspot_spreads == 0
    assert len(set(b.log.instance.tolist())) > len(set(a.log.instance.tolist()))
