"""The online chunk planner, live: the scenario's `chunk_plan:` section re-plans `max_num_batched_tokens` on the
recent window's finished requests, and the launcher starts the next worker with the pick.

It is the live side of the simulator's `twin.sim.fleet.Fleet.chunk_process` with `apply: new`: one builder
(`twin.sim.evaluate.online_chunk_planner`: the robust planner when `resamples` > 0, else the offline one), one
evaluator (`twin.sim.evaluate.TwinEvaluator`: the twin run on the window's requests with a candidate's knobs).
The twin it runs is a scenario of the live fleet (`live.shadow.shadow_scenario`: `shadow.hardware`, `model`,
`perf`, the serving workers' scraped engine settings and their number), so the planner needs the shadow's
description of the workers, not shadow mode itself.

Every `chunk_plan.interval_s` the finished requests since the last plan are handed to the planner
(arrival time, prompt tokens, the output tokens they produced) and `OnlineChunkPlanner.step` runs in a thread,
off the event loop. A pick (`EngineKnobs.as_engine_args`, vLLM's engine-argument names) is kept as
`engine_args`; `Controller.launch_spec` lays it over `launcher.engine_args` for every worker started after it,
and a scale action's own `engine_args` over both. Running workers keep the arguments they were started with:
vLLM fixes its scheduler budget at start (`vllm/config/scheduler.py`, `SchedulerConfig`), and the simulator's
`apply: all` (restart every instance) is refused in a live config.

ASSUMPTIONS, as the simulator's online planner makes them: the window is replayed open-loop from its arrival
times with no shared prefixes; each evaluation starts from idle engines; the chunk the workers run before the
first pick is `launcher.engine_args.max_num_batched_tokens`, else vLLM's default for `shadow.hardware`
(`twin.engine.defaults.batch_defaults`, as `vllm/engine/arg_utils.py` `EngineArgs.get_batch_defaults`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from typing import TYPE_CHECKING, Any

from twin.errors import TwinInputError
from twin.policy.chunk import SLO, EngineKnobs

if TYPE_CHECKING:
    from live.controller import Controller

log = logging.getLogger("llmtwin.live")


def _simulate(sc: Any, stream: Any) -> Any:
    """The evaluator's run: one twin cluster (handed in to `TwinEvaluator`, as the fleet hands in its own)."""
    from twin.sim.cluster import Cluster

    return Cluster(sc, stream).run()


def launched_knobs(cfg: Any, engine: dict) -> EngineKnobs:
    """The chunk workers start with before a pick: the launcher's argument, else vLLM's default for the GPU."""
    args = cfg.launcher.engine_args if cfg.launcher is not None else {}
    if args.get("max_num_batched_tokens"):
        return EngineKnobs(int(args["max_num_batched_tokens"]))
    from live.shadow import shadow_scenario
    from twin.sim.build import engine_config

    rest = {k: v for k, v in engine.items() if k != "max_num_batched_tokens"}
    return EngineKnobs(engine_config(shadow_scenario(cfg, 1, rest, "chunk-plan")).max_num_batched_tokens)


class LiveChunkPlanner:
    """The controller's chunk planner: observations from the proxy, a plan per interval, the pick to launch with."""

    def __init__(self, ctl: "Controller") -> None:
        cfg = ctl.cfg
        self.ctl = ctl
        self.spec = cfg.chunk_plan
        slo = cfg.shadow.slo
        self.slo = SLO(slo.ttft_s, slo.tpot_s, slo.e2e_s)
        self.planner: Any = None  # twin.policy.chunk.OnlineChunkPlanner, built once a worker serves
        self.evaluator: Any = None
        self.engine_args: dict[str, int] = {}  # the pick: engine arguments for workers launched from now on
        self.picked_at: float | None = None
        self.last_plan_s: float | None = None
        self.errors = 0
        self._seen: list[tuple[float, int, int]] = []  # finished since the last plan (event-loop side)
        self._lock = asyncio.Lock()
        self.metrics = ctl.metrics.enable_chunk_plan()

    def observe(self, arrival_s: float, prompt_tokens: int, output_tokens: int) -> None:
        """A request completed: it enters the planner's window at the next plan."""
        self._seen.append((float(arrival_s), int(prompt_tokens), int(output_tokens)))

    def fleet(self) -> tuple[int, dict] | None:
        """How many workers serve and the engine settings a twin instance of them takes (None: none serves)."""
        from live.shadow import base_engine

        serving = [w for w in self.ctl.registry if w.routable]
        if not serving:
            return None
        return len(serving), base_engine(self.ctl.cfg, serving[0].config)

    def _build(self, engine: dict) -> None:
        from live.shadow import _profile_api_times, shadow_scenario
        from twin.sim.evaluate import TwinEvaluator, online_chunk_planner

        cfg = self.ctl.cfg
        self.api = _profile_api_times(cfg)
        self.evaluator = TwinEvaluator(shadow_scenario(cfg, 1, engine, "chunk-plan", self.api), _simulate)
        self.planner = online_chunk_planner(self.spec, self.evaluator, launched_knobs(cfg, engine), cfg.seed)
        self.metrics.set_current(self.planner.current)

    async def plan_once(self, now: float | None = None) -> EngineKnobs | None:
        """Hand the planner what finished, plan in a thread, keep a new pick; returns it (None: no change)."""
        async with self._lock:
            now = time.monotonic() if now is None else now
            fleet = self.fleet()
            if fleet is None:
                return None  # observations wait for a worker to plan for
            n, engine = fleet
            if self.planner is None:
                self._build(engine)
            # the twin of the fleet as it is now: its size and the workers' engine settings
            from live.shadow import shadow_scenario

            self.evaluator.scenario = shadow_scenario(self.ctl.cfg, n, engine, "chunk-plan", self.api)
            seen, self._seen = self._seen, []
            for a, p, o in seen:
                self.planner.observe(a, p, o)
            plans = self.planner.plans
            t0 = time.perf_counter()
            knobs = await asyncio.to_thread(self.planner.step, now, self.slo)
            if self.planner.plans > plans:
                self.last_plan_s = time.perf_counter() - t0
                self.metrics.plans.inc()
                self.metrics.plan_seconds.set(self.last_plan_s)
            if knobs is None:
                return None
            self.engine_args = knobs.as_engine_args()
            self.picked_at = now
            self.metrics.changes.inc()
            self.metrics.set_current(knobs)
            log.info("chunk planner: workers launched from now on get %s (%d requests in the window; running "
                     "workers keep theirs)", knobs.label(), len(self.planner.window(now)))
            return knobs

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.interval_s)
            try:
                await self.plan_once()
            except TwinInputError as e:  # the twin refuses the fleet's settings: one line, as at load time
                self.errors += 1
                log.error("chunk planner: %s", str(e).splitlines()[0])
            except Exception:  # noqa: BLE001 - a planner failure is logged; the proxy keeps serving
                self.errors += 1
                log.error("chunk planner failed:\n%s", traceback.format_exc())

    def status(self) -> dict:
        """The `/workers` page's `chunk_plan`: the pick, the knobs planned from, how often it planned and changed."""
        p = self.planner
        return {"interval_s": self.spec.interval_s, "window_s": self.spec.window_s,
                "planner": None if p is None else p.planner.name, "engine_args": dict(self.engine_args),
                "current": None if p is None else p.current.as_engine_args(), "plans": 0 if p is None else p.plans,
                "changes": [] if p is None else [{"t": t, **k.as_engine_args()} for t, k in p.changes],
                "waiting_observations": len(self._seen), "last_plan_s": self.last_plan_s, "errors": self.errors}
