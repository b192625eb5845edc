"""THE SHARED POLICY OBJECTS: pure routers, predictors, scalers and planners that both the twin and `live` run.

Nothing here imports from `twin.sim.cluster`, `twin.engine`, `live` or simpy: policies read views
(`twin.policy.views`) and return decisions.
"""

from twin.policy import block as _block  # noqa: F401  (registers the look-ahead router)
from twin.policy import routers as _routers  # noqa: F401  (registers the built-in routers)
from twin.policy import prefix_routers as _prefix_routers  # noqa: F401  (registers lmetric, weighted, ...)
from twin.policy import affinity as _affinity  # noqa: F401  (registers session-affinity)
from twin.policy.affinity import SessionAffinity
from twin.policy.base import ALIASES, ROUTERS, Router, RouterBase, make_router, register_router, router_params
from twin.policy.bookkeeping import Bookkeeping, InstanceLoad
from twin.policy.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from twin.policy.prefix_index import ApproxPrefixIndex, PreciseIndex, PrefixIndex, make_prefix_index
from twin.policy.prefix_routers import CacheAware, KVCost, LMetric, Weighted
from twin.policy.routers import LeastKV, LeastOutstanding, PowerOfTwo, Random, RoundRobin
from twin.policy.scorers import FILTERS, SCORERS, register_filter, register_scorer
from twin.policy.views import FleetView, Forecast, Gauges, InstanceConfig, InstanceView, Reject, RequestView

__all__ = [
    "ALIASES", "AllBlocksCleared", "ApproxPrefixIndex", "BlockRemoved", "BlockStored", "Bookkeeping",
    "CacheAware", "FILTERS", "KVCost", "LMetric", "SCORERS", "SessionAffinity", "Weighted", "register_filter",
    "register_scorer", "FleetView", "Forecast", "Gauges", "InstanceConfig", "InstanceLoad", "InstanceView",
    "KVEventBatch", "LeastKV",
    "LeastOutstanding", "PowerOfTwo", "PreciseIndex", "PrefixIndex", "ROUTERS", "Random", "Reject",
    "RequestView", "RoundRobin", "Router", "RouterBase", "make_prefix_index", "make_router", "register_router",
    "router_params",
]
