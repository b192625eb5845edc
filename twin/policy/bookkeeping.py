"""Router-side bookkeeping: what was sent where and is still in flight. One class for both worlds.

The dispatcher (simulator) and the proxy (live) call `dispatched`, `first_token` and `finished`; routers
read the per-instance `InstanceLoad` through `InstanceView.inflight_*`. Unlike scraped gauges it is never
stale, which is what keeps a burst from piling onto one instance between two scrapes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class InstanceLoad:
    """In-flight totals of one instance."""

    requests: int = 0
    prompt_tokens: int = 0  # of requests without a first token yet (prefill pending)
    decode_tokens: int = 0  # context held by requests past their first token: prompt + expected output
    dispatched_total: int = 0


class _Flight:
    """One request in flight. A plain class, not a dataclass: compiled, its constructor is native (a compiled
    dataclass keeps the interpreted `__init__`, about 1,800 instructions a request)."""

    __slots__ = ("instance_id", "prompt_tokens", "expected_output", "decoding")

    def __init__(self, instance_id: str, prompt_tokens: int, expected_output: int) -> None:
        self.instance_id = instance_id
        self.prompt_tokens = prompt_tokens
        self.expected_output = expected_output
        self.decoding = False


class Bookkeeping:
    """In-flight requests per instance, updated at dispatch, first token and finish."""

    def __init__(self) -> None:
        self.loads: dict[str, InstanceLoad] = {}
        self._flights: dict[str, _Flight] = {}

    def load(self, instance_id: str) -> InstanceLoad:
        """The live record for an instance (created on first use; views hold it)."""
        ld = self.loads.get(instance_id)
        if ld is None:
            ld = self.loads[instance_id] = InstanceLoad()
        return ld

    def dispatched(self, request_id: str, instance_id: str, prompt_tokens: int, expected_output: int = 0) -> None:
        """`expected_output`: predicted length, or the client's cap, or 0 when unknown."""
        ld = self.load(instance_id)
        ld.requests += 1
        ld.prompt_tokens += prompt_tokens
        ld.dispatched_total += 1
        self._flights[request_id] = _Flight(instance_id, prompt_tokens, expected_output)

    def first_token(self, request_id: str) -> None:
        f = self._flights.get(request_id)
        if f is None or f.decoding:
            return
        f.decoding = True
        ld = self.loads[f.instance_id]
        ld.prompt_tokens -= f.prompt_tokens
        ld.decode_tokens += f.prompt_tokens + f.expected_output

    def finished(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): it leaves the books."""
        f = self._flights.pop(request_id, None)
        if f is None:
            return
        ld = self.loads[f.instance_id]
        ld.requests -= 1
        if f.decoding:
            ld.decode_tokens -= f.prompt_tokens + f.expected_output
        else:
            ld.prompt_tokens -= f.prompt_tokens

    def snapshot(self) -> "Bookkeeping":
        """A read-only copy its owner's updates do not reach: the live controller's routing thread decides on the
        counts as they were when the decision began, while its event loop records first tokens and finishes."""
        b = Bookkeeping()
        b.loads = {k: InstanceLoad(v.requests, v.prompt_tokens, v.decode_tokens, v.dispatched_total)
                   for k, v in self.loads.items()}
        b._flights = dict(self._flights)  # the records shared: a router reads only where each went (`instance_of`)
        return b

    def instance_of(self, request_id: str) -> str | None:
        f = self._flights.get(request_id)
        return None if f is None else f.instance_id

    def in_flight(self) -> int:
        return len(self._flights)
