"""The engine-side request: vLLM's `Request` state plus the bookkeeping this simulator needs."""

from __future__ import annotations

from enum import IntEnum

from twin.engine.block_pool import Handle, Run


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
        "idx", "arrival_time", "num_prompt_tokens", "max_tokens", "block_keys", "session_id",
        "status", "num_computed_tokens", "num_output_tokens", "num_cached_tokens", "num_preemptions",
        "keyed", "num_blocks", "next_reg", "own_run",
        "in_decode", "out_base", "d_base", "phase", "heap_seq", "run_seq", "reg_pending",
        "first_token_time", "last_output_time",
    )

    def __init__(self, idx: int, arrival_time: float, num_prompt_tokens: int, max_tokens: int,
                 block_keys: list[int] | tuple[int, ...] = (), session_id: int = -1) -> None:
        self.idx = idx
        self.session_id = session_id
        self.arrival_time = arrival_time
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.block_keys = block_keys  # hashes of this request's shareable full blocks, in order
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = -1  # set at first admission
        self.num_preemptions = 0
        self.keyed: list[Handle] = []  # cached block copies this request holds a reference to
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
                f"out={self.num_output_tokens}/{self.max_tokens}, computed={self.num_computed_tokens})")


def engine_block_keys(hash_ids, hash_block_size: int, block_size: int, num_tokens: int) -> list[int]:
    """Engine-block hashes from trace-level prefix ids (e.g. Mooncake's 512-token `hash_ids`).

    Block j of the engine covers tokens [j*bs, (j+1)*bs); its identity is the chained hash of every
    trace block up to the one holding its last token, plus j. Only blocks that are full within the
    `num_tokens` the ids describe get a key, as vLLM hashes only full blocks.
    """
    if not hash_ids:
        return []
    covered = min(len(hash_ids) * hash_block_size, num_tokens)
    n_full = covered // block_size
    chain = []
    h = 0x5EED
    for hid in hash_ids:
        h = hash((h, hid))
        chain.append(h)
    if hash_block_size == block_size:
        return chain[:n_full]
    return [hash((chain[((j + 1) * block_size - 1) // hash_block_size], j)) for j in range(n_full)]
