"""The fleet over time: instances start (after a start-up delay), serve, drain and stop; GPU-seconds; the scaler.

A drained instance takes no new requests and stops when its last request ends: nothing is lost or
restarted. Every instance is billed from its start (start-up included) to its stop, times its GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twin.policy.scalers import ACTIVE, ScaleAction, plan_scale
from twin.sim.build import build_scaler


@dataclass
class ScaleEvent:
    t: float
    action: str  # start | serving | drain | stop
    instance: str
    fleet_active: int
    reason: str = ""


@dataclass
class Lifetime:
    created_s: float
    serving_s: float | None = None
    draining_s: float | None = None
    stopped_s: float | None = None


@dataclass
class Fleet:
    """Lifecycle bookkeeping for a cluster's instances; the cluster builds instances, the fleet schedules them."""

    cluster: object
    min_instances: int
    max_instances: int
    startup_delay_s: float
    gpus_per_instance: int
    lifetimes: dict = field(default_factory=dict)
    events: list = field(default_factory=list)
    chunk_planner: Any = None  # twin.policy.chunk.OnlineChunkPlanner when chunk_plan.online

    def __post_init__(self) -> None:
        sc = self.cluster.scenario.scaler
        self.scaler = build_scaler(self.cluster.scenario, self.max_instances)  # bad ones: one TwinInputError line
        self.interval_s = sc.interval_s
        self.decisions = 0

    @property
    def env(self):
        return self.cluster.env

    def register_initial(self, inst) -> None:
        self.lifetimes[inst.id] = Lifetime(0.0, 0.0)

    def active(self) -> list:
        return [i for i in self.cluster.instances if i.state in ACTIVE]

    def start(self, reason: str = "") -> None:
        """A new instance: billed from now, routable after the start-up delay."""
        inst = self.cluster.new_instance(state="starting")
        now = self.env.now
        self.lifetimes[inst.id] = Lifetime(now)
        self.events.append(ScaleEvent(now, "start", inst.id, len(self.active()), reason))
        self.env.timeout(self.startup_delay_s).callbacks.append(lambda _e, inst=inst: self._ready(inst))

    def serve_after(self, inst, delay_s: float) -> None:
        """An initial instance still starting: routable after `delay_s` (the live shadow twin forecasts a fleet
        whose workers are mid-start, `live.shadow.Slot`). Billed from the run's start, as the other initial ones."""
        if delay_s <= 0:
            return
        inst.state = "starting"
        self.cluster.dispatcher.lifecycle_changed()
        self.env.timeout(delay_s).callbacks.append(lambda _e, inst=inst: self._ready(inst))

    def _ready(self, inst) -> None:
        if inst.state != "starting":
            return  # drained (cancelled) while starting
        now = self.env.now
        inst.touch(now)  # the timeline records the ticks before the change
        inst.state = "serving"
        inst.serving_since = now
        self.lifetimes[inst.id].serving_s = now
        self.events.append(ScaleEvent(now, "serving", inst.id, len(self.active())))
        self.cluster.dispatcher.lifecycle_changed()

    def drain(self, inst, reason: str = "") -> None:
        """No new requests; stop once the last in-flight one ends (at once if none, or if still starting)."""
        now = self.env.now
        was_starting = inst.state == "starting"
        inst.touch(now)  # the timeline records the ticks before the change
        inst.state = "draining"
        self.lifetimes[inst.id].draining_s = now
        self.events.append(ScaleEvent(now, "drain", inst.id, len(self.active()), reason))
        self.cluster.dispatcher.lifecycle_changed()
        if was_starting or self._idle(inst):
            self.stop(inst)

    def _idle(self, inst) -> bool:
        """Nothing left in the engine and nothing on its way there (requests still in the API server)."""
        return (not inst.scheduler.has_unfinished_requests()
                and self.cluster.dispatcher.bookkeeping.load(inst.id).requests == 0)

    def maybe_stop(self, inst) -> None:
        if inst.state == "draining" and self._idle(inst):
            self.stop(inst)

    def stop(self, inst) -> None:
        now = self.env.now
        inst.touch(now)  # the timeline records the ticks before the change
        inst.state = "stopped"
        self.lifetimes[inst.id].stopped_s = now
        self.events.append(ScaleEvent(now, "stop", inst.id, len(self.active())))
        self.cluster.dispatcher.lifecycle_changed()

    def apply(self, action: ScaleAction) -> None:
        """The action made concrete by the planner the live launcher uses too (`plan_scale`): clamped to
        [min_instances, max_instances], starting instances cancelled first, then the least loaded drained."""
        d = self.cluster.dispatcher
        d.lifecycle_changed()  # the views' states are the instances' own
        plan = plan_scale(action, d.fleet, self.min_instances, self.max_instances)
        for _ in range(plan.start):
            self.start(plan.reason)
        for iid in plan.drain:
            inst = d.by_id.get(iid)
            if inst is not None and inst.state in ACTIVE:
                self.drain(inst, plan.reason)

    def scaler_process(self):
        d = self.cluster.dispatcher
        forecast = None
        if getattr(self.scaler, "needs_forecaster", False):
            from twin.sim.forecaster import FleetForecaster

            forecast = FleetForecaster(self.cluster, seed=self.cluster.scenario.seed,
                                       arrivals=getattr(self.scaler, "arrivals", "poisson"))
        if getattr(self.scaler, "slo", 0) is None:  # a scaler object handed to the cluster
            setattr(self.scaler, "slo", self.cluster.scenario.slo)
        for limit in ("min_instances", "max_instances"):  # the twin scaler forecasts no size the fleet clamps
            if getattr(self.scaler, limit, 0) is None:
                setattr(self.scaler, limit, getattr(self, limit))
        while True:
            yield self.env.timeout(self.interval_s)
            d.scrape()
            d.fleet.now = self.env.now
            self.decisions += 1
            self.apply(self.scaler.decide(self.env.now, d.fleet, forecast))

    def chunk_process(self):
        """The online chunk planner: observe finished requests, re-plan every interval, apply changes."""
        from dataclasses import replace as dc_replace

        from twin.sim.evaluate import TwinEvaluator, online_chunk_planner, slo_of
        from twin.policy.chunk import EngineKnobs

        cl = self.cluster
        spec = cl.scenario.chunk_plan
        sc = cl.scenario
        quiet = sc.model_copy(update={  # the evaluator's own runs: no scaler, no planner, no timeline
            "scaler": sc.scaler.model_copy(update={"name": "none", "params": {}}),
            "chunk_plan": spec.model_copy(update={"online": False}),
            "sim": sc.sim.model_copy(update={"timeline_interval_s": 0.0, "max_sim_time_s": None})})
        ec = cl.engine_config
        current = EngineKnobs(ec.max_num_batched_tokens)
        evaluator = TwinEvaluator(quiet, lambda s, st: type(cl)(s, st).run())  # the run handed in
        planner = online_chunk_planner(spec, evaluator, current, sc.seed)
        self.chunk_planner = planner
        slo = slo_of(sc)
        while True:
            yield self.env.timeout(spec.interval_s)
            knobs = planner.step(self.env.now, slo)
            if knobs is None:
                continue
            cl.engine_config = dc_replace(cl.engine_config, **knobs.as_engine_args())
            self.events.append(ScaleEvent(self.env.now, "engine", "-", len(self.active()),
                                          f"chunk planner: {knobs.label()}"))
            if spec.apply == "all":  # roll every instance: start replacements, drain the old ones once they serve
                old = [i for i in self.active()]
                for _ in old:
                    self.start("restart with " + knobs.label())
                label = knobs.label()

                def retire(_event, old=old, label=label) -> None:
                    for inst in old:
                        if inst.state in ACTIVE:
                            self.drain(inst, "replaced: " + label)

                self.env.timeout(self.startup_delay_s).callbacks.append(retire)

    def gpu_seconds(self, end: float) -> float:
        total = 0.0
        for lt in self.lifetimes.values():
            stop = lt.stopped_s if lt.stopped_s is not None else end
            total += max(0.0, stop - lt.created_s)
        return total * self.gpus_per_instance

    def instance_seconds(self, end: float) -> dict[str, float]:
        return {k: max(0.0, (lt.stopped_s if lt.stopped_s is not None else end) - lt.created_s)
                for k, lt in self.lifetimes.items()}

    def summary(self, end: float) -> dict:
        sizes = [e.fleet_active for e in self.events] or [len(self.lifetimes)]
        return {"scaler": self.scaler.name, "initial_instances": self.cluster.scenario.cluster.num_instances,
                "peak_active": max([self.cluster.scenario.cluster.num_instances] + sizes),
                "final_active": len(self.active()), "instances_ever": len(self.lifetimes),
                "scale_events": [vars(e) for e in self.events], "decisions": self.decisions,
                "startup_delay_s": self.startup_delay_s}
