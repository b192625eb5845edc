"""The scheduler split along vLLM's lines: the async scheduler is a subclass picked from the config, and the
KV cache manager hides which block pool the engine has."""

import pytest

from twin.engine.async_scheduler import AsyncScheduler, make_scheduler
from twin.engine.block_pool import BlockPool
from twin.engine.fork import fork_scheduler
from twin.engine.kv_cache_manager import KVCacheManager, SegmentKVCacheManager
from twin.engine.records import RequestLog
from twin.engine.request import BlockKeys, Request
from twin.engine.scheduler import Scheduler, SchedulerConfig
from twin.engine.segment_pool import SegmentPool
from twin.lab.parity import _UnitSteps


@pytest.mark.parametrize("async_on", [False, True])
def test_the_config_picks_the_scheduler_class_and_a_fork_keeps_it(async_on):
    sched = make_scheduler(SchedulerConfig(async_scheduling=async_on), BlockPool(64, 16, True), _UnitSteps(),
                           RequestLog(2))
    assert type(sched) is (AsyncScheduler if async_on else Scheduler)
    assert sched.async_scheduling is async_on
    sched.add_request(Request(0, 0.0, 40, 5, []), 0.0)
    assert (len(sched.inbox), len(sched.waiting)) == ((1, 0) if async_on else (0, 1))  # async: seen at the next decision
    copy, _ = fork_scheduler(sched)
    assert type(copy) is type(sched)


def test_a_plain_scheduler_refuses_an_async_config():
    with pytest.raises(ValueError, match="make_scheduler"):
        Scheduler(SchedulerConfig(async_scheduling=True), BlockPool(64, 16, True), _UnitSteps(), RequestLog(1))


def test_each_pool_gets_its_kv_cache_manager():
    plain = make_scheduler(SchedulerConfig(), BlockPool(64, 16, True), _UnitSteps(), RequestLog(1))
    seg = make_scheduler(SchedulerConfig(), SegmentPool(64, 16, True), _UnitSteps(), RequestLog(1))
    assert type(plain.kv) is KVCacheManager and type(seg.kv) is SegmentKVCacheManager
    r = Request(0, 0.0, 64, 3, [7, 8, 9, 10])
    seg.add_request(r, 0.0)
    assert isinstance(r.block_keys, BlockKeys)  # the range pool reads keys as runs
    # the same request, the same schedule and the same cached prefix through either manager
    for s in (plain, seg):
        if s is plain:
            s.add_request(Request(0, 0.0, 64, 3, [7, 8, 9, 10]), 0.0)
        out = s.schedule(0.0)
        s.update_from_output(out, 1.0)
        assert s.kv.num_registrations == 1 and s.pool.num_cached_hits(s.running[0].block_keys, 4) == 4
