"""One inference engine modelled on vLLM V1: KV block pool, scheduler, engine config, SimPy-free (the SimPy process that runs it is twin.sim.instance)."""

from twin.engine.block_pool import BlockPool
from twin.engine.config import EngineConfig
from twin.engine.request import Request, RequestStatus
from twin.engine.scheduler import Scheduler, SchedulerConfig
from twin.engine.async_scheduler import AsyncScheduler, make_scheduler

__all__ = ["BlockPool", "EngineConfig", "Request", "RequestStatus", "Scheduler", "SchedulerConfig", "AsyncScheduler", "make_scheduler"]
