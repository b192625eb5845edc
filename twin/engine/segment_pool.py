"""The KV block pool at the trace's segment granularity: the same queue and caching as `BlockPool`, in ranges.

`BlockPool` (twin/engine/block_pool.py) is the per-block reference: one hash-map entry and one LRU entry per
engine block. A Mooncake request names ~800 engine blocks by ~25 trace hash ids (512 tokens each), and its
blocks are registered, touched, released and evicted together except at a few boundaries. This pool stores
*ranges* (`Seg`): blocks [j0, j0 + n) of one chain id (`BlockKeys` runs, block j's key = chain + j) with
one reference count, split only where behaviour diverges (a chunk boundary, a partial hit, an eviction that
stops inside a range) and merged back where it converges, so each operation costs O(ranges), not O(blocks).

Same behaviour as vLLM's `BlockPool` (`vllm/v1/core/block_pool.py`), range by range:

- Free queue: unhashed free blocks first (a count), then cached free blocks in LRU order (`head` .. `tail`,
  a doubly linked list of ranges and runs, as vLLM's `FreeKVCacheBlockQueue`). vLLM frees a request's
  blocks tail first (`KVCacheManager.free` -> `free_blocks(reversed(...))`), so within a range in the queue
  the highest block comes first: eviction shrinks a range from its tail end.
- Duplicates (`BlockHashToBlockMap`): a block computed while its hash is cached gets another copy. Copies
  of a block are ordered by `gen` (registration order among the live copies: a new copy's gen is one more
  than the newest live copy's); a lookup takes the oldest live copy (`get_one_block`), eviction drops one
  copy, and the hash stays hittable while any copy survives.
- KV events go to `event_sink` with per-block hashes (chain + j), expanded only when a sink is set.

A request holds its copies as (chain, gen, j0, n) tuples in block order (`Request.keyed`); they name blocks,
not range objects, so splitting or merging ranges never invalidates them. Unshareable full blocks are one
`Seg` run per release (gen -1), as `BlockPool`'s `Run`.
"""

from __future__ import annotations

from typing import cast

from twin.engine.block_pool import BlockPool, Run
from twin.engine.request import BlockKeys
from twin.policy.kv_events import BlockRemoved, BlockStored

Held = tuple[int, int, int, int]  # (chain id, gen, first block j, count): copies a request references


class Seg(Run):
    """Blocks [j0, j0 + count) of chain `chain`, copy generation `gen` (-1: a run nobody else can hit), one
    ref count. A `Run` (gen -1) is a request's `own_run` handle, as `BlockPool`'s."""

    __slots__ = ("chain", "gen", "j0", "ref", "prev", "next", "in_lru")

    def __init__(self, chain: int, gen: int, j0: int, n: int, ref: int) -> None:
        super().__init__(n)
        self.chain = chain
        self.gen = gen
        self.j0 = j0
        self.ref = ref
        self.prev: Seg | None = None
        self.next: Seg | None = None
        self.in_lru = False

    def __repr__(self) -> str:
        return f"Seg({self.chain}, g{self.gen}, [{self.j0}, {self.j0 + self.count}), ref={self.ref})"


Gens = dict[int, list[Seg]]  # a chain's live copies: gen -> its ranges, sorted by j0, disjoint


def _piece_start(p: tuple[int, int, int]) -> int:
    return p[1]


def as_block_keys(keys) -> BlockKeys:
    """Keys in run form (per-block lists, e.g. a router's view, are regrouped: O(blocks), rare)."""
    if isinstance(keys, BlockKeys):
        return keys
    return BlockKeys.from_keys(keys)


class SegmentPool(BlockPool):
    """`BlockPool`'s state in ranges: free counts, chain -> gen -> ranges, and the LRU of free ranges.

    A subclass so the scheduler's `pool` keeps one type; the per-block maps it inherits stay empty."""

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        super().__init__(num_gpu_blocks, block_size, enable_caching)
        self.head: Seg | None = None  # LRU front: evicted first
        self.tail: Seg | None = None
        self.chains: dict[int, Gens] = {}

    # -- the LRU list --------------------------------------------------------------------------------
    def _append(self, s: Seg) -> None:
        s.in_lru = True
        s.next = None
        s.prev = self.tail
        if self.tail is None:
            self.head = s
        else:
            self.tail.next = s
        self.tail = s

    def _insert_before(self, s: Seg, at: Seg) -> None:
        s.in_lru = True
        s.next = at
        s.prev = at.prev
        if at.prev is None:
            self.head = s
        else:
            at.prev.next = s
        at.prev = s

    def _unlink(self, s: Seg) -> None:
        if s.prev is None:
            self.head = s.next
        else:
            s.prev.next = s.next
        if s.next is None:
            self.tail = s.prev
        else:
            s.next.prev = s.prev
        s.prev = None
        s.next = None
        s.in_lru = False

    # -- ranges of one copy generation ---------------------------------------------------------------
    def _split(self, lst: list[Seg], i: int, p: int) -> None:
        """Cut lst[i] at block p; the upper part (evicted first when free) goes right before it in the LRU."""
        s = lst[i]
        up = Seg(s.chain, s.gen, p, s.j0 + s.count - p, s.ref)
        s.count = p - s.j0
        lst.insert(i + 1, up)
        if s.in_lru:
            self._insert_before(up, s)

    def _isolate(self, lst: list[Seg], a: int, b: int) -> tuple[int, int]:
        """Split so that ranges start at a and b; returns the index span of the ranges inside [a, b)."""
        i = 0
        ln = len(lst)
        while i < ln and lst[i].j0 + lst[i].count <= a:
            i += 1
        if i < ln and lst[i].j0 < a:
            self._split(lst, i, a)
            i += 1
        k = i
        while k < len(lst) and lst[k].j0 < b:
            s = lst[k]
            if s.j0 + s.count > b:
                self._split(lst, k, b)
            k += 1
        return i, k

    def _coalesce(self, lst: list[Seg]) -> None:
        """Merge neighbours that behave as one: same ref held, or free and adjacent in the LRU (upper first)."""
        i = 0
        while i + 1 < len(lst):
            lo = lst[i]
            hi = lst[i + 1]
            if lo.j0 + lo.count == hi.j0 and lo.ref == hi.ref and (lo.ref > 0 or lo.prev is hi):
                lo.count += hi.count
                if hi.in_lru:
                    self._unlink(hi)
                del lst[i + 1]
            else:
                i += 1

    def _assign(self, gens: Gens, a: int, b: int, oldest: bool) -> list[tuple[int, int, int]]:
        """Split [a, b) into pieces (gen, x, y) by the oldest (or newest) live copy of each block; gen -1:
        no copy. Pieces in block order."""
        out: list[tuple[int, int, int]] = []
        free_iv: list[tuple[int, int]] = [(a, b)]
        order = sorted(gens) if oldest else sorted(gens, reverse=True)
        for g in order:
            nxt: list[tuple[int, int]] = []
            lst = gens[g]
            for x, y in free_iv:
                cur = x
                for s in lst:
                    s1 = s.j0 + s.count
                    if s1 <= cur:
                        continue
                    if s.j0 >= y:
                        break
                    if s.j0 > cur:
                        nxt.append((cur, s.j0))
                        cur = s.j0
                    hi = s1 if s1 < y else y
                    if out and out[-1][0] == g and out[-1][2] == cur:
                        out[-1] = (g, out[-1][1], hi)
                    else:
                        out.append((g, cur, hi))
                    cur = hi
                    if cur >= y:
                        break
                if cur < y:
                    nxt.append((cur, y))
            free_iv = nxt
            if not free_iv:
                break
        for x, y in free_iv:
            out.append((-1, x, y))
        if len(out) > 1:
            out.sort(key=_piece_start)
        return out

    @staticmethod
    def _covered_to(gens: Gens, a: int, b: int) -> int:
        """The end of the leading stretch of [a, b) where every block has a live copy."""
        pos = a
        moved = True
        while moved and pos < b:
            moved = False
            for lst in gens.values():
                for s in lst:
                    if s.j0 > pos:
                        break
                    if pos < s.j0 + s.count:
                        pos = s.j0 + s.count
                        moved = True
                        break
        return pos if pos < b else b

    # -- queries -------------------------------------------------------------------------------------
    def num_cached_hits(self, keys, max_blocks: int) -> int:
        """Length of the longest run of leading blocks (at most `max_blocks`) that are cached."""
        if not self.enable_caching:
            return 0
        chains = self.chains
        n = 0
        for c, j0, cnt in as_block_keys(keys).runs:
            lim = cnt if cnt < max_blocks - n else max_blocks - n
            if lim <= 0:
                break
            gens = chains.get(c)
            if gens is None:
                break
            p = self._covered_to(gens, j0, j0 + lim)
            n += p - j0
            if p < j0 + cnt:
                break
        return n

    def num_free_hits(self, keys: BlockKeys, hk: int) -> int:
        """How many of the first `hk` (cached) blocks sit in the free queue: the copy a lookup takes is free."""
        n = 0
        left = hk
        for c, j0, cnt in keys.runs:
            if left <= 0:
                break
            m = cnt if cnt < left else left
            left -= m
            gens = self.chains[c]
            for g, x, y in self._assign(gens, j0, j0 + m, True):
                for s in gens[g]:
                    if s.j0 >= y:
                        break
                    if s.ref == 0 and s.j0 + s.count > x:
                        n += min(s.j0 + s.count, y) - max(s.j0, x)
        return n

    # -- mutations -----------------------------------------------------------------------------------
    @staticmethod
    def _hold(held: list[Held], c: int, g: int, j0: int, n: int) -> None:
        if held:
            last = held[-1]
            if last[0] == c and last[1] == g and last[2] + last[3] == j0:
                held[-1] = (c, g, last[2], last[3] + n)
                return
        held.append((c, g, j0, n))

    def touch_prefix(self, keys: BlockKeys, hk: int) -> list[Held]:
        """A request hit its first `hk` blocks: take the oldest copy of each out of the free queue, add a ref
        (vLLM `BlockPool.touch` on `get_cached_block`'s first copy). Returns the copies it now holds."""
        held: list[Held] = []
        left = hk
        for c, j0, cnt in keys.runs:
            if left <= 0:
                break
            m = cnt if cnt < left else left
            left -= m
            gens = self.chains[c]
            for g, x, y in self._assign(gens, j0, j0 + m, True):
                lst = gens[g]
                i0, i1 = self._isolate(lst, x, y)
                for i in range(i0, i1):
                    s = lst[i]
                    if s.ref == 0:
                        self._unlink(s)
                        self.num_lru_free -= s.count
                    s.ref += 1
                self._coalesce(lst)
                self._hold(held, c, g, x, y - x)
        return held

    def register_blocks(self, keys: BlockKeys, held: list[Held], start: int, end: int) -> None:
        """Blocks [start, end) of a request became full: cache a copy of each, held once (`cache_full_blocks`;
        a block already cached gets a newer copy, as vLLM does not deduplicate), with one `BlockStored`."""
        chains = self.chains
        runs = keys.runs
        for ri in range(keys.run_index(start), len(runs)):
            c, j0, cnt = runs[ri]
            if j0 >= end:
                break
            a = j0 if j0 > start else start
            b = j0 + cnt if j0 + cnt < end else end
            gens = chains.get(c)
            if gens is None:  # nothing of this chain is cached (so nobody holds it): one new range
                chains[c] = {0: [Seg(c, 0, a, b - a, 1)]}
                held.append((c, 0, a, b - a))
                continue
            pieces = self._assign(gens, a, b, False)
            for g, x, y in pieces:
                ng = g + 1
                lst = gens.get(ng)
                if lst is None:
                    lst = gens[ng] = []
                i = 0
                while i < len(lst) and lst[i].j0 < x:
                    i += 1
                lst.insert(i, Seg(c, ng, x, y - x, 1))
                self._coalesce(lst)
                self._hold(held, c, ng, x, y - x)
        sink = self.event_sink
        if sink is not None:
            sink(BlockStored(list(keys[start:end]), keys.key(start - 1) if start else None, None,
                             self.block_size))

    def release_held(self, held: list[Held]) -> None:
        """Drop one reference per held block, tail first; blocks reaching zero go to the tail of the LRU."""
        chains = self.chains
        freed = 0
        for idx in range(len(held) - 1, -1, -1):
            c, g, j0, n = held[idx]
            lst = chains[c][g]
            if len(lst) == 1:  # the common case: the held blocks are the chain's one range
                s = lst[0]
                if s.j0 == j0 and s.count == n:
                    s.ref -= 1
                    if s.ref == 0:
                        self._append(s)
                        freed += n
                    continue
            i0, i1 = self._isolate(lst, j0, j0 + n)
            for i in range(i1 - 1, i0 - 1, -1):
                s = lst[i]
                s.ref -= 1
                if s.ref == 0:
                    self._append(s)
                    freed += s.count
            self._coalesce(lst)
        self.num_lru_free += freed

    def allocate(self, n: int) -> None:
        """Take `n` free blocks from the front of the queue, evicting cached ones (tail block first)."""
        if n <= 0:
            return
        if n > self.num_anon_free + self.num_lru_free:
            raise RuntimeError(f"allocate({n}) with only {self.get_num_free_blocks()} free blocks")
        take = n if n < self.num_anon_free else self.num_anon_free
        self.num_anon_free -= take
        n -= take
        if n == 0:
            return
        removed: list[int] | None = [] if self.event_sink is not None else None
        while n > 0:
            s = self.head
            assert s is not None
            k = n if n < s.count else s.count
            top = s.j0 + s.count
            s.count -= k
            n -= k
            self.num_lru_free -= k
            self.num_evictions += k
            if s.gen >= 0 and removed is not None:
                removed.extend(range(s.chain + top - 1, s.chain + top - 1 - k, -1))
            if s.count == 0:
                self._unlink(s)
                if s.gen >= 0:
                    gens = self.chains[s.chain]
                    lst = gens[s.gen]
                    lst.remove(s)
                    if not lst:
                        del gens[s.gen]
                        if not gens:
                            del self.chains[s.chain]
        if removed and self.event_sink is not None:
            self.event_sink(BlockRemoved(removed))

    def touch_run(self, run: Run, n: int) -> None:
        """A resumed request takes back the first `n` blocks of its own run; the rest become anonymous."""
        s = cast(Seg, run)
        self._unlink(s)
        self.num_lru_free -= s.count
        self.num_anon_free += s.count - n
        s.count = 0

    def release_run(self, count: int) -> Seg | None:
        """Freed full blocks nobody else can hit: one LRU entry (or anonymous blocks without caching)."""
        if count <= 0:
            return None
        if not self.enable_caching:
            self.num_anon_free += count
            return None
        run = Seg(0, -1, 0, count, 0)
        self._append(run)
        self.num_lru_free += count
        return run

    @staticmethod
    def num_held(held: list[Held]) -> int:
        n = 0
        for h in held:
            n += h[3]
        return n

    # -- forks ---------------------------------------------------------------------------------------
    def fork(self, runs: dict) -> SegmentPool:
        """A copy with its own ranges (`runs` maps id(old range) -> new, for the requests' run handles)."""
        new = SegmentPool(self.num_gpu_blocks, self.block_size, self.enable_caching)
        new.num_anon_free = self.num_anon_free
        new.num_lru_free = self.num_lru_free
        new.num_evictions = self.num_evictions

        def same(s: Seg) -> Seg:
            c = runs.get(id(s))
            if c is None:
                c = runs[id(s)] = Seg(s.chain, s.gen, s.j0, s.count, s.ref)
            return c

        for ch, gens in self.chains.items():
            new.chains[ch] = {g: [same(s) for s in lst] for g, lst in gens.items()}
        s = self.head
        while s is not None:
            new._append(same(s))
            s = s.next
        return new

    # -- invariants (tests) --------------------------------------------------------------------------
    def all_unreferenced(self) -> bool:
        return all(s.ref == 0 for gens in self.chains.values() for lst in gens.values() for s in lst)

    def check(self) -> None:
        lru_total = 0
        in_lru = 0
        s = self.head
        prev = None
        while s is not None:
            assert s.in_lru and s.prev is prev and s.count > 0 and s.ref == 0
            lru_total += s.count
            in_lru += s.gen >= 0
            prev = s
            s = s.next
        assert prev is self.tail
        assert lru_total == self.num_lru_free, (lru_total, self.num_lru_free)
        zero = 0
        for c, gens in self.chains.items():
            assert gens
            for g, lst in gens.items():
                assert lst and g >= 0
                for i, x in enumerate(lst):
                    assert x.count > 0 and x.ref >= 0 and x.chain == c and x.gen == g
                    assert x.in_lru == (x.ref == 0)
                    zero += x.ref == 0
                    if i:
                        assert lst[i - 1].j0 + lst[i - 1].count <= x.j0
        assert zero == in_lru
        assert 0 <= self.get_num_free_blocks() <= self.num_usable_blocks
