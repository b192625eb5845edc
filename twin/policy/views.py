"""The read-only views a policy sees. The simulator and the live controller each back them with their state."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class RequestView(Protocol):
    """What a router may know about a request at dispatch time."""

    @property
    def id(self) -> int: ...

    @property
    def arrival_time(self) -> float: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int:
        """The output cap the client asked for (the twin knows the true length; a router must not)."""
        ...

    @property
    def block_keys(self) -> Sequence[int]:
        """Prefix identity: hashes of the prompt's full KV blocks (may be empty)."""
        ...

    @property
    def session_id(self) -> int:
        """-1 when unknown."""
        ...


@runtime_checkable
class InstanceView(Protocol):
    """What a router may know about an instance (exact in the simulator, scraped in production)."""

    @property
    def id(self) -> str: ...

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        ...

    @property
    def num_waiting(self) -> int:
        """Queued, including preempted."""
        ...

    @property
    def kv_usage(self) -> float:
        """0..1 of the KV block pool referenced by requests."""
        ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def inflight_prefill_tokens(self) -> int:
        """Prompt tokens dispatched there and not yet computed."""
        ...

    def cached_prefix_tokens(self, req: RequestView) -> int: ...


class Router(Protocol):
    """A routing policy: one pure decision per request."""

    name: str

    def choose(self, req: RequestView, instances: Sequence[InstanceView]) -> str:
        """The id of the instance that should serve `req`."""
        ...
