"""A step model that returns a real server's measured step durations, so a replay tests the scheduling alone.

The durations come from vLLM's own engine loop (`live/vllm_plugins/llmtwin_steplog.py` times every
`EngineCore.step` of vllm/v1/engine/core.py and records its batch; `twin.lab.steplog` reads the log and
`twin.lab.steps` replays it). Fed to the twin with the engine's own arrival stamps, every step takes exactly
as long as the server's did, so the twin's request times differ from the server's only where its scheduling
differs: a figure that does not move with the machine's speed, since the machine's speed is in the
durations on both sides.

Matching a twin step to a recorded one (`match`):

- `composition` (the default): the recorded step with the same batch composition (prefill tokens, decode
  requests, prefill chunks, chunks that sample) whose position in the run is nearest the twin's own step
  count. While the twin's schedule agrees with the server's this is the very same step (the same duration,
  the machine's speed at that moment); where it diverges (a request admitted one step later) a step of the
  same shape from the same moment stands in, instead of every later step taking its neighbour's duration.
  A shape the server never ran takes the nearest recorded step within `window` steps, rescaled by the base
  model's ratio of the two batches (`base.step_time`), and is counted as `scaled`.
- `order`: the k-th twin step takes the k-th recorded duration. Exact only while the schedules agree step
  for step; any divergence shifts every later duration, so it is the strict check, not the default.

Past the recording (the twin ran more steps than the server) the base model prices the step (`beyond`).
`stats()` says how many steps matched each way (`order`: `mismatched` counts steps whose recorded shape was
not the twin's): the share matched exactly is the schedule's agreement.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

from twin.errors import TwinInputError
from twin.perf.base import StepBatch, StepTimeModel, decode_run_times_by_steps

MATCHES = ("composition", "order")


@dataclass(frozen=True)
class RecordedStep:
    """One engine step as the server ran it: its batch (the twin's sums) and its measured duration."""

    batch: StepBatch
    duration_s: float


def shape(b: StepBatch) -> tuple[int, int, int, int]:
    """The batch composition a recorded step is matched by: prefill tokens, decodes, chunks, sampling chunks."""
    return (int(b.num_prefill_tokens), int(b.num_decode_tokens), int(b.num_prefill_reqs), int(b.num_prefill_sampled))


class ReplayStepModel:
    """Recorded step durations in place of a model's; sizes, bounds and API times are the base model's."""

    def __init__(self, steps: Sequence[RecordedStep], base: StepTimeModel, match: str = "composition",
                 window: int = 64) -> None:
        if match not in MATCHES:
            raise TwinInputError(f"replay step model: match must be one of {', '.join(MATCHES)}, got {match!r}")
        if not steps:
            raise TwinInputError("replay step model: no recorded steps to replay")
        for i, s in enumerate(steps):
            if not s.duration_s >= 0:
                raise TwinInputError(f"replay step model: step {i} has duration {s.duration_s!r} (needs >= 0)")
        self.steps = list(steps)
        self.base = base
        self.gpu = base.gpu
        self.match = match
        self.window = int(window)
        self.calls = 0
        self.counts = {"exact": 0, "scaled": 0, "mismatched": 0, "beyond": 0}
        self._base_s = [base.step_time(s.batch) for s in self.steps]  # the base model's price of each
        self._by_shape: dict[tuple, list[int]] = {}
        for i, s in enumerate(self.steps):
            self._by_shape.setdefault(shape(s.batch), []).append(i)

    # -- step time --------------------------------------------------------------------------------------
    def step_time(self, b: StepBatch) -> float:
        if b.num_prefill_tokens + b.num_decode_tokens == 0:
            return 0.0
        k = self.calls
        self.calls += 1
        n = len(self.steps)
        if self.match == "order":
            if k >= n:
                self.counts["beyond"] += 1
                return self.base.step_time(b)
            self.counts["exact" if shape(self.steps[k].batch) == shape(b) else "mismatched"] += 1
            return self.steps[k].duration_s
        same = self._by_shape.get(shape(b))
        if same:
            j = bisect_left(same, k)
            near = min((x for x in (same[j - 1] if j > 0 else None, same[j] if j < len(same) else None)
                        if x is not None), key=lambda x: abs(x - k))
            if abs(near - k) <= self.window or k >= n:
                self.counts["exact"] += 1
                return self.steps[near].duration_s
        if k >= n:
            self.counts["beyond"] += 1
            return self.base.step_time(b)
        lo, hi = max(0, k - self.window), min(n, k + self.window + 1)
        want = self.base.step_time(b)
        best = min(range(lo, hi), key=lambda i: (abs(self._base_s[i] - want), abs(i - k)))
        self.counts["scaled"] += 1
        ref_model = self._base_s[best]
        return self.steps[best].duration_s * (want / ref_model) if ref_model > 0 else want

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        return decode_run_times_by_steps(self, num_decode, context0, k)

    def stats(self) -> dict:
        """How the twin's steps found their durations; `agreement`: the share that matched exactly."""
        called = sum(self.counts.values())
        return {**self.counts, "twin_steps": called, "recorded_steps": len(self.steps), "match": self.match,
                "agreement": self.counts["exact"] / called if called else float("nan")}

    # -- everything else: the base model's ----------------------------------------------------------------
    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.base.weight_bytes_per_gpu

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self.base.kv_bytes_per_token_per_gpu

    def peak_tokens_per_s(self) -> float:
        return self.base.peak_tokens_per_s()

    def ideal(self) -> StepTimeModel:
        return self.base.ideal()

    def api_request_s(self, prompt_tokens: int) -> float:
        return self.base.api_request_s(prompt_tokens)

    def api_token_s(self) -> float:
        return self.base.api_token_s()

    def api_queue_settings(self):
        return self.base.api_queue_settings()  # type: ignore[attr-defined]

    def host_time_s(self, num_requests: int) -> float:
        return self.base.host_time_s(num_requests)  # type: ignore[attr-defined]

    def describe(self) -> dict:
        return {"kind": "replay", "match": self.match, "window": self.window, "recorded_steps": len(self.steps),
                "base": self.base.describe(), "assumptions": ["match", "window"]}
