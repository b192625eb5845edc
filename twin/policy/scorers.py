"""llm-d's scheduling pieces: filters narrow the instances, weighted scorers rate them 0..1, a picker chooses.

The structure and the built-ins follow the Gateway API Inference Extension that llm-d's inference scheduler
builds on (`pkg/epp/scheduling/framework/plugins/` in kubernetes-sigs/gateway-api-inference-extension):

- `queue` (`queuescorer/queue.go`, QueueScorer): waiting queue from the scrape, min-max normalised,
  `(max - q) / (max - min)`, 1.0 for all when every queue is equal.
- `kv` (`kvcacheutilizationscorer/kvcache_utilization.go`): `1 - kv_cache_usage_perc` from the scrape.
- `prefix` (`prefixcachescorer/plugin.go`, Plugin.Score): leading blocks cached there / blocks of the
  request, from the prefix index (approximate or precise).
- `inflight`: the queue scorer's normalisation over the router's own in-flight count (fresh between
  scrapes); the twin's addition, not an llm-d plugin.
- filters `low-queue` (`filter/low_queue_filter.go`: waiting <= threshold, default 128 as
  `DefaultQueueingThresholdLoRA`), `least-queue` and `least-kv-cache` (`filter/least_queue_filter.go`,
  `least_kvcache_filter.go`: keep the instances within (max - min) / N of the minimum).
- picker `max-score` (`maxscorepicker/max_score_picker.go`): highest weighted sum; ties uniformly at
  random (llm-d shuffles before a stable sort).

Users add their own with `@register_scorer("name")` / `@register_filter("name")` (or `module:Class`): a scorer
has `score(ctx, instances) -> list[float]` (clamped to 0..1 unless it sets `bounded = True`) and sets
`needs_prefix_index = True` if it reads `ctx.cached`; a filter has `filter(ctx, instances) -> list`.
When every scorer is a built-in (its exact class), `weighted` sums them in one pass over the instances
(`fuse_scorers`, the same floats); a user's scorer, or a subclass of a built-in, is called as written.
"""

from __future__ import annotations

import math
import random
from itertools import repeat
from operator import mul, sub
from typing import Any, Callable, Mapping, Protocol, Sequence

from twin.policy.views import FleetView, InstanceView, RequestView


class Context:
    """What one decision computes once and every scorer may share (the prefix match, lazily)."""

    __slots__ = ("req", "fleet", "_cached")

    def __init__(self, req: RequestView, fleet: FleetView) -> None:
        self.req = req
        self.fleet = fleet
        self._cached: dict[str, int] | None = None

    @property
    def cached(self) -> dict[str, int]:
        """Leading prefix blocks of the request cached per instance (absent: 0)."""
        c = self._cached
        if c is None:
            c = self._cached = cached_blocks(self.req, self.fleet)
        return c


def cached_blocks(req: RequestView, fleet: FleetView) -> dict[str, int]:
    """Leading blocks of `req.prefix` cached per instance (every instance the index knows; absent: 0)."""
    idx = fleet.prefix_index
    if idx is None or not req.prefix:
        return {}
    return idx.match(req.prefix, None)


class Scorer(Protocol):
    def score(self, ctx: Context, instances: Sequence[InstanceView]) -> list[float]:
        """One value in 0..1 per instance, higher is better."""
        ...


class Filter(Protocol):
    def filter(self, ctx: Context, instances: Sequence[InstanceView]) -> list[InstanceView]: ...


SCORERS: dict[str, Callable[..., Scorer]] = {}
FILTERS: dict[str, Callable[..., Filter]] = {}


def register_scorer(name: str, *aliases: str) -> Callable[[type], type]:
    """Class decorator: a scorer usable by name in `weighted`'s `scorers:` map."""

    def deco(cls: type) -> type:
        for n in (name, *aliases):
            SCORERS[n] = cls
        return cls

    return deco


def register_filter(name: str, *aliases: str) -> Callable[[type], type]:
    """Class decorator: a filter usable by name in `weighted`'s `filters:` list."""

    def deco(cls: type) -> type:
        for n in (name, *aliases):
            FILTERS[n] = cls
        return cls

    return deco


def _min_max_inverse(values: Sequence[float]) -> list[float]:
    """llm-d's queue normalisation: (max - v) / (max - min); 1.0 for all when equal."""
    lo = min(values)
    hi = max(values)
    if hi == lo:
        return [1.0] * len(values)
    return list(map(mul, map(sub, repeat(hi), values), repeat(1.0 / (hi - lo))))


@register_scorer("queue", "queue-scorer")
class QueueScorer:
    """Shorter scraped waiting queue scores higher (llm-d QueueScorer)."""

    bounded = True  # scores already in 0..1

    def score(self, ctx: Context, instances: Sequence[InstanceView]) -> list[float]:
        return _min_max_inverse([v.gauges.num_waiting for v in instances])


@register_scorer("kv", "kv-cache-utilization", "kv-cache-utilization-scorer")
class KVUtilizationScorer:
    """Lower scraped KV-cache usage scores higher: 1 - usage (llm-d KVCacheUtilizationScorer)."""

    bounded = True  # scores already in 0..1

    def score(self, ctx: Context, instances: Sequence[InstanceView]) -> list[float]:
        return [1.0 - v.gauges.kv_usage for v in instances]


@register_scorer("prefix", "prefix-cache", "prefix-cache-scorer")
class PrefixCacheScorer:
    """Share of the request's blocks cached there (llm-d prefix-cache-scorer: matchLen / total)."""

    bounded = True  # scores already in 0..1

    needs_prefix_index = True

    def score(self, ctx: Context, instances: Sequence[InstanceView]) -> list[float]:
        total = len(ctx.req.prefix)
        cached = ctx.cached
        if not total or not cached:
            return [0.0] * len(instances)
        get = cached.get
        inv = 1.0 / total
        return [get(v.id, 0) * inv for v in instances]


@register_scorer("inflight", "active-request")
class InflightScorer:
    """Fewer requests in flight by the router's books scores higher (queue scorer's normalisation)."""

    bounded = True  # scores already in 0..1

    def score(self, ctx: Context, instances: Sequence[InstanceView]) -> list[float]:
        return _min_max_inverse([v.load.requests for v in instances])


@register_filter("low-queue")
class LowQueueFilter:
    """Instances whose scraped waiting queue is at most `threshold` (llm-d LowQueueFilter, default 128)."""

    def __init__(self, threshold: int = 128) -> None:
        self.threshold = threshold

    def filter(self, ctx: Context, instances: Sequence[InstanceView]) -> list[InstanceView]:
        t = self.threshold
        return [v for v in instances if v.gauges.num_waiting <= t]


def _lowest_bucket(instances: Sequence[InstanceView], key: Callable[[InstanceView], float]) -> list[InstanceView]:
    vals = [key(v) for v in instances]
    lo = min(vals)
    hi = max(vals)
    top = lo + (hi - lo) / len(instances)
    return [v for v, x in zip(instances, vals) if x <= top]


@register_filter("least-queue")
class LeastQueueFilter:
    """Instances within (max - min) / N of the shortest scraped queue (llm-d LeastQueueFilter)."""

    def filter(self, ctx: Context, instances: Sequence[InstanceView]) -> list[InstanceView]:
        return _lowest_bucket(instances, lambda v: v.gauges.num_waiting)


@register_filter("least-kv-cache")
class LeastKVCacheFilter:
    """Instances within (max - min) / N of the lowest scraped KV usage (llm-d LeastKVCacheFilter)."""

    def filter(self, ctx: Context, instances: Sequence[InstanceView]) -> list[InstanceView]:
        return _lowest_bucket(instances, lambda v: v.gauges.kv_usage)


def max_score_pick(instances: Sequence[InstanceView], totals: Sequence[float], rng: random.Random) -> str:
    """The highest total, ties uniformly at random (llm-d MaxScorePicker shuffles, then sorts stably)."""
    best = max(totals)
    if totals.count(best) == 1:
        return instances[totals.index(best)].id
    tied = [v for v, t in zip(instances, totals) if t == best]
    return tied[rng.randrange(len(tied))].id


def fuse_scorers(scorers: Sequence[tuple[str, float, Any]]
                 ) -> Callable[[Context, Sequence[InstanceView]], list[float]] | None:
    """The weighted sum in one pass over the instances when every scorer is a built-in (exact type): the same
    products and sums in the same order as scoring each and adding (so the same floats), without a list and
    two C passes per scorer. None when a scorer is a user's (or a subclass), or every weight is 0."""
    setup: list[str] = []
    cols: list[str] = []
    terms: list[str] = []
    ns: dict[str, Any] = {}
    for j, (_, w, sc) in enumerate(scorers):
        if w == 0:
            continue
        ns[f"w{j}"] = w
        times = "" if w == 1 else f" * w{j}"  # the generic path skips the product at weight 1
        t = type(sc)
        if t is QueueScorer or t is InflightScorer:  # min-max normalised over the fleet: its own list
            ns[f"sc{j}"] = sc
            setup.append(f"    c{j} = sc{j}.score(ctx, insts)")
            cols.append(f"x{j}")
            terms.append(f"x{j}{times}")
        elif t is KVUtilizationScorer:
            terms.append(f"(1.0 - v.gauges.kv_usage){times}")
        elif t is PrefixCacheScorer:  # a missing instance (or no match) reads 0 blocks: 0.0, as the scorer's zeros
            setup += [f"    total{j} = len(ctx.req.prefix)",
                      f"    cached{j} = ctx.cached",
                      f"    get{j} = cached{j}.get",
                      f"    inv{j} = 1.0 / total{j} if total{j} and cached{j} else 0.0"]
            terms.append(f"get{j}(v.id, 0) * inv{j}{times}")
        else:
            return None
    if not terms:
        return None
    loop = (f"for v, {', '.join(cols)} in zip(insts, {', '.join('c' + c[1:] for c in cols)})" if cols
            else "for v in insts")
    src = "\n".join(["def totals(ctx, insts):", *setup, f"    return [{' + '.join(terms)} {loop}]"])
    exec(src, ns)  # noqa: S102 - built from the fixed terms above
    return ns["totals"]


def _build(kind: str, registry: Mapping[str, Callable[..., Any]], spec: Any) -> tuple[str, Any]:
    """A plugin from a name, `{name: ..., params: {...}}` or a `module:Class` reference; its parameters are
    judged by their defaults' kinds first (`twin.policy.base.judge_params`)."""
    from twin.policy.base import ParamError, _load_object, judge_params

    params: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise ValueError(f"a {kind} needs a name, got {dict(spec)!r}")
        params = dict(spec.get("params") or {})
        spec = spec["name"]
    if not isinstance(spec, str):
        raise ValueError(f"a {kind} is a name or {{name, params}}, got {spec!r}")
    cls = registry.get(spec)
    if cls is None:
        if ":" not in spec:
            raise ValueError(f"unknown {kind} {spec!r} (known: {', '.join(sorted(registry))})")
        try:
            cls = _load_object(spec, kind)
        except (KeyError, LookupError) as e:
            raise ValueError(f"{kind} {spec!r}: {e}") from None
    try:
        return spec, cls(**judge_params(cls, params))
    except ParamError as e:
        raise ValueError(f"{kind} {spec!r}: params.{e}") from None
    except TypeError as e:
        raise ValueError(f"{kind} {spec!r}: {e}") from None


def build_scorers(spec: Any) -> list[tuple[str, float, Scorer]]:
    """`{queue: 2, kv: 2, prefix: 3}` or `[{name: queue, weight: 2, params: {...}}, ...]` as (name, weight, scorer)."""
    items: list[tuple[Any, Any]] = []
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, (list, tuple)):
        for s in spec:
            if not isinstance(s, Mapping) or "weight" not in s:
                raise ValueError(f"each scorer in a list needs a name and a weight, got {s!r}")
            items.append(({k: v for k, v in s.items() if k != "weight"}, s["weight"]))
    else:
        raise ValueError(f"scorers must be a map name -> weight or a list, got {spec!r}")
    out = []
    for name_or_spec, w in items:
        try:
            weight = float(w)
        except (TypeError, ValueError):
            raise ValueError(f"scorer weight must be a number, got {w!r}") from None
        if isinstance(w, bool) or not 0 <= weight < math.inf:  # NaN and inf made every total NaN or inf
            label = name_or_spec.get("name") if isinstance(name_or_spec, Mapping) else name_or_spec
            raise ValueError(f"scorer weight must be a finite number >= 0, got {w!r} for {label!r}")
        name, scorer = _build("scorer", SCORERS, name_or_spec)
        out.append((name, weight, scorer))
    if not out:
        raise ValueError("weighted needs at least one scorer")
    return out


def build_filters(spec: Any) -> list[tuple[str, Filter]]:
    if spec is None:
        return []
    if not isinstance(spec, (list, tuple)):
        raise ValueError(f"filters must be a list, got {spec!r}")
    return [_build("filter", FILTERS, s) for s in spec]
