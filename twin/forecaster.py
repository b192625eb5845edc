"""The simulator's `Forecaster`: fork an instance exactly, give its requests their *predicted* lengths, run forward.

Block-style routers ask "what would this instance do with this request added?" A fork (twin.engine.fork)
copies the engine state; each request in it is then given the length the world predicted for it at arrival
(`RequestView.predicted_output_tokens`; the client's cap or the recent mean when no predictor is set), never
its true length unless the predictor is the oracle. Policies reach this only through the `Forecaster`
protocol in twin.policy.views.
"""

from __future__ import annotations

import heapq
import math

from twin.engine.fork import EngineFork, _fork_request, fork_instance
from twin.engine.request import Request
from twin.policy.views import Forecast, RequestView


def _predicted(view: RequestView | None, fallback: float) -> float:
    if view is not None and view.predicted_output_tokens is not None:
        return view.predicted_output_tokens
    if view is not None and view.max_tokens is not None:
        return view.max_tokens
    return fallback


def apply_predicted_lengths(f: EngineFork, lengths: dict[int, float]) -> None:
    """Replace each forked request's stop length by its prediction (never below what it already produced)."""
    s = f.scheduler
    for r in list(s.running) + list(s.waiting):
        if r.idx not in lengths:
            continue
        done = s._member_output(r) if r.in_decode else r.num_output_tokens
        r.max_tokens = max(int(math.ceil(lengths[r.idx])), done + 1)
    # the decode group's finish heap is keyed by each member's stop length: rebuild it
    heap = []
    for r in s.running:
        if r.in_decode:
            s._heap_seq += 1
            r.heap_seq = s._heap_seq
            heap.append((r.d_base + r.max_tokens - r.out_base, s._heap_seq, r))
    heapq.heapify(heap)
    s.finish_heap = heap


class SimForecaster:
    """Per-candidate look-ahead over the cluster's instances, for routers and scalers."""

    EXTRA = -1  # the index the extra request gets inside a fork

    def __init__(self, cluster, default_output_tokens: float = 256.0, horizon_s: float = 60.0) -> None:
        self.cluster = cluster
        self.default_output_tokens = default_output_tokens
        self.horizon_s = horizon_s
        self.calls = 0

    def _fallback(self) -> float:
        sig = self.cluster.dispatcher.signals
        _, osl = sig.mean_lengths(self.cluster.env.now, 600.0)
        return osl if osl is not None else self.default_output_tokens

    def fork(self, instance_id: str) -> tuple[EngineFork, list]:
        """An exact fork with predicted lengths in place of true ones, and the requests still on their way
        to it (in the API server) as (engine time, request) to arrive in the fork."""
        inst = self.cluster.by_id[instance_id]
        f = fork_instance(inst, self.cluster.env.now)
        transit = sorted(((t, _fork_request(r, {})) for r, t in self.cluster.in_transit.get(instance_id, {}).values()),
                         key=lambda x: x[0])
        fallback = self._fallback()
        inflight = self.cluster.dispatcher.inflight
        lengths = {idx: _predicted(rec[0], fallback) for idx, rec in inflight.items()}
        for _, r in transit:
            if r.idx in lengths:
                r.max_tokens = max(1, int(math.ceil(lengths[r.idx])))
        apply_predicted_lengths(f, lengths)
        return f, transit

    def engine_request(self, view: RequestView) -> Request:
        out = max(1, int(math.ceil(_predicted(view, self._fallback()))))
        return Request(self.EXTRA, self.cluster.env.now, view.num_prompt_tokens, out, list(view.prefix), -1)

    def forecast(self, instance_id: str, extra_request: RequestView | None = None,
                 horizon_s: float | None = None, until: str = "finish") -> Forecast:
        self.calls += 1
        f, transit = self.fork(instance_id)
        now = f.now
        horizon = now + (self.horizon_s if horizon_s is None else horizon_s)
        x = self.EXTRA
        log = f.log
        cl = self.cluster
        arrivals = list(transit)
        if extra_request is not None:
            # the engine sees the request after the API server's work, as in the cluster
            arrivals.append((now + cl._api_request_s(extra_request.num_prompt_tokens), self.engine_request(extra_request)))
        arrivals.sort(key=lambda a: a[0])  # stable: the extra request after any in transit at the same time
        for t_in, r in arrivals:
            f.arrive(r, t_in)
        if until == "first_token" and extra_request is not None:
            stop = lambda: x in log.first_token_s  # noqa: E731
        elif until == "finish" and extra_request is not None:
            stop = lambda: x in log.finish_s  # noqa: E731
        else:
            stop = None
        end = f.advance(until=horizon, stop=stop)
        shift = cl.api_token_s()  # tokens reach the client this much later
        ttft = log.first_token_s.get(x)
        fin = log.finish_s.get(x)
        ttft = None if ttft is None else ttft + shift
        fin = None if fin is None else fin + shift
        idle = not f.scheduler.has_unfinished_requests()
        wanted = {"first_token": ttft, "finish": fin, "drain": end if idle else None}.get(until)
        return Forecast(instance_id, None if ttft is None else ttft - now, None if fin is None else fin - now,
                        end - now if idle else None, f.scheduler.stats.kv_peak_used_blocks,
                        wanted is None and (extra_request is not None or until == "drain"), f.steps)
