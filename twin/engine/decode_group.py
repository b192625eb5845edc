"""The decode group: every decoding request of one engine, advanced in lockstep by one step counter.

Decoding requests get one token each per step, so they form one group driven by a shared counter
`group_step`: a member's output count is `out_base + group_step - d_base`. A step then costs O(1) for all
decodes, and the scheduler's fast-forward (`Scheduler.plan_decode_run`) can advance k homogeneous decode
steps at once. Blocks a decode needs follow from its position modulo the block size (`phase_count`), finishes
from a heap keyed by the value of `group_step` at which each member reaches its `stop_at_tokens`. Members
whose block keys cover their output sit in per-phase buckets (`reg_buckets`) until each output block they fill
is cached, so a step touches only the members that cross a block boundary in it.

vLLM has no such object: its scheduler walks every running request each step. This is the twin's own
bookkeeping of the same schedule (tested step by step against vLLM's scheduler, twin.lab.parity).
"""

from __future__ import annotations

from heapq import heappop, heappush

from twin.engine.request import Request


def _by_run_seq(r: Request) -> int:
    return r.run_seq


class DecodeGroup:
    """The members' shared counter, phases, finish heap and blocks still to cache."""

    def __init__(self, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_step = 0
        self.phase_count = [0] * self.block_size
        self.finish_heap: list[tuple[int, int, Request]] = []
        self.heap_seq = 0
        self.num_decode = 0
        self.decode_context = 0  # sum over members of the tokens each attends to in the next step
        self.group_last_out = 0.0
        self.stale: dict[Request, float] = {}  # members whose last output was not the group's
        # members with blocks still to register, by phase: those with phase (-group_step-1) % bs fill a block at group_step
        self.reg_buckets: list[dict[Request, None]] = [{} for _ in range(self.block_size)]
        self.num_reg_members = 0
        self.reg_by_first_key: dict[int, dict[Request, None]] = {}  # the same members by their first key

    def member_output(self, r: Request) -> int:
        return r.out_base + self.group_step - r.d_base

    def join(self, r: Request, now: float) -> None:
        """A request whose prompt is computed and that sampled a token starts decoding."""
        bs = self.block_size
        r.in_decode = True
        r.out_base = r.num_output_tokens
        r.d_base = self.group_step
        computed = r.num_prompt_tokens + r.num_output_tokens - 1
        r.phase = (computed - self.group_step) % bs
        self.phase_count[r.phase] += 1
        self.num_decode += 1
        self.decode_context += computed + 1
        self.heap_seq += 1
        r.heap_seq = self.heap_seq
        heappush(self.finish_heap, (self.group_step + r.stop_at_tokens - r.out_base, self.heap_seq, r))
        if r.next_reg < len(r.block_keys) and self.enable_caching:
            r.reg_pending = True
            self.reg_buckets[r.phase][r] = None
            self.num_reg_members += 1
            group = self.reg_by_first_key.get(r.block_keys[0])
            if group is None:
                self.reg_by_first_key[r.block_keys[0]] = {r: None}
            else:
                group[r] = None
        if self.num_decode == 1:
            self.group_last_out = now
        elif self.group_last_out != now:
            self.stale[r] = now

    def leave(self, r: Request) -> None:
        """Materialise a member's counters and take it out of the group."""
        out = self.member_output(r)
        r.num_output_tokens = out
        r.num_computed_tokens = r.num_prompt_tokens + out - 1
        r.num_blocks = -(-r.num_computed_tokens // self.block_size)
        self.phase_count[r.phase] -= 1
        if r.reg_pending:
            self.drop_reg(r)
        self.num_decode -= 1
        self.decode_context -= r.num_computed_tokens + 1
        r.in_decode = False
        r.heap_seq = -1  # invalidates its heap entry
        if r in self.stale:
            r.last_output_time = self.stale.pop(r)
        else:
            r.last_output_time = self.group_last_out

    def skip(self, r: Request) -> None:
        """A member got no token this step (budget exhausted): it falls one step behind the group."""
        bs = self.block_size
        self.phase_count[r.phase] -= 1
        if r.reg_pending:
            del self.reg_buckets[r.phase][r]
            self.reg_buckets[(r.phase - 1) % bs][r] = None
        r.d_base += 1
        r.phase = (r.phase - 1) % bs
        self.phase_count[r.phase] += 1
        self.heap_seq += 1
        r.heap_seq = self.heap_seq
        heappush(self.finish_heap, (r.d_base + r.stop_at_tokens - r.out_base, self.heap_seq, r))
        if r not in self.stale:
            self.stale[r] = self.group_last_out

    def drop_reg(self, r: Request) -> None:
        del self.reg_buckets[r.phase][r]
        r.reg_pending = False
        self.num_reg_members -= 1
        first = r.block_keys[0]
        group = self.reg_by_first_key[first]
        del group[r]
        if not group:
            del self.reg_by_first_key[first]

    def crossing(self, d: int) -> list[Request]:
        """Members that fill a block in the step at group counter `d`, in running order."""
        b = self.reg_buckets[(-d - 1) % self.block_size]
        if not b:
            return []
        if len(b) == 1:
            return list(b)
        return sorted(b, key=_by_run_seq)

    def next_finish(self) -> int | None:
        h = self.finish_heap
        while h and h[0][2].heap_seq != h[0][1]:
            heappop(h)
        return h[0][0] if h else None

    def steps_until_blocks_run_out(self, free: int) -> int:
        """Decode steps the group can take before the free blocks cannot cover a step's allocations."""
        bs = self.block_size
        nd = self.num_decode
        periods = free // nd  # each run of block_size steps takes exactly one block per member
        left = free - periods * nd
        pc = self.phase_count
        group_step = self.group_step
        s = 0
        while True:
            need = pc[(-(group_step + s)) % bs]
            if need > left:
                return periods * bs + s
            left -= need
            s += 1

    def blocks_needed(self, j: int) -> int:
        """New blocks the decode group takes over the next j steps (each member one per block_size)."""
        bs = self.block_size
        full, rest = divmod(j, bs)
        pc = self.phase_count
        group_step = self.group_step
        n = full * self.num_decode
        for s in range(rest):  # a loop, not a generator: compiled, a generator is an object per call
            n += pc[(-(group_step + s)) % bs]
        return n

    def pop_finished(self) -> list[Request]:
        """Members whose output count reached stop_at_tokens at the current group_step leave the group."""
        finished = []
        h = self.finish_heap
        group_step = self.group_step
        while h:
            d_fin, seq, r = h[0]
            if r.heap_seq != seq:
                heappop(h)
                continue
            if d_fin > group_step:
                break
            heappop(h)
            self.leave(r)
            finished.append(r)
        return finished
