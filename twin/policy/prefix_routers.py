"""Prefix- and load-aware routers from the field: LMetric, llm-d's weighted scorers, Dynamo's KV cost, SGLang's
cache-aware policy. Each reads views only (a `FleetView` and its prefix index), works with either prefix index
(`prefix_index = "any"`) and reads the router's fresh books for load unless told to read the scraped gauges.
"""

from __future__ import annotations

import math
import random
from collections import deque
from itertools import repeat
from operator import add, mul
from typing import Any, Callable, Mapping, Sequence

from twin.policy.base import ParamError, RouterBase, check_seed, register_router, require, require_finite
from twin.policy.routers import NO_INSTANCE
from twin.policy.scorers import (Context, build_filters, build_scorers, cached_blocks, fuse_scorers,
                                max_score_pick)
from twin.policy.views import FleetView, InstanceView, Reject, RequestView

LOAD_SIGNALS = ("bookkeeping", "gauges")


def _check_signal(signal: str) -> str:
    require(signal in LOAD_SIGNALS, "load_signal", f"must be 'bookkeeping' or 'gauges', got {signal!r}")
    return signal


def _loads(insts: Sequence[InstanceView], signal: str) -> list[int]:
    """Requests at each instance: the router's in-flight count (fresh) or scraped running + waiting."""
    if signal == "gauges":
        return [v.gauges.num_running + v.gauges.num_waiting for v in insts]
    return [v.load.requests for v in insts]


class _FleetCache:
    """Per-fleet facts that change only when the world replaces its instance list (each scrape, each
    lifecycle change): instance positions and start times. Keyed on the list object and its length."""

    __slots__ = ("ref", "n", "ids", "pos", "t0", "t1", "started")

    def __init__(self) -> None:
        self.ref: object = None
        self.n = -1

    def of(self, insts: Sequence[InstanceView]) -> "_FleetCache":
        if insts is not self.ref or len(insts) != self.n:
            self.ref = insts
            self.n = len(insts)
            self.ids = [v.id for v in insts]
            self.pos = {v.id: k for k, v in enumerate(insts)}
            self.started = [v.started_at for v in insts]
            self.t0 = min(self.started) if insts else 0.0
            self.t1 = max(self.started) if insts else 0.0
        return self


def _argmin(values: Sequence[float], rng: random.Random) -> int:
    """Index of the least value, ties uniformly at random."""
    best = min(values)
    if values.count(best) == 1:
        return values.index(best)
    tied = [k for k, x in enumerate(values) if x == best]
    return tied[rng.randrange(len(tied))]


def _argmax(values: Sequence[float], rng: random.Random) -> int:
    best = max(values)
    if values.count(best) == 1:
        return values.index(best)
    tied = [k for k, x in enumerate(values) if x == best]
    return tied[rng.randrange(len(tied))]


@register_router("lmetric")
class LMetric(RouterBase):
    """The multiplicative score: the least `p_tokens x bs` wins, random tie-break.

    Source: Zhang et al., "LMetric: Simple is Better - Multiplication May Be All You Need for LLM Request
    Scheduling" (arXiv 2603.15202, 2026). `p_tokens` = prompt tokens still to prefill there (prompt minus
    the leading tokens the prefix index says are cached there) and `bs` = requests running + waiting there.

    - `bs` is the router's in-flight count (`load_signal: bookkeeping`, fresh between scrapes) or the scraped
      running + waiting (`load_signal: gauges`).
    - `p_tokens >= 1`: vLLM always recomputes the last prompt token (`KVCacheManager.get_computed_blocks`
      caps a hit at `num_tokens - 1`), so a full hit does not zero the score.
    - ASSUMPTION `bs_offset = 1`: the score is `p_tokens x (bs + 1)`, so an idle instance does not score 0
      whatever its prefill (the paper's degenerate case "both indicators zero" becomes a plain comparison
      of prefill work; set 0 for the raw product, where every idle instance ties at 0).
    - Hotspot guard (the paper's two stages): over a sliding window of the last `hotspot_window` requests,
      a prefix (its first `hotspot_prefix_blocks` blocks) with request share `x`, held by the set `M` of
      instances, is hot when `x / (1 - x) > |M| / (N - |M|)` (stage 1: it draws more than `M`'s share of
      the fleet) and the last `> 2|M|` requests of it were all routed into `M` (stage 2); the next one is
      spread: routed by score among the instances outside `M`. ASSUMPTIONS (user-settable):
      `hotspot_window = 1000`, `hotspot_prefix_blocks = 4`, `hotspot_min_requests = 32` (no verdict on a
      nearly empty window).
    - Cold start: an instance that began serving after the fleet's first ones and less than `warmup_s`
      ago (ASSUMPTION 60 s; `InstanceView.started_at`) takes requests
      only while its batch is below `cold_batch_frac` (0.5, the paper's half) of the warm instances' mean
      (at least 1), and scores `(p_tokens + cold_token_penalty) x (bs + bs_offset)` (penalty 10 tokens).
    """

    name = "lmetric"
    prefix_index = "any"

    def __init__(self, load_signal: str = "bookkeeping", bs_offset: int = 1, hotspot: bool = True,
                 hotspot_window: int = 1000, hotspot_prefix_blocks: int = 4, hotspot_min_requests: int = 32,
                 cold_start: bool = True, warmup_s: float = 60.0, cold_batch_frac: float = 0.5,
                 cold_token_penalty: float = 10.0, seed: int = 0) -> None:
        self.load_signal = _check_signal(load_signal)
        require(0 <= bs_offset < math.inf, "bs_offset", f"must be >= 0, got {bs_offset}")
        for k, v in (("hotspot_window", hotspot_window), ("hotspot_prefix_blocks", hotspot_prefix_blocks),
                     ("hotspot_min_requests", hotspot_min_requests)):
            require(v >= 1, k, f"must be >= 1, got {v}")
        require(warmup_s >= 0, "warmup_s", f"must be >= 0, got {warmup_s}")
        require(0 < cold_batch_frac <= 1, "cold_batch_frac", f"must be in (0, 1], got {cold_batch_frac}")
        # inf: an idle warming instance would score inf x 0 = NaN
        require_finite("cold_token_penalty", cold_token_penalty, 0, strict=False)
        seed = check_seed(seed)
        self.bs_offset = bs_offset
        self.hotspot = hotspot
        self.hotspot_prefix_blocks = hotspot_prefix_blocks
        self.hotspot_min_requests = hotspot_min_requests
        self.cold_start = cold_start and warmup_s > 0
        self.warmup_s = warmup_s
        self.cold_batch_frac = cold_batch_frac
        self.cold_token_penalty = cold_token_penalty
        self._rng = random.Random(seed)
        self._window: deque = deque(maxlen=hotspot_window)
        self._counts: dict[int, int] = {}
        self._streak: dict[int, int] = {}
        self._fleet = _FleetCache()
        self.hotspot_spreads = 0  # decisions the hotspot guard redirected
        self.cold_capped = 0  # decisions where a warming instance was held back

    def _observe(self, key: int) -> float:
        """Push the request's prefix key into the window; its share there."""
        w = self._window
        counts = self._counts
        if len(w) == w.maxlen:
            old = w.popleft()
            c = counts[old] - 1
            if c:
                counts[old] = c
            else:
                del counts[old]
                self._streak.pop(old, None)
        w.append(key)
        counts[key] = counts.get(key, 0) + 1
        return counts[key] / len(w)

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        insts = fleet.instances
        n = len(insts)
        if not n:
            return NO_INSTANCE
        fc = self._fleet.of(insts)
        prompt = req.num_prompt_tokens if req.num_prompt_tokens > 1 else 1
        # _loads and cached_blocks inline (a decision is ~25 us at 16 instances; each call ~0.1)
        loads = [v.load.requests for v in insts] if self.load_signal == "bookkeeping" else _loads(insts, "gauges")
        off = self.bs_offset
        prefix = req.prefix
        idx = fleet.prefix_index
        cached = idx.match(prefix, None) if idx is not None and prefix else {}
        bsz = req.prefix_block_size
        # mine(k): leading blocks cached at position k (0: none); dense: the same as a list over the fleet
        dense: list[int] | None = None
        if cached and 4 * len(cached) >= n:  # most instances hold some of it: one pass over the fleet
            get = cached.get
            dense = [get(i, 0) for i in fc.ids]
            # c = 0 gives prompt (>= 1): the uncached score
            scores = [(p if p > 1 else 1) * (b + off) for c, b in zip(dense, loads) for p in (prompt - c * bsz,)]
            mine = dense.__getitem__
        else:  # few holders: score everyone uncached, then fix the holders
            scores = [prompt * (b + off) for b in loads]
            at: dict[int, int] = {}  # position -> cached blocks, for routable instances with a match
            if cached:
                pos = fc.pos
                for iid, c in cached.items():
                    k = pos.get(iid)
                    if k is not None:
                        at[k] = c
                        p = prompt - c * bsz
                        scores[k] = (p if p > 1 else 1) * (loads[k] + off)
            mine = lambda k, g=at.get: g(k, 0)  # noqa: E731
        if self.cold_start and fc.t1 > fc.t0 and fleet.now - fc.t1 < self.warmup_s:
            self._cold(fc, fleet.now, prompt, bsz, loads, mine, scores)
        if self.hotspot and prefix:
            depth = len(prefix)
            if depth > self.hotspot_prefix_blocks:
                depth = self.hotspot_prefix_blocks
            key = prefix[depth - 1]
            x = self._observe(key)
            # instances holding the key's blocks (a C-level count over the fleet in the dense case)
            m = n - sum(map(depth.__gt__, dense)) if dense is not None else sum(1 for c in at.values() if c >= depth)
            if 0 < m < n and len(self._window) >= self.hotspot_min_requests:
                stage1 = x >= 1.0 or x / (1.0 - x) > m / (n - m)
                if stage1 and self._streak.get(key, 0) > 2 * m:
                    outside = [k for k in range(n) if mine(k) < depth and scores[k] != math.inf]
                    if outside:
                        k = outside[_argmin([scores[j] for j in outside], self._rng)]
                        self._streak[key] = 0
                        self.hotspot_spreads += 1
                        return insts[k].id
            best = min(scores)  # _argmin inline when there is no tie (a tie draws as _argmin does)
            k = scores.index(best) if scores.count(best) == 1 else _argmin(scores, self._rng)
            if mine(k) >= depth:
                self._streak[key] = self._streak.get(key, 0) + 1
            else:
                self._streak[key] = 0
            return insts[k].id
        return insts[_argmin(scores, self._rng)].id

    def _cold(self, fc: _FleetCache, now: float, prompt: int, bsz: int, loads: list[int],
              mine: Callable[[int], int], scores: list[float]) -> None:
        """Warming instances: held back at half the warm mean batch, else scored with the token penalty."""
        t0 = fc.t0
        warm_s = self.warmup_s
        cold = [k for k, t in enumerate(fc.started) if t > t0 and now - t < warm_s]
        if not cold:
            return
        cold_set = set(cold)
        warm_loads = [b for k, b in enumerate(loads) if k not in cold_set]
        cap = max(1.0, self.cold_batch_frac * sum(warm_loads) / len(warm_loads))
        pen = self.cold_token_penalty
        off = self.bs_offset
        held = False
        for k in cold:
            if loads[k] >= cap:
                scores[k] = math.inf
                held = True
            else:
                p = max(prompt - mine(k) * bsz, 1)
                scores[k] = (p + pen) * (loads[k] + off)
        self.cold_capped += held


DEFAULT_WEIGHTS: Mapping[str, float] = {"queue": 2, "kv": 2, "prefix": 3}


@register_router("weighted")
class Weighted(RouterBase):
    """llm-d's scheduling profile as data: filters, then a weighted sum of 0..1 scorers, then max-score pick.

    Source: llm-d inference scheduler's default profile (`queue-scorer` weight 2, `kv-cache-utilization-scorer`
    2, `prefix-cache-scorer` 3, `max-score-picker`; llm-d `guides/inference-scheduling`), with the GIE
    plugins listed in `twin.policy.scorers`. `scorers: {name: weight}` (or a list of `{name, weight,
    params}`), `filters: [name | {name, params}]`; a filter that leaves no instance rejects the request,
    as llm-d answers 503 when no endpoint passes.
    """

    name = "weighted"
    prefix_index = "any"

    def __init__(self, scorers: Any = DEFAULT_WEIGHTS, filters: Any = (), seed: int = 0) -> None:
        try:
            self.scorers = build_scorers(scorers)
        except ValueError as e:
            raise ParamError("scorers", str(e)) from None
        try:
            self.filters = build_filters(list(filters) if isinstance(filters, tuple) else filters)
        except ValueError as e:
            raise ParamError("filters", str(e)) from None
        seed = check_seed(seed)
        self.prefix_index = ("any" if any(getattr(s, "needs_prefix_index", False) for _, _, s in self.scorers)
                             else None)
        self._rng = random.Random(seed)
        self._fused: tuple = ((), None)  # (the scorers it was built from, their one-pass sum or None)

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        insts: Sequence[InstanceView] = fleet.instances
        if not insts:
            return NO_INSTANCE
        ctx = Context(req, fleet)
        for fname, f in self.filters:
            insts = f.filter(ctx, insts)
            if not insts:
                return Reject(f"no instance passed the {fname} filter")
        key = tuple(self.scorers)
        fused = self._fused
        if fused[0] != key:  # built once; again if the scorers are changed
            fused = self._fused = (key, fuse_scorers(key))
        if fused[1] is not None:
            return max_score_pick(insts, fused[1](ctx, insts), self._rng)
        totals: list[float] | None = None
        for _, w, sc in self.scorers:
            if w == 0:
                continue
            vals = sc.score(ctx, insts)
            if not getattr(sc, "bounded", False):  # a user scorer: clamp to 0..1 as llm-d does
                vals = [0.0 if x < 0 else 1.0 if x > 1 else x for x in vals]
            part = vals if w == 1 else list(map(mul, vals, repeat(w)))
            totals = part if totals is None else list(map(add, totals, part))
        if totals is None:
            totals = [0.0] * len(insts)
        return max_score_pick(insts, totals, self._rng)


@register_router("kv-cost", "kv_cost", "dynamo")
class KVCost(RouterBase):
    """Dynamo's KV router: the least `overlap_score_weight x prefill blocks + decode blocks` wins.

    Source: ai-dynamo/dynamo, `DefaultWorkerSelector::worker_logit` and `softmax_sample` in the KV router's
    scheduling selector (`--kv-overlap-score-weight` default 1.0, `--router-temperature` default 0.0), with
    `potential_blocks_and_tokens` of its active-sequence tracker. Per instance:

    - prefill blocks = (prompt tokens still prefilling there + this request's uncached tokens) / block size;
      the router keeps its own ledger of the uncached tokens it sent (Dynamo's `prefill_tokens`, dropped at
      first token: `mark_prefill_completed`).
    - decode blocks = context of the requests in flight there (the books' prompt + decode tokens) / block
      size + this request's blocks not cached there. Dynamo counts unique blocks; the books count tokens
      per request, so shared prefixes are counted once per request (a deviation, heavier on hot prefixes).
    - `temperature > 0` samples from `softmax(-(cost - min) / ((max - min) x T))` (seeded); 0 takes the
      minimum, ties at random (Dynamo breaks ties by smaller radix tree first; the twin has no tree size).
    """

    name = "kv-cost"
    prefix_index = "any"

    def __init__(self, overlap_score_weight: float = 1.0, temperature: float = 0.0, seed: int = 0) -> None:
        # inf: costs of inf - inf (NaN), or a uniform draw (temperature)
        require_finite("overlap_score_weight", overlap_score_weight, 0, strict=False)
        require_finite("temperature", temperature, 0, strict=False)
        seed = check_seed(seed)
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._rng = random.Random(seed)
        self._prefill: dict[str, int] = {}  # instance -> uncached prompt tokens still prefilling
        self._ledger: dict[str, tuple[str, int]] = {}  # request -> (instance, tokens)
        self._last: tuple[str, str, int] | None = None
        self._fleet = _FleetCache()

    def costs(self, req: RequestView, fleet: FleetView) -> tuple[list[float], dict[int, int]]:
        """Cost per routable instance, and the cached blocks at the positions that have some."""
        insts = fleet.instances
        bs = req.prefix_block_size
        prompt = req.num_prompt_tokens
        req_blocks = -(-prompt // bs)
        w = self.overlap_score_weight
        inv = 1.0 / bs
        const = w * prompt * inv + req_blocks  # this request's prefill and blocks where nothing is cached
        pf = self._prefill
        if pf:
            pfg = pf.get
            costs = [(w * pfg(v.id, 0) + v.load.prompt_tokens + v.load.decode_tokens) * inv + const for v in insts]
        else:
            costs = [(v.load.prompt_tokens + v.load.decode_tokens) * inv + const for v in insts]
        mine: dict[int, int] = {}
        cached = cached_blocks(req, fleet)
        if cached:
            pos = self._fleet.of(insts).pos
            for iid, c in cached.items():
                k = pos.get(iid)
                if k is not None:
                    mine[k] = c
                    hit = c * bs
                    costs[k] -= w * (hit if hit < prompt else prompt) * inv + c
        return costs, mine

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        insts = fleet.instances
        if not insts:
            return NO_INSTANCE
        costs, mine = self.costs(req, fleet)
        if self.temperature > 0 and len(costs) > 1:
            k = self._softmax_sample(costs)
        else:
            k = _argmin(costs, self._rng)
        new_tokens = max(req.num_prompt_tokens - mine.get(k, 0) * req.prefix_block_size, 0)
        self._last = (req.id, insts[k].id, new_tokens)
        return insts[k].id

    def _softmax_sample(self, costs: Sequence[float]) -> int:
        lo = min(costs)
        hi = max(costs)
        if hi == lo:
            return self._rng.randrange(len(costs))
        scale = 1.0 / ((hi - lo) * self.temperature)
        weights = [math.exp(-(c - lo) * scale) for c in costs]
        r = self._rng.random() * sum(weights)
        acc = 0.0
        for k, wt in enumerate(weights):
            acc += wt
            if r <= acc:
                return k
        return len(costs) - 1

    def on_dispatch(self, req: RequestView, instance_id: str, now: float) -> None:
        last = self._last
        tokens = last[2] if last is not None and last[0] == req.id and last[1] == instance_id \
            else req.num_prompt_tokens
        self._last = None
        self._ledger[req.id] = (instance_id, tokens)
        self._prefill[instance_id] = self._prefill.get(instance_id, 0) + tokens

    def _prefill_done(self, req: RequestView) -> None:
        rec = self._ledger.pop(req.id, None)
        if rec is not None:
            inst, tokens = rec
            left = self._prefill[inst] - tokens
            if left:
                self._prefill[inst] = left
            else:
                del self._prefill[inst]

    def on_first_token(self, req: RequestView, instance_id: str, now: float) -> None:
        self._prefill_done(req)

    def on_finish(self, req: RequestView, instance_id: str, now: float, output_tokens: int) -> None:
        self._prefill_done(req)  # ended before its first token (abort): its prefill is no longer pending


@register_router("cache-aware", "cache_aware", "sglang")
class CacheAware(RouterBase):
    """SGLang's cache-aware policy: shortest queue when imbalanced, else the best prefix match above a rate.

    Source: sgl-project/sglang `sgl-router/src/policies/cache_aware.rs` (CacheAwarePolicy::select_worker),
    defaults `cache_threshold 0.3`, `balance_abs_threshold 64`, `balance_rel_threshold 1.5` (sgl-router's
    CLI defaults). Load is the router's in-flight count per worker (SGLang's `worker.load()`).

    - imbalanced when `max - min > balance_abs_threshold` and `max > balance_rel_threshold x min`: the
      least-loaded instance;
    - else the instance with the longest cached prefix if its match rate (cached tokens / prompt tokens;
      SGLang: matched characters / text characters) is above `cache_threshold`;
    - else `fallback`: `smallest-cache` (SGLang's `get_smallest_tenant`, the instance holding the fewest
      blocks in the index: most room) or `least-loaded`.
    Ties go at random among the tied in fleet order (SGLang takes the first found), the same pick in every
    process; ties for the smallest cache go to the least loaded.

    The prefix is SGLang's text by another name: SGLang's tree holds the prompt characters, the twin's index
    chained block hashes (`RequestView.prefix`). Where a trace has no prefix hashes but the prompt text
    (`RequestStream.texts`), the simulator derives them from the text, and the live proxy from the token ids,
    or from the text in `tokenizer.mode: estimate` (`twin.workload.text_prefix`), so shared prefixes match in
    both worlds. On a trace with neither (e.g. Azure or BurstGPT lengths-only traces) there is nothing to
    match and every instance's cache is empty in the index: the smallest-cache tie then goes to the least
    loaded (SGLang's shortest queue), not to a random instance.
    """

    name = "cache-aware"
    prefix_index = "any"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, fallback: str = "smallest-cache",
                 load_signal: str = "bookkeeping", seed: int = 0) -> None:
        require(0 <= cache_threshold <= 1, "cache_threshold", f"must be in [0, 1], got {cache_threshold}")
        require(balance_abs_threshold >= 0, "balance_abs_threshold", f"must be >= 0, got {balance_abs_threshold}")
        require(fallback in ("smallest-cache", "least-loaded"), "fallback",
                f"must be 'smallest-cache' or 'least-loaded', got {fallback!r}")
        seed = check_seed(seed)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.fallback = fallback
        self.load_signal = _check_signal(load_signal)
        self._rng = random.Random(seed)
        self._fleet = _FleetCache()
        self.imbalanced_decisions = 0
        self.cache_hits = 0

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        insts = fleet.instances
        if not insts:
            return NO_INSTANCE
        loads = _loads(insts, self.load_signal)
        hi = max(loads)
        lo = min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            self.imbalanced_decisions += 1
            return insts[_argmin(loads, self._rng)].id
        cached = cached_blocks(req, fleet)
        if cached:
            pos = self._fleet.of(insts).pos
            mine = [(c, k) for iid, c in cached.items() if (k := pos.get(iid)) is not None]
            if mine:
                best = max(mine)[0]
                if best * req.prefix_block_size / max(req.num_prompt_tokens, 1) > self.cache_threshold:
                    self.cache_hits += 1
                    # in fleet order: the index's dict comes in the order of a set of instance ids, which
                    # Python's salted str hash changes from process to process (PYTHONHASHSEED)
                    tied = sorted(k for c, k in mine if c == best)
                    return insts[tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]].id
        idx = fleet.prefix_index
        if self.fallback == "smallest-cache" and idx is not None and hasattr(idx, "blocks_held"):
            held = [idx.blocks_held(v.id) for v in insts]
            least = min(held)
            tied = [k for k, h in enumerate(held) if h == least]
            if len(tied) == 1:
                return insts[tied[0]].id
            return insts[tied[_argmin([loads[k] for k in tied], self._rng)]].id
        return insts[_argmin(loads, self._rng)].id
