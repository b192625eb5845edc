"""The block pool's KV events let a precise prefix index know exactly what the pool caches."""

import pytest

from twin.lab.parity import WORKLOADS, run_twin
from twin.policy.prefix_index import PreciseIndex


def copies_in_pool(pool):
    out = {k: 1 for k in pool.cached_block_hash_to_ref}
    for k, c in pool.dups.items():
        out[k] = out.get(k, 0) + len(c)
    return out


@pytest.mark.parametrize("mode", ["step", "fast"])
@pytest.mark.parametrize("seed", range(12))
def test_a_precise_index_fed_with_no_delay_answers_what_the_pool_would_hit(seed, mode):
    wl = WORKLOADS["random"](seed)
    idx = PreciseIndex()
    checked = [0]

    def on_start(sched):
        sched.pool.event_sink = lambda e: idx.apply("i", e)

    def on_step(sched):
        pool = sched.pool
        bs = pool.block_size
        for r in sched.waiting:
            if r.num_computed_tokens:
                continue
            cap = (r.num_tokens - 1) // bs  # the scheduler's lookup cap: the last token is recomputed
            keys = r.block_keys[:cap]
            assert idx.match(keys, ["i"]).get("i", 0) == pool.num_cached_hits(keys, cap)
            checked[0] += 1
        held = {h: c.get("i", 0) for h, c in idx._holders.items()}
        assert held == copies_in_pool(pool)

    tr = run_twin(wl, mode, on_step=on_step, on_start=on_start)
    assert not tr.error and checked[0] > 0


def test_events_cover_duplicates_and_streaming_outputs():
    """Sessions under pressure: copies get stored and evicted, and the index follows every one."""
    idx = PreciseIndex()
    seen = {"stored": 0, "removed": 0, "dups": 0}

    def on_start(sched):
        def sink(e):
            seen["stored" if type(e).__name__ == "BlockStored" else "removed"] += 1
            idx.apply("i", e)
        sched.pool.event_sink = sink

    def on_step(sched):
        pool = sched.pool
        held = {h: c.get("i", 0) for h, c in idx._holders.items()}
        assert held == copies_in_pool(pool)
        seen["dups"] += len(pool.dups)

    wl = WORKLOADS["streaming-turns"](0)
    wl.num_gpu_blocks = 60
    run_twin(wl, "step", on_step=on_step, on_start=on_start)
    assert seen["stored"] > 0 and seen["removed"] > 0 and seen["dups"] > 0
