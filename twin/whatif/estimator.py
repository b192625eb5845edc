"""A cheap learned resource estimate: step time and KV blocks in use from a step's batch, by XGBoost.

Policies that must price many candidate batches (a planner, a router's look-ahead) may want an estimate
cheaper than a simulation and usable where only measurements exist. `record_run` collects training data from
a twin run (every step's `StepBatch`, its step time and the KV blocks in use when it ran, from the engine's
step events; the run is forced to step mode on one instance so every step is one event); measured profiles with the same columns train it the
same way. `ResourceEstimator.fit` learns both targets; `error_report` measures it against held-out twin
steps, and that error is what a policy using the estimate must budget for (the twin itself remains the
reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twin.engine.sink import StepRecorder
from twin.errors import TwinInputError
from twin.perf.base import StepBatch

FEATURES = ("num_prefill_tokens", "prefill_attn_tokens", "prefill_kv_read_tokens", "num_prefill_sampled",
            "num_decode_tokens", "decode_context_tokens", "num_prefill_reqs")


def features(batches: list[StepBatch]) -> np.ndarray:
    """The batch fields as a float matrix, one row per step (log1p: lengths span orders of magnitude)."""
    x = np.array([[getattr(b, f) for f in FEATURES] for b in batches], dtype=np.float64).reshape(-1, len(FEATURES))
    return np.log1p(x)


class StepLog(StepRecorder):
    """Every step one engine ran, subscribed to its events (twin.engine.sink): batch, seconds, KV blocks in use."""

    @property
    def times(self) -> list[float]:
        return [e - s for s, e in zip(self.starts, self.ends)]

    @property
    def kv_blocks(self) -> list[int]:
        return self.used_blocks


def record_run(sc, stream) -> StepLog:
    """Run `sc` on `stream` (one instance, step mode) and return every step its engine ran."""
    from twin.sim.cluster import Cluster, build_perf

    sc = sc.model_copy(deep=True)
    sc.sim.mode = "step"
    sc.sim.timeline_interval_s = 0.0
    c = sc.cluster
    c.min_instances, c.num_instances, c.max_instances = 1, 1, 1
    sc.scaler.name = "none"
    cluster = Cluster(sc, stream, perf=build_perf(sc))
    rec = StepLog()
    cluster.instances[0].subscribe(rec)
    cluster.run()
    return rec


def _xgb():
    try:
        import xgboost
    except ImportError:  # pragma: no cover - the [whatif] extra installs it
        raise TwinInputError("the resource estimator needs xgboost: pip install 'llmtwin[whatif]'") from None
    return xgboost


@dataclass
class ResourceEstimator:
    """Two gradient-boosted regressors over the batch features: log step time, and KV blocks in use."""

    n_estimators: int = 200
    max_depth: int = 6
    learning_rate: float = 0.1
    seed: int = 0
    models: dict = field(default_factory=dict)

    def fit(self, batches: list[StepBatch], step_times, kv_blocks=None) -> "ResourceEstimator":
        if len(batches) < 10:
            raise TwinInputError(f"the resource estimator needs at least 10 steps to train on, got {len(batches)}")
        xgb = _xgb()
        x = features(batches)
        kw = dict(n_estimators=self.n_estimators, max_depth=self.max_depth, learning_rate=self.learning_rate,
                  random_state=self.seed, n_jobs=1)
        self.models["step_time"] = xgb.XGBRegressor(**kw).fit(x, np.log(np.asarray(step_times, dtype=float)))
        if kv_blocks is not None:
            self.models["kv_blocks"] = xgb.XGBRegressor(**kw).fit(x, np.asarray(kv_blocks, dtype=float))
        return self

    def step_time(self, batches: list[StepBatch]) -> np.ndarray:
        """Estimated seconds per step."""
        return np.exp(self.models["step_time"].predict(features(batches)))

    def kv_blocks(self, batches: list[StepBatch]) -> np.ndarray:
        """Estimated KV blocks in use while the step runs."""
        if "kv_blocks" not in self.models:
            raise TwinInputError("this estimator was trained without KV use")
        return self.models["kv_blocks"].predict(features(batches))


def error_report(est: ResourceEstimator, batches: list[StepBatch], step_times, kv_blocks=None) -> dict:
    """The estimator against the twin on steps it did not train on: mean and p90 relative error."""
    t = np.asarray(step_times, dtype=float)
    rel = np.abs(est.step_time(batches) - t) / t
    out = {"steps": len(batches), "step_time_mape": float(rel.mean()), "step_time_p90_rel_err": float(np.quantile(rel, 0.9))}
    if kv_blocks is not None and "kv_blocks" in est.models:
        k = np.asarray(kv_blocks, dtype=float)
        err = np.abs(est.kv_blocks(batches) - k)
        out["kv_blocks_mae"] = float(err.mean())
        out["kv_blocks_rel_err"] = float(err.sum() / max(k.sum(), 1.0))
    return out


def train_from_run(sc, stream, test_share: float = 0.2, seed: int = 0) -> tuple[ResourceEstimator, dict]:
    """Record a twin run, train on a random (1 - test_share) of its steps, report the error on the rest."""
    rec = record_run(sc, stream)
    n = len(rec.batches)
    idx = np.random.default_rng(seed).permutation(n)
    k = max(1, int(n * test_share))
    test, train = idx[:k], idx[k:]
    pick = lambda xs, ii: [xs[i] for i in ii]  # noqa: E731
    times = rec.times  # derived from the step events: once
    est = ResourceEstimator(seed=seed).fit(pick(rec.batches, train), pick(times, train), pick(rec.kv_blocks, train))
    report = error_report(est, pick(rec.batches, test), pick(times, test), pick(rec.kv_blocks, test))
    report["train_steps"] = len(train)
    return est, report
