"""The engine-side request: vLLM's `Request` state plus the bookkeeping this simulator needs."""

from __future__ import annotations

from enum import IntEnum
from typing import Sequence

from twin.engine.block_pool import Run
from twin.workload.prefix_hash import TRACE_ROOT, chain


class RequestStatus(IntEnum):
    """Where a request is; also the `status` column of requests.parquet (as its name)."""

    PENDING = 0  # not yet arrived (sim ended first)
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED = 4
    REJECTED = 5


class Request:
    """One request inside an engine. Counts only: no token ids, prefix identity as block hashes."""

    __slots__ = (
        "idx", "arrival_time", "num_prompt_tokens", "stop_at_tokens", "block_keys", "session_id",
        "status", "num_computed_tokens", "num_output_tokens", "num_cached_tokens", "num_preemptions",
        "keyed", "num_blocks", "next_reg", "own_run",
        "in_decode", "out_base", "d_base", "phase", "heap_seq", "run_seq", "reg_pending",
        "first_token_time", "last_output_time", "priority",
    )

    def __init__(self, idx: int, arrival_time: float, num_prompt_tokens: int, stop_at_tokens: int,
                 block_keys: Sequence[int] | BlockKeys = (), session_id: int = -1, priority: int = 0) -> None:
        self.idx = idx
        self.priority = priority  # vLLM's request priority: lower is served first under the priority policy
        self.session_id = session_id
        self.arrival_time = arrival_time
        self.num_prompt_tokens = num_prompt_tokens
        # the output length at which this request stops: its true length (capped by the client's max_tokens),
        # which only the engine knows; a router sees the cap alone (RequestView.max_tokens)
        self.stop_at_tokens = stop_at_tokens
        self.block_keys = block_keys  # hashes of this request's shareable full blocks, in order (or runs)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = -1  # set at first admission
        self.num_preemptions = 0
        # cached block copies this request holds a reference to: `Handle`s (BlockPool), or (chain, gen, j0,
        # count) tuples (SegmentPool)
        self.keyed: list = []
        self.num_blocks = 0  # blocks held (keyed + anonymous); derived while decoding
        self.next_reg = 0  # next block index whose hash may still be registered
        self.own_run: Run | None = None  # its unshareable blocks freed by a preemption, still hittable by itself
        self.in_decode = False
        self.out_base = 0
        self.d_base = 0
        self.phase = 0
        self.heap_seq = -1
        self.run_seq = -1  # order of admission to the running list (vLLM's running order)
        self.reg_pending = False  # a decode member whose block keys still cover blocks it will fill
        self.first_token_time = -1.0
        self.last_output_time = -1.0

    @property
    def id(self) -> int:
        return self.idx

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def __repr__(self) -> str:
        return (f"Request({self.idx}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}/{self.stop_at_tokens}, computed={self.num_computed_tokens})")


_chain = chain  # chained trace ids (twin.workload.prefix_hash): element t names every trace block up to t


class KeyBases:
    """Where each trace block's engine-block keys start, so a prompt that continues a prefix continues its keys.

    Engine block j inside trace block t is keyed base(t) + j. A trace block takes its parent's base when it is
    the first continuation of that parent seen in the run; a later, different continuation (a branch) starts
    at its own chained id. Each base thus names one path of trace blocks, so keys of different prefixes never
    collide (as with chain + j), while a prompt's unshared part and a conversation's later turns are one
    contiguous key range: one run and one pool range instead of one per 512-token trace block.
    """

    __slots__ = ("base", "continued")

    def __init__(self) -> None:
        self.base: dict[int, int] = {}
        self.continued: set[int] = set()  # parents whose base a child has taken

    def runs_of(self, hash_ids) -> list[tuple[int, int, int]]:
        """A request's trace blocks as (base, first trace block, count): blocks on one base form one run."""
        base = self.base
        cont = self.continued
        runs: list[tuple[int, int, int]] = []
        h = TRACE_ROOT
        prev = 0
        cur_b = 0
        cur_t0 = 0
        t = 0
        for hid in hash_ids:
            h = hash((h, hid))  # chained, as `_chain`: equal values mean equal prefixes
            b = base.get(h)
            if b is None:
                if t > 0 and prev not in cont:  # the first continuation of its parent takes its keys on
                    cont.add(prev)
                    b = cur_b
                else:
                    b = h
                base[h] = b
            if t == 0:
                cur_b = b
            elif b != cur_b:
                runs.append((cur_b, cur_t0, t - cur_t0))
                cur_b = b
                cur_t0 = t
            prev = h
            t += 1
        if t:
            runs.append((cur_b, cur_t0, t - cur_t0))
        return runs


def engine_block_keys(hash_ids, hash_block_size: int, block_size: int, num_tokens: int,
                      trace_runs: list[tuple[int, int, int]] | None = None) -> list[int]:
    """Engine-block hashes from trace-level prefix ids (e.g. Mooncake's 512-token `hash_ids`).

    Block j of the engine covers tokens [j*bs, (j+1)*bs); its identity is the chained id of every trace
    block up to the one holding its last token, plus j (key = chain + j, so consecutive blocks of one trace
    block differ by 1 and `BlockKeys.from_keys` can regroup them). Only blocks that are full within the
    `num_tokens` the ids describe get a key, as vLLM hashes only full blocks. With `trace_runs` (a
    `KeyBases.runs_of`) the key is base + j instead, so continuations share a run. The per-block reference of
    `engine_block_runs`.
    """
    if not hash_ids:
        return []
    if hash_block_size == block_size:
        covered = min(len(hash_ids) * hash_block_size, num_tokens)
        return _chain(hash_ids)[:covered // block_size]
    return list(engine_block_runs(hash_ids, hash_block_size, block_size, num_tokens, trace_runs))


def engine_block_runs(hash_ids, hash_block_size: int, block_size: int, num_tokens: int,
                      trace_runs: list[tuple[int, int, int]] | None = None) -> "BlockKeys":
    """`engine_block_keys` as runs: one (key base, first block, count) per trace block, or with the
    `trace_runs` a `KeyBases` gave (`twin.sim.cluster.trace_key_runs`) one per path of continued trace blocks (a
    conversation's turns: usually one or two). Engine block j belongs to the trace block holding its last
    token, so trace blocks [t0, t1) hold engine blocks [t0 * hbs // bs, t1 * hbs // bs)."""
    covered = min(len(hash_ids) * hash_block_size, num_tokens) if hash_ids else 0
    n_full = covered // block_size
    if n_full == 0:
        return BlockKeys([], 0)
    if hash_block_size == block_size:  # one block per id: key = chain id, as `engine_block_keys`
        return BlockKeys.from_keys(_chain(hash_ids)[:n_full])
    if trace_runs is None:
        trace_runs = [(c, t, 1) for t, c in enumerate(_chain(hash_ids))]
    runs: list[tuple[int, int, int]] = []
    for b, t0, nt in trace_runs:
        j0 = (t0 * hash_block_size) // block_size
        if j0 >= n_full:
            break
        j1 = ((t0 + nt) * hash_block_size) // block_size
        if j1 > n_full:
            j1 = n_full
        if j1 > j0:
            runs.append((b, j0, j1 - j0))
    return BlockKeys(runs, n_full)


class BlockKeys:
    """A request's engine-block hashes as runs (chain id, first block j, count): block j's key is chain + j.

    Behaves as the per-block `Sequence[int]` (len, index, iteration, prefix slices) for routers and the
    prefix index, while `SegmentPool` works on the runs, so a request costs O(trace blocks), not O(blocks).
    """

    __slots__ = ("runs", "n")

    def __init__(self, runs: list[tuple[int, int, int]], n: int) -> None:
        self.runs = runs
        self.n = n

    @staticmethod
    def from_keys(keys) -> "BlockKeys":
        """Regroup per-block keys into runs: consecutive keys k with equal k - j share a chain id."""
        runs: list[tuple[int, int, int]] = []
        j = 0
        for k in keys:
            c = k - j
            if runs and runs[-1][0] == c and runs[-1][1] + runs[-1][2] == j:
                last = runs[-1]
                runs[-1] = (c, last[1], last[2] + 1)
            else:
                runs.append((c, j, 1))
            j += 1
        return BlockKeys(runs, j)

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def run_index(self, j: int) -> int:
        """Index of the run holding block j (len(runs) if j is past the end): a bisection, O(log runs)."""
        runs = self.runs
        lo = 0
        hi = len(runs)
        while lo < hi:
            mid = (lo + hi) // 2
            if runs[mid][1] + runs[mid][2] <= j:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def key(self, j: int) -> int:
        if j < 0:
            j += self.n
        if not 0 <= j < self.n:
            raise IndexError(j)
        return self.runs[self.run_index(j)][0] + j

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            if start == 0 and step == 1:
                return self.prefix(stop)
            return [self.key(j) for j in range(start, stop, step)]
        return self.key(i)

    def prefix(self, m: int) -> "BlockKeys":
        """The first m blocks' keys, O(runs)."""
        if m >= self.n:
            return self
        out: list[tuple[int, int, int]] = []
        for c, j0, cnt in self.runs:
            if j0 >= m:
                break
            out.append((c, j0, min(cnt, m - j0)))
        return BlockKeys(out, max(m, 0))

    def __iter__(self):
        for c, j0, cnt in self.runs:
            yield from range(c + j0, c + j0 + cnt)

    def __eq__(self, other: object) -> bool:
        try:
            return list(self) == list(other)  # type: ignore[call-overload]
        except TypeError:
            return False

    def __hash__(self) -> int:
        return hash(tuple(self.runs))

    def __repr__(self) -> str:
        return f"BlockKeys({self.runs!r}, n={self.n})"
