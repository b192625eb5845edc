"""The policy host: the one object both worlds put between requests and their policies.

The simulator's dispatcher (`twin.sim.dispatcher`) and the live controller (`live.controller`) are thin
adapters over it. They build the views and move the requests. The host owns what is decided or recorded on
the router's side: the router and its hooks, the bookkeeping, the prefix index, the recent-traffic window,
the length predictor, and one rule for a policy that raises.

The rule, the same in both worlds:
- `choose()` raising is handled by `on_error`. With `raise` (the default) it is a `RouterError` naming the
  request: the simulation stops, and the live proxy answers 500. With `reject` the request is rejected
  with the reason, and counted.
- A hook (`on_dispatch`, `on_first_token`, `on_finish`) or a predictor's `observe` raising never drops or
  stops a request. It is counted in `hook_errors`. The first traceback of each hook is logged
  (`llmtwin.policy`), and runs report the counts.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from twin.policy.base import has_hook, prefix_index_kind
from twin.policy.bookkeeping import Bookkeeping
from twin.policy.prefix_index import ApproxPrefixIndex, PreciseIndex
from twin.policy.signals import RecentWindow
from twin.policy.views import FleetView, Reject, RequestView

log = logging.getLogger("llmtwin.policy")


class RouterError(Exception):
    """A router raised: a bug in the policy the user must see, with the request that triggered it.

    One message argument only (SimPy re-creates exceptions from their args); the router's own exception
    is the `__cause__` chain's root (`router_cause` finds it).
    """

    @classmethod
    def of(cls, router_name: str, req: RequestView, cause: BaseException) -> "RouterError":
        return cls(f"router {router_name!r} raised {type(cause).__name__}: {cause} while routing request "
                   f"{req.id} (arrival {req.arrival_time:.6f} s, {req.num_prompt_tokens} prompt tokens, "
                   f"session {req.session_id})")


def router_cause(e: BaseException) -> BaseException:
    """The router's own exception behind a RouterError (through SimPy's re-raise)."""
    while isinstance(e, RouterError) and e.__cause__ is not None:
        e = e.__cause__
    return e


def expected_output_tokens(req: RequestView) -> int:
    """What the books count a request will decode: the prediction, else the client's cap, else 0 (unknown)."""
    return int(req.predicted_output_tokens or req.max_tokens or 0)


def build_prefix_index(kind: str | None, capacity_blocks: int = 100_000) -> ApproxPrefixIndex | PreciseIndex | None:
    """The prefix index a router reads, by kind: `approximate` (where we sent what), `precise` (KV events)."""
    if kind is None:
        return None
    if kind == "approximate":
        return ApproxPrefixIndex(capacity_blocks)
    if kind == "precise":
        return PreciseIndex()
    raise ValueError(f"prefix_index must be 'approximate' or 'precise', got {kind!r}")


class PolicyHost:
    """Router, hooks, books, prefix index, recent window and predictor for one fleet (see the module doc)."""

    def __init__(self, router: Any, *, prefix_index: str | None = None, prefix_index_capacity_blocks: int = 100_000,
                 predictor: Any = None, on_error: str = "raise", resolve_index: bool = False,
                 observed_since: float | None = None) -> None:
        """`prefix_index`: the kind configured; with `resolve_index` it is resolved against what the router
        reads (`prefix_index_kind`: none for a router that reads none, the router's own preference if unset).
        `observed_since`: when this world began watching traffic (the recent window's first observed bin)."""
        if on_error not in ("raise", "reject"):
            raise ValueError(f"on_error must be 'raise' or 'reject', got {on_error!r}")
        self.router = router
        self.router_name: str = getattr(router, "name", type(router).__name__)
        self.on_error = on_error
        self.bookkeeping = Bookkeeping()
        self.index_kind = prefix_index_kind(router, prefix_index) if resolve_index else prefix_index
        self.index = build_prefix_index(self.index_kind, prefix_index_capacity_blocks)
        self.signals = RecentWindow(observed_since=observed_since)
        self.predictor = predictor
        self.hook_errors: dict[str, int] = {}
        self._hook_dispatch = has_hook(router, "on_dispatch")
        self._hook_first = has_hook(router, "on_first_token")
        self._hook_finish = has_hook(router, "on_finish")
        self._first_token_at: dict[str, float] = {}

    # -- a request's view --------------------------------------------------------------------------------
    def predict(self, req: RequestView) -> float | None:
        """The predictor's output length for `req` (None without a predictor): each world puts it in the view
        it builds (`predicted_output_tokens`)."""
        p = self.predictor
        return None if p is None else float(p.predict(req))

    # -- a decision ------------------------------------------------------------------------------------
    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        """The router's pick. A router that raises: a RouterError (`on_error: raise`) or a rejection."""
        try:
            return self.router.choose(req, fleet)
        except Exception as e:  # noqa: BLE001 - a policy bug: surfaced, never lost
            if self.on_error == "reject":
                self._count("choose", "router", self.router_name)
                return Reject(f"router error: {type(e).__name__}: {e}", router_error=True)
            raise RouterError.of(self.router_name, req, e) from e

    # -- what happened to a request ----------------------------------------------------------------------
    def dispatched(self, req: RequestView, instance_id: str, now: float) -> None:
        # `expected_output_tokens`, inlined: this runs at every request in both worlds
        self.bookkeeping.dispatched(req.id, instance_id, req.num_prompt_tokens,
                                    int(req.predicted_output_tokens or req.max_tokens or 0))
        self.signals.arrived(now, req.num_prompt_tokens)
        if self.index is not None:
            self.index.on_dispatch(req.prefix, instance_id, now)
        if self._hook_dispatch:
            self._call("on_dispatch", req, instance_id, now)

    def first_token(self, req: RequestView, instance_id: str, now: float) -> None:
        self.bookkeeping.first_token(req.id)
        self._first_token_at.setdefault(req.id, now)
        if self._hook_first:
            self._call("on_first_token", req, instance_id, now)

    def finished(self, req: RequestView, instance_id: str, now: float, output_tokens: int) -> None:
        """A request ended. One that completed (a first token, output tokens) enters the recent window and
        teaches the predictor; a failed one only leaves the books."""
        self.bookkeeping.finished(req.id)
        ft = self._first_token_at.pop(req.id, None)
        if ft is not None and output_tokens > 0:
            self.signals.finished(now, ft - req.arrival_time, now - req.arrival_time, req.num_prompt_tokens,
                                  output_tokens)
            if self.predictor is not None:
                self._call_on(self.predictor, "observe", req, output_tokens)
        if self._hook_finish:
            self._call("on_finish", req, instance_id, now, output_tokens)

    def _call(self, name: str, *args: Any) -> None:
        self._call_on(self.router, name, *args)

    def _call_on(self, obj: Any, name: str, *args: Any) -> None:
        try:
            getattr(obj, name)(*args)
        except Exception:  # noqa: BLE001 - a hook bug never drops a request; counted, first one logged
            if obj is self.router:
                self._count(name, "router", self.router_name)
            else:
                self._count(f"predictor.{name}", "predictor", type(obj).__name__)

    def _count(self, key: str, what: str, owner: str) -> None:
        """Inside an `except`: one more error of `key`; the first one's traceback is logged."""
        n = self.hook_errors.get(key, 0)
        self.hook_errors[key] = n + 1
        if n == 0:
            log.error("%s %s: %s raised (further errors of it are counted, not logged):\n%s", what, owner, key,
                      traceback.format_exc())
