"""The fast-forward (homogeneous decode runs advanced together) gives the reference step-by-step results."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.workload import build_stream

from conftest import kv_blocks, make_scenario, run_checked, stream_of

COLUMNS = ["scheduled_s", "first_token_s", "finish_s"]


def both_modes(sc, stream):
    fast = run_checked(sc.model_copy(update={"sim": sc.sim.model_copy(update={"mode": "fast"})}), stream)
    step = run_checked(sc.model_copy(update={"sim": sc.sim.model_copy(update={"mode": "step"})}), stream)
    return fast, step


def assert_same(fast, step):
    a, b = fast.log, step.log
    np.testing.assert_array_equal(a.status, b.status)
    np.testing.assert_array_equal(a.instance, b.instance)
    np.testing.assert_array_equal(a.preemptions, b.preemptions)
    np.testing.assert_array_equal(a.cached_tokens, b.cached_tokens)
    np.testing.assert_array_equal(a.output_tokens, b.output_tokens)
    for col in COLUMNS:
        np.testing.assert_allclose(getattr(a, col), getattr(b, col), rtol=1e-9, atol=1e-9, equal_nan=True)
    sa = [i.scheduler.stats for i in fast.instances]
    sb = [i.scheduler.stats for i in step.instances]
    assert [s.num_steps for s in sa] == [s.num_steps for s in sb]
    assert [s.generated_tokens for s in sa] == [s.generated_tokens for s in sb]
    for x, y in zip(sa, sb):
        assert x.kv_used_block_seconds == pytest.approx(y.kv_used_block_seconds, rel=1e-9)
    # every inter-token gap, token by token: a run's step gaps are its end times' differences, as a stepped engine's
    # (`t_end - group_last_out`), so they agree as the clock's times do
    for x, y in zip(sa, sb):
        np.testing.assert_allclose(itl_tokens(x), itl_tokens(y), rtol=1e-9, atol=1e-12)


def itl_tokens(stats) -> np.ndarray:
    """Every token's inter-token latency, sorted (the recorder's order and chunking aside)."""
    values, weights = stats.itl.arrays()
    return np.sort(np.repeat(values, weights))

SCENARIOS = {
    "plain": {},
    "many instances": {"cluster.num_instances": 3, "workload.num_requests": 300, "workload.arrival.rate": 60},
    "chunked prefill": {"cluster.engine.max_num_batched_tokens": 256, "workload.lengths.prompt_tokens": 700},
    "long prefill threshold": {"cluster.engine.long_prefill_token_threshold": 64,
                               "workload.num_requests": 60, "workload.arrival.rate": 100},
    "preemption": {**kv_blocks(60), "workload.num_requests": 60,
                   "workload.arrival.rate": 50},
    "sessions with prefix caching": {"workload.sessions": {"turns_mean": 4, "think_time_s": 0.5},
                                     "workload.num_requests": 120, "workload.arrival.rate": 20},
    "open-loop sessions": {"workload.sessions": {"turns_mean": 4, "think_time_s": 0.5, "closed_loop": False},
                           "workload.num_requests": 120, "workload.arrival.rate": 20},
    "sessions, preemption and no full-sequence gate": {
        "workload.sessions": {"turns_mean": 3, "think_time_s": 0.2}, "workload.num_requests": 120,
        "workload.arrival.rate": 40, **kv_blocks(120),
        "cluster.engine.scheduler_reserve_full_isl": False},
    "priority policy under preemption": {
        **kv_blocks(60), "workload.num_requests": 80, "workload.arrival.rate": 50,
        "cluster.engine.scheduling_policy": "priority",
        "workload.priorities": [{"priority": 0, "share": 1}, {"priority": 1, "share": 2}, {"priority": 5, "share": 1}]},
    "priority policy, sessions": {
        "workload.sessions": {"turns_mean": 3, "think_time_s": 0.2}, "workload.num_requests": 120,
        "workload.arrival.rate": 40, **kv_blocks(120), "cluster.engine.scheduling_policy": "priority",
        "workload.priorities": [{"priority": 0, "share": 1}, {"priority": 1, "share": 1}]},
    "max_num_active_seqs": {"cluster.engine.max_num_active_seqs": 5, "workload.num_requests": 120,
                            "workload.arrival.rate": 60, **kv_blocks(200)},
    "adaptive long prefill threshold": {"cluster.engine.long_prefill_token_threshold": 64,
                                        "cluster.engine.long_prefill_token_threshold_adaptive": True,
                                        "workload.num_requests": 60, "workload.arrival.rate": 100},
    "vLLM admission limits": {"cluster.engine.max_num_queued_reqs": 12, "cluster.engine.max_num_queued_tokens": 4000,
                              "workload.num_requests": 150, "workload.arrival.rate": 120},
    "trace lengths": {"workload.lengths": {"kind": "trace", "path": "traces/sharegpt_lengths.sample.csv",
                                           "max_total_tokens": 4096},
                      "cluster.num_instances": 2, "workload.num_requests": 150, "workload.arrival.rate": 8},
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fast_and_step_modes_agree(name):
    sc = make_scenario(**SCENARIOS[name])
    fast, step = both_modes(sc, build_stream(sc))
    assert_same(fast, step)
    if "preemption" in name:
        assert fast.log.preemptions.sum() > 0
    if "sessions" in name:
        assert fast.log.cached_tokens.sum() > 0


def test_fast_mode_takes_fewer_simpy_events():
    sc = make_scenario(**{"workload.num_requests": 20, "workload.arrival.rate": 0.5,
                          "workload.lengths.output_tokens": 500})
    fast, step = both_modes(sc, build_stream(sc))
    assert_same(fast, step)
    # the same engine steps either way; the fast mode covers most of them in a few decode runs
    assert fast.instances[0].scheduler.stats.num_steps == step.instances[0].scheduler.stats.num_steps
    assert fast.instances[0].num_wakeups * 20 < step.instances[0].num_wakeups


requests = st.lists(
    st.tuples(st.floats(0, 3, allow_nan=False), st.integers(1, 600), st.integers(1, 120),
              st.integers(0, 3)),
    min_size=1, max_size=25,
)


# LLMTWIN_HYPOTHESIS_EXAMPLES=1000 for a long stress run
@settings(max_examples=int(os.environ.get("LLMTWIN_HYPOTHESIS_EXAMPLES", 40)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, blocks=st.integers(45, 400), budget=st.sampled_from([64, 128, 2048]),
       seqs=st.integers(1, 16), thr=st.sampled_from([0, 0, 48]), instances=st.integers(1, 2),
       gate=st.booleans(), caching=st.booleans())
def test_random_workloads_are_accounted_for_and_modes_agree(reqs, blocks, budget, seqs, thr, instances, gate,
                                                             caching):
    """Any mix of arrivals, lengths, shared prefixes and pool sizes: every request finishes (or is
    rejected with a reason), no block leaks, timestamps are ordered, and both modes agree."""
    arrivals = sorted(r[0] for r in reqs)
    prompts = [r[1] for r in reqs]
    outputs = [r[2] for r in reqs]
    # requests in the same "family" share a prefix of 16-token blocks
    ids = [[f * 1000 + b for b in range(-(-p // 16))] for (_, p, _, f) in reqs]
    sc = make_scenario(**{"cluster.num_instances": instances,
                          **kv_blocks(blocks),
                          "cluster.engine.max_num_batched_tokens": max(budget, seqs),
                          "cluster.engine.max_num_seqs": seqs,
                          "cluster.engine.long_prefill_token_threshold": thr,
                          "cluster.engine.scheduler_reserve_full_isl": gate,
                          "cluster.engine.enable_prefix_caching": caching,
                          "router.name": "round_robin"})
    stream = stream_of(arrivals, prompts, outputs, ids, hash_block_size=16)
    fast, step = both_modes(sc, stream)
    assert_same(fast, step)
    log = fast.log
    for i in np.flatnonzero(log.status == 5):
        assert i in log.reject_reason


@pytest.mark.parametrize("async_on", [True, False])
def test_kv_gauges_while_a_cut_run_plays_out_equal_the_step_by_step_ones(async_on):
    """After an arrival cuts a decode run, its remaining steps still take their blocks: the timeline (and every
    gauge a router reads) shows the same KV use in fast and step mode (it showed 1-5 blocks too few)."""
    sc = make_scenario(**{"cluster.num_instances": 2, "sim.timeline_interval_s": 0.01,
                          "cluster.engine.async_scheduling": async_on})
    rng = np.random.default_rng(5)
    n = 80
    stream = stream_of(np.sort(rng.uniform(0, 2.0, n)), rng.integers(20, 600, n), rng.integers(30, 300, n))
    fast, step = both_modes(sc, stream)
    assert_same(fast, step)
    a, b = fast.timeline.to_frame(), step.timeline.to_frame()
    assert len(a) == len(b) > 100
    np.testing.assert_array_equal(a["kv_usage"].to_numpy(), b["kv_usage"].to_numpy())


@pytest.mark.parametrize("path", ["scenarios/quickstart.yaml", "scenarios/sharegpt-sessions.yaml"])
def test_modes_agree_to_the_last_bit_with_the_api_server_on(path):
    """The API server's output work reads the running step's token rate (`Instance.token_rate`); a decode
    run's step must last the same floats as the stepped clock's `t_end - t_start`, or finishes drift."""
    from twin.scenario import load_scenario
    sc = load_scenario(path, overrides=["workload.num_requests=1500"])
    assert sc.cluster.perf.api_queue == "ps" and sc.cluster.perf.api_output_token_s > 0
    fast, step = both_modes(sc, build_stream(sc))
    for col in COLUMNS:
        np.testing.assert_array_equal(getattr(fast.log, col), getattr(step.log, col))
