"""Session affinity around any router: a conversation's later turns go where its first went.

The pattern of llm-d's session-affinity scorer and of sticky sessions in every L7 proxy: the prior turns'
KV blocks are most likely still cached on the instance that served them. While that instance serves, the
session sticks; otherwise the inner router decides and the session moves. Memory is bounded: the
`max_sessions` most recently seen sessions are remembered (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

from twin.policy.base import ParamError, RouterBase, check_seed, register_router, require, router_from
from twin.policy.views import FleetView, Reject, RequestView


@register_router("session-affinity", "session_affinity", "sticky")
class SessionAffinity(RouterBase):
    """A session's turns to the instance of its last placement while it serves; else `inner` decides.

    `inner: {name: ..., params: {...}}` is any registered router or `module:Class`; requests without a
    session id always go to `inner`. Hooks are forwarded, and the prefix index wanted is `inner`'s.
    """

    name = "session-affinity"

    def __init__(self, inner: Any = None, max_sessions: int = 100_000, seed: int = 0) -> None:
        spec: Mapping[str, Any] = {"name": "least-outstanding"} if inner is None else inner
        if isinstance(spec, str):
            spec = {"name": spec}
        require(isinstance(spec, Mapping) and "name" in spec, "inner",
                f"must be {{name: ..., params: {{...}}}}, got {inner!r}")
        require(max_sessions >= 1, "max_sessions", f"must be >= 1, got {max_sessions}")
        seed = check_seed(seed)
        inner_params = spec.get("params") or {}
        require(isinstance(inner_params, Mapping), "inner.params", f"must be a mapping, got {inner_params!r}")
        try:
            self.inner = router_from(str(spec["name"]), seed, dict(inner_params))
        except KeyError:
            raise ParamError("inner", f"unknown router {spec['name']!r}") from None
        except LookupError as e:
            raise ParamError("inner", str(e)) from None
        except ParamError as e:
            raise e.below("inner.params") from None
        except (TypeError, ValueError) as e:
            raise ParamError("inner.params", str(e)) from None
        self.prefix_index = getattr(self.inner, "prefix_index", None)
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._serving_of: tuple[Any, frozenset[str]] = (None, frozenset())
        self.sticky_decisions = 0

    def _serving(self, fleet: FleetView) -> frozenset[str]:
        insts = fleet.instances
        ref, ids = self._serving_of
        if ref is not insts:  # the world replaces the list when membership changes
            ids = frozenset(v.id for v in insts)
            self._serving_of = (insts, ids)
        return ids

    def choose(self, req: RequestView, fleet: FleetView) -> str | Reject:
        sid = req.session_id
        sessions = self._sessions
        if sid is not None:
            inst = sessions.get(sid)
            if inst is not None and inst in self._serving(fleet):
                sessions.move_to_end(sid)
                self.sticky_decisions += 1
                return inst
        target = self.inner.choose(req, fleet)
        if sid is not None and isinstance(target, str):
            sessions[sid] = target
            sessions.move_to_end(sid)
            if len(sessions) > self.max_sessions:
                sessions.popitem(False)
        return target

    def on_dispatch(self, req: RequestView, instance_id: str, now: float) -> None:
        fn = getattr(self.inner, "on_dispatch", None)
        if fn is not None:
            fn(req, instance_id, now)

    def on_first_token(self, req: RequestView, instance_id: str, now: float) -> None:
        fn = getattr(self.inner, "on_first_token", None)
        if fn is not None:
            fn(req, instance_id, now)

    def on_finish(self, req: RequestView, instance_id: str, now: float, output_tokens: int) -> None:
        fn = getattr(self.inner, "on_finish", None)
        if fn is not None:
            fn(req, instance_id, now, output_tokens)
