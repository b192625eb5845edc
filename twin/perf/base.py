"""The step-time interface every latency model implements (roofline now, calibrated later)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class StepBatch:
    """What one engine step computes, in the few sums a latency model needs."""

    num_prefill_tokens: int = 0  # prompt tokens computed this step (sum of chunk sizes)
    prefill_attn_tokens: float = 0.0  # sum over those tokens of the context each attends to
    prefill_kv_read_tokens: int = 0  # KV tokens the prefill chunks read (sum of prior + chunk)
    num_prefill_sampled: int = 0  # chunks that end a prompt, so sample a token (LM head)
    num_decode_tokens: int = 0  # one per decoding request
    decode_context_tokens: int = 0  # sum over decodes of the tokens attended (incl. the new one)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class StepTimeModel(Protocol):
    """`step_time(batch) -> seconds`; `decode_run_times` is the same for k homogeneous decode steps."""

    def step_time(self, batch: StepBatch) -> float: ...

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        """Durations of k decode-only steps of `num_decode` requests, step s attending context0 + s*num_decode."""
        ...


def decode_run_times_by_steps(model: StepTimeModel, num_decode: int, context0: int, k: int) -> list[float]:
    """Reference implementation of `decode_run_times`: one `step_time` call per step."""
    return [model.step_time(StepBatch(num_decode_tokens=num_decode, decode_context_tokens=context0 + s * num_decode))
            for s in range(k)]
