"""What one scheduling step decided: vLLM's `SchedulerOutput` (`vllm/v1/core/sched/output.py`), in counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.engine.request import Request
from twin.perf.base import StepBatch


@dataclass
class SchedulerOutput:
    """What one `schedule()` decided."""

    t_start: float
    prefills: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, tokens, computed before)
    num_decode: int = 0  # decode-group members scheduled (1 token each)
    decode_context: int = 0
    skipped: list[Request] = field(default_factory=list)  # decode members that got no token
    preempted: list[Request] = field(default_factory=list)

    t_decided: float = -1.0  # when vLLM made this decision (async: the start of the step before)

    def __init__(self, t_start: float, prefills: list[tuple[Request, int, int]] | None = None, num_decode: int = 0,
                 decode_context: int = 0, skipped: list[Request] | None = None,
                 preempted: list[Request] | None = None, t_decided: float = -1.0) -> None:
        # written out (dataclass keeps it): one per step, a native constructor when compiled
        self.t_start = t_start
        self.prefills = [] if prefills is None else prefills
        self.num_decode = num_decode
        self.decode_context = decode_context
        self.skipped = [] if skipped is None else skipped
        self.preempted = [] if preempted is None else preempted
        self.t_decided = t_decided

    def batch(self) -> StepBatch:
        b = StepBatch(num_decode_tokens=self.num_decode, decode_context_tokens=self.decode_context,
                      num_prefill_reqs=len(self.prefills))
        for r, n, c in self.prefills:
            b.num_prefill_tokens += n
            b.prefill_attn_tokens += n * c + n * (n + 1) / 2
            b.prefill_kv_read_tokens += c + n
            if c + n == r.num_tokens:
                b.num_prefill_sampled += 1
        return b

    @property
    def is_empty(self) -> bool:
        return not self.prefills and self.num_decode == 0
