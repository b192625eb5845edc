"""One inference instance modelled on vLLM V1: block pool, scheduler, step loop."""

from twin.engine.block_pool import BlockPool
from twin.engine.instance import EngineConfig, Instance
from twin.engine.request import Request, RequestStatus
from twin.engine.scheduler import Scheduler, SchedulerConfig

__all__ = ["BlockPool", "EngineConfig", "Instance", "Request", "RequestStatus", "Scheduler", "SchedulerConfig"]
