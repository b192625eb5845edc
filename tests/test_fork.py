"""An engine fork advanced alone gives exactly what the original gives with no further arrivals; forking
never touches the original; an arrival added to a fork is handled as the original handles one."""

import numpy as np
import pytest

from twin.sim.cluster import Cluster
from twin.engine.fork import _fork_request, fork_instance
from twin.engine.request import Request

from conftest import kv_blocks, make_scenario, stream_of


def workload(n, seed, until, shared=True):
    rng = np.random.default_rng(seed)
    arr = np.sort(rng.uniform(0, until, n))
    prompts = rng.integers(20, 700, n)
    outs = rng.integers(1, 120, n)
    hashes = [[int(rng.integers(0, 3)) * 1000 + j for j in range(int(p) // 16)] if shared else None
              for p in prompts]
    return stream_of(arr, prompts, outs, hashes if shared else None, hash_block_size=16)


def scenario(mode, blocks, instances=1, budget=512, seqs=16):
    return make_scenario(**{"cluster.num_instances": instances, "sim.mode": mode,
                            **kv_blocks(blocks),
                            "cluster.engine.max_num_batched_tokens": budget, "cluster.engine.max_num_seqs": seqs,
                            "sim.timeline_interval_s": 0, "router.scrape_interval_s": 0})


def finish_times(log, idxs):
    return {i: (log.first_token_s[i], log.finish_s[i], log.output_tokens[i]) for i in idxs}


CASES = [(mode, blocks, seed) for mode in ("fast", "step") for blocks in (60, 2000) for seed in range(6)]


@pytest.mark.parametrize("mode,blocks,seed", CASES)
def test_fork_advanced_alone_equals_the_original_with_no_more_arrivals(mode, blocks, seed):
    stream = workload(40, seed, until=1.0)
    sc = scenario(mode, blocks, instances=2)
    cl = Cluster(sc, stream)
    t_fork = 1.0 + 0.37 * (seed + 1) / 7  # after the last arrival, while the engines are busy
    cl.env.run(until=t_fork)
    forks = [fork_instance(inst, cl.env.now) for inst in cl.instances]
    live = [{r.idx for r in list(inst.scheduler.running) + list(inst.scheduler.waiting)} for inst in cl.instances]
    assert any(live)
    for f in forks:
        f.advance()
    res = cl.run()
    # the original is untouched: the same run without forking gives the same records
    ref = Cluster(sc, stream).run()
    for col in ("first_token_s", "finish_s", "output_tokens", "preemptions", "cached_tokens"):
        np.testing.assert_array_equal(getattr(res.log, col), getattr(ref.log, col))
    shift = cl.api_token_s()  # the fork logs engine times; the run's log has the client's
    for f, idxs in zip(forks, live):
        for i in idxs:
            assert f.sink.finish_s[i] + shift == res.log.finish_s[i], i
            assert f.sink.output_tokens[i] == res.log.output_tokens[i]
            if i in f.sink.first_token_s:
                assert f.sink.first_token_s[i] + shift == res.log.first_token_s[i]
        assert not f.scheduler.has_unfinished_requests()
        f.scheduler.pool.check()
        assert f.scheduler.pool.get_num_free_blocks() == f.scheduler.pool.num_usable_blocks


@pytest.mark.parametrize("mode,blocks,seed", CASES)
def test_a_request_added_to_a_fork_is_served_as_the_original_serves_an_arrival(mode, blocks, seed):
    base = workload(30, seed, until=1.0)
    rng = np.random.default_rng(100 + seed)
    t_x = float(rng.uniform(0.3, 0.9))
    px, ox = int(rng.integers(50, 600)), int(rng.integers(2, 80))
    keys = [int(rng.integers(0, 3)) * 1000 + j for j in range(px // 16)]
    later = base.arrival_s > t_x
    # run A: the base requests up to t_x, then X at t_x, nothing after
    keep = ~later
    a_arr = np.append(base.arrival_s[keep], t_x)
    a = stream_of(a_arr, np.append(base.prompt_tokens[keep], px), np.append(base.output_tokens[keep], ox),
                  [h for h, k in zip(base.hash_ids, keep) if k] + [keys], hash_block_size=16)
    sc = scenario(mode, blocks)
    res_a = Cluster(sc, a).run()
    x = len(a_arr) - 1
    # run B: the same requests before t_x; fork at t_x and add X to the fork
    b = stream_of(base.arrival_s[keep], base.prompt_tokens[keep], base.output_tokens[keep],
                  [h for h, k in zip(base.hash_ids, keep) if k], hash_block_size=16)
    cl = Cluster(sc, b)
    t = float(a.arrival_s[x])
    cl.env.run(until=t)
    f = fork_instance(cl.instances[0], cl.env.now)
    for r, t_in in sorted(cl.in_transit.get("instance-0", {}).values(), key=lambda v: v[1]):
        f.arrive(_fork_request(r, {}), t_in)  # routed before t, still in the API server
    f.arrive(Request(x, t, px, ox, keys_engine(cl, keys, px), -1), t + cl._api_request_s(px))
    f.advance()
    shift = cl.api_token_s()
    assert f.sink.finish_s[x] + shift == res_a.log.finish_s[x]
    assert f.sink.first_token_s[x] + shift == res_a.log.first_token_s[x]
    for i in f.sink.finish_s:
        assert f.sink.finish_s[i] + shift == res_a.log.finish_s[i], i


def keys_engine(cl, hash_ids, prompt):
    from twin.engine.request import engine_block_keys

    return engine_block_keys(hash_ids, 16, cl.engine_config.block_size, prompt)


def test_advance_until_stops_at_the_horizon_and_resumes_exactly():
    stream = workload(40, 3, until=1.0)
    sc = scenario("fast", 2000)
    cl = Cluster(sc, stream)
    cl.env.run(until=1.2)
    whole = fork_instance(cl.instances[0], cl.env.now)
    parts = fork_instance(cl.instances[0], cl.env.now)
    whole.advance()
    t = parts.advance(until=1.5)
    assert t <= 1.5
    parts.advance()
    assert parts.sink.finish_s == whole.sink.finish_s
