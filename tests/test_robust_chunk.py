"""Robust chunk planner: a lucky stretch of the planning window does not move it off vLLM's default."""

import numpy as np
import pytest

from twin.policy.chunk import SLO, ChunkPlanner, EngineKnobs, OnlineChunkPlanner, WorkloadWindow
from twin.policy.robust_chunk import RobustChunkPlanner, block_bounds, block_resample, recent

DEFAULT = EngineKnobs(8192)
SLO_ = SLO(ttft_s=1.0, tpot_s=0.05)


def lucky_window():
    """160 requests, one a second; requests 80..89 (one of 16 time blocks) carry prompt 100, the rest 500."""
    p = np.full(160, 500)
    p[80:90] = 100
    return WorkloadWindow(np.arange(160.0), p, np.full(160, 50))


def lucky_evaluator(w, k, slo):
    """Chunks <= 512 win big on the lucky requests (1.7 vs 1) and lose 3 % on all others."""
    small = k.max_num_batched_tokens <= 512
    score = np.where(w.prompt_tokens == 100, 1.7 if small else 1.0, 0.97 if small else 1.0)
    return {"goodput_req_s": float(score.mean())}


def test_one_lucky_block_moves_the_old_planner_but_not_the_robust_one():
    w = lucky_window()
    # the whole window: small chunks are 1.5 % better, past the old planner's 1 % tie tolerance
    assert ChunkPlanner(lucky_evaluator).plan(w, SLO_).max_num_batched_tokens == 256
    for seed in range(5):
        p = RobustChunkPlanner(lucky_evaluator, DEFAULT, blocks=16, resamples=16, seed=seed)
        assert p.plan(w, SLO_) == DEFAULT
        assert p.wins[EngineKnobs(256)] < p.min_wins  # a resample needs the lucky block twice to clear the margin
        assert [r.knobs for r in p.table if r.chosen] == [DEFAULT]


def test_a_chunk_better_everywhere_is_picked():
    def ev(w, k, slo):
        return {"goodput_req_s": 1.1 if k.max_num_batched_tokens == 2048 else 1.0}

    p = RobustChunkPlanner(ev, DEFAULT, blocks=8, resamples=8)
    assert p.plan(lucky_window(), SLO_) == EngineKnobs(2048)
    assert p.wins[EngineKnobs(2048)] == 1.0 and p.gains[EngineKnobs(2048)] == pytest.approx(0.1)


def test_ties_keep_the_default_not_the_smallest_chunk():
    def flat(w, k, slo):  # every chunk meets the SLOs on a light window
        return {"goodput_req_s": 2.0 + (0.01 if k.max_num_batched_tokens == 256 else 0.0)}

    assert ChunkPlanner(flat).plan(lucky_window(), SLO_).max_num_batched_tokens == 256
    assert RobustChunkPlanner(flat, DEFAULT).plan(lucky_window(), SLO_) == DEFAULT


def test_recent_window_and_block_resample_keep_the_window_shape():
    w = lucky_window()
    r = recent(w, 39.5)
    assert r.arrival_s[0] == 120.0 and len(r) == 40
    assert recent(w, None) is w
    b = block_bounds(w, 16)
    assert b[0][0] == 0 and b[-1][1] == 160 and all(e >= s for s, e in b)
    assert sum(e - s for s, e in b) == 160
    rs = block_resample(w, 16, np.random.default_rng(3))
    assert np.all(np.diff(rs.arrival_s) >= 0)  # blocks laid end to end, in order
    assert rs.arrival_s[0] >= 0 and rs.arrival_s[-1] <= w.duration_s + 1e-9
    assert set(rs.prompt_tokens) <= {100, 500}
    same = RobustChunkPlanner(lucky_evaluator, DEFAULT, seed=7)
    assert all(np.array_equal(x.arrival_s, y.arrival_s) for x, y in zip(same.windows(w), same.windows(w)))


def test_the_robust_planner_only_scores_the_recent_part():
    seen = []

    def ev(w, k, slo):
        seen.append(w.prompt_tokens.copy())
        return {"goodput_req_s": 1.0}

    p = RobustChunkPlanner(ev, DEFAULT, chunks=[512], recent_s=60.0, resamples=3)
    p.plan(lucky_window(), SLO_)
    assert len(seen) == 2 * 3  # (candidates + default) x resamples
    assert all(100 not in s for s in seen)  # the lucky requests are older than the last 60 s


def test_bad_settings_are_refused():
    for kw in ({"blocks": 0}, {"resamples": 0}, {"min_wins": 0}, {"min_wins": 1.5}, {"margin": -0.1}):
        with pytest.raises(ValueError):
            RobustChunkPlanner(lucky_evaluator, DEFAULT, **kw)


def test_online_planner_runs_the_robust_planner():
    def ev(w, k, slo):
        return {"goodput_req_s": 1.5 if k.max_num_batched_tokens == 1024 else 1.0}

    on = OnlineChunkPlanner(RobustChunkPlanner(ev, DEFAULT, resamples=4), DEFAULT, window_s=1000, min_requests=10)
    for t, p, o in zip(lucky_window().arrival_s, lucky_window().prompt_tokens, lucky_window().output_tokens):
        on.observe(t, p, o)
    assert on.step(160.0, SLO_) == EngineKnobs(1024)


def test_the_fleet_runs_the_robust_planner_online_and_switches_on_a_real_shift():
    from twin.sim.cluster import Cluster
    from twin.policy.robust_chunk import RobustChunkPlanner as R

    from conftest import make_scenario, stream_of

    rng = np.random.default_rng(3)
    short = np.arange(0, 60, 0.1)
    long_ = 60 + np.arange(0, 60, 0.1)  # ~45k prompt tokens/s: more than 256-token steps can prefill
    arr = np.concatenate([short, long_])
    prompts = np.concatenate([rng.integers(50, 200, len(short)), rng.integers(3000, 6000, len(long_))])
    outs = np.concatenate([rng.integers(20, 60, len(short)), rng.integers(5, 20, len(long_))])
    sc = make_scenario(**{"cluster.num_instances": 1, "cluster.max_instances": 3, "cluster.startup_delay_s": 5.0,
                          "cluster.engine.max_num_batched_tokens": 256, "cluster.engine.max_num_seqs": 64,
                          "slo.ttft_s": 2.0, "scaler.name": "none"},
                       chunk_plan={"online": True, "interval_s": 20.0, "window_s": 30.0, "min_requests": 30,
                                   "candidates": [256, 2048, 8192], "apply": "new", "resamples": 3, "blocks": 4})
    cl = Cluster(sc, stream_of(arr, prompts, outs))
    cl.run()
    on = cl.fleet.chunk_planner
    assert isinstance(on.planner, R) and on.planner.resamples == 3
    assert on.changes and on.changes[0][0] > 60.0 and on.changes[0][1].max_num_batched_tokens > 256
