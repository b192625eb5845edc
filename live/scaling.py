"""The scaler hook in live: the twin's own scalers, actions and planner (`twin.policy.scalers`), nothing else.

The controller calls `decide(now, fleet, forecast)` every `scaler.interval_s` with the live `FleetView` (all
workers, states included). The one planner both worlds use (`plan_scale`) turns its `ScaleAction` (a target,
or explicit add / drain) into starts and drains, and the actuator carries them out (`live.launcher`). A
scaler is named as in a scenario: a registered name (`none`, `static`, `threshold`, `queue`, `throughput`,
`twin`) or `module:Class` / `file.py:Class`, with `scaler.params` as its constructor arguments.
"""

from __future__ import annotations

from twin.policy.scalers import (NO_CHANGE, NoScaler, ScaleAction, ScalePlan, Scaler, StaticScaler, make_scaler,
                                 plan_scale)

__all__ = ["NO_CHANGE", "NoScaler", "ScaleAction", "ScalePlan", "Scaler", "StaticScaler", "make_scaler",
           "plan_scale"]
