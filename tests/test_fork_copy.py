"""The fork's generated copiers: a fork shares no mutable object with its original, and an engine attribute the
fork has no copy rule for stops the fork with a clear error instead of being shared."""

import enum

import numpy as np
import pytest

from twin.engine.block_pool import Dup, Run
from twin.engine.fork import fork_instance, fork_scheduler, vars_of
from twin.engine.request import Request
from twin.sim.cluster import Cluster

from conftest import kv_blocks, make_scenario, stream_of


def busy(async_on: bool, blocks: int = 400, seed: int = 4):
    """One instance mid-run under a shared-prefix burst, small pool: decodes, a queue, cached and freed blocks."""
    rng = np.random.default_rng(seed)
    n = 60
    prompts = rng.integers(20, 600, n)
    hashes = [[int(rng.integers(0, 3)) * 1000 + j for j in range(int(p) // 16)] for p in prompts]
    sc = make_scenario(**{"cluster.engine.async_scheduling": async_on, **kv_blocks(blocks),
                          "cluster.engine.max_num_batched_tokens": 512, "cluster.engine.max_num_seqs": 16,
                          "sim.timeline_interval_s": 0})
    cl = Cluster(sc, stream_of(np.sort(rng.uniform(0, 1.0, n)), prompts, rng.integers(1, 200, n), hashes,
                               hash_block_size=16))
    cl.env.run(until=1.1)
    return cl


READ_ONLY = ("block_keys", "config", "perf")  # shared on purpose: never written after the request is made


def mutable_parts(obj, seen=None, depth=0):
    """Every list, dict, deque, set and engine object reachable from an engine object (by id), less READ_ONLY."""
    seen = {} if seen is None else seen
    if depth > 6 or id(obj) in seen or isinstance(obj, enum.Enum):
        return seen
    if isinstance(obj, (list, tuple, dict, set)) or type(obj).__name__ in ("deque", "OrderedDict"):
        if not isinstance(obj, tuple):
            seen[id(obj)] = obj
        items = list(obj.items()) if isinstance(obj, dict) else list(obj)
        for x in items:
            mutable_parts(x, seen, depth + 1)
    elif isinstance(obj, (Request, Run, Dup)) or type(obj).__module__.startswith("twin.engine"):
        seen[id(obj)] = obj
        for k, v in vars_of(obj).items():
            if k not in READ_ONLY and not callable(v):
                mutable_parts(v, seen, depth + 1)
    return seen


@pytest.mark.parametrize("async_on", [False, True])
def test_a_fork_shares_no_mutable_object_with_the_original(async_on):
    cl = busy(async_on)
    inst = cl.instances[0]
    s = inst.scheduler
    assert s.running and s.waiting and s.pool.free_lru  # the state the copy rules are for
    f = fork_instance(inst, cl.env.now)
    orig = mutable_parts(s)
    mine = mutable_parts(f.scheduler)
    shared = [type(v).__name__ for k, v in mine.items() if k in orig]
    assert shared == []
    # the same shape: as many requests, queue entries, free-queue entries
    assert [r.idx for r in f.scheduler.running] == [r.idx for r in s.running]
    assert [r.idx for r in f.scheduler.waiting] == [r.idx for r in s.waiting]
    assert len(f.scheduler.pool.free_lru) == len(s.pool.free_lru)
    assert f.scheduler.group.num_decode == s.group.num_decode


def test_a_request_copy_has_every_slot_of_the_original():
    cl = busy(False)
    s = cl.instances[0].scheduler
    copy, reqs = fork_scheduler(s)
    for r in [*s.running, *s.waiting]:
        c = reqs[id(r)]
        for name, v in vars_of(r).items():
            if name == "keyed":
                assert c.keyed is not v and len(c.keyed) == len(v)
            elif name != "own_run":
                assert getattr(c, name) == v, name


@pytest.mark.parametrize("where", ["scheduler", "group", "pool"])
def test_an_attribute_without_a_copy_rule_stops_the_fork(where):
    cl = busy(False)
    s = cl.instances[0].scheduler
    target = {"scheduler": s, "group": s.group, "pool": s.pool}[where]
    if not hasattr(target, "__dict__"):
        pytest.skip("a compiled class has a fixed attribute layout: nothing can be added to it")
    target.new_list_attribute = []
    with pytest.raises(TypeError, match="new_list_attribute .*needs an explicit copy rule"):
        fork_scheduler(s)
    del target.new_list_attribute
    fork_scheduler(s)  # the layout as before: copies again
