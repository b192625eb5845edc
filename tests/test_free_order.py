"""Requests that finish in the same step free their blocks in running order, as vLLM's scheduler does.

vLLM's `Scheduler.update_from_output` frees stopped requests as it walks the step's `num_scheduled_tokens`
(running order); each request's blocks go tail first to the free queue's tail. The twin's decode group pops
finishers from its finish heap in join order, which differs when a request admitted earlier samples its
first token later (a long-prefill threshold chunks it). tests_vllm/test_parity.py checks the same cases
against vLLM itself; these pin the order without it.
"""

from __future__ import annotations

import pytest

import twin.lab.parity as parity
from twin.engine.block_pool import BlockPool
from twin.engine.request import Request
from twin.engine.async_scheduler import make_scheduler
from twin.engine.scheduler import Scheduler, SchedulerConfig
from twin.engine.segment_pool import SegmentPool
from twin.engine.records import RequestLog
from twin.engine.sink import EngineSink, FanOut

BS = 16


def finish_order_case():
    """A (3 prompt blocks, 4 outputs) admitted before B (1 block, 6 outputs); both finish in step 5."""
    wl = parity.WORKLOADS["two-finishers"](0)
    a, b = wl.requests[0], wl.requests[1]
    return wl, parity.block_keys(a.prompt + a.output, BS), parity.block_keys(b.prompt + b.output, BS)


@pytest.mark.parametrize("mode", ["step", "fast"])
def test_same_step_finishers_reach_the_lru_tail_in_running_order(mode):
    wl, ka, kb = finish_order_case()
    assert len(ka) == 3 and len(kb) == 1
    lru_after: list = []

    def on_step(s: Scheduler) -> None:
        if not s.running and not lru_after:  # the step both finished in
            lru_after.extend(s.pool.free_lru)

    wl.requests = wl.requests[:2]
    tr = parity.run_twin(wl, mode, on_step=on_step)
    assert tr.first_token == {1: 0, 0: 2}  # B joined the decode group two steps before A
    assert tr.finish == {0: 5, 1: 5}
    # A first (tail block first), then B: the order vLLM frees them in
    assert lru_after == [ka[2], ka[1], ka[0], kb[0]]


@pytest.mark.parametrize("pool", ["per-block", "segment"])
@pytest.mark.parametrize("mode", ["step", "fast"])
@pytest.mark.parametrize("seed", range(4))
def test_a_later_admission_hits_what_vllm_order_left_cached(seed, mode, pool, monkeypatch):
    """C evicts two blocks from the LRU front: A's last two (vLLM's order), not B's and A's last (join order).

    D opens with B's block (even seeds) or A's first two (odd seeds); vLLM 0.32 gives 16 hit tokens for
    both (tests_vllm/test_parity.py::test_named_workload[two-finishers-*]); join order would give 0 and 32."""
    if pool == "segment":
        monkeypatch.setattr(parity, "BlockPool", SegmentPool)
    wl = parity.WORKLOADS["two-finishers"](seed)
    tr = parity.run_twin(wl, mode)
    assert not tr.error
    assert tr.finish[0] == tr.finish[1] == 5 and tr.first_token[1] < tr.first_token[0]
    assert tr.cached[3] == BS


def test_async_scheduling_frees_same_step_finishers_in_running_order():
    """Under async scheduling the finishers are freed after the next schedule, still A before B."""
    wl, ka, kb = finish_order_case()
    pool = BlockPool(8, BS, True)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=BS,
                          async_scheduling=True)
    sched = make_scheduler(cfg, pool, parity._UnitSteps(), RequestLog(2))
    for p in wl.requests[:2]:
        sched.add_request(parity.twin_request(wl, p), -1.0)
    finishing: list[int] = []
    lru: list = []
    for step in range(20):
        if not sched.has_unfinished_requests():
            break
        if sched.is_idle():
            sched.wake(float(step) - 1.0)
        sched.admit_inbox()
        out = sched.schedule(float(step))
        if sched.release_finished():
            lru = list(pool.free_lru)
        if out.is_empty:
            sched.next_decision_t = float(step) - 1.0
            continue
        sched.update_from_output(out, float(step + 1))
        if sched.finishing and not finishing:
            finishing = [r.idx for r in sched.finishing]
    assert finishing == [0, 1]
    assert lru == [ka[2], ka[1], ka[0], kb[0]]


def test_finishers_of_one_step_are_returned_in_running_order():
    """The list `update_from_output` returns (and the order a sink hears the finishes in) is the running order."""
    pool = BlockPool(64, BS, True)
    told: list[int] = []

    class Told(EngineSink):
        def request_finished(self, r, t):
            told.append(r.idx)

    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=BS),
                      pool, parity._UnitSteps(), FanOut([RequestLog(3), Told()]))
    # admitted 0, 1, 2; prompts 48, 32, 16 sample their first tokens at steps 2, 1, 0; all finish at step 6
    for idx, (prompt, outs) in enumerate([(48, 5), (32, 6), (16, 7)]):
        sched.add_request(Request(idx, 0.0, prompt, outs, []))
    finished: list[int] = []
    for step in range(10):
        out = sched.schedule(float(step))
        fin = sched.update_from_output(out, float(step + 1))
        if fin:
            finished = [r.idx for r in fin]
            assert step == 6
            break
    assert finished == [0, 1, 2] and told == [0, 1, 2]
