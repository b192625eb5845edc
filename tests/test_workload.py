"""Synthetic workloads have the statistics they claim; sessions share their history as a prefix."""

import numpy as np
import pytest

from twin.sim.cluster import Cluster
from twin.engine.request import engine_block_keys
from twin.workload import build_stream
from twin.workload.synthetic import gamma_arrivals, poisson_arrivals

from conftest import make_scenario, run_checked


def test_poisson_and_gamma_have_the_requested_rate_and_burstiness():
    rng = np.random.default_rng(0)
    gaps = np.diff(poisson_arrivals(200_000, 20.0, rng))
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.02)
    gaps = np.diff(gamma_arrivals(200_000, 20.0, 3.0, rng))
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.05)


def test_length_trace_sampling_respects_the_cap():
    sc = make_scenario(**{"workload.num_requests": 2000,
                          "workload.lengths": {"kind": "trace", "path": "traces/sharegpt_lengths.sample.csv",
                                               "max_total_tokens": 2048}})
    s = build_stream(sc)
    assert (s.prompt_tokens + s.output_tokens <= 2048).all()
    assert s.stats.rows_filtered > 0 and s.stats.rows_read == 10000
    assert len(np.unique(s.prompt_tokens)) > 100


def test_sessions_carry_earlier_turns_as_a_prefix_and_hit_the_cache():
    sc = make_scenario(**{"workload.num_requests": 60, "workload.arrival.rate": 2,
                          "workload.sessions": {"turns_mean": 4, "think_time_s": 30}})
    s = build_stream(sc)
    assert len(np.unique(s.session_id)) < 60
    # turn k+1's prompt = turn k's prompt + answer + a new message
    for sid in np.unique(s.session_id):
        idx = np.flatnonzero(s.session_id == sid)
        for a, b in zip(idx, idx[1:]):
            assert s.prompt_tokens[b] > s.prompt_tokens[a] + s.output_tokens[a]
            keys_a = engine_block_keys(s.hash_ids[a], 16, 16, int(s.prompt_tokens[a] + s.output_tokens[a]))
            keys_b = engine_block_keys(s.hash_ids[b], 16, 16, int(s.prompt_tokens[b]))
            assert keys_b[:len(keys_a)] == keys_a
    res = run_checked(sc, s)
    later = np.flatnonzero(np.r_[False, s.session_id[1:] == s.session_id[:-1]])
    assert (res.log.cached_tokens[later] > 0).mean() > 0.9


def test_kv_capacity_follows_memory_minus_weights():
    sc = make_scenario()
    cl = Cluster(sc, build_stream(sc))
    tokens = cl.num_blocks * 16
    # Llama-3-8B on an H100: (79.22 GiB x 0.92 - 14.96 GiB weights - activations) / 128 KiB = ~450k tokens
    assert 430_000 < tokens < 470_000
    sc70 = make_scenario(**{"cluster.model": "Llama-3-70B", "cluster.tensor_parallel": 4})
    cl70 = Cluster(sc70, build_stream(sc70))
    assert cl70.num_blocks > 0
    with pytest.raises(Exception, match="no room for a KV cache"):
        sc_bad = make_scenario(**{"cluster.model": "Llama-3-70B"})
        Cluster(sc_bad, build_stream(sc_bad))


def test_tensor_parallel_instance_serves_faster():
    base = {"cluster.model": "Llama-3-70B", "cluster.hardware": "H200", "workload.num_requests": 20}
    tp2 = run_checked(make_scenario(**base, **{"cluster.tensor_parallel": 2}), build_stream(make_scenario(**base)))
    tp4 = run_checked(make_scenario(**base, **{"cluster.tensor_parallel": 4}), build_stream(make_scenario(**base)))
    e2e = lambda r: np.nanmean(r.log.finish_s - r.log.arrival_s)  # noqa: E731
    assert e2e(tp4) < e2e(tp2)


def test_truncated_requests_lose_their_prefix_identity():
    from twin.workload import apply_context_limit

    from conftest import stream_of
    s = stream_of([0.0, 1.0], [9000, 100], [10, 10], [[1, 2, 3], [1, 2]], hash_block_size=512)
    s = apply_context_limit(s, 8192, "truncate", "test")
    assert s.prompt_tokens[0] == 8182 and s.hash_ids[0] is None and s.hash_ids[1] == [1, 2]


def test_closed_loop_turns_are_sent_a_think_time_after_the_previous_answer():
    sc = make_scenario(**{"workload.num_requests": 80, "workload.arrival.rate": 4,
                          "workload.sessions": {"turns_mean": 4, "think_time_s": 3}})
    s = build_stream(sc)
    assert s.after is not None and (s.after >= 0).sum() > 20
    log = run_checked(sc, s).log
    later = np.flatnonzero(s.after >= 0)
    prev = s.after[later]
    np.testing.assert_allclose(log.arrival_s[later], log.finish_s[prev] + s.think_s[later], rtol=1e-12)
    # one instance: the previous turn's full blocks are cached, its answer included (the last sampled
    # token never had its KV computed)
    np.testing.assert_array_equal(log.cached_tokens[later],
                                  (s.prompt_tokens[prev] + s.output_tokens[prev] - 1) // 16 * 16)


def test_open_loop_turns_keep_their_precomputed_times():
    sc = make_scenario(**{"workload.num_requests": 40, "workload.arrival.rate": 4,
                          "workload.sessions": {"turns_mean": 4, "think_time_s": 3, "closed_loop": False}})
    s = build_stream(sc)
    assert s.after is None
    log = run_checked(sc, s).log
    np.testing.assert_allclose(log.arrival_s, s.arrival_s, rtol=1e-12)


def test_a_rejected_turn_still_releases_the_next_and_a_time_limit_leaves_later_turns_pending():
    sc = make_scenario(**{"workload.num_requests": 60, "workload.arrival.rate": 2, "workload.on_too_long": "reject",
                          "workload.lengths.prompt_tokens": 3000, "workload.lengths.output_tokens": 500,
                          "workload.sessions": {"turns_mean": 5, "think_time_s": 1}})
    s = build_stream(sc)
    log = run_checked(sc, s).log
    assert (log.status == 5).sum() > 0  # later turns outgrow the 8k context and are rejected
    assert (log.status == 4).sum() + (log.status == 5).sum() == len(s)
    sc2 = make_scenario(**{"workload.num_requests": 60, "workload.arrival.rate": 2,
                           "workload.sessions": {"turns_mean": 5, "think_time_s": 5}, "sim.max_sim_time_s": 8.0})
    log2 = run_checked(sc2, build_stream(sc2)).log
    assert (log2.status == 0).sum() > 0
