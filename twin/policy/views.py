"""What a policy may know: small frozen values built by the world (simulator or live proxy), never engine objects.

The seam, version 2 (../DESIGN.md, "The seam that matters"). A `RequestView` carries the client's `max_tokens`
cap, never the true output length; an `InstanceView` carries gauges as old as the last scrape plus the
router-side bookkeeping, which is always fresh; a `FleetView` bundles them with the prefix index.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from random import Random
from typing import Any, Final, Literal, Mapping, Protocol, Sequence

# imported at run time, not only for type checking: the compiled build (`make compiled`) resolves a
# dataclass's field types when the module loads. None of these imports this module back.
from twin.policy.bookkeeping import Bookkeeping, InstanceLoad
from twin.policy.prefix_index import PrefixIndex
from twin.policy.signals import RecentWindow

InstanceState = Literal["starting", "serving", "draining", "stopped"]
ROUTABLE: tuple[str, ...] = ("serving",)


def _reduce(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """How a frozen view is pickled and copied: rebuilt by its constructor. The compiled build (`make compiled`)
    needs it; pickle's default would set the frozen fields one by one."""
    return (type(obj), tuple(getattr(obj, f.name) for f in fields(obj)))


@dataclass(frozen=True, slots=True)
class RequestView:
    """A request as a router sees it at arrival.

    `prefix` holds the hashes of the prompt's full blocks of `prefix_block_size` tokens, in order (chained, so
    equal hashes mean equal prefixes); it must not be mutated. `max_tokens` is the client's cap (None: vLLM's
    default, `max_model_len - num_prompt_tokens`). `predicted_output_tokens` is set when a length predictor
    is configured. The true output length is not here: only the engine knows when a request stops.
    """

    id: str
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None = None
    prefix: Sequence[int] = ()
    prefix_block_size: int = 16
    session_id: str | None = None
    priority: int = 0
    predicted_output_tokens: float | None = None
    text: str | None = None  # the prompt text where the world has it (live, text traces); else None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce(self)


# RequestView is a frozen dataclass: its generated __init__ sets each field through object.__setattr__ from
# interpreted code, ~14,000 instructions a request in either build. `new_request_view` sets the same fields
# directly: compiled, native stores into the object (mypyc's attribute set does not pass through the frozen
# __setattr__); pure Python, the slots' own setters. The order is the dataclass's, checked at import.
_NATIVE: Final[bool] = not __file__.endswith(".py")
_VIEW_FIELDS = ("id", "arrival_time", "num_prompt_tokens", "max_tokens", "prefix", "prefix_block_size", "session_id",
                "priority", "predicted_output_tokens", "text")
if tuple(f.name for f in fields(RequestView)) != _VIEW_FIELDS:  # pragma: no cover - a RequestView field changed
    raise ImportError("twin.policy.views.new_request_view must set RequestView's fields: update _VIEW_FIELDS")
_VIEW_SETTERS = tuple(getattr(RequestView, name).__set__ for name in _VIEW_FIELDS)


def draw_below(rng: Any, n: int) -> int:
    """`rng.randrange(n)` for n > 0, the same draw: for a `random.Random` itself, CPython's algorithm behind it
    (`Random._randbelow_with_getrandbits`: k = n.bit_length() bits until one is below n) without the two
    interpreted calls; any other generator (a subclass may draw from `random()` instead) is asked as before."""
    if type(rng) is Random:
        k = n.bit_length()
        r: int = rng.getrandbits(k)
        while r >= n:
            r = rng.getrandbits(k)
        return r
    return rng.randrange(n)


def argmin_index(values: list[int], rng: Any) -> int:
    """The index of the least of `values`, ties broken as the k-th tied in order with k = `rng.randrange(number
    tied)`: the routers' `argmin_values` pick. Compiled, one typed pass; pure Python, C's min, index and count."""
    if not _NATIVE:
        best = min(values)
        i = values.index(best)
        ties = values.count(best)
        if ties > 1:
            for _k in range(draw_below(rng, ties)):
                i = values.index(best, i + 1)
        return i
    n = len(values)
    best = values[0]
    i = 0
    ties = 1
    for j in range(1, n):
        x = values[j]
        if x < best:
            best, i, ties = x, j, 1
        elif x == best:
            ties += 1
    if ties > 1:
        k = draw_below(rng, ties)
        j = i + 1
        while k:
            if values[j] == best:
                k -= 1
                i = j
            j += 1
    return i


def new_request_view(id: str, arrival_time: float, num_prompt_tokens: int, max_tokens: int | None,
                     prefix: Any, prefix_block_size: int, session_id: str | None, priority: int,
                     predicted_output_tokens: float | None, text: str | None) -> RequestView:
    """`RequestView(...)` with every field given, equal to it, without the dataclass's interpreted __init__.

    `prefix`: a `Sequence[int]` (the simulator's `BlockKeys` behaves as one)."""
    v = RequestView.__new__(RequestView)  # (the compiled class refuses `object.__new__`)
    if _NATIVE:
        v.id = id  # type: ignore[misc]
        v.arrival_time = arrival_time  # type: ignore[misc]
        v.num_prompt_tokens = num_prompt_tokens  # type: ignore[misc]
        v.max_tokens = max_tokens  # type: ignore[misc]
        v.prefix = prefix  # type: ignore[misc]
        v.prefix_block_size = prefix_block_size  # type: ignore[misc]
        v.session_id = session_id  # type: ignore[misc]
        v.priority = priority  # type: ignore[misc]
        v.predicted_output_tokens = predicted_output_tokens  # type: ignore[misc]
        v.text = text  # type: ignore[misc]
        return v
    s = _VIEW_SETTERS
    s[0](v, id)
    s[1](v, arrival_time)
    s[2](v, num_prompt_tokens)
    s[3](v, max_tokens)
    s[4](v, prefix)
    s[5](v, prefix_block_size)
    s[6](v, session_id)
    s[7](v, priority)
    s[8](v, predicted_output_tokens)
    s[9](v, text)
    return v


@dataclass(frozen=True, slots=True)
class Reject:
    """A router's decision not to serve a request; the world answers the client with `reason`.

    `router_error`: the router raised and its `on_error` is `reject` (twin.policy.host), so the world counts
    it as a router failure, not as the policy's choice."""

    reason: str
    router_error: bool = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce(self)


@dataclass(frozen=True, slots=True)
class Gauges:
    """An instance's scraped signals (vLLM's `/metrics` names in live), as of the scrape's time `as_of`."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1
    as_of: float = 0.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce(self)


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    """What an instance was launched with (`vllm:cache_config_info` and launch arguments in live)."""

    num_gpu_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce(self)


class InstanceView:
    """One instance for a policy: lifecycle state, stale gauges, launch config, and fresh bookkeeping.

    Gauges are a snapshot (replaced at each scrape); `inflight_*` read the router-side bookkeeping, which
    the dispatcher updates at dispatch, first token and finish, so they are never stale.
    """

    __slots__ = ("id", "state", "gauges", "config", "_load", "load", "started_at")

    def __init__(self, id: str, state: InstanceState, gauges: Gauges, config: InstanceConfig,
                 load: InstanceLoad, started_at: float = 0.0) -> None:
        self.id = id
        self.state = state
        self.gauges = gauges
        self.config = config
        self._load = load
        self.load = load  # the same books as a plain slot: loops over hundreds of instances skip the properties
        self.started_at = started_at  # when it began serving (cold-start guards read it)

    # gauges
    @property
    def num_running(self) -> int:
        return self.gauges.num_running

    @property
    def num_waiting(self) -> int:
        return self.gauges.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.gauges.kv_usage

    @property
    def as_of(self) -> float:
        return self.gauges.as_of

    # launch config
    @property
    def num_gpu_blocks(self) -> int:
        return self.config.num_gpu_blocks

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    @property
    def free_blocks(self) -> int:
        """Free KV blocks implied by the scraped usage."""
        return int(round((1.0 - self.gauges.kv_usage) * max(self.config.num_gpu_blocks - 1, 0)))

    # bookkeeping (fresh)
    @property
    def inflight_requests(self) -> int:
        return self._load.requests

    @property
    def inflight_prompt_tokens(self) -> int:
        """Prompt tokens of requests dispatched here that have not produced a first token."""
        return self._load.prompt_tokens

    @property
    def inflight_decode_tokens(self) -> int:
        """Context tokens held by requests here that are past their first token (prompt + output cap)."""
        return self._load.decode_tokens

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled and copied by its constructor (the compiled class needs it)."""
        return (InstanceView, (self.id, self.state, self.gauges, self.config, self._load, self.started_at))

    def with_gauges(self, gauges: Gauges) -> "InstanceView":
        return InstanceView(self.id, self.state, gauges, self.config, self._load, self.started_at)

    def __repr__(self) -> str:
        g = self.gauges
        return (f"InstanceView({self.id!r}, {self.state}, running={g.num_running}, waiting={g.num_waiting}, "
                f"kv={g.kv_usage:.2f}, inflight={self._load.requests}, as_of={g.as_of:.3f})")


@dataclass(frozen=True, slots=True)
class Forecast:
    """What running an instance's model forward predicts (seconds from now; None where not reached).

    `censored` is True when the horizon ended the look-ahead before the asked-for event.
    """

    instance_id: str
    ttft_s: float | None = None  # of the extra request
    e2e_s: float | None = None  # of the extra request
    drain_s: float | None = None  # until the instance has nothing left to do
    kv_peak_blocks: int = 0
    censored: bool = False
    steps: int = 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce(self)


class Forecaster(Protocol):
    """Runs an instance's model forward without the policy importing the engine (Block-style routing).

    `until` says how far to look: "first_token" (of the extra request), "finish" (of the extra request)
    or "drain" (until the instance is idle); `horizon_s` bounds it.
    """

    def forecast(self, instance_id: str, extra_request: RequestView | None = None,
                 horizon_s: float | None = None, until: str = "finish") -> Forecast: ...


@dataclass
class FleetView:
    """Everything a router reads for one decision.

    `instances` are the routable (serving) ones, in a stable order; `all_instances` includes starting,
    draining and stopped ones. `prefix_index` may be None when no prefix index is configured.
    """

    now: float
    instances: Sequence[InstanceView]
    bookkeeping: Bookkeeping
    prefix_index: PrefixIndex | None = None
    forecaster: Forecaster | None = None
    all_instances: Sequence[InstanceView] = field(default=())
    signals: RecentWindow | None = None  # recent arrivals and completed requests (scalers read it)
    extras: Mapping[str, Any] = field(default_factory=dict)

    def snapshot(self, forecaster: Forecaster | None = None, window: bool = True) -> "FleetView":
        """The fleet as it is now, in a copy its owner's updates do not reach: a policy deciding on the live
        controller's routing or scaler thread reads in-flight counts, instance lists and (with `window`) the recent
        window as they were when it began, as a simulated decision does, while the event loop records first tokens
        and finishes. Gauges are replaced whole at a scrape, so they are shared; so is the prefix index (too large to
        copy per decision: its lookups are single reads), and without `window` the recent window (an hour of
        arrivals and completions: 11 ms to copy at 40 req/s, which no router reads). `forecaster`: the snapshot's
        own, else this view's."""
        books = self.bookkeeping.snapshot()
        views = {v.id: InstanceView(v.id, v.state, v.gauges, v.config, books.load(v.id), v.started_at)
                 for v in list(self.all_instances) + list(self.instances)}
        signals = self.signals.copy() if window and self.signals is not None else self.signals
        return FleetView(self.now, [views[v.id] for v in self.instances], books, self.prefix_index,
                         forecaster if forecaster is not None else self.forecaster,
                         [views[v.id] for v in self.all_instances], signals, dict(self.extras))

    def by_id(self, instance_id: str) -> InstanceView | None:
        for v in self.instances:
            if v.id == instance_id:
                return v
        return None

    def inflight_counts(self) -> list[int]:
        """Each routable instance's `inflight_requests`, in `instances` order (one call, not one per view)."""
        insts = self.instances  # (a list, typed: compiled, a native walk; a Sequence is iterated generically)
        views: list[InstanceView] = insts if type(insts) is list else list(insts)
        return [v._load.requests for v in views]  # (`inflight_requests`, without a property call each)

    def cached_blocks(self, req: RequestView) -> dict[str, int]:
        """Leading prefix blocks of `req` cached per routable instance (0 where none, or no index)."""
        if self.prefix_index is None or not req.prefix:
            return {}
        return self.prefix_index.match(req.prefix, [v.id for v in self.instances])
