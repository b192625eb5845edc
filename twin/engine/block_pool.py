"""The KV block pool with prefix caching, modelled on vLLM V1's `BlockPool` (`vllm/v1/core/block_pool.py`).

Per block: the reference pool, and the one used where each trace id names one engine block. Prefix-heavy
traces (ids naming many blocks each) use `SegmentPool` (twin/engine/segment_pool.py), the same behaviour in
ranges; tests/test_segment_pool.py checks the two give the same schedules.

vLLM's free queue always holds every *unhashed* free block ahead of every *hashed* one: unhashed blocks
are prepended when freed, hashed blocks appended, and allocation pops from the front. So the queue is
exactly (a count of anonymous free blocks) + (an LRU of cached free blocks), and this pool stores it that
way. Blocks are counted, not named: a request holds a list of hashed ("keyed") blocks plus a count of
anonymous ones. The full blocks of content that nobody can share (a prompt with no prefix identity) are
kept in the LRU as one *run* entry per release, so freeing or evicting them costs O(1), not O(blocks),
while eviction order stays vLLM's. The preempted request keeps a handle on the run its blocks went
to, so when resumed it can hit its own surviving blocks as it does in vLLM.

Duplicates as vLLM keeps them (`BlockHashToBlockMap` in `vllm/v1/core/block_pool.py`): when a request
computes a block whose hash is already cached, both copies are cached under the one hash; a lookup takes
the oldest surviving copy (`get_one_block`), eviction drops one copy, and the hash stays hittable while any
copy survives. The first copy of a hash is its int key (the common, fast case); later copies are `Dup`
objects, so a held or free block is named by an int (first copy) or a `Dup`. A copy is added only while
the hash has copies, so an int copy, when alive, is always the oldest.

KV events (`vllm/distributed/kv_events.py`) go to `event_sink` when one is set: `BlockStored` for every
registration call with all its new hashes, duplicate copies included (`cache_full_blocks`), and
`BlockRemoved` for each evicted cached copy (`_maybe_evict_cached_block`), batched per allocation. Runs
(content nobody can share) emit nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Sequence, Union, cast

from twin.policy.kv_events import BlockRemoved, BlockStored, KVEvent


class Run:
    """`count` hashed-but-unshareable full blocks released together."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count


class Dup:
    """A second (third...) cached copy of hash `key`, with its own reference count."""

    __slots__ = ("key", "ref")

    def __init__(self, key: int, ref: int) -> None:
        self.key = key
        self.ref = ref


Handle = Union[int, Dup]  # a cached block a request holds: the first copy of a hash (its key) or a Dup


class BlockPool:
    """Counts of free and cached KV blocks, the hash -> ref-count map, and the LRU eviction queue."""

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("the pool needs at least 2 blocks (block 0 is vLLM's null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # block 0 is the permanent null block, as in vLLM: usable blocks = num_gpu_blocks - 1
        self.num_usable_blocks = num_gpu_blocks - 1
        self.num_anon_free = self.num_usable_blocks  # front of vLLM's free queue
        # cached free blocks in LRU order (front = evicted first): a first copy's key, a Dup, or a Run
        self.free_lru: OrderedDict[int | Run | Dup, None] = OrderedDict()
        self.num_lru_free = 0
        # the first copy of every hash whose first copy is alive: hash -> ref_cnt (0 means it is in free_lru)
        self.cached_block_hash_to_ref: dict[int, int] = {}
        # later copies, oldest first: hash -> [Dup]; a hash is cached iff it is in either map
        self.dups: dict[int, list[Dup]] = {}
        self.num_evictions = 0
        self.event_sink: Callable[[KVEvent], None] | None = None

    # -- queries -------------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.num_anon_free + self.num_lru_free

    def get_usage(self) -> float:
        """Fraction of usable blocks referenced by some request (vLLM's `kv_cache_usage_perc`)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def is_cached(self, key: int) -> bool:
        return key in self.cached_block_hash_to_ref or key in self.dups

    def num_cached_hits(self, keys: Iterable[int], max_blocks: int) -> int:
        """Length of the longest run of leading `keys` (at most `max_blocks`) that are cached."""
        if not self.enable_caching:
            return 0
        m = self.cached_block_hash_to_ref
        d = self.dups
        n = 0
        for key in keys:
            if n >= max_blocks or (key not in m and key not in d):
                break
            n += 1
        return n

    def num_free_among(self, keys: Iterable[int]) -> int:
        """How many of these cached `keys` sit in the free queue (touching them costs free capacity)."""
        m = self.cached_block_hash_to_ref
        if not self.dups:
            return sum(1 for k in keys if m[k] == 0)
        n = 0
        for k in keys:  # the copy a lookup takes: the first if alive, else the oldest Dup
            if k in m:
                n += m[k] == 0
            else:
                n += self.dups[k][0].ref == 0
        return n

    # -- mutations -----------------------------------------------------------------------------------
    def touch(self, keys: Sequence[int]) -> list[Handle]:
        """A request hit these cached blocks: take them out of the free queue and add a reference.

        Returns the copies it now holds (vLLM `BlockPool.touch` on `get_cached_block`'s first copy).
        """
        m = self.cached_block_hash_to_ref
        lru = self.free_lru
        if not self.dups:
            for key in keys:
                ref = m[key]
                if ref == 0:
                    del lru[key]
                    self.num_lru_free -= 1
                m[key] = ref + 1
            return list(keys)
        held: list[Handle] = []
        for key in keys:
            if key in m:
                ref = m[key]
                if ref == 0:
                    del lru[key]
                    self.num_lru_free -= 1
                m[key] = ref + 1
                held.append(key)
            else:
                d = self.dups[key][0]
                if d.ref == 0:
                    del lru[d]
                    self.num_lru_free -= 1
                d.ref += 1
                held.append(d)
        return held

    def touch_run(self, run: Run, n: int) -> None:
        """A resumed request takes back the first `n` blocks of its own run; the rest become anonymous."""
        del self.free_lru[run]
        self.num_lru_free -= run.count
        # blocks of the run past the hit are still free but no longer reachable: plain free blocks
        self.num_anon_free += run.count - n
        run.count = 0

    def allocate(self, n: int) -> None:
        """Take `n` free blocks from the front of the queue, evicting cached ones when needed."""
        if n <= 0:
            return
        if n > self.num_anon_free + self.num_lru_free:
            raise RuntimeError(f"allocate({n}) with only {self.get_num_free_blocks()} free blocks")
        free = self.num_anon_free
        take = free if free < n else n  # min(n, free): a conditional, not a builtin call (pure Python)
        self.num_anon_free -= take
        n -= take
        if n == 0:
            return
        lru = self.free_lru
        m = self.cached_block_hash_to_ref
        removed: list[int] | None = [] if self.event_sink is not None else None
        if not self.dups and removed is None:  # the common case: first copies and runs only
            while n > 0:
                for entry in lru:  # the front, left in place: a run partly used stays there (a loop: compiled,
                    break  # `next(iter(...))` looks `next` up in builtins and calls it generically)
                else:
                    raise RuntimeError(f"allocate: the free queue is empty with {n} blocks still to take")
                if isinstance(entry, Run):
                    k = entry.count
                    if k > n:
                        k = n
                    else:
                        del lru[entry]
                    entry.count -= k
                    n -= k
                    self.num_lru_free -= k
                    self.num_evictions += k
                else:  # without Dups alive, every other entry is a first copy's key
                    del lru[entry]
                    del m[cast(int, entry)]
                    n -= 1
                    self.num_lru_free -= 1
                    self.num_evictions += 1
            return
        while n > 0:
            for entry in lru:  # the front, left in place: a run partly used stays there
                break
            else:
                raise RuntimeError(f"allocate: the free queue is empty with {n} blocks still to take")
            if isinstance(entry, Run):
                k = entry.count
                if k > n:
                    k = n
                else:
                    del lru[entry]
                entry.count -= k
                n -= k
                self.num_lru_free -= k
                self.num_evictions += k
                continue
            del lru[entry]
            if isinstance(entry, Dup):
                key = entry.key
                copies = self.dups[key]
                copies.remove(entry)
                if not copies:
                    del self.dups[key]
            else:
                key = entry
                del m[key]
            n -= 1
            self.num_lru_free -= 1
            self.num_evictions += 1
            if removed is not None:
                removed.append(key)
        if removed and self.event_sink is not None:
            self.event_sink(BlockRemoved(removed))

    def add_copy(self, key: int) -> Handle:
        """An allocated, now full block gets hash `key`, held once; a second copy if `key` is cached."""
        m = self.cached_block_hash_to_ref
        if key not in m and key not in self.dups:
            m[key] = 1
            return key
        d = Dup(key, 1)
        copies = self.dups.get(key)
        if copies is None:
            self.dups[key] = [d]
        else:
            copies.append(d)
        return d

    def register(self, key: int, parent: int | None = None) -> Handle | None:
        """`add_copy` plus its `BlockStored` event; None without prefix caching (nothing is cached)."""
        if not self.enable_caching:
            return None
        h = self.add_copy(key)
        if self.event_sink is not None:
            self.event_sink(BlockStored([key], parent, None, self.block_size))
        return h

    def release_keyed(self, held: list[Handle]) -> None:
        """Drop one reference per held copy, tail first (a request's copies, head first); copies reaching zero go
        to the tail of the LRU. (`reversed` inside the loop: compiled, a native walk; passed as an argument it
        was a builtin looked up and called, and a generic iterator.)"""
        m = self.cached_block_hash_to_ref
        lru = self.free_lru
        freed = 0
        if not self.dups:  # no second copy is alive, so every held copy is a first copy (an int key)
            for h0 in reversed(held):
                key = cast(int, h0)
                ref = m[key] - 1
                m[key] = ref
                if not ref:
                    lru[key] = None
                    freed += 1
            self.num_lru_free += freed
            return
        for h in reversed(held):
            if isinstance(h, Dup):
                h.ref -= 1
                if not h.ref:
                    lru[h] = None
                    freed += 1
                continue
            ref = m[h] - 1
            m[h] = ref
            if not ref:
                lru[h] = None
                freed += 1
        self.num_lru_free += freed

    def cache_free(self, keys: list[int]) -> bool:
        """Leave `keys` cached and free, as a request that computed those blocks and finished would (taking free
        blocks as `allocate` does, the tail first in the LRU): the live forecast's `warm`, in one pass where
        `allocate`, `add_copy` per block and `release_keyed` took three. False, and nothing changed, where a key is
        cached already or fewer blocks are free."""
        m = self.cached_block_hash_to_ref
        if (len(keys) > self.get_num_free_blocks() or not m.keys().isdisjoint(keys)
                or (self.dups and not self.dups.keys().isdisjoint(keys))):
            return False
        self.allocate(len(keys))
        lru = self.free_lru
        for key in reversed(keys):
            m[key] = 0
            lru[key] = None
        self.num_lru_free += len(keys)
        return True

    def release_run(self, count: int) -> Run | None:
        """Freed full blocks nobody else can hit: one LRU entry (or anonymous blocks without caching)."""
        if count <= 0:
            return None
        if not self.enable_caching:
            self.num_anon_free += count
            return None
        run = Run(count)
        self.free_lru[run] = None
        self.num_lru_free += count
        return run

    def release_anon(self, count: int) -> None:
        """Freed partial (unhashed) blocks: to the front of the queue, reused first."""
        self.num_anon_free += count

    # -- invariants (tests) --------------------------------------------------------------------------
    def all_unreferenced(self) -> bool:
        """No request holds a cached copy (after a complete run)."""
        return (all(ref == 0 for ref in self.cached_block_hash_to_ref.values())
                and all(d.ref == 0 for c in self.dups.values() for d in c))

    def check(self) -> None:
        lru_total = 0
        for entry in self.free_lru:
            if isinstance(entry, Run):
                assert entry.count > 0
                lru_total += entry.count
            elif isinstance(entry, Dup):
                assert entry.ref == 0 and entry in self.dups[entry.key]
                lru_total += 1
            else:
                assert self.cached_block_hash_to_ref[entry] == 0
                lru_total += 1
        assert lru_total == self.num_lru_free, (lru_total, self.num_lru_free)
        zero = sum(1 for r in self.cached_block_hash_to_ref.values() if r == 0)
        zero += sum(1 for c in self.dups.values() for d in c if d.ref == 0)
        assert zero == sum(1 for e in self.free_lru if type(e) is not Run)
        assert all(r >= 0 for r in self.cached_block_hash_to_ref.values())
        assert all(c and all(d.ref >= 0 and d.key == k for d in c) for k, c in self.dups.items())
        assert 0 <= self.get_num_free_blocks() <= self.num_usable_blocks
