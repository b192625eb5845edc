"""Closed-loop load: N clients, each sending its next request when its previous one ends (after a think time).

This is the load of `vllm bench serve --max-concurrency N` (a semaphore of N around `request_rate inf`;
vllm/benchmarks/serve.py `benchmark`, `limited_request_func`), GenAI-Perf's `--concurrency` and InferenceX.
It is built on the stream's closed-loop turns (`RequestStream.after` / `think_s`): client c's k-th request is
request k * N + c and waits for request (k - 1) * N + c, so at most N are in flight, and exactly N while every
client still has requests to send. ASSUMPTION: requests are pinned to clients round-robin; vLLM's benchmark
hands the next prompt to whichever slot frees first, which differs only in which lengths a slot draws.
"""

from __future__ import annotations

import numpy as np

from twin.workload.stream import RequestStream, TraceStats


def closed_loop_stream(prompt: np.ndarray, output: np.ndarray, concurrency: int, rng: np.random.Generator,
                       think_time_s: float = 0.0, think: str = "fixed", ramp_up_s: float = 0.0,
                       stats: TraceStats | None = None) -> RequestStream:
    """The stream of `len(prompt)` requests sent by `concurrency` clients in closed loop.

    Client c starts at c * ramp_up_s / concurrency (0: all at once, as `vllm bench serve` does) and sends
    each later request `think_time_s` after its previous one ended (`think: exponential` draws the gap with
    that mean). `arrival_s` of a later request is only an open-loop estimate that orders the stream.
    """
    n = len(prompt)
    idx = np.arange(n, dtype=np.int64)
    client = idx % concurrency
    k = idx // concurrency
    after = np.where(idx >= concurrency, idx - concurrency, -1)
    if think_time_s > 0 and think == "exponential":
        gaps = rng.exponential(think_time_s, size=n)
    else:
        gaps = np.full(n, float(think_time_s))
    gaps[after < 0] = 0.0
    start = client * (ramp_up_s / concurrency)
    # non-decreasing in the index, which keeps each client's chain in order when the stream sorts itself
    arrival = np.where(after < 0, start, ramp_up_s + k * float(think_time_s))
    st = stats if stats is not None else TraceStats(source="closed loop", rows_read=n, rows_used=n)
    st.notes.append(f"closed loop: {concurrency} clients, think time {think_time_s:g} s ({think})")
    return RequestStream(arrival, prompt, output, stats=st, after=after, think_s=gaps)
