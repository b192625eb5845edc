"""The range pool (twin/engine/segment_pool.py) schedules exactly as the per-block reference pool.

Same traces through both pools (`Cluster(pool=...)`): identical cached tokens, first-token and finish times,
preemptions, evictions, the step-by-step schedule of every instance, and the KV events (per-block hashes).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from twin.sim.cluster import Cluster
from twin.engine.block_pool import BlockPool
from twin.engine.request import BlockKeys, engine_block_keys, engine_block_runs
from twin.engine.segment_pool import SegmentPool
from twin.policy.kv_events import BlockStored
from twin.scenario import load_scenario
from twin.workload import build_stream

from conftest import make_scenario, stream_of

ROOT = Path(__file__).resolve().parent.parent


def record(cl: Cluster, events: list) -> list:
    """Wrap every scheduler's schedule / commit_decode_run / pool sink to log what it decided."""
    steps: list = []
    for inst in cl.instances:
        sched = inst.scheduler
        i = inst.index

        def schedule(now, _s=sched, _orig=sched.schedule, _i=i):
            out = _orig(now)
            steps.append((_i, "s", now, tuple((r.idx, n, c) for r, n, c in out.prefills), out.num_decode,
                          tuple(r.idx for r in out.skipped), tuple(r.idx for r in out.preempted),
                          _s.pool.get_num_free_blocks()))
            return out

        def commit(j, ends, t0, _s=sched, _orig=sched.commit_decode_run, _i=i):
            fin = _orig(j, ends, t0)
            steps.append((_i, "run", j, ends[j - 1], tuple(r.idx for r in fin), _s.pool.get_num_free_blocks()))
            return fin

        try:
            sched.schedule = schedule
            sched.commit_decode_run = commit
        except AttributeError:  # the compiled build: native methods cannot be wrapped; logs still compared
            pass
        if events is not None:
            inst.pool.event_sink = lambda e, _i=i: events.append(
                (_i, type(e).__name__, tuple(e.block_hashes), getattr(e, "parent_block_hash", None)))
    return steps


def run_both(sc, stream, router=None, sink=False):
    out = {}
    for kind in ("per-block", "segment"):
        cl = Cluster(sc, stream, router, pool=kind)
        assert cl.segmented == (kind == "segment")
        events: list | None = [] if sink else None
        steps = record(cl, events)
        res = cl.run()
        for inst in res.instances:
            inst.pool.check()
            assert inst.pool.all_unreferenced()
            assert inst.pool.get_num_free_blocks() == inst.pool.num_usable_blocks
        out[kind] = (res, steps, events)
    return out


def assert_identical(out) -> None:
    (a, sa, ea), (b, sb, eb) = out["per-block"], out["segment"]
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x == y
    for col in ("status", "instance", "preemptions", "cached_tokens", "output_tokens", "scheduled_s",
                "first_token_s", "finish_s"):
        np.testing.assert_array_equal(getattr(a.log, col), getattr(b.log, col), err_msg=col)
    assert [i.pool.num_evictions for i in a.instances] == [i.pool.num_evictions for i in b.instances]
    assert [i.scheduler.stats.prefix_cache_hits for i in a.instances] == [
        i.scheduler.stats.prefix_cache_hits for i in b.instances]
    assert ea == eb


def mooncake(n: int, **ov):
    sc = load_scenario(ROOT / "scenarios" / "mooncake-replay.yaml", [f"{k}={v}" for k, v in ov.items()])
    stream = build_stream(sc)
    keep = slice(0, n)
    from twin.workload.stream import RequestStream

    st = RequestStream(stream.arrival_s[keep], stream.prompt_tokens[keep], stream.output_tokens[keep],
                       stream.hash_ids[keep], hash_block_size=stream.hash_block_size)
    return sc, st


MOONCAKE = [
    ("fast", True, None),
    ("step", True, None),
    ("fast", False, None),
    ("step", False, None),
    ("fast", True, 3000),  # a pool of 48k tokens: evictions and preemptions everywhere
    ("step", False, 3000),
    ("fast", False, 9000),
    ("step", True, 9000),
]


@pytest.mark.parametrize("mode,async_on,blocks", MOONCAKE)
def test_mooncake_sample_schedules_identically(mode, async_on, blocks):
    ov = {"sim.mode": mode, "cluster.engine.async_scheduling": str(async_on).lower(), "cluster.num_instances": 2}
    if blocks:
        ov["cluster.engine.num_gpu_blocks_override"] = blocks
        ov["cluster.engine.max_model_len"] = blocks * 16 - 2000
        ov["cluster.engine.rope_scaling_factor"] = 5  # 142,000 at 9,000 blocks: past Qwen2.5's YaRN x4
    sc, st = mooncake(120 if blocks else 200, **ov)
    out = run_both(sc, st)
    assert_identical(out)
    res = out["segment"][0]
    assert res.log.cached_tokens[res.log.status == 4].sum() > 0
    if blocks:
        assert sum(i.pool.num_evictions for i in res.instances) > 0


def test_mooncake_with_kv_events_and_a_precise_index_router():
    sc, st = mooncake(150, **{"router.name": "kv-cost", "router.prefix_index": "precise",
                              "cluster.engine.num_gpu_blocks_override": 6000, "cluster.num_instances": 3,
                              "cluster.engine.max_model_len": 90000})
    out = run_both(sc, st, sink=True)
    assert_identical(out)
    assert any(e[1] == "BlockRemoved" for e in out["segment"][2])


def synthetic(seed: int, hbs: int, n: int = 60):
    """Shared prefixes from a small tree of ids, partial last segments, sessions whose ids cover the answer."""
    rng = random.Random(seed)
    roots = [[rng.randrange(1000) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    arrivals, prompts, outputs, ids = [], [], [], []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(8.0)
        base = list(rng.choice(roots))
        if rng.random() < 0.3:
            base = base[: rng.randint(1, len(base))]
        tail = [rng.randrange(10_000) for _ in range(rng.randint(0, 4))]
        hid = base + tail
        p = max(1, len(hid) * hbs - rng.randrange(hbs))
        arrivals.append(t)
        prompts.append(p)
        outputs.append(rng.randint(1, 60))
        ids.append(hid)
    return arrivals, prompts, outputs, ids


SYNTH = [(seed, hbs, mode, a, blocks, tok, thr)
         for seed in range(3) for hbs in (64, 48)
         for mode, a, blocks, tok, thr in (("fast", False, 60, 128, 0), ("step", True, 60, 96, 0),
                                           ("step", False, 400, 2048, 0), ("fast", True, 90, 256, 32))]


@pytest.mark.parametrize("seed,hbs,mode,async_on,blocks,tokens,thr", SYNTH)
def test_shared_prefix_workloads_schedule_identically(seed, hbs, mode, async_on, blocks, tokens, thr):
    sc = make_scenario(**{"sim.mode": mode, "cluster.engine.async_scheduling": async_on,
                          "cluster.engine.num_gpu_blocks_override": blocks,
                          "cluster.engine.max_num_batched_tokens": tokens,
                          "cluster.engine.long_prefill_token_threshold": thr,
                          "cluster.engine.max_model_len": 900})
    a, p, o, ids = synthetic(seed, hbs)
    st = stream_of(a, p, o, ids, hash_block_size=hbs, hashes_cover_output=seed % 2 == 1)
    out = run_both(sc, st, sink=seed == 0)
    assert_identical(out)


def test_engine_block_runs_name_the_same_blocks_as_the_per_block_keys():
    rng = random.Random(3)
    for hbs in (16, 48, 64, 100, 512):
        for _ in range(20):
            ids = [rng.randrange(50) for _ in range(rng.randint(0, 9))]
            nt = rng.randrange(0, len(ids) * hbs + 40)
            flat = engine_block_keys(ids, hbs, 16, nt)
            runs = engine_block_runs(ids, hbs, 16, nt)
            assert list(runs) == flat and len(runs) == len(flat)
            assert all(runs[:m] == flat[:m] for m in range(len(flat) + 1))
            assert list(BlockKeys.from_keys(flat)) == flat
            if hbs == 64:
                assert len(runs.runs) == -(-len(flat) // 4)


def test_pool_ops_match_the_reference_block_by_block():
    """Random register / touch / release / evict sequences, duplicates included, on both pools."""
    for seed in range(40):
        rng = random.Random(seed)
        ref, seg = BlockPool(40), SegmentPool(40)
        ev_ref: list = []
        ev_seg: list = []
        ref.event_sink = ev_ref.append
        seg.event_sink = ev_seg.append
        chains = [rng.randrange(1 << 40) * 64 for _ in range(3)]
        holders: list = []  # (keys, ref handles, seg held)
        for _ in range(60):
            op = rng.random()
            if op < 0.45 and ref.get_num_free_blocks() >= 8:
                c = rng.choice(chains)
                n = rng.randint(1, 8)
                keys = BlockKeys([(c, 0, n)], n) if rng.random() < 0.7 else BlockKeys(
                    [(c, 0, 4), (c + 1000, 4, n)], n + 4)
                n = len(keys)
                hk = ref.num_cached_hits(list(keys), n - 1)
                assert seg.num_cached_hits(keys, n - 1) == hk
                assert seg.num_free_hits(keys, hk) == (ref.num_free_among(list(keys)[:hk]) if hk else 0)
                h_ref = ref.touch(list(keys)[:hk]) if hk else []
                h_seg = seg.touch_prefix(keys, hk) if hk else []
                ref.allocate(n - hk)
                seg.allocate(n - hk)
                cut = rng.randint(hk, n)
                for lo, hi in ((hk, cut), (cut, n)):
                    if hi > lo:
                        seg.register_blocks(keys, h_seg, lo, hi)
                        for j in range(lo, hi):
                            h_ref.append(ref.add_copy(keys[j]))
                        ref.event_sink(BlockStored(list(keys)[lo:hi], keys[lo - 1] if lo else None, None, 16))
                holders.append((keys, h_ref, h_seg))
            elif holders:
                keys, h_ref, h_seg = holders.pop(rng.randrange(len(holders)))
                ref.release_keyed(h_ref)
                seg.release_held(h_seg)
            if rng.random() < 0.3:
                k = rng.randint(0, ref.get_num_free_blocks())
                ref.allocate(k)
                seg.allocate(k)
                ref.num_anon_free += k
                seg.num_anon_free += k
            ref.check()
            seg.check()
            assert ref.get_num_free_blocks() == seg.get_num_free_blocks()
            assert ref.num_evictions == seg.num_evictions
            assert [(type(e).__name__, list(e.block_hashes), getattr(e, "parent_block_hash", 0)) for e in ev_ref] == [
                (type(e).__name__, list(e.block_hashes), getattr(e, "parent_block_hash", 0)) for e in ev_seg]
            for c in chains:
                probe = list(range(c, c + 8))
                assert ref.num_cached_hits(probe, 8) == seg.num_cached_hits(probe, 8)


FORK_CASES = [(mode, blocks, seed) for mode in ("fast", "step") for blocks in (70, 2000) for seed in range(3)]


def fork_scenario(mode, blocks, instances=1):
    return make_scenario(**{"cluster.num_instances": instances, "sim.mode": mode,
                            "cluster.engine.num_gpu_blocks_override": blocks,
                            "cluster.engine.max_num_batched_tokens": 256, "cluster.engine.max_num_seqs": 16,
                            "cluster.engine.max_model_len": 1100,
                            "sim.timeline_interval_s": 0, "router.scrape_interval_s": 0})


@pytest.mark.parametrize("mode,blocks,seed", FORK_CASES)
def test_a_fork_of_the_range_pool_runs_as_the_original(mode, blocks, seed):
    """Forks copy the ranges and their LRU links: advanced alone, a fork finishes as the original does."""
    from twin.engine.fork import fork_instance

    a, p, o, ids = synthetic(seed, 48, n=40)
    st = stream_of(a, p, o, ids, hash_block_size=48)
    sc = fork_scenario(mode, blocks, instances=2)
    cl = Cluster(sc, st, pool="segment")
    cl.env.run(until=a[-1] + 0.05)
    forks = [fork_instance(inst, cl.env.now) for inst in cl.instances]
    live = [{r.idx for r in list(inst.scheduler.running) + list(inst.scheduler.waiting)} for inst in cl.instances]
    assert any(live)
    for f in forks:
        f.advance()
    res = cl.run()
    ref = Cluster(sc, st, pool="per-block").run()  # the original is untouched, and equals the reference
    for col in ("first_token_s", "finish_s", "output_tokens", "preemptions", "cached_tokens"):
        np.testing.assert_array_equal(getattr(res.log, col), getattr(ref.log, col))
    shift = cl.api_token_s()
    for f, idxs in zip(forks, live):
        for i in idxs:
            assert f.sink.finish_s[i] + shift == res.log.finish_s[i], i
        assert not f.scheduler.has_unfinished_requests()
        f.scheduler.pool.check()
        assert f.scheduler.pool.get_num_free_blocks() == f.scheduler.pool.num_usable_blocks


def test_a_request_with_per_block_keys_hits_the_range_pool_as_its_runs_would():
    """A request built from a router's view (per-block hashes, as the forecaster builds one) is regrouped."""
    from twin.engine.fork import fork_instance
    from twin.engine.request import Request

    a, p, o, ids = synthetic(1, 64, n=30)
    st = stream_of(a, p, o, ids, hash_block_size=64)
    cl = Cluster(fork_scenario("fast", 2000), st, pool="segment")
    cl.env.run(until=a[-1] + 0.05)
    hits = 0
    for i in range(30):
        runs = engine_block_runs(ids[i], 64, 16, p[i])
        f1 = fork_instance(cl.instances[0], cl.env.now)
        f2 = fork_instance(cl.instances[0], cl.env.now)
        t = cl.env.now
        f1.arrive(Request(100 + i, t, p[i], 5, runs, -1), t)
        f2.arrive(Request(100 + i, t, p[i], 5, list(runs), -1), t)
        f1.advance()
        f2.advance()
        assert f1.sink.cached_tokens[100 + i] == f2.sink.cached_tokens[100 + i]
        assert f1.sink.finish_s[100 + i] == f2.sink.finish_s[100 + i]
        hits += f1.sink.cached_tokens[100 + i] > 0
    assert hits > 0


PARITY = [(name, seed, mode) for name in ("shared-prefix", "multi-turn", "streaming-turns", "preemption",
                                          "long-prompts", "long-prefill-threshold", "two-finishers", "random")
          for seed in range(3) for mode in ("step", "fast")]


@pytest.mark.parametrize("name,seed,mode", PARITY)
def test_the_differential_workloads_run_identically_on_the_range_pool(name, seed, mode, monkeypatch):
    """tests_vllm/test_parity.py checks the per-block pool against vLLM's scheduler on these workloads
    (token-hash keys, duplicates, streaming output blocks, preemption); the range pool must give the same
    trace (its keys regrouped from per-block hashes, one-block runs)."""
    import twin.lab.parity as parity

    wl = parity.WORKLOADS[name](seed)
    ref = parity.run_twin(wl, mode)
    monkeypatch.setattr(parity, "BlockPool", SegmentPool)
    pools: list = []
    seg = parity.run_twin(wl, mode, on_start=lambda s: pools.append(s.pool),
                          on_step=lambda s: s.pool.check())
    assert isinstance(pools[0], SegmentPool)
    assert not ref.error and not seg.error
    assert seg.steps == ref.steps
    assert seg.cached == ref.cached and seg.first_token == ref.first_token and seg.finish == ref.finish


def _random_id_paths(rng, n: int) -> list[list[int]]:
    """Prompts as trace-id paths: continuations of earlier prompts (turns), branches from them, fresh ones."""
    paths: list[list[int]] = []
    nxt = 1000
    for _ in range(n):
        u = rng.random()
        if paths and u < 0.5:  # a later turn: an earlier prompt plus new ids
            base = list(paths[rng.randrange(len(paths))])
        elif paths and u < 0.8:  # a branch: a prefix of an earlier prompt plus new ids
            p = paths[rng.randrange(len(paths))]
            base = list(p[:rng.randrange(1, len(p) + 1)])
        else:
            base = [0]  # a shared system prompt
        for _ in range(rng.randrange(1, 5)):
            base.append(nxt)
            nxt += 1
        paths.append(base)
    return paths


@pytest.mark.parametrize("seed", range(5))
def test_key_bases_keep_which_blocks_are_equal(seed):
    """Continued keys name the same blocks as chain + j: two blocks' keys are equal with bases iff without."""
    from twin.engine.request import KeyBases

    rng = random.Random(seed)
    paths = _random_id_paths(rng, 60)
    kb = KeyBases()
    old = [engine_block_keys(p, 64, 16, len(p) * 64) for p in paths]
    new = [engine_block_keys(p, 64, 16, len(p) * 64, kb.runs_of(p)) for p in paths]
    first_old: dict[int, tuple[int, int]] = {}
    first_new: dict[int, tuple[int, int]] = {}
    for i, (ko, kn) in enumerate(zip(old, new)):
        assert len(ko) == len(kn)
        for j, (a, b) in enumerate(zip(ko, kn)):
            # the first (request, block) that had each key: equal keys must map to the same first owner
            assert first_old.setdefault(a, (i, j)) == first_new.setdefault(b, (i, j))


def test_key_bases_make_a_conversation_one_run():
    """A later turn continuing the previous prompt (and a fresh prompt's own part) is one run, not one per id."""
    from twin.engine.request import KeyBases

    kb = KeyBases()
    turn1 = engine_block_runs([0, 1, 2, 3], 512, 16, 4 * 512, kb.runs_of([0, 1, 2, 3]))
    turn2 = engine_block_runs([0, 1, 2, 3, 4, 5], 512, 16, 6 * 512, kb.runs_of([0, 1, 2, 3, 4, 5]))
    other = engine_block_runs([0, 7, 8], 512, 16, 3 * 512, kb.runs_of([0, 7, 8]))  # a branch after id 0
    assert len(turn1.runs) == 1 and len(turn2.runs) == 1 and list(turn2)[:len(turn1)] == list(turn1)
    assert len(other.runs) == 2 and list(other)[:32] == list(turn1)[:32]
    assert set(list(other)[32:]).isdisjoint(list(turn2))
    # without bases every 512-token id is its own run
    assert len(engine_block_runs([0, 1, 2, 3, 4, 5], 512, 16, 6 * 512).runs) == 6
