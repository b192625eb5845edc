"""summarize's ITL quantiles over per-instance arrays (twin.sim.metrics.describe_parts) equal the joined, sorted ones."""

import numpy as np
import pytest

from twin.sim import metrics
from twin.sim.metrics import describe, describe_parts


def _parts(rng, kind):
    parts = []
    for _ in range(rng.integers(1, 6)):
        n = int(rng.integers(0, 3000))
        if kind == "continuous":
            v = rng.gamma(2.0, 0.01, n)
        elif kind == "ties":  # step durations repeat exactly: few distinct values, large multiplicities
            v = rng.choice(np.array([0.0071, 0.0072, 0.0125, 0.5]), n)
        else:  # one value almost everywhere, a few outliers, NaNs
            v = np.full(n, 0.008)
            if n:
                v[rng.integers(0, n, 5)] = rng.uniform(0, 1, 5)
                v[rng.integers(0, n, 3)] = np.nan
        w = rng.integers(0, 130, n).astype(np.int64)
        parts.append((v, w))
    return parts


@pytest.mark.parametrize("kind", ["continuous", "ties", "spike"])
@pytest.mark.parametrize("sort_at_most", [1 << 20, 7])  # 7: every range is narrowed by histograms first
def test_describe_parts_equals_describe_on_the_joined_samples(monkeypatch, kind, sort_at_most):
    monkeypatch.setattr(metrics, "_SORT_AT_MOST", sort_at_most)
    rng = np.random.default_rng(11)
    for _ in range(40):
        parts = _parts(rng, kind)
        v = np.concatenate([p[0] for p in parts]) if parts else np.empty(0)
        w = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, dtype=np.int64)
        want, got = describe(v, w), describe_parts(parts)
        assert got["count"] == want["count"]
        for k in metrics.QUANTILES:
            assert got[k] == want[k], (k, kind)  # the very same float
        if want["mean"] is None:
            assert got["mean"] is None
        else:
            assert got["mean"] == pytest.approx(want["mean"], rel=1e-12)


def test_describe_parts_of_nothing():
    assert describe_parts([])["count"] == 0
    assert describe_parts([(np.array([np.nan]), np.array([3]))])["p50"] is None


def test_percentiles_are_numpys_as_vllm_bench_serve_prints_them():
    """`vllm bench serve` prints np.median and np.percentile (linear between samples): on [10, 20, 30, 100] ms that
    is p50 25, p90 79, p99 97.9, not the samples 20, 100, 100 an inverted CDF gives."""
    d = describe(np.array([0.010, 0.020, 0.030, 0.100]))
    assert (d["p50"], d["p90"], d["p99"]) == tuple(np.percentile([0.010, 0.020, 0.030, 0.100], [50, 90, 99]))
    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 10, 999):
        v = rng.exponential(size=n)
        w = rng.integers(1, 5, size=n)
        want = np.percentile(np.repeat(v, w), [50, 90, 99]).tolist()
        assert [describe(v, w)[k] for k in metrics.QUANTILES] == want
        assert [describe_parts([(v[:n // 3], w[:n // 3]), (v[n // 3:], w[n // 3:])])[k]
                for k in metrics.QUANTILES] == want


def test_output_throughput_counts_finished_requests_as_vllm_bench_serve_does():
    """A run cut by max_sim_time_s: `throughput_output_tok_s` is the finished requests' tokens per second, every
    token generated is `generated_tok_s`."""
    from conftest import make_scenario, run_checked
    from twin.workload import build_stream

    sc = make_scenario(**{"workload.num_requests": 200, "workload.arrival.rate": 50, "sim.max_sim_time_s": 2.0})
    res = run_checked(sc, build_stream(sc))
    s = metrics.summarize(res)
    log = res.log
    fin = log.status == 4
    assert 0 < fin.sum() < 200
    assert s["throughput_output_tok_s"] == pytest.approx(log.output_tokens[fin].sum() / s["sim_time_s"])
    assert s["generated_tok_s"] > s["throughput_output_tok_s"]  # the unfinished requests' tokens
