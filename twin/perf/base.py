"""The step-time interface every latency model implements (roofline, fitted), and what the engine,
the KV sizing and the metrics read from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from twin.specs.hardware import GPUSpec


@dataclass(slots=True)
class StepBatch:
    """What one engine step computes, in the few sums a latency model needs."""

    num_prefill_tokens: int = 0  # prompt tokens computed this step (sum of chunk sizes)
    prefill_attn_tokens: float = 0.0  # sum over those tokens of the context each attends to
    prefill_kv_read_tokens: int = 0  # KV tokens the prefill chunks read (sum of prior + chunk)
    num_prefill_sampled: int = 0  # chunks that end a prompt, so sample a token (LM head)
    num_decode_tokens: int = 0  # one per decoding request
    decode_context_tokens: int = 0  # sum over decodes of the tokens attended (incl. the new one)
    num_prefill_reqs: int = 0  # requests with a prefill chunk this step

    def __init__(self, num_prefill_tokens: int = 0, prefill_attn_tokens: float = 0.0,
                 prefill_kv_read_tokens: int = 0, num_prefill_sampled: int = 0, num_decode_tokens: int = 0,
                 decode_context_tokens: int = 0, num_prefill_reqs: int = 0) -> None:
        # written out (dataclass keeps it): compiled, a native constructor, not a generated Python __init__
        self.num_prefill_tokens = num_prefill_tokens
        self.prefill_attn_tokens = prefill_attn_tokens
        self.prefill_kv_read_tokens = prefill_kv_read_tokens
        self.num_prefill_sampled = num_prefill_sampled
        self.num_decode_tokens = num_decode_tokens
        self.decode_context_tokens = decode_context_tokens
        self.num_prefill_reqs = num_prefill_reqs

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_requests(self) -> int:
        """Requests scheduled this step: every decode (one token each) and every prefill chunk."""
        return self.num_decode_tokens + self.num_prefill_reqs


class StepTimeModel(Protocol):
    """A step-time model: `step_time(batch) -> seconds`, and the sizes and bounds the twin reads from it.

    `decode_run_times` must equal `step_time` step by step (see `decode_run_times_by_steps`); `ideal()` is
    the physical floor the model is checked against; `peak_tokens_per_s` bounds any run's throughput.
    """

    gpu: GPUSpec

    def step_time(self, batch: StepBatch) -> float: ...

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        """Durations of k decode-only steps of `num_decode` requests, step s attending context0 + s*num_decode."""
        ...

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Stored weights on one GPU (all of them, embedding included): KV sizing subtracts this."""
        ...

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        """KV-cache bytes one token takes on one GPU."""
        ...

    def peak_tokens_per_s(self) -> float:
        """Tokens/s one instance could compute at 100 % of peak FLOP/s: a hard ceiling."""
        ...

    def ideal(self) -> "StepTimeModel":
        """The same hardware and model at the physical floor (100 % efficiency, no overheads)."""
        ...

    def describe(self) -> dict:
        """Parameters, and which are assumptions, for summary.json."""
        ...

    def api_request_s(self, prompt_tokens: int) -> float:
        """API-server time before the engine sees a request of this many prompt tokens."""
        ...

    def api_token_s(self) -> float:
        """API-server time per streamed output token."""
        ...


def decode_run_times_by_steps(model: StepTimeModel, num_decode: int, context0: int, k: int) -> list[float]:
    """Reference implementation of `decode_run_times`: one `step_time` call per step."""
    return [model.step_time(StepBatch(num_decode_tokens=num_decode, decode_context_tokens=context0 + s * num_decode))
            for s in range(k)]
