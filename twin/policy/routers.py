"""Load-only routers: round-robin, random, least-outstanding, least-KV and power-of-two choices.

Each reads `FleetView` only. Prefix-aware routers live in `twin.policy.prefix_routers`; look-ahead routing
(Block) in `twin.policy.block`.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from twin.policy.base import RouterBase, check_seed, register_router
from twin.policy.views import FleetView, InstanceView, Reject, RequestView, argmin_index

NO_INSTANCE = Reject("no instance is serving")


def argmin_random(instances: Sequence[InstanceView], key: Callable[[InstanceView], float],
                  rng: random.Random) -> str:
    """The instance with the least `key`, ties broken uniformly at random (lowest-index ties herd). An instance
    whose key is NaN is never chosen."""
    best: list[InstanceView] = []
    best_v = float("inf")
    for v in instances:
        k = key(v)
        if k < best_v:
            best_v = k
            best = [v]
        elif k == best_v:
            best.append(v)
    if len(best) == 1:
        return best[0].id
    return best[rng.randrange(len(best))].id


def argmin_values(instances: Sequence[InstanceView], values: list[int], rng: random.Random) -> str:
    """`argmin_random` over integer values given as a list (one per instance, in order): the same pick and the
    same draw, without a key function called per instance. Integers only: `min` does not skip NaN as
    `argmin_random` does."""
    return instances[argmin_index(values, rng)].id  # the k-th tied in fleet order, k = `randrange(number tied)`


@register_router("round-robin", "round_robin", "rr")
class RoundRobin(RouterBase):
    """Each request to the next serving instance in turn."""

    name = "round-robin"
    reads_gauges = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        insts = fleet.instances
        if not insts:
            return NO_INSTANCE
        inst = insts[self._next % len(insts)]
        self._next += 1
        return inst.id


@register_router("random")
class Random(RouterBase):
    """A uniformly random serving instance, from its own seeded generator (reproducible)."""

    name = "random"
    reads_gauges = False

    def __init__(self, seed: int = 0) -> None:
        self.seed = check_seed(seed)
        self._rng = random.Random(self.seed)

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        insts = fleet.instances
        if not insts:
            return NO_INSTANCE
        return insts[self._rng.randrange(len(insts))].id


@register_router("least-outstanding", "least_outstanding_requests", "least_outstanding", "lor")
class LeastOutstanding(RouterBase):
    """Fewest requests in flight by the router's own books (always fresh), random tie-break.

    `signal: gauges` uses the scraped running + waiting instead: what a router that reads only
    `/metrics` does, and why it herds between scrapes.
    """

    name = "least-outstanding"

    def __init__(self, signal: str = "bookkeeping", seed: int = 0) -> None:
        if signal not in ("bookkeeping", "gauges"):
            raise ValueError(f"signal must be 'bookkeeping' or 'gauges', got {signal!r}")
        self.signal = signal
        self.reads_gauges = signal == "gauges"
        self._rng = random.Random(check_seed(seed))

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        if not fleet.instances:
            return NO_INSTANCE
        if self.signal == "gauges":
            return argmin_values(fleet.instances, [v.num_running + v.num_waiting for v in fleet.instances], self._rng)
        return argmin_values(fleet.instances, fleet.inflight_counts(), self._rng)


@register_router("least-kv", "least_kv")
class LeastKV(RouterBase):
    """Lowest scraped KV-cache usage (`vllm:kv_cache_usage_perc`), then fewest waiting; random tie-break."""

    name = "least-kv"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(check_seed(seed))

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        if not fleet.instances:
            return NO_INSTANCE
        return argmin_random(fleet.instances, lambda v: v.kv_usage + 1e-6 * v.num_waiting, self._rng)


@register_router("power-of-two", "power_of_two", "p2c")
class PowerOfTwo(RouterBase):
    """Two instances drawn at random, the one with fewer requests in flight wins (Mitzenmacher's p2c)."""

    name = "power-of-two"
    reads_gauges = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(check_seed(seed))

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        insts = fleet.instances
        n = len(insts)
        if n == 0:
            return NO_INSTANCE
        if n == 1:
            return insts[0].id
        i, j = self._rng.sample(range(n), 2)
        a, b = insts[i], insts[j]
        la, lb = a.inflight_requests, b.inflight_requests
        if la == lb:
            return (a if self._rng.random() < 0.5 else b).id
        return (a if la < lb else b).id
