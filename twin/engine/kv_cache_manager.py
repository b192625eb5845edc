"""What the scheduler asks of the KV cache, for either block pool: vLLM's `KVCacheManager`
(`vllm/v1/core/kv_cache_manager.py`: `get_computed_blocks`, `cache_blocks`, `free`) over its `BlockPool`.

Two pools give the same schedules (tested): the per-block `BlockPool` (twin/engine/block_pool.py, the
reference, keys are per-block hashes) and the range pool `SegmentPool` (twin/engine/segment_pool.py, keys
are `BlockKeys` runs, for prefix-heavy traces). Each has its manager here, behind one interface, so the
scheduler never asks which pool it has. Allocation of anonymous blocks (`pool.allocate`) and the free-block
count are the pools' own and shared.
"""

from __future__ import annotations

from twin.engine.block_pool import BlockPool
from twin.engine.request import BlockKeys, Request
from twin.engine.segment_pool import SegmentPool
from twin.policy.kv_events import BlockStored


class KVCacheManager:
    """The per-block pool's manager: a request holds one entry per cached block (its key, or a copy)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_caching = pool.enable_caching
        self.num_registrations = 0  # cache_blocks calls that cached something: a refused head may hit more after one

    def prepare(self, r: Request) -> None:
        """The request's keys in the form this pool reads (the per-block pool reads any sequence)."""

    def lookup(self, r: Request) -> tuple[int, int, int]:
        """(hit keyed blocks, hit own-run blocks, free blocks among the hits) for a waiting request (vLLM's
        `get_computed_blocks`: the longest cached prefix, never the whole prompt: one token is recomputed)."""
        keys = r.block_keys
        run = r.own_run
        if not keys and run is None:  # content nobody shares and no blocks of its own left behind
            return 0, 0, 0
        max_blocks = (r.num_tokens - 1) // self.block_size
        hk = self.pool.num_cached_hits(keys, max_blocks)
        own = 0
        if run is not None and run.count > 0 and hk == len(keys) and hk < max_blocks:
            own = min(run.count, max_blocks - hk)
        if not hk:
            return hk, own, own
        return hk, own, own + self._num_free_hits(keys, hk)

    def _num_free_hits(self, keys, hk: int) -> int:
        return self.pool.num_free_among(keys[:hk])

    def touch_prefix(self, r: Request, hk: int) -> None:
        """An admitted request takes its first `hk` cached blocks (out of the free queue if they were there)."""
        r.keyed = self.pool.touch(r.block_keys[:hk])

    def cache_blocks(self, r: Request, computed: int) -> None:
        """Blocks full after computing `computed` tokens get their hash (vLLM `cache_blocks`).

        A hash already cached gets a second copy, as vLLM does not deduplicate (`cache_full_blocks`); one
        `BlockStored` event per call carries all the new hashes (`BlockPool.cache_full_blocks`)."""
        start = r.next_reg
        end = min(computed // self.block_size, len(r.block_keys))
        if end <= start:
            return
        if self.enable_caching:
            self._store(r, start, end)
            self.num_registrations += 1
        r.next_reg = end

    def _store(self, r: Request, start: int, end: int) -> None:
        """Blocks start..end-1 of `r` get their keys, held by `r`, with one `BlockStored` event."""
        pool = self.pool
        keys = r.block_keys
        m = pool.cached_block_hash_to_ref
        keyed = r.keyed
        if pool.dups:  # BlockPool.add_copy, inlined: this loop runs once per prompt block
            for j in range(start, end):
                keyed.append(pool.add_copy(keys[j]))
        else:
            for j in range(start, end):
                key = keys[j]
                if key in m:
                    keyed.append(pool.add_copy(key))
                else:
                    m[key] = 1
                    keyed.append(key)
        sink = pool.event_sink
        if sink is not None:
            sink(BlockStored(list(keys[start:end]), keys[start - 1] if start else None, None, self.block_size))

    def _num_held(self, r: Request) -> int:
        return len(r.keyed)

    def _release_held(self, r: Request) -> None:
        self.pool.release_keyed(r.keyed)

    def free(self, r: Request, preempted: bool, in_flight: int = 0) -> None:
        """Release all blocks in vLLM's order: tail first; hashed blocks to the LRU tail
        (`SingleTypeKVCacheManager.free`, `BlockPool.free_blocks`).

        `in_flight` computed tokens are not known yet (async: a preempted decode's last one), so the block
        they fill is freed uncached. A preempted request keeps a handle on its uncached full blocks
        (`own_run`): they stay hittable by it alone until evicted."""
        pool = self.pool
        computed = r.num_computed_tokens - in_flight
        if r.next_reg < len(r.block_keys):  # every full computed block is registered; no-op normally
            self.cache_blocks(r, computed)
        full = computed // self.block_size
        pool.release_anon(r.num_blocks - full)  # the partial block
        run = pool.release_run(full - self._num_held(r))  # full blocks past the keys: nobody else hits them
        if preempted:
            r.own_run = run
        self._release_held(r)
        r.keyed = []
        r.num_blocks = 0
        r.next_reg = 0


class SegmentKVCacheManager(KVCacheManager):
    """The range pool's manager: keys are `BlockKeys` runs, a request holds (chain, gen, j0, n) ranges."""

    def __init__(self, pool: SegmentPool) -> None:
        super().__init__(pool)
        self.seg = pool

    def prepare(self, r: Request) -> None:
        if r.block_keys and not isinstance(r.block_keys, BlockKeys):
            r.block_keys = BlockKeys.from_keys(r.block_keys)  # e.g. a forecaster's request from a view

    def _num_free_hits(self, keys, hk: int) -> int:
        return self.seg.num_free_hits(keys, hk)

    def touch_prefix(self, r: Request, hk: int) -> None:
        r.keyed = self.seg.touch_prefix(r.block_keys, hk)  # type: ignore[arg-type]

    def _store(self, r: Request, start: int, end: int) -> None:
        self.seg.register_blocks(r.block_keys, r.keyed, start, end)  # type: ignore[arg-type]

    def _num_held(self, r: Request) -> int:
        return self.seg.num_held(r.keyed)

    def _release_held(self, r: Request) -> None:
        self.seg.release_held(r.keyed)


def kv_cache_manager(pool: BlockPool) -> KVCacheManager:
    """The manager for this pool."""
    if isinstance(pool, SegmentPool):  # (a BlockPool subclass)
        return SegmentKVCacheManager(pool)
    return KVCacheManager(pool)
