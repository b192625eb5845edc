"""One instance's capacity at the SLO, measured with the twin: the highest Poisson rate it serves within the SLOs.

Scalers that plan from demand (`throughput`) divide forecast load by this. It runs a handful of short
single-instance simulations of the scenario's own request lengths, bisecting on the arrival rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from twin.errors import TwinInputError


@dataclass(frozen=True)
class Capacity:
    req_s: float  # sustainable arrival rate per instance
    tokens_per_request: float  # mean prompt + output tokens of the requests it was measured on
    attainment_target: float
    probes: tuple  # (rate, attainment) pairs tried


def measure_capacity(sc, prompt_tokens=None, output_tokens=None, attainment: float = 0.9, iterations: int = 7,
                     probe_s: float = 30.0, min_requests: int = 200, max_requests: int = 2000, *,
                     simulate: Callable[[Any, Any], Any]) -> Capacity:
    """Bisect the Poisson rate at which one instance meets the SLOs for `attainment` of requests.

    Request lengths are drawn from `prompt_tokens`/`output_tokens` (the run's own stream) or, without them,
    from the scenario's workload. Each probe lasts about `probe_s` simulated seconds of arrivals, long enough
    for an overloaded queue to show, within [min_requests, max_requests] requests; where that cap made the
    probes shorter than `probe_s`, the result is confirmed (and refined) with full-length probes of up to
    10 x max_requests. A probe is judged on its later half of arrivals, where a growing queue shows.

    `simulate(scenario, stream) -> SimResult` runs each probe (`twin.sim.cluster.simulate`): handed in, so that
    the cluster, which measures its throughput scaler's capacity before a run, and this module do not import
    each other.
    """
    from twin.sim.metrics import slo_mask
    from twin.workload import RequestStream, build_stream

    s = sc.slo
    if s.ttft_s is None and s.tpot_s is None and s.e2e_s is None:
        raise TwinInputError("capacity: set at least one SLO (slo.ttft_s, slo.tpot_s or slo.e2e_s) to measure "
                             "an instance's capacity at it, or give the scaler capacity_req_s")
    rng = np.random.default_rng(sc.seed)
    if prompt_tokens is None or output_tokens is None:
        stream = build_stream(sc)
        prompt_tokens, output_tokens = stream.prompt_tokens, stream.output_tokens
    prompt_tokens = np.asarray(prompt_tokens)
    output_tokens = np.asarray(output_tokens)
    if len(prompt_tokens) == 0:
        raise TwinInputError("capacity: the workload has no requests to measure on")
    one = sc.model_copy(update={
        "cluster": sc.cluster.model_copy(update={"num_instances": 1, "min_instances": 1, "max_instances": 1}),
        "scaler": sc.scaler.model_copy(update={"name": "none", "params": {}}),
        "sim": sc.sim.model_copy(update={"timeline_interval_s": 0.0, "max_sim_time_s": None}),
    })
    probes = []
    mean_tokens = float(np.mean(prompt_tokens + output_tokens))

    def attained(rate: float, cap: int = max_requests) -> float:
        n = int(min(max(rate * probe_s, min_requests), cap))
        idx = rng.integers(0, len(prompt_tokens), n)
        stream = RequestStream(np.cumsum(rng.exponential(1.0 / rate, n)), prompt_tokens[idx], output_tokens[idx])
        res = simulate(one, stream)
        # judged on the later half of arrivals: an overloaded queue grows over the probe, so early requests see
        # a near-empty engine and a short probe (many short requests, max_requests) would flatter the rate
        got = float(slo_mask(res.log, s)[n // 2:].mean())
        probes.append((rate, got))
        return got

    lo, hi = 0.0, 1.0
    while attained(hi) >= attainment and hi < 1e5:
        lo, hi = hi, hi * 4
    if lo == 0.0:
        lo = hi / 64
        if attained(lo) < attainment:
            return Capacity(lo, mean_tokens, attainment, tuple(probes))
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        if attained(mid) >= attainment:
            lo = mid
        else:
            hi = mid
    # Short requests at a high rate: max_requests caps the probe below probe_s of arrivals, too short for a
    # slowly growing queue to show. Confirm with a full-length probe and bisect down with such probes if it fails.
    full = int(max(lo * probe_s, min_requests))
    if full > max_requests:
        long_cap = int(min(full, 10 * max_requests))
        if attained(lo, long_cap) < attainment:
            hi, lo = lo, lo * 0.7
            while attained(lo, long_cap) < attainment and lo > hi / 64:
                hi, lo = lo, lo * 0.7
            for _ in range(max(2, iterations // 2)):
                mid = (lo * hi) ** 0.5
                if attained(mid, long_cap) >= attainment:
                    lo = mid
                else:
                    hi = mid
    return Capacity(lo, mean_tokens, attainment, tuple(probes))
