"""Prefix- and load-aware routers on hand-made fleets: each one's defining behaviour, with either prefix index."""

import random

import pytest

from twin.policy import (ApproxPrefixIndex, BlockRemoved, BlockStored, Bookkeeping, CacheAware, KVCost, LMetric,
                         PreciseIndex, Reject, SessionAffinity, Weighted, make_router, register_scorer)
from twin.policy.prefix_index import _leading_match

from policy_fakes import fleet_of, req

KINDS = ["approximate", "precise"]


def index_with(kind, placed):
    """An index of `kind` that holds each prefix on its instances: placed = {instance: [prefix, ...]}."""
    idx = ApproxPrefixIndex() if kind == "approximate" else PreciseIndex()
    for inst, prefixes in placed.items():
        for p in prefixes:
            if kind == "approximate":
                idx.on_dispatch(p, inst)
            else:
                idx.apply(inst, BlockStored(list(p)))
    return idx


def chain(tag, n):
    """n chained block hashes: equal tags and positions give equal hashes, as the contract asks."""
    return [hash((tag, j)) for j in range(n)]


def place(kind, idx, prefix, inst):
    """What the world does after a dispatch: the approximate index learns at once, the precise one by event."""
    if kind == "approximate":
        idx.on_dispatch(prefix, inst)
    else:
        idx.apply(inst, BlockStored(list(prefix)))


# -- lmetric ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_lmetric_prefers_the_warm_instance_until_its_batch_flips_the_product(kind):
    p = chain("sys", 62)  # 62 full blocks of a 1000-token prompt
    idx = index_with(kind, {"a": [p[:50]]})  # a holds 800 tokens of it: p_tokens 200 there, 1000 on b
    picks = {}
    for b in range(8):
        fleet = fleet_of({"id": "a", "inflight": b, "running": 0}, {"id": "b", "inflight": 0, "running": 40},
                         index=idx)  # stale gauges say the opposite; the books are what counts
        picks[b] = {LMetric(seed=s).choose(req(prompt=1000, prefix=p), fleet) for s in range(12)}
    # 200 x (b + 1) against 1000 x 1: a while b < 4, a tie at 4, b after
    assert all(picks[b] == {"a"} for b in range(4))
    assert picks[4] == {"a", "b"}
    assert all(picks[b] == {"b"} for b in range(5, 8))


def test_lmetric_on_gauges_reads_running_plus_waiting():
    p = chain("sys", 62)
    idx = index_with("approximate", {"a": [p[:50]]})
    fleet = fleet_of({"id": "a", "running": 3, "waiting": 3, "inflight": 0}, {"id": "b", "inflight": 9}, index=idx)
    assert LMetric(load_signal="gauges").choose(req(prompt=1000, prefix=p), fleet) == "b"  # 200 x 7 > 1000 x 1
    assert LMetric().choose(req(prompt=1000, prefix=p), fleet) == "a"  # books: 200 x 1 < 1000 x 10
    with pytest.raises(ValueError):
        LMetric(load_signal="vibes")


def test_lmetric_full_hit_still_counts_load_and_raw_product_ties_idle_instances():
    p = chain("sys", 10)
    idx = index_with("approximate", {"a": [p]})
    fleet = fleet_of({"id": "a", "inflight": 30}, {"id": "b", "inflight": 0}, index=idx)
    # 160 tokens all cached on a: vLLM still computes 1 token, so a scores 1 x 31 against 160 x 1
    assert LMetric().choose(req(prompt=160, prefix=p), fleet) == "a"
    fleet = fleet_of({"id": "a", "inflight": 200}, {"id": "b", "inflight": 0}, index=idx)
    assert LMetric().choose(req(prompt=160, prefix=p), fleet) == "b"
    idle = fleet_of({"id": "a"}, {"id": "b"}, {"id": "c"}, index=idx)
    # bs_offset 0 is the raw product: every idle instance scores 0, the prefix no longer matters
    assert {LMetric(bs_offset=0, seed=s).choose(req(prompt=160, prefix=p), idle) for s in range(20)} == {"a", "b", "c"}
    assert {LMetric(seed=s).choose(req(prompt=160, prefix=p), idle) for s in range(20)} == {"a"}


def _drive(router, kind, idx, books, ids, prefixes, n, rng):
    """Route n requests whose prefixes are drawn from `prefixes`, booking each dispatch as the world does."""
    targets = []
    for k in range(n):
        p = prefixes[rng.randrange(len(prefixes))]
        r = req(k, prompt=len(p) * 16 + 10, prefix=p)
        fleet = fleet_of(*({"id": i} for i in ids), index=idx, bookkeeping=books)
        t = router.choose(r, fleet)
        books.dispatched(r.id, t, r.num_prompt_tokens)
        place(kind, idx, p, t)
        targets.append(t)
    return targets


@pytest.mark.parametrize("kind", KINDS)
def test_lmetric_hotspot_guard_fires_on_a_skewed_prefix_and_spreads_it(kind):
    ids = ["i0", "i1", "i2", "i3"]
    hot = chain("hot", 64)
    for guard in (False, True):
        idx = index_with(kind, {"i0": [hot]})
        router = LMetric(hotspot=guard, seed=1)
        targets = _drive(router, kind, idx, Bookkeeping(), ids, [hot], 80, random.Random(0))
        if not guard:
            # 10 prefill tokens x bs on i0 against 1034 elsewhere: the score alone keeps it all on i0
            assert set(targets) == {"i0"} and router.hotspot_spreads == 0
        else:
            assert router.hotspot_spreads >= 3
            assert set(targets) == set(ids)  # spread, instance by instance, until the prefix lives on all
            # no verdict before the window holds hotspot_min_requests (32), the 32nd is spread
            assert targets[:31] == ["i0"] * 31 and targets[31] != "i0"


@pytest.mark.parametrize("kind", KINDS)
def test_lmetric_hotspot_guard_stays_quiet_on_a_uniform_mix(kind):
    ids = ["i0", "i1", "i2", "i3"]
    prefixes = [chain(f"p{k}", 64) for k in range(20)]
    idx = index_with(kind, {ids[k % 4]: [] for k in range(4)})
    for k, p in enumerate(prefixes):
        place(kind, idx, p, ids[k % 4])
    router = LMetric(seed=2)
    targets = _drive(router, kind, idx, Bookkeeping(), ids, prefixes, 400, random.Random(3))
    assert router.hotspot_spreads == 0  # each prefix draws ~5% of requests, far below |M|/N = 25%
    assert len(set(targets)) == 4


def test_lmetric_cold_start_caps_a_new_instance_at_half_the_mean_batch():
    p = chain("sys", 60)
    idx = index_with("approximate", {"a": [p], "b": [p]})
    r = req(prompt=1000, prefix=p)

    def fleet(new_load, now):
        return fleet_of({"id": "a", "inflight": 10, "started_at": 0.0}, {"id": "b", "inflight": 10, "started_at": 0.0},
                        {"id": "new", "inflight": new_load, "started_at": 100.0}, index=idx, now=now)

    router = LMetric()
    # the warm ones hold the prefix: 40 x 11 = 440 beats the fresh instance's (1000 + 10) x 1
    assert router.choose(r, fleet(0, 110.0)) in ("a", "b")
    r_cold = req(prompt=1000)  # no prefix: p_tokens 1000 everywhere, the new instance's empty batch wins
    assert router.choose(r_cold, fleet(0, 110.0)) == "new"
    assert router.choose(r_cold, fleet(4, 110.0)) == "new"  # below half the mean (5)
    assert router.choose(r_cold, fleet(5, 110.0)) in ("a", "b")  # capped while warming
    assert router.cold_capped == 1
    assert router.choose(r_cold, fleet(5, 170.0)) == "new"  # warm after 60 s: the plain score again
    assert LMetric(cold_start=False).choose(r_cold, fleet(5, 110.0)) == "new"


# -- weighted (llm-d) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_weighted_default_profile_sums_queue_kv_and_prefix(kind):
    p = chain("doc", 20)
    idx = index_with(kind, {"a": [p]})
    fleet = fleet_of({"id": "a", "waiting": 4, "kv": 0.5}, {"id": "b", "waiting": 0, "kv": 0.1}, index=idx)
    # a: queue 0 x 2 + kv 0.5 x 2 + prefix 1 x 3 = 4.0; b: 1 x 2 + 0.9 x 2 + 0 = 3.8
    assert Weighted().choose(req(prompt=330, prefix=p), fleet) == "a"
    assert Weighted(scorers={"queue": 2, "kv": 2}).choose(req(prompt=330, prefix=p), fleet) == "b"
    assert make_router("weighted", scorers={"prefix": 1}).prefix_index == "any"
    assert make_router("weighted", scorers={"queue": 1}).prefix_index is None  # no index needed, none built


def test_weighted_filters_and_user_scorers_are_configuration():
    @register_scorer("test-fewest-running")
    class FewestRunning:
        def score(self, ctx, instances):
            return [1.0 / (1 + v.num_running) for v in instances]

    fleet = fleet_of({"id": "a", "waiting": 3, "running": 0}, {"id": "b", "waiting": 0, "running": 5})
    assert make_router("weighted", scorers={"test-fewest-running": 1}).choose(req(), fleet) == "a"
    assert make_router("weighted", scorers=[{"name": "queue", "weight": 1}]).choose(req(), fleet) == "b"
    low = make_router("weighted", scorers={"test-fewest-running": 1},
                      filters=[{"name": "low-queue", "params": {"threshold": 2}}])
    assert low.choose(req(), fleet) == "b"
    none_pass = make_router("weighted", filters=[{"name": "low-queue", "params": {"threshold": -1}}])
    assert isinstance(none_pass.choose(req(), fleet), Reject)
    for bad in ({"nope": 1}, {"queue": "heavy"}, {"queue": -1}, {}, [{"name": "queue"}]):
        with pytest.raises(ValueError):
            make_router("weighted", scorers=bad)
    with pytest.raises(ValueError, match="unknown filter"):
        make_router("weighted", filters=["nope"])


def test_weighted_breaks_ties_at_random_and_least_queue_filter_keeps_the_low_bucket():
    fleet = fleet_of({"id": "a"}, {"id": "b"}, {"id": "c"})
    assert {Weighted(seed=s).choose(req(), fleet) for s in range(30)} == {"a", "b", "c"}
    fleet = fleet_of({"id": "a", "waiting": 0}, {"id": "b", "waiting": 1}, {"id": "c", "waiting": 9})
    w = Weighted(scorers={"kv": 1}, filters=["least-queue"])  # bucket [0, 0 + 9/3]: a and b
    assert {Weighted(scorers={"kv": 1}, filters=["least-queue"], seed=s).choose(req(), fleet)
            for s in range(30)} == {"a", "b"}
    assert w.choose(req(), fleet) in ("a", "b")


# -- kv-cost (Dynamo) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_kv_cost_is_overlap_weighted_prefill_plus_active_blocks(kind):
    p = chain("doc", 20)  # 320 tokens, 20 blocks
    idx = index_with(kind, {"a": [p[:10]]})
    fleet = fleet_of({"id": "a"}, {"id": "b"}, index=idx)
    r = req(prompt=320, prefix=p)
    costs, _ = KVCost().costs(r, fleet)
    assert costs == [1.0 * 10 + 10, 1.0 * 20 + 20]  # prefill blocks + (active 0 + new blocks)
    assert KVCost().choose(r, fleet) == "a"
    busy = fleet_of({"id": "a", "decode": 480}, {"id": "b"}, index=idx)  # 30 blocks decoding on a
    assert KVCost().costs(r, busy)[0] == [10 + 30 + 10, 40]
    assert KVCost().choose(r, busy) == "b"
    assert KVCost(overlap_score_weight=3.0).choose(r, busy) == "a"  # 3 x 10 + 40 = 70 < 3 x 20 + 20 = 80


def test_kv_cost_books_its_own_pending_prefill_between_dispatch_and_first_token():
    fleet = fleet_of({"id": "a"}, {"id": "b"})
    router = KVCost(seed=0)
    r1 = req(1, prompt=320)
    t = router.choose(r1, fleet)
    router.on_dispatch(r1, t, 0.0)
    other = "b" if t == "a" else "a"
    r2 = req(2, prompt=320)
    assert router.choose(r2, fleet) == other  # the first one's 20 prefill blocks are still pending there
    router.on_first_token(r1, t, 0.1)
    assert router._prefill == {}
    assert {KVCost(seed=s).choose(r2, fleet) for s in range(20)} == {"a", "b"}  # tie again: random


def test_kv_cost_temperature_samples_a_seeded_softmax_over_normalised_costs():
    p = chain("doc", 20)
    idx = index_with("approximate", {"a": [p]})
    fleet = fleet_of({"id": "a"}, {"id": "b"}, {"id": "c"}, index=idx)
    r = req(prompt=320, prefix=p)
    assert {KVCost().choose(r, fleet) for _ in range(10)} == {"a"}
    hot = KVCost(temperature=1.0, seed=4)
    picks = [hot.choose(r, fleet) for _ in range(600)]
    assert set(picks) == {"a", "b", "c"}
    # normalised costs 0, 1, 1 at T = 1: P(a) = 1 / (1 + 2 / e) ~ 0.58
    assert 0.50 < picks.count("a") / 600 < 0.66
    again = KVCost(temperature=1.0, seed=4)
    assert [again.choose(r, fleet) for _ in range(600)] == picks


# -- cache-aware (SGLang) --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_cache_aware_balanced_follows_the_prefix_imbalanced_takes_the_shortest_queue(kind):
    p = chain("doc", 20)
    idx = index_with(kind, {"a": [p], "c": [chain("x", 50)]})
    r = req(prompt=330, prefix=p)
    balanced = fleet_of({"id": "a", "inflight": 40}, {"id": "b", "inflight": 0}, {"id": "c", "inflight": 5},
                        index=idx)
    assert CacheAware().choose(r, balanced) == "a"  # max - min = 40 <= 64: cache wins (rate 0.97)
    imbalanced = fleet_of({"id": "a", "inflight": 70}, {"id": "b", "inflight": 0}, {"id": "c", "inflight": 5},
                          index=idx)
    assert CacheAware().choose(r, imbalanced) == "b"  # 70 - 0 > 64 and 70 > 1.5 x 0
    relative = fleet_of({"id": "a", "inflight": 170}, {"id": "b", "inflight": 120}, {"id": "c", "inflight": 150},
                        index=idx)
    assert CacheAware().choose(r, relative) == "a"  # 170 < 1.5 x 120: still balanced
    # a short match (below the 0.3 rate) goes to the smallest cache (b holds nothing), or the least loaded
    short = req(prompt=330, prefix=p[:4] + chain("new", 16))
    assert CacheAware().choose(short, balanced) == "b"
    assert CacheAware(fallback="least-loaded").choose(short, balanced) == "b"
    assert CacheAware(cache_threshold=0.1).choose(short, balanced) == "a"  # 64/330 > 0.1


def test_cache_aware_smallest_cache_fallback_reads_the_index_size():
    idx = index_with("approximate", {"a": [chain("x", 30)], "b": [chain("y", 5)], "c": [chain("z", 12)]})
    fleet = fleet_of({"id": "a"}, {"id": "b", "inflight": 50}, {"id": "c"}, index=idx)
    assert CacheAware().choose(req(prompt=100), fleet) == "b"
    assert CacheAware(fallback="least-loaded").choose(req(prompt=100), fleet) in ("a", "c")


# -- session-affinity ------------------------------------------------------------------------------------

def test_session_affinity_sticks_while_the_instance_serves_then_moves():
    books = Bookkeeping()
    router = SessionAffinity(inner={"name": "least-outstanding"})
    fleet = fleet_of({"id": "a"}, {"id": "b", "inflight": 3}, bookkeeping=books)
    assert router.choose(req(1, session="s1"), fleet) == "a"
    fleet = fleet_of({"id": "a", "inflight": 9}, {"id": "b", "inflight": 0}, bookkeeping=books)
    assert router.choose(req(2, session="s1"), fleet) == "a"  # the inner router would say b
    assert router.choose(req(3), fleet) == "b"  # no session: the inner router
    drained = fleet_of({"id": "a", "state": "draining"}, {"id": "b"}, bookkeeping=books)
    assert router.choose(req(4, session="s1"), drained) == "b"
    assert router.choose(req(5, session="s1"), fleet) == "b"  # the mapping moved with it
    assert router.sticky_decisions == 2


def test_session_affinity_memory_is_bounded_and_wraps_any_router():
    router = make_router("session-affinity", inner={"name": "round-robin"}, max_sessions=2)
    fleet = fleet_of({"id": "a"}, {"id": "b"}, {"id": "c"})
    first = [router.choose(req(k, session=f"s{k}"), fleet) for k in range(3)]
    assert first == ["a", "b", "c"]
    assert len(router._sessions) == 2
    assert router.choose(req(9, session="s2"), fleet) == "c"  # remembered
    assert router.choose(req(10, session="s0"), fleet) == "a"  # forgotten: the inner router's next
    assert make_router("session-affinity", inner={"name": "lmetric"}).prefix_index == "any"
    with pytest.raises(ValueError):
        make_router("session-affinity", inner={"name": "nope"})
    kv = make_router("session-affinity", inner={"name": "kv-cost"})
    r = req(1, prompt=320, session="s")
    t = kv.choose(r, fleet)
    kv.on_dispatch(r, t, 0.0)
    assert kv.inner._prefill == {t: 320}  # hooks reach the inner router
    kv.on_first_token(r, t, 0.1)
    assert kv.inner._prefill == {}


# -- one-pass sums: the same numbers as scoring each -----------------------------------------------------

def _random_fleet(rng, n, index=None):
    specs = [{"id": f"i{k}", "waiting": rng.choice([0, 3, rng.randint(0, 9)]), "kv": rng.random(),
              "inflight": rng.randint(0, 30)} for k in range(n)]
    if rng.random() < 0.3:  # every queue equal: the min-max scorers give 1.0 to all
        for s in specs:
            s["waiting"] = 4
    return fleet_of(*specs, index=index)


@pytest.mark.parametrize("seed", range(6))
def test_weighted_one_pass_sum_gives_the_same_floats_as_scoring_each_then_adding(seed):
    from twin.policy.scorers import Context, fuse_scorers

    rng = random.Random(seed)
    p = chain("sys", 40)
    idx = index_with("approximate", {"i0": [p], "i1": [p[:7]], "i3": [p[:30]]})
    for _ in range(40):
        names = rng.sample(["queue", "kv", "prefix", "inflight"], rng.randint(1, 4))
        router = Weighted(scorers={nm: rng.choice([0, 1, 2, 3, 0.7]) for nm in names}, seed=seed)
        fleet = _random_fleet(rng, rng.randint(1, 9), idx)
        r = req(prompt=700, prefix=p[:rng.choice([0, 5, 40])] + chain(f"q{rng.random()}", 2))
        ctx = Context(r, fleet)
        want = None  # the generic path: each scorer's list, times its weight, added in order
        for _, w, sc in router.scorers:
            if w:
                part = [x * w for x in sc.score(ctx, fleet.instances)]
                want = part if want is None else [a + b for a, b in zip(want, part)]
        fused = fuse_scorers(router.scorers)
        if want is None:
            assert fused is None
        else:
            assert fused(ctx, fleet.instances) == want


def test_weighted_sums_a_subclassed_scorer_by_its_own_score():
    from twin.policy.scorers import QueueScorer, fuse_scorers

    class LongestQueue(QueueScorer):  # a user's override of a built-in: the one-pass sum must not bypass it
        def score(self, ctx, instances):
            return [1.0 - x for x in super().score(ctx, instances)]

    router = Weighted(scorers={"kv": 1})
    router.scorers = [("queue", 1.0, LongestQueue())]
    assert fuse_scorers(router.scorers) is None
    fleet = fleet_of({"id": "a", "waiting": 0}, {"id": "b", "waiting": 5})
    assert router.choose(req(), fleet) == "b"


@pytest.mark.parametrize("seed", range(4))
def test_lmetric_scores_the_product_whether_few_or_most_instances_hold_the_prefix(seed):
    """Both ways of scoring (per holder, or one pass over the fleet when most hold some) pick the least product."""
    rng = random.Random(seed)
    p = chain("doc", 60)
    for _ in range(30):
        n = rng.randint(2, 12)
        holders = rng.sample(range(n), rng.choice([1, n // 2, n]))
        cut = {k: rng.randint(1, 60) for k in holders}
        idx = index_with("approximate", {f"i{k}": [p[:c]] for k, c in cut.items()})
        fleet = fleet_of(*({"id": f"i{k}", "inflight": rng.randint(0, 20)} for k in range(n)), index=idx)
        prompt = 60 * 16 + rng.randint(0, 15)
        score = {v.id: max(prompt - cut.get(int(v.id[1:]), 0) * 16, 1) * (v.load.requests + 1)
                 for v in fleet.instances}
        best = min(score.values())
        router = LMetric(hotspot=False, cold_start=False, seed=seed)
        got = router.choose(req(prompt=prompt, prefix=p + chain(f"q{rng.random()}", 3)), fleet)
        assert score[got] == best


# -- prefix index: bisection equals the block-by-block walk ---------------------------------------------

def _random_tree(rng, n_heads=4, n_prefixes=40):
    heads = [chain(f"h{k}", rng.randint(1, 12)) for k in range(n_heads)]
    out = []
    for k in range(n_prefixes):
        h = heads[rng.randrange(n_heads)]
        cut = rng.randint(1, len(h))
        out.append(h[:cut] + [hash((tuple(h[:cut]), k, j)) for j in range(rng.randint(0, 15))])
    return out


@pytest.mark.parametrize("seed", range(12))
def test_index_match_equals_the_reference_walk_under_dispatch_eviction_and_events(seed):
    rng = random.Random(seed)
    prefixes = _random_tree(rng)
    ids = [f"i{k}" for k in range(5)]
    approx = ApproxPrefixIndex(capacity_blocks=rng.choice([8, 30, 200]))
    precise = PreciseIndex()
    for step in range(300):
        p = prefixes[rng.randrange(len(prefixes))]
        inst = ids[rng.randrange(len(ids))]
        approx.on_dispatch(p, inst)
        op = rng.random()
        if op < 0.5:  # a stored run, possibly starting mid-chain (a hole before it)
            a = rng.randrange(len(p))
            b = rng.randint(a + 1, len(p))
            precise.apply(inst, BlockStored(p[a:b], parent_block_hash=p[a - 1] if a else None))
        elif op < 0.9:
            held = list(precise._held.get(inst, ()))
            if held:
                precise.apply(inst, BlockRemoved(rng.sample(held, min(len(held), rng.randint(1, 4)))))
        elif op < 0.95:
            precise.remove_instance(inst)
        else:
            approx.remove_instance(inst)
        if step % 10 == 0:
            for q in rng.sample(prefixes, 8):
                q = q + chain(f"tail{step}", rng.randint(0, 3))
                want = set(rng.sample(ids, rng.randint(1, 5)))
                for idx in (approx, precise):
                    assert idx.match(q, want) == _leading_match(idx._holders, q, want)
                    assert idx.match(q, None) == _leading_match(idx._holders, q, set(ids))
    for inst in ids:  # nothing left behind once every instance is gone
        approx.remove_instance(inst)
        precise.remove_instance(inst)
    for idx in (approx, precise):
        assert not idx._holders and not idx._chains.closed and not idx._chains.parent



def _walk_levels(closed, prefix):
    """The level-by-level walk block by block: each level's instances as `cur - next`, in that order (the order
    a router reading the dict sees, e.g. cache-aware's ties)."""
    out = {}
    cur = closed.get(prefix[0]) if prefix else None
    if not cur:
        return out
    for j in range(1, len(prefix)):
        s = closed.get(prefix[j])
        if not s:
            out.update(dict.fromkeys(cur, j))
            return out
        if len(s) < len(cur):
            out.update(dict.fromkeys(cur - s, j))
            cur = s
    out.update(dict.fromkeys(cur, len(prefix)))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_chain_match_finds_every_level_in_the_walks_order_on_long_chains_and_tails(seed):
    """Long shared heads, many instances (many levels), unknown tails of 0..40 blocks, fully held prefixes:
    the galloping-back / divide-and-conquer match gives the walk's dict, items in the same order."""
    from twin.policy.prefix_index import _chain_match

    rng = random.Random(seed)
    ids = [f"i{k}" for k in range(rng.choice([3, 16, 40]))]
    heads = [chain(f"h{seed}.{k}", rng.randint(1, 300)) for k in range(3)]
    prefixes = []
    for k in range(60):
        h = heads[rng.randrange(len(heads))]
        cut = rng.randint(1, len(h))
        prefixes.append(h[:cut] + [hash((seed, k, j)) for j in range(rng.randint(0, 200))])
    approx = ApproxPrefixIndex(capacity_blocks=rng.choice([50, 400, 100_000]))
    for _ in range(400):
        p = prefixes[rng.randrange(len(prefixes))]
        approx.on_dispatch(p[:rng.randint(1, len(p))], ids[rng.randrange(len(ids))])
    closed = approx._chains.closed
    for k in range(200):
        q = prefixes[rng.randrange(len(prefixes))]
        q = q[:rng.randint(1, len(q))] + chain(f"t{seed}.{k}", rng.choice([0, 0, 1, 2, 5, 40]))
        got = _chain_match(closed, q)
        assert list(got.items()) == list(_walk_levels(closed, q).items())
        assert got == _leading_match(approx._holders, q, set(ids))


def test_chain_match_terminates_on_prefixes_that_break_the_chain_contract():
    """Hashes reused at other positions (not chained): the sets along a prefix are then not nested; the match
    must still answer (instances and counts within the prefix), not raise or loop."""
    from twin.policy.prefix_index import _chain_match

    rng = random.Random(5)
    ids = [f"i{k}" for k in range(6)]
    approx = ApproxPrefixIndex(capacity_blocks=60)
    for _ in range(300):
        approx.on_dispatch([rng.randrange(30) for _ in range(rng.randint(1, 40))], rng.choice(ids))
    for _ in range(300):
        q = [rng.randrange(30) for _ in range(rng.randint(1, 60))]
        got = _chain_match(approx._chains.closed, q)
        assert set(got) <= set(ids) and all(1 <= c <= len(q) for c in got.values())
    idx = index_with("approximate", {"a": [[1, 2]], "b": [[1, 2]], "c": [[5]]})  # 5 held after unknown blocks
    assert _chain_match(idx._chains.closed, [1, 99, 98, 5]) == {"a": 1, "b": 1, "c": 4}


def test_a_router_block_may_set_the_routers_own_seed():
    """`router: {name: p2c, params: {seed: 3}}` used to fail with "multiple values for keyword argument 'seed'";
    the block's seed wins over the scenario's."""
    from types import SimpleNamespace

    from twin.policy.base import build_router

    fleet = fleet_of(*({"id": f"i{k}", "inflight": k % 3} for k in range(8)))

    def picks(params, seed):
        r = build_router(SimpleNamespace(name="p2c", params=params), seed=seed)
        return [r.choose(req(), fleet) for _ in range(40)]

    assert picks({"seed": 3}, 0) == picks({"seed": 3}, 99) == picks({}, 3)
    assert picks({"seed": 3}, 0) != picks({"seed": 4}, 0)


def test_load_routers_pick_the_least_and_break_ties_at_random_in_fleet_order():
    """least-outstanding (either signal) and least-kv: a unique minimum wins without drawing from the generator (so
    later ties draw as before); ties draw one index among the tied, in fleet order."""
    from twin.policy.routers import LeastKV, LeastOutstanding

    fleet = fleet_of({"id": "a", "inflight": 3, "running": 2, "kv": 0.5}, {"id": "b", "inflight": 1, "running": 4,
                     "kv": 0.2}, {"id": "c", "inflight": 2, "running": 1, "kv": 0.9})
    lor, gauges, kv = LeastOutstanding(seed=5), LeastOutstanding(signal="gauges", seed=5), LeastKV(seed=5)
    state = lor._rng.getstate()
    assert (lor.choose(req(), fleet), gauges.choose(req(), fleet), kv.choose(req(), fleet)) == ("b", "c", "b")
    assert lor._rng.getstate() == state
    tied = fleet_of({"id": "a", "inflight": 1}, {"id": "b", "inflight": 4}, {"id": "c", "inflight": 1},
                    {"id": "d", "inflight": 1})
    picks = [LeastOutstanding(seed=s).choose(req(), tied) for s in range(30)]
    assert set(picks) == {"a", "c", "d"}
    assert picks == [["a", "c", "d"][random.Random(s).randrange(3)] for s in range(30)]


def test_argmin_index_is_the_first_least_then_the_drawn_tie():
    """`argmin_index` (compiled: one typed pass) picks as min, index and count do, with the same draw."""
    from twin.policy.views import argmin_index

    def reference(values, rng):
        best = min(values)
        i = values.index(best)
        ties = values.count(best)
        if ties > 1:
            for _ in range(rng.randrange(ties)):
                i = values.index(best, i + 1)
        return i

    gen = random.Random(7)
    picks = set()
    for case in range(400):
        values = [gen.randrange(4) for _ in range(gen.randrange(1, 20))]
        got = argmin_index(values, random.Random(case))
        assert got == reference(values, random.Random(case)), values
        if values.count(min(values)) > 1:
            picks.add(got != values.index(min(values)))
    assert picks == {True, False}  # ties went both to the first tied and to a later one


def test_draw_below_is_randrange():
    """`draw_below(rng, n)` gives `rng.randrange(n)`'s draws, in sequence, for a `random.Random` and a subclass."""
    from twin.policy.views import draw_below

    class OwnRandom(random.Random):
        def random(self):  # a subclass that draws from random() alone: randrange takes another path
            return super().random()

    for cls in (random.Random, OwnRandom):
        a, b = cls(11), cls(11)
        for n in [1, 2, 3, 5, 7, 8, 16, 17, 100, 2**40 + 3] * 20:
            assert draw_below(a, n) == b.randrange(n)
