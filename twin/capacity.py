"""One instance's capacity at the SLO, measured with the twin: the highest Poisson rate it serves within the SLOs.

Scalers that plan from demand (`throughput`) divide forecast load by this. It runs a handful of short
single-instance simulations of the scenario's own request lengths, bisecting on the arrival rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twin.errors import TwinInputError


@dataclass(frozen=True)
class Capacity:
    req_s: float  # sustainable arrival rate per instance
    tokens_per_request: float  # mean prompt + output tokens of the requests it was measured on
    attainment_target: float
    probes: tuple  # (rate, attainment) pairs tried


def _lengths(sc, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    from twin.workload import build_stream

    stream = build_stream(sc)
    k = len(stream)
    if k == 0:
        raise TwinInputError("capacity: the workload has no requests to measure on")
    idx = rng.integers(0, k, n)
    return stream.prompt_tokens[idx], stream.output_tokens[idx]


def measure_capacity(sc, num_requests: int = 300, attainment: float = 0.9, iterations: int = 7) -> Capacity:
    """Bisect the rate between a light and an overloaded one, on 1 instance, no scaler, no sessions."""
    from twin.cluster import Cluster
    from twin.metrics import slo_mask
    from twin.workload import RequestStream

    s = sc.slo
    if s.ttft_s is None and s.tpot_s is None and s.e2e_s is None:
        raise TwinInputError("capacity: set at least one SLO (slo.ttft_s, slo.tpot_s or slo.e2e_s) to measure "
                             "an instance's capacity at it, or give the scaler capacity_req_s")
    rng = np.random.default_rng(sc.seed)
    prompt, output = _lengths(sc, num_requests, rng)
    one = sc.model_copy(update={
        "cluster": sc.cluster.model_copy(update={"num_instances": 1, "min_instances": 1, "max_instances": 1}),
        "scaler": sc.scaler.model_copy(update={"name": "none"}),
        "sim": sc.sim.model_copy(update={"timeline_interval_s": 0.0, "max_sim_time_s": None}),
    })
    gaps = rng.exponential(1.0, num_requests)
    probes = []

    def attained(rate: float) -> float:
        stream = RequestStream(np.cumsum(gaps) / rate, prompt, output)
        res = Cluster(one, stream).run()
        got = float(slo_mask(res.log, s).mean())
        probes.append((rate, got))
        return got

    lo, hi = 0.05, 1.0
    while attained(hi) >= attainment and hi < 1e4:
        lo, hi = hi, hi * 4
    if not probes or probes[0][1] < attainment and hi == 1.0:
        if attained(lo) < attainment:
            return Capacity(lo, float(np.mean(prompt + output)), attainment, tuple(probes))
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        if attained(mid) >= attainment:
            lo = mid
        else:
            hi = mid
    return Capacity(lo, float(np.mean(prompt + output)), attainment, tuple(probes))
