"""Async scheduling (vLLM's AsyncScheduler with a batch queue, on by default on GPUs): the CPU part of a step
hides behind the previous step's GPU time, and outputs are processed one step later (finished requests hold
their blocks one more step, arrivals during a step are admitted a step later); fast and step modes and the
fork stay exact."""

import numpy as np
import pytest

import conftest
import test_fast_forward
import test_fork
from twin.sim.cluster import Cluster
from twin.engine.block_pool import BlockPool
from twin.engine.request import Request
from twin.engine.async_scheduler import make_scheduler
from twin.engine.scheduler import SchedulerConfig
from twin.perf.base import StepBatch
from twin.engine.records import RequestLog
from twin.scenario import parse_scenario
from twin.workload import build_stream

from conftest import make_scenario, run_checked, stream_of


def lone(async_on: bool, prompt=100, out=20):
    sc = make_scenario(**{"cluster.engine.async_scheduling": async_on})
    return run_checked(sc, stream_of([0.0], [prompt], [out]))


def test_async_is_vllms_gpu_default():
    raw = {k: v for k, v in conftest.BASE.items()}
    raw["cluster"] = dict(raw["cluster"], engine={})
    assert parse_scenario(raw, "t").cluster.engine.async_scheduling is True


def test_a_lone_requests_itl_excludes_the_overlapped_cpu_overhead():
    sync, asy = lone(False), lone(True)
    perf = sync.instances[0].perf
    itl_sync = np.unique(np.round(sync.instances[0].scheduler.stats.itl.arrays()[0], 12))
    itl_async = np.unique(np.round(asy.instances[0].scheduler.stats.itl.arrays()[0], 12))
    cpu = perf.host_time_s(1)
    assert cpu > 0
    # every decode step of one request: step time (GPU + CPU) synchronously, GPU only under async
    ctx = np.arange(101, 120)
    steps = np.array([perf.step_time(StepBatch(num_decode_tokens=1, decode_context_tokens=int(c))) for c in ctx])
    np.testing.assert_allclose(np.sort(itl_sync), np.unique(np.round(steps, 12)), rtol=1e-9)
    np.testing.assert_allclose(np.sort(itl_async), np.unique(np.round(steps - cpu, 12)), rtol=1e-9)
    # the first step of an idle engine has nothing to hide behind: TTFT is the same
    ttft = lambda r: r.log.first_token_s[0] - r.log.arrival_s[0]  # noqa: E731
    assert ttft(asy) == pytest.approx(ttft(sync), rel=1e-12)
    decode = asy.log.finish_s[0] - asy.log.first_token_s[0]
    assert decode == pytest.approx(sync.log.finish_s[0] - sync.log.first_token_s[0] - 19 * cpu, rel=1e-9)


def test_cpu_longer_than_the_gpu_shows_only_its_excess():
    sc = make_scenario(**{"cluster.engine.async_scheduling": True, "cluster.perf.step_overhead_s": 0.05})
    res = run_checked(sc, stream_of([0.0], [100], [5]))
    perf = res.instances[0].perf
    itl = res.instances[0].scheduler.stats.itl.arrays()[0]
    # each step waits for its own CPU work, which started as the previous step's GPU work did
    gpu = perf.step_time(StepBatch(num_decode_tokens=1, decode_context_tokens=101)) - perf.host_time_s(1)
    assert gpu < perf.host_time_s(1)
    assert itl.min() == pytest.approx(perf.host_time_s(1), rel=1e-3)


# -- outputs one step later, driven step by step --------------------------------------------------------

class UnitSteps:
    """Every step lasts 1 s, of which a tenth is CPU."""

    def step_time(self, b):
        return 1.0

    def host_time_s(self, n):
        return 0.1

    def decode_run_times(self, nd, ctx, k):
        return [1.0] * k


def drive(async_on: bool, reqs, arrivals, blocks=12, steps=40):
    """Run a scheduler by hand as the engine loop does; per step: (who got tokens, free blocks after it)."""
    log = RequestLog(len(reqs))
    pool = BlockPool(blocks + 1, 16, True)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, async_scheduling=async_on),
                      pool, UnitSteps(), log)
    trace = []
    t = 0.0
    for step in range(steps):
        for i in arrivals.get(step, []):
            sched.add_request(reqs[i], t)
        if async_on:
            if sched.is_idle():
                sched.wake(t)
            sched.admit_inbox()
        out = sched.schedule(t)
        if async_on:
            sched.release_finished()
        got = {r.idx for r, _, _ in out.prefills} | {r.idx for r in sched.running if r.in_decode} - {
            r.idx for r in out.skipped}
        if out.is_empty:
            got = set()
        t += 1.0
        sched.update_from_output(out, t)
        trace.append((got, pool.get_num_free_blocks()))
    return trace, log


def test_a_finished_request_frees_its_blocks_one_step_later_and_the_next_is_admitted_then():
    # A (5 blocks) finishes while C decodes; B (6 blocks) fits only once A's blocks are back
    def reqs():
        return [Request(0, 0.0, 64, 3), Request(1, 0.0, 90, 3), Request(2, 0.0, 60, 12)]
    sync, _ = drive(False, reqs(), {0: [0, 2], 1: [1]})
    asy, _ = drive(True, reqs(), {0: [0, 2], 1: [1]})
    first = lambda tr, i: next(s for s, (got, _) in enumerate(tr) if i in got)  # noqa: E731
    last = lambda tr, i: max(s for s, (got, _) in enumerate(tr) if i in got)  # noqa: E731
    assert last(sync, 0) == last(asy, 0)  # A's last token comes in the same step
    assert first(asy, 1) == first(sync, 1) + 1  # B waits one more step for A's blocks
    a_done = last(sync, 0)
    # synchronously A's blocks are free after its last step; under async only after the next one
    assert sync[a_done][1] > asy[a_done][1]
    # C decodes throughout in both
    assert all(2 in got for got, _ in asy[1:12])


def test_an_arrival_during_a_step_is_admitted_one_step_later():
    # C decodes; X arrives during step 3 (after that step's decision was made)
    def reqs():
        return [Request(0, 0.0, 40, 30), Request(1, 0.0, 40, 3)]
    log_first = {}
    for mode in (False, True):
        tr, log = drive(mode, reqs(), {0: [0], 3: [1]}, blocks=40)
        log_first[mode] = next(s for s, (got, _) in enumerate(tr) if 1 in got)
    assert log_first[True] == log_first[False] + 1


# -- exactness: fast vs step, fork vs original, under async --------------------------------------------

@pytest.fixture
def async_base(monkeypatch):
    monkeypatch.setitem(conftest.BASE["cluster"]["engine"], "async_scheduling", True)


@pytest.mark.parametrize("name", list(test_fast_forward.SCENARIOS))
def test_fast_and_step_modes_agree_under_async(name, async_base):
    sc = make_scenario(**test_fast_forward.SCENARIOS[name])
    assert sc.cluster.engine.async_scheduling
    fast, step = test_fast_forward.both_modes(sc, build_stream(sc))
    test_fast_forward.assert_same(fast, step)
    if "sessions" in name:
        assert fast.log.cached_tokens.sum() > 0


ASYNC_FORK_CASES = [(m, b, s) for m in ("fast", "step") for b in (60, 2000) for s in range(3)]


@pytest.mark.parametrize("mode,blocks,seed", ASYNC_FORK_CASES)
def test_the_fork_is_exact_under_async(mode, blocks, seed, async_base):
    test_fork.test_fork_advanced_alone_equals_the_original_with_no_more_arrivals(mode, blocks, seed)
    test_fork.test_a_request_added_to_a_fork_is_served_as_the_original_serves_an_arrival(mode, blocks, seed)


def test_async_changes_the_schedule_only_as_described(async_base):
    """Under load async is faster per token (CPU hidden) and everyone still finishes with no leaked blocks."""
    ov = {"workload.num_requests": 200, "workload.arrival.rate": 40}
    asy = run_checked(make_scenario(**ov), build_stream(make_scenario(**ov)))
    ov["cluster.engine.async_scheduling"] = False
    sync = run_checked(make_scenario(**ov), build_stream(make_scenario(**ov)))
    tpot = lambda r: np.median((r.log.finish_s - r.log.first_token_s) / (r.log.output_tokens - 1))  # noqa: E731
    assert tpot(asy) < tpot(sync)
    assert asy.instances[0].scheduler.stats.num_steps >= sync.instances[0].scheduler.stats.num_steps


def test_an_output_block_is_cached_one_step_later():
    """vLLM caches only known tokens, and under async the token sampled in step k is known after schedule(k+1)."""
    def when_cached(async_on: bool) -> int:
        log = RequestLog(1)
        pool = BlockPool(40, 16, True)
        sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                          async_scheduling=async_on), pool, UnitSteps(), log)
        keys = [11, 12, 13, 14]  # the prompt's 2 blocks and the first 2 output blocks
        sched.add_request(Request(0, 0.0, 32, 40, keys), 0.0)
        t = 0.0
        for step in range(30):
            if async_on:
                if sched.is_idle():
                    sched.wake(t)
                sched.admit_inbox()
            out = sched.schedule(t)
            if async_on:
                sched.release_finished()
            if 13 in pool.cached_block_hash_to_ref:
                return step
            t += 1.0
            sched.update_from_output(out, t)
        raise AssertionError("never cached")
    # block 2 holds tokens 32..47: full once 16 outputs are known (sampled in steps 0..15)
    assert when_cached(False) == 16
    assert when_cached(True) == 17


def test_a_decode_run_starts_after_a_finish_even_when_its_first_step_evicts_cached_blocks():
    """The step after a finish may start a decode run while the finisher still holds its blocks, also when the
    free blocks are all cached ones: the run's first step takes its blocks (evicting) and caches its output blocks
    before the finisher's blocks are freed, as `schedule` then `update_from_output` do, so the same blocks are
    evicted as step by step and the pool ends in the same state."""
    from twin.engine.core import EngineCore

    class Recorder(RequestLog):
        """Engine events in order; at a finish, whether the next step's new blocks exceed the uncached free ones."""

        wants_steps = True

        def __init__(self, n, sched_of):
            super().__init__(n)
            self.events = []
            self.sched_of = sched_of

        def request_finished(self, r, t):
            super().request_finished(r, t)
            s = self.sched_of()
            g = s.group
            need = g.phase_count[(-g.group_step) % s.block_size] if g.num_decode else 0
            self.events.append(("finish", t, need > s.pool.num_anon_free and not s.waiting))

        def step(self, out, t_end, used_blocks):
            self.events.append(("step", out.t_start))

        def decode_run(self, num_decode, decode_context, t0, ends, used_blocks):
            self.events.append(("run", t0))

    def run(fast: bool):
        # wave 1 leaves the free queue full of cached blocks; wave 2 decodes in lockstep, finishing one by one;
        # request 7 crosses into a new block in the step after request 6 finishes with a partial last block, which
        # freed first would be reused instead of evicting a cached block
        waves = [(0.0, 64, 3)] * 6 + [(20.0, 60, 22), (20.0, 59, 30), (20.0, 60, 37), (20.0, 60, 52)]
        reqs = [Request(i, t, p, o, [1000 * i + b for b in range((p + o) // 16)]) for i, (t, p, o) in enumerate(waves)]
        box = []
        log = Recorder(len(reqs), lambda: box[0])
        pool = BlockPool(31, 16, True)
        sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, async_scheduling=True),
                               pool, UnitSteps(), log)
        box.append(sched)
        core = EngineCore(sched, sched.perf, 0.0, fast_forward=fast)
        for r in reqs:
            core.arrive(r, r.arrival_time)
        core.advance()
        lru = [k if isinstance(k, int) else (type(k).__name__, k.count) for k in pool.free_lru]
        return log, (lru, dict(pool.cached_block_hash_to_ref), pool.num_anon_free, pool.num_evictions), core.steps

    step_log, step_pool, step_steps = run(False)
    fast_log, fast_pool, fast_steps = run(True)
    ev = fast_log.events
    # a finish whose next step needs more blocks than the uncached free ones, and the engine's next event is a run
    # that starts as the finish's step ends (not a single step)
    evicting = [k for k, e in enumerate(ev) if e[0] == "finish" and e[2]]
    assert evicting
    assert any(ev[k + 1][0] == "run" and ev[k + 1][1] == ev[k][1] for k in evicting if k + 1 < len(ev))
    assert fast_pool == step_pool and fast_pool[3] > 0 and not step_log.preemptions.any()
    assert fast_steps == step_steps
    for col in ("first_token_s", "finish_s", "output_tokens", "cached_tokens"):
        np.testing.assert_array_equal(getattr(fast_log, col), getattr(step_log, col))


def test_random_workloads_agree_in_both_modes_under_async(async_base):
    """The fast-forward's random-workload check (any mix of arrivals, lengths, shared prefixes, pool sizes and
    budgets) under async scheduling, vLLM's GPU default: every request accounted for and both modes equal."""
    test_fast_forward.test_random_workloads_are_accounted_for_and_modes_agree()
