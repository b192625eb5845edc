"""The KV block pool with prefix caching, modelled on vLLM V1's `BlockPool` (`vllm/v1/core/block_pool.py`).

vLLM's free queue always holds every *unhashed* free block ahead of every *hashed* one: unhashed blocks
are prepended when freed, hashed blocks appended, and allocation pops from the front. So the queue is
exactly (a count of anonymous free blocks) + (an LRU of cached free blocks), and this pool stores it that
way. Blocks are counted, not named: a request holds a list of hashed ("keyed") blocks plus a count of
anonymous ones. The full blocks of content that nobody can share (a prompt with no prefix identity) are
kept in the LRU as one *run* entry per release, so freeing or evicting them costs O(1), not O(blocks),
while eviction order stays vLLM's. The preempted request keeps a handle on the run its blocks went
to, so when resumed it can hit its own surviving blocks as it does in vLLM.
"""

from __future__ import annotations

from collections import OrderedDict


class Run:
    """`count` hashed-but-unshareable full blocks released together."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count


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
        # cached free blocks in LRU order (front = evicted first): hash -> None, or Run -> None
        self.free_lru: OrderedDict[int | Run, None] = OrderedDict()
        self.num_lru_free = 0
        # every live hashed block: hash -> ref_cnt (0 means it sits in free_lru)
        self.cached_block_hash_to_ref: dict[int, int] = {}
        self.num_evictions = 0

    # -- queries -------------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.num_anon_free + self.num_lru_free

    def get_usage(self) -> float:
        """Fraction of usable blocks referenced by some request (vLLM's `kv_cache_usage_perc`)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def num_cached_hits(self, keys, max_blocks: int) -> int:
        """Length of the longest run of leading `keys` (at most `max_blocks`) that are cached."""
        if not self.enable_caching:
            return 0
        m = self.cached_block_hash_to_ref
        n = 0
        for key in keys:
            if n >= max_blocks or key not in m:
                break
            n += 1
        return n

    def num_free_among(self, keys) -> int:
        """How many of these cached `keys` sit in the free queue (touching them costs free capacity)."""
        m = self.cached_block_hash_to_ref
        return sum(1 for k in keys if m[k] == 0)

    # -- mutations -----------------------------------------------------------------------------------
    def touch(self, keys) -> None:
        """A request hit these cached blocks: take them out of the free queue and add a reference."""
        m = self.cached_block_hash_to_ref
        for key in keys:
            ref = m[key]
            if ref == 0:
                del self.free_lru[key]
                self.num_lru_free -= 1
            m[key] = ref + 1

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
        take = min(n, self.num_anon_free)
        self.num_anon_free -= take
        n -= take
        lru = self.free_lru
        m = self.cached_block_hash_to_ref
        while n > 0:
            entry, _ = lru.popitem(last=False)
            if isinstance(entry, Run):
                k = min(n, entry.count)
                entry.count -= k
                n -= k
                self.num_lru_free -= k
                self.num_evictions += k
                if entry.count:  # partly used: the rest stays at the front
                    lru[entry] = None
                    lru.move_to_end(entry, last=False)
            else:
                del m[entry]
                n -= 1
                self.num_lru_free -= 1
                self.num_evictions += 1

    def register(self, key: int) -> bool:
        """An allocated, now full block gets hash `key`. False if that hash is already cached (a duplicate)."""
        if not self.enable_caching:
            return False
        m = self.cached_block_hash_to_ref
        if key in m:
            return False
        m[key] = 1
        return True

    def release_keyed(self, keys_reversed) -> None:
        """Drop one reference per key (tail first); blocks reaching zero go to the tail of the LRU."""
        m = self.cached_block_hash_to_ref
        lru = self.free_lru
        freed = 0
        for key in keys_reversed:
            ref = m[key] - 1
            m[key] = ref
            if not ref:
                lru[key] = None
                freed += 1
        self.num_lru_free += freed

    def release_cached_unkeyed(self, key: int) -> None:
        """A freed full block whose hash was never registered: cache it now, straight into the LRU."""
        self.cached_block_hash_to_ref[key] = 0
        self.free_lru[key] = None
        self.num_lru_free += 1

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
    def check(self) -> None:
        lru_total = 0
        for entry in self.free_lru:
            if isinstance(entry, Run):
                assert entry.count > 0
                lru_total += entry.count
            else:
                assert self.cached_block_hash_to_ref[entry] == 0
                lru_total += 1
        assert lru_total == self.num_lru_free, (lru_total, self.num_lru_free)
        zero = sum(1 for r in self.cached_block_hash_to_ref.values() if r == 0)
        assert zero == sum(1 for e in self.free_lru if type(e) is not Run)
        assert all(r >= 0 for r in self.cached_block_hash_to_ref.values())
        assert 0 <= self.get_num_free_blocks() <= self.num_usable_blocks
