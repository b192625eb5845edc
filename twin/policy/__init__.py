"""THE SHARED POLICY OBJECTS: pure routers (and later scalers, planners) that both the twin and `live` run.

Nothing here imports from `twin.cluster`, `twin.engine` or `live`.
"""

from twin.policy.routers import ROUTERS, LeastOutstandingRequests, Random, RoundRobin, make_router
from twin.policy.views import InstanceView, RequestView, Router

__all__ = ["ROUTERS", "InstanceView", "LeastOutstandingRequests", "Random", "RequestView", "RoundRobin",
           "Router", "make_router"]
