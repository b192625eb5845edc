"""The read-only views a policy sees. The simulator and the live controller each back them with their state."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class RequestView(Protocol):
    """What a router may know about a request at dispatch time."""

    id: int
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int  # the output cap the client asked for (the twin knows the true length; a router must not)
    block_keys: Sequence[int]  # prefix identity: hashes of the prompt's full KV blocks (may be empty)
    session_id: int  # -1 when unknown


@runtime_checkable
class InstanceView(Protocol):
    """What a router may know about an instance (exact in the simulator, scraped in production)."""

    id: str
    num_running: int  # requests in the running batch
    num_waiting: int  # queued, including preempted
    kv_usage: float  # 0..1 of the KV block pool referenced by requests
    free_blocks: int
    inflight_prefill_tokens: int  # prompt tokens dispatched there and not yet computed

    def cached_prefix_tokens(self, req: RequestView) -> int: ...


class Router(Protocol):
    """A routing policy: one pure decision per request."""

    name: str

    def choose(self, req: RequestView, instances: Sequence[InstanceView]) -> str:
        """The id of the instance that should serve `req`."""
        ...
