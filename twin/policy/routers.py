"""Routers: small, pure policies. They read views and return an instance id; they import no simulator code."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from twin.policy.views import InstanceView, RequestView, Router


@dataclass
class RoundRobin:
    """Each request to the next instance in turn."""

    name: str = "round_robin"
    _next: int = field(default=0, repr=False)

    def choose(self, req: RequestView, instances: Sequence[InstanceView]) -> str:
        inst = instances[self._next % len(instances)]
        self._next += 1
        return inst.id


@dataclass
class Random:
    """A uniformly random instance, from its own seeded generator (reproducible)."""

    seed: int = 0
    name: str = "random"

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(self, req: RequestView, instances: Sequence[InstanceView]) -> str:
        return instances[self._rng.randrange(len(instances))].id


@dataclass
class LeastOutstandingRequests:
    """The instance with the fewest requests in flight (running + waiting); ties to the lowest index."""

    name: str = "least_outstanding_requests"

    def choose(self, req: RequestView, instances: Sequence[InstanceView]) -> str:
        best = instances[0]
        best_n = best.num_running + best.num_waiting
        for inst in instances[1:]:
            n = inst.num_running + inst.num_waiting
            if n < best_n:
                best, best_n = inst, n
        return best.id


ROUTERS: dict[str, Callable[..., Router]] = {
    "round_robin": RoundRobin,
    "random": Random,
    "least_outstanding_requests": LeastOutstandingRequests,
}
ALIASES = {"rr": "round_robin", "least_outstanding": "least_outstanding_requests", "lor": "least_outstanding_requests"}


def make_router(name: str, **params) -> Router:
    """Build a router by registry name; new routers register here without touching the simulator."""
    key = ALIASES.get(name, name)
    if key not in ROUTERS:
        raise KeyError(name)
    return ROUTERS[key](**params)
