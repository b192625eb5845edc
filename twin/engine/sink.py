"""What an engine tells the world: one sink object receives its request and step events.

vLLM's engine core reports through `EngineCoreOutputs` (per-request new tokens, finish reasons), the
scheduler's `SchedulerStats` and per-iteration `IterationStats` (`vllm/v1/metrics/stats.py`), and KV events
(`vllm/distributed/kv_events.py`). The twin's engine does the same through one sink: the scheduler calls
the methods below as things happen, and never writes into a run's records itself. The run's `RequestLog`
is a sink; the fork's `ForkLog` is one; the cluster adds its hooks with `FanOut`; calibration and what-if
subscribe to steps. KV events keep their own seam, the block pool's `event_sink` (one callable per pool,
as vLLM's block pool emits them).

Subclass `EngineSink` and override what you need; the engine skips step events when no subscriber asked
for them (`wants_steps`), so a run that records no steps pays nothing for them.
"""

from __future__ import annotations

from typing import Any

from twin.perf.base import StepBatch

EVENTS = ("request_queued", "request_scheduled", "request_running", "request_preempted", "first_token",
          "request_finished", "step", "decode_run")


class EngineSink:
    """No-op base: each method is one engine event, called at the simulated time it happens."""

    wants_steps = False  # True: `step` and `decode_run` are called (one call per step or per decode run)

    def request_queued(self, r: Any, now: float) -> None:
        """The request reached the engine's waiting queue (vLLM: `Scheduler.add_request`)."""

    def request_scheduled(self, r: Any, t_decided: float, cached_tokens: int) -> None:
        """First admission (vLLM's SCHEDULED event and prefix-cache stats), with its prefix-cache hit."""

    def request_running(self, r: Any) -> None:
        """Admitted into the running batch (first time or after a preemption)."""

    def request_preempted(self, r: Any) -> None:
        """Preempted (recompute): its blocks were freed; `r.num_preemptions` counts it already."""

    def first_token(self, r: Any, t: float) -> None:
        """The request's first output token was sampled in the step that ended at `t`."""

    def request_finished(self, r: Any, t: float) -> None:
        """The request reached its stop length in the step that ended at `t` (`r.num_output_tokens` final)."""

    def step(self, out: Any, t_end: float, used_blocks: int) -> None:
        """One scheduled step ran from `out.t_start` to `t_end` (`out.batch()` is its batch); KV blocks in use
        during it."""

    def decode_run(self, num_decode: int, decode_context: int, t0: float, ends: list[float],
                   used_blocks: int) -> None:
        """A fast-forwarded run of len(ends) decode-only steps of `num_decode` members each, from t0: step s ran
        from ends[s-1] (t0 for the first) to ends[s]; the first step attended `decode_context` tokens, each later
        one `num_decode` more; KV blocks in use at its end."""


def overrides(sink: Any, name: str) -> bool:
    """Does `sink` do something on event `name` (not the base class's no-op)?"""
    fn = getattr(type(sink), name, None)
    return fn is not None and fn is not getattr(EngineSink, name)


class FanOut(EngineSink):
    """Several sinks in order (the first sees each event first); each event calls only those that act on it."""

    def __init__(self, sinks: list[Any]) -> None:
        self.sinks = list(sinks)
        self.wants_steps = any(getattr(s, "wants_steps", False) for s in sinks)
        for name in EVENTS:
            setattr(self, "_" + name, [getattr(s, name) for s in sinks if overrides(s, name)])

    def request_queued(self, r: Any, now: float) -> None:
        for f in self._request_queued:
            f(r, now)

    def request_scheduled(self, r: Any, t_decided: float, cached_tokens: int) -> None:
        for f in self._request_scheduled:
            f(r, t_decided, cached_tokens)

    def request_running(self, r: Any) -> None:
        for f in self._request_running:
            f(r)

    def request_preempted(self, r: Any) -> None:
        for f in self._request_preempted:
            f(r)

    def first_token(self, r: Any, t: float) -> None:
        for f in self._first_token:
            f(r, t)

    def request_finished(self, r: Any, t: float) -> None:
        for f in self._request_finished:
            f(r, t)

    def step(self, out: Any, t_end: float, used_blocks: int) -> None:
        for f in self._step:
            f(out, t_end, used_blocks)

    def decode_run(self, num_decode: int, decode_context: int, t0: float, ends: list[float],
                   used_blocks: int) -> None:
        for f in self._decode_run:
            f(num_decode, decode_context, t0, ends, used_blocks)


class StepRecorder(EngineSink):
    """Every step an engine ran, as (start, end, batch, KV blocks in use): what calibration and what-if read.

    A decode run is expanded into its steps (each member one token, the context growing by one per member)."""

    wants_steps = True

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.batches: list[Any] = []
        self.used_blocks: list[int] = []

    def step(self, out: Any, t_end: float, used_blocks: int) -> None:
        self.starts.append(out.t_start)
        self.ends.append(t_end)
        self.batches.append(out.batch())
        self.used_blocks.append(used_blocks)

    def decode_run(self, num_decode: int, decode_context: int, t0: float, ends: list[float],
                   used_blocks: int) -> None:
        start = t0
        for s, e in enumerate(ends):  # as a stepped engine records them: each step starts at the last one's end
            self.starts.append(start)
            self.ends.append(e)
            start = e
            self.batches.append(StepBatch(num_decode_tokens=num_decode,
                                          decode_context_tokens=decode_context + s * num_decode))
            self.used_blocks.append(used_blocks)
