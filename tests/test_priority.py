"""vLLM's priority scheduling policy (`--scheduling-policy priority`): the queue by (priority, arrival), victims by
the largest, and the workload's priority classes. The step-by-step match with vLLM's own scheduler is in
tests_vllm/test_parity.py (workloads `priority` and `random-priority`)."""

from __future__ import annotations

import numpy as np
import pytest

from twin.engine.block_pool import BlockPool
from twin.engine.async_scheduler import make_scheduler
from twin.engine.records import RequestLog
from twin.engine.request import Request
from twin.engine.scheduler import SchedulerConfig
from twin.errors import TwinInputError
from twin.lab.parity import WORKLOADS, run_twin
from twin.scenario import parse_scenario
from twin.sim.metrics import summarize
from twin.workload import build_stream

from conftest import BASE, kv_blocks, make_scenario, run_checked


class UnitSteps:
    def step_time(self, b):
        return 1.0

    def decode_run_times(self, nd, ctx, k):
        return [1.0] * k


def scheduler(blocks=100, policy="priority", budget=2048):
    pool = BlockPool(blocks, 16, True)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64, policy=policy)
    return make_scheduler(cfg, pool, UnitSteps(), RequestLog(32))


def test_the_queue_is_ordered_by_priority_then_arrival_then_id():
    s = scheduler()
    for idx, (t, prio) in enumerate([(0.0, 2), (1.0, 0), (2.0, 1), (3.0, 0), (3.0, 0)]):
        s.add_request(Request(idx, t, 10, 5, priority=prio), t)
    assert [r.idx for r in s.waiting] == [1, 3, 4, 2, 0]


def test_under_fcfs_the_queue_keeps_arrival_order_whatever_the_priority():
    s = scheduler(policy="fcfs")
    for idx, prio in enumerate([2, 0, 1]):
        s.add_request(Request(idx, float(idx), 10, 5, priority=prio), float(idx))
    assert [r.idx for r in s.waiting] == [0, 1, 2]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs and priority"):
        scheduler(policy="lifo")


def _decode_all(s, steps):
    t = 0.0
    for _ in range(steps):
        out = s.schedule(t)
        s.update_from_output(out, t + 1.0)
        t += 1.0
    return t


def _three(policy):
    """Request 0 (priority 1) alone, then 1 and 2 (priority 0) a step later: all three hold the 4 usable blocks."""
    s = scheduler(blocks=5, policy=policy)
    s.add_request(Request(0, 0.0, 16, 40, priority=1), 0.0)
    s.update_from_output(s.schedule(0.0), 1.0)
    for idx in (1, 2):
        s.add_request(Request(idx, 1.0, 16, 40, priority=0), 1.0)
    out = s.schedule(1.0)
    assert [r.idx for r, _n, _c in out.prefills] == [1, 2] and out.num_decode == 1
    s.update_from_output(out, 2.0)
    assert s.pool.get_num_free_blocks() == 0
    return s


def test_the_victim_is_the_lowest_priority_request_even_one_scheduled_earlier_in_the_step():
    """At their 17th token requests 1 and 2 need a second block. The walk gives request 0 its token first, then
    request 1 finds no block: vLLM preempts request 0, the largest (priority, arrival), though it stands first and
    was already scheduled in this step; its token goes back to the budget and its blocks to the pool."""
    s = _three("priority")
    out = s.schedule(2.0)
    assert [r.idx for r in out.preempted] == [0]
    assert s.waiting[0].idx == 0 and [r.idx for r in s.running] == [1, 2]
    assert out.num_decode == 2
    s.update_from_output(out, 3.0)
    s.pool.check()


def test_fcfs_takes_the_last_admitted_instead():
    s = _three("fcfs")
    out = s.schedule(2.0)
    assert [r.idx for r in out.preempted] == [2]


@pytest.mark.parametrize("seed", range(4))
def test_parity_workloads_run_the_same_in_step_and_fast_mode(seed):
    """The fast-forward asks the admission questions the priority queue changes; both modes agree."""
    for name in ("priority", "random-priority"):
        wl = WORKLOADS[name](seed)
        a, b = run_twin(wl, "step"), run_twin(wl, "fast")
        assert not a.error and a.steps == b.steps and a.finish == b.finish
        assert len(a.finish) == len(wl.requests)


PRIORITIES = [{"priority": 0, "share": 1}, {"priority": 1, "share": 4}]
LOADED = {"cluster.engine.max_num_seqs": 4, "workload.num_requests": 400, "workload.arrival.rate": 40,
          "workload.priorities": PRIORITIES}  # 4 seats serve about 28 of the 40 req/s: a queue builds


def test_the_priority_policy_serves_the_high_class_first_and_fcfs_does_not():
    runs = {}
    for policy in ("priority", "fcfs"):
        sc = make_scenario(**LOADED, **{"cluster.engine.scheduling_policy": policy})
        res = run_checked(sc, build_stream(sc))
        by = summarize(res)["by_priority"]
        runs[policy] = (by["0"]["ttft_s"]["p50"], by["1"]["ttft_s"]["p50"])
        assert by["0"]["requests"] + by["1"]["requests"] == 400
    hi, lo = runs["priority"]
    assert hi < lo / 5  # the queue is long: class 0 skips it
    hi_f, lo_f = runs["fcfs"]
    assert 0.5 < hi_f / lo_f < 2  # under fcfs the classes wait alike


def test_priorities_are_drawn_per_session_and_land_in_the_requests_table():
    sc = make_scenario(**{"workload.sessions": {"turns_mean": 4, "think_time_s": 1.0}, "workload.num_requests": 200,
                          "workload.priorities": PRIORITIES, "cluster.engine.scheduling_policy": "priority"})
    stream = build_stream(sc)
    for sid in np.unique(stream.session_id):
        assert len(set(stream.priority[stream.session_id == sid].tolist())) == 1
    share = float(np.mean(stream.priority == 0))
    assert 0.1 < share < 0.35  # 1 in 5 sessions, give or take
    res = run_checked(sc, stream)
    df = res.log.to_frame()
    assert set(df["priority"].unique()) == {0, 1}


def test_the_stream_without_priorities_is_unchanged_by_the_feature():
    base = build_stream(make_scenario())
    with_p = build_stream(make_scenario(**{"workload.priorities": PRIORITIES}))
    np.testing.assert_array_equal(base.arrival_s, with_p.arrival_s)
    np.testing.assert_array_equal(base.prompt_tokens, with_p.prompt_tokens)
    assert base.priority is None and with_p.priority is not None


def test_fcfs_with_priorities_says_vllm_ignores_them():
    sc = make_scenario(**{"workload.priorities": PRIORITIES})
    assert any("ignores request priorities" in n for n in build_stream(sc).stats.notes)


def _raw(**engine):
    import copy
    raw = copy.deepcopy(BASE)
    raw["cluster"].setdefault("engine", {}).update(engine)
    return raw


def test_priority_before_vllm_0_10_is_refused_in_one_line():
    with pytest.raises(TwinInputError, match="scheduling_policy: priority is modelled as vLLM V1"):
        parse_scenario(_raw(scheduling_policy="priority", vllm_version="0.9"), "test")
    parse_scenario(_raw(scheduling_policy="priority", vllm_version="0.10"), "test")


def test_a_priority_given_twice_is_refused():
    import copy
    raw = copy.deepcopy(BASE)
    raw["workload"]["priorities"] = [{"priority": 1, "share": 1}, {"priority": 1, "share": 2}]
    with pytest.raises(TwinInputError, match="each priority once"):
        parse_scenario(raw, "test")


def test_semantic_batching_and_the_priority_policy_are_refused_together():
    import copy
    raw = copy.deepcopy(BASE)
    raw["cluster"]["engine"]["scheduling_policy"] = "priority"
    raw["whatif"] = {"semantic_batching": {"enabled": True}}
    with pytest.raises(TwinInputError, match="use one of the two"):
        parse_scenario(raw, "test")


def test_a_sweep_row_has_each_priority_classes_latency():
    from twin.analysis.sweep import flatten

    sc = make_scenario(**LOADED, **{"cluster.engine.scheduling_policy": "priority"})
    row = flatten(summarize(run_checked(sc, build_stream(sc))), sc)
    assert row["priority_0_ttft_p99_s"] < row["priority_1_ttft_p99_s"]
    assert {"priority_0_e2e_p50_s", "priority_1_goodput_req_s"} <= set(row)
