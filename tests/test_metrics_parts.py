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
            assert got[k] == want[k], (k, kind)  # an actual sample, the very same one
        if want["mean"] is None:
            assert got["mean"] is None
        else:
            assert got["mean"] == pytest.approx(want["mean"], rel=1e-12)


def test_describe_parts_of_nothing():
    assert describe_parts([])["count"] == 0
    assert describe_parts([(np.array([np.nan]), np.array([3]))])["p50"] is None
