"""The scaler hook: a policy object's `decide(now, fleet, forecast) -> ScaleAction`, applied by an actuator.

Scalers are pure policies (../shared/DESIGN.md: `Scaler.decide`); the controller calls `decide` every
`scaler.interval_s` with the live `FleetView` (all workers, states included) and hands the action to the
actuator (`live.launcher.Actuator`). Until the policy package has its own scalers, two trivial ones are
here: `none` (never acts) and `static` (keeps `target` workers). Any object with `decide` plugs in by
`scaler.name: module:Class` or `file.py:Class`, with `scaler.params` as its constructor arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from twin.errors import TwinInputError
from twin.policy.views import FleetView


@dataclass(frozen=True)
class ScaleAction:
    """Start `add` workers (with `engine_args` over the launcher's), drain the workers in `drain`."""

    add: int = 0
    drain: Sequence[str] = ()
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""

    @property
    def is_noop(self) -> bool:
        return self.add <= 0 and not self.drain


NOOP = ScaleAction()


class Scaler(Protocol):
    def decide(self, now: float, fleet: FleetView, forecast: Any) -> ScaleAction: ...


class NoScaler:
    """Never scales: the fleet is what the config and the operator make it."""

    name = "none"

    def decide(self, now: float, fleet: FleetView, forecast: Any) -> ScaleAction:
        return NOOP


class StaticScaler:
    """Keeps `target` workers starting or serving: replaces lost ones, drains the newest extras."""

    name = "static"

    def __init__(self, target: int = 1) -> None:
        if target < 0:
            raise ValueError("target must be >= 0")
        self.target = target

    def decide(self, now: float, fleet: FleetView, forecast: Any) -> ScaleAction:
        live = [v for v in fleet.all_instances if v.state in ("starting", "serving")]
        if len(live) < self.target:
            return ScaleAction(add=self.target - len(live), reason=f"{len(live)} < target {self.target}")
        if len(live) > self.target:
            newest = sorted(live, key=lambda v: v.started_at, reverse=True)[:len(live) - self.target]
            return ScaleAction(drain=tuple(v.id for v in newest), reason=f"{len(live)} > target {self.target}")
        return NOOP


SCALERS: dict[str, type] = {"none": NoScaler, "static": StaticScaler}


def make_scaler(name: str, **params: Any) -> Scaler:
    """A scaler by registry name or `module:Class` / `file.py:Class`; bad names or parameters are one line."""
    from twin.policy.base import _load_object
    from twin.policy.scalers import SCALERS as TWIN_SCALERS

    try:
        if name in SCALERS:
            cls = SCALERS[name]
        elif name in TWIN_SCALERS:  # the very scaler objects the twin evaluated: threshold, queue, throughput...
            cls = TWIN_SCALERS[name]
        else:
            cls = _load_object(name)
    except KeyError:
        raise TwinInputError(f"scaler.name: unknown scaler {name!r} (known: {', '.join({**SCALERS, **TWIN_SCALERS})}; "
                             "or module:Class, file.py:Class)") from None
    except LookupError as e:
        raise TwinInputError(f"scaler.name: {e}") from None
    try:
        obj = cls(**params)
    except (TypeError, ValueError) as e:
        raise TwinInputError(f"scaler.params: {e}") from None
    if not callable(getattr(obj, "decide", None)):
        raise TwinInputError(f"scaler.name: {name} has no decide(now, fleet, forecast)")
    return obj


def as_action(obj: Any, fleet: FleetView | None = None) -> ScaleAction:
    """Accept any object with `add` / `drain`, a twin scaler's `ScaleAction(target)` (turned into starts, or
    drains of the least loaded workers, as the simulator's fleet does), or None for no action."""
    if obj is None:
        return NOOP
    if isinstance(obj, ScaleAction):
        return obj
    target = getattr(obj, "target", None)
    if fleet is not None and hasattr(obj, "target") and not hasattr(obj, "add"):
        if target is None:
            return NOOP
        active = [v for v in fleet.all_instances if v.state in ("starting", "serving")]
        reason = str(getattr(obj, "reason", ""))
        if target > len(active):
            return ScaleAction(add=int(target) - len(active), reason=reason)
        if target < len(active):
            order = sorted(active, key=lambda v: (v.state != "starting", v.inflight_requests, -v.started_at))
            return ScaleAction(drain=tuple(v.id for v in order[:len(active) - int(target)]), reason=reason)
        return NOOP
    return ScaleAction(int(getattr(obj, "add", 0) or 0), tuple(getattr(obj, "drain", ()) or ()),
                       dict(getattr(obj, "engine_args", {}) or {}), str(getattr(obj, "reason", "")))
