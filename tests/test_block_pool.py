"""The block pool conserves blocks and keeps vLLM's free-queue order, whatever happens to it."""

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from twin.engine.block_pool import BlockPool, Dup
from twin.policy.kv_events import BlockRemoved, BlockStored
from twin.policy.prefix_index import PreciseIndex


class Holder:
    def __init__(self):
        self.keyed = []
        self.anon = 0


class PoolMachine(RuleBasedStateMachine):
    """Requests allocate, hash, hit and free blocks at random; held + free always equals the pool."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(64, 16, True)
        self.holders: list[Holder] = []

    def held(self):
        """Physical blocks in use: a shared cached copy counts once, however many hold it."""
        shared = {k if isinstance(k, int) else id(k) for h in self.holders for k in h.keyed}
        return len(shared) + sum(h.anon for h in self.holders)

    @rule(n=st.integers(1, 10))
    def allocate(self, n):
        if n <= self.pool.get_num_free_blocks():
            self.pool.allocate(n)
            h = Holder()
            h.anon = n
            self.holders.append(h)

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100), key=st.integers(0, 30))
    def register(self, i, key):
        h = self.holders[i % len(self.holders)]
        if h.anon:  # a second copy when the hash is cached already, as vLLM keeps duplicates
            h.anon -= 1
            h.keyed.append(self.pool.register(key))

    @rule(keys=st.lists(st.integers(0, 30), max_size=5, unique=True))
    def hit(self, keys):
        n = self.pool.num_cached_hits(keys, len(keys))
        hits = keys[:n]
        if hits:
            h = Holder()
            h.keyed = self.pool.touch(hits)
            self.holders.append(h)

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100), partial=st.booleans())
    def free(self, i, partial):
        h = self.holders.pop(i % len(self.holders))
        p = 1 if (partial and h.anon) else 0
        self.pool.release_anon(p)
        self.pool.release_run(h.anon - p)
        self.pool.release_keyed(h.keyed)

    @invariant()
    def conserved(self):
        self.pool.check()
        assert self.held() + self.pool.get_num_free_blocks() == self.pool.num_usable_blocks

    @invariant()
    def ref_counts_match_holders(self):
        refs = {}
        for h in self.holders:
            for k in h.keyed:
                refs[k] = refs.get(k, 0) + 1
        for k, r in self.pool.cached_block_hash_to_ref.items():
            assert r == refs.get(k, 0)
        for copies in self.pool.dups.values():
            for d in copies:
                assert d.ref == sum(1 for h in self.holders for x in h.keyed if x is d)

    @invariant()
    def a_hash_is_hittable_while_any_copy_survives(self):
        held = {k if isinstance(k, int) else k.key for h in self.holders for k in h.keyed}
        for k in held:
            assert self.pool.num_cached_hits([k], 1) == 1


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=int(os.environ.get("LLMTWIN_HYPOTHESIS_EXAMPLES", 150)),
                             stateful_step_count=40, deadline=None)


def test_eviction_is_lru_by_release_time_and_unhashed_blocks_go_first():
    pool = BlockPool(11, 16, True)  # 10 usable
    pool.allocate(6)
    for k in (1, 2, 3):
        assert pool.register(k) == k
    # release request A: keyed 1,2,3 (tail first) and one partial block
    pool.release_anon(1)
    pool.release_keyed([1, 2, 3])
    pool.release_run(2)
    assert pool.get_num_free_blocks() == 10
    pool.allocate(5)  # 4 never-used + 1 partial: no eviction yet
    assert pool.num_evictions == 0 and pool.num_cached_hits([1, 2, 3], 3) == 3
    pool.allocate(2)  # LRU front: 3 (the deepest block of A) then 2
    assert pool.num_cached_hits([1], 1) == 1 and pool.num_cached_hits([1, 2], 2) == 1
    assert 3 not in pool.cached_block_hash_to_ref
    pool.check()


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(5, 16, True)
    pool.allocate(1)
    pool.register(9)
    pool.release_keyed([9])
    assert pool.get_num_free_blocks() == 4
    assert pool.num_free_among([9]) == 1
    pool.touch([9])
    assert pool.get_num_free_blocks() == 3 and pool.get_usage() == 0.25
    pool.check()


def test_a_second_copy_of_a_hash_is_kept_and_the_hash_outlives_the_first_copy():
    """vLLM's BlockHashToBlockMap: one hash, several copies; eviction drops one; lookups take the oldest."""
    pool = BlockPool(5, 16, True)  # 4 usable
    pool.allocate(2)
    first = pool.register(7)
    second = pool.register(7)  # another request computed the same block
    assert first == 7 and isinstance(second, Dup) and pool.get_num_free_blocks() == 2
    pool.release_keyed([first])  # the first copy is freed first: it is evicted first
    pool.release_keyed([second])
    assert pool.get_num_free_blocks() == 4
    pool.allocate(3)  # 2 never-used blocks, then the LRU front: the first copy
    assert pool.num_evictions == 1 and pool.num_cached_hits([7], 1) == 1  # the Dup still serves hits
    assert pool.num_free_among([7]) == 1
    held = pool.touch([7])
    assert held == [second] and second.ref == 1 and pool.get_num_free_blocks() == 0
    pool.release_keyed(held)
    pool.allocate(1)
    assert pool.num_cached_hits([7], 1) == 0 and not pool.dups
    pool.check()


def test_events_tell_a_precise_index_every_stored_and_evicted_copy():
    pool = BlockPool(4, 16, True)  # 3 usable
    events = []
    pool.event_sink = events.append
    pool.allocate(3)
    a, b = pool.register(1), pool.register(1, parent=None)
    c = pool.register(2, parent=1)
    assert events == [BlockStored([1], None, None, 16), BlockStored([1], None, None, 16),
                      BlockStored([2], 1, None, 16)]
    pool.release_keyed([a, b, c])
    events.clear()
    pool.allocate(2)  # the LRU front: 2, then the second copy of 1
    assert events == [BlockRemoved([2, 1])]
    idx = PreciseIndex()
    for e in [BlockStored([1], None), BlockStored([1], None), BlockStored([2], 1), BlockRemoved([2, 1])]:
        idx.apply("i", e)
    assert idx.match([1, 2], ["i"]) == {"i": 1}
    pool.check()


def _state(pool):
    return (dict(pool.cached_block_hash_to_ref), [k if isinstance(k, int) else (type(k).__name__, getattr(k, "key", 0))
                                                   for k in pool.free_lru],
            pool.num_anon_free, pool.num_lru_free, {k: [d.ref for d in v] for k, v in pool.dups.items()},
            pool.num_evictions)


def test_cache_free_leaves_the_pool_as_allocate_add_copy_and_release_did():
    """The live forecast's `warm` places a decoding request's prompt as cached free blocks in one pass: the same
    pool, LRU order and counts (evictions included) as the three calls it replaces; refused, with nothing changed,
    where a key is cached (a first copy or a second) or the pool has too few free blocks."""
    import random

    rng = random.Random(5)
    seen = set()
    for trial in range(60):
        pools = [BlockPool(40, 16, True) for _ in range(2)]
        script = []  # the same history on both: registered, duplicated, held and released blocks
        for _ in range(rng.randrange(0, 6)):
            n = rng.randrange(1, 6)
            keys = [rng.randrange(100) for _ in range(n)]
            script.append((n, keys, rng.random() < 0.6))
        for pool in pools:
            for n, keys, release in script:
                if n > pool.get_num_free_blocks():
                    continue
                pool.allocate(n)
                held = [pool.add_copy(k) for k in keys]
                if release:
                    pool.release_keyed(held)
        keys = list(range(1000 + trial, 1000 + trial + rng.randrange(1, 30)))
        if rng.random() < 0.3 and pools[0].cached_block_hash_to_ref:
            keys[rng.randrange(len(keys))] = next(iter(pools[0].cached_block_hash_to_ref))
        a, b = pools
        before = _state(a)
        fits = len(keys) <= b.get_num_free_blocks() and not any(b.is_cached(k) for k in keys)
        if fits:
            b.allocate(len(keys))
            b.release_keyed([b.add_copy(k) for k in keys])
        assert a.cache_free(keys) is fits
        seen.add((fits, bool(a.dups)))
        assert _state(a) == _state(b) and (fits or _state(a) == before)
        a.check()
    assert seen == {(True, True), (True, False), (False, True), (False, False)}  # each case was met
