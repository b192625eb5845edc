"""The simulator's side of the policy seam: views and KV-event delivery around the shared `PolicyHost`.

The host (`twin.policy.host`) owns the router, its hooks, the bookkeeping, the prefix index and the recent
window, as the live controller's does. This adapter mirrors the live proxy (`live/`): the router sees `RequestView`s and `InstanceView`s built here, never
engine objects. Gauges are as of the last scrape, every `scrape_interval_s` (0 = exact at each decision),
bookkeeping is updated at dispatch, first token and finish, and KV events reach a precise index
`kv_event_delay_s` after the block pool emits them.

No process scrapes: the views are brought to the last tick when a decision reads them, from the values each
instance kept at that tick (`twin.sim.instance.ScrapeClock`). A fleet polled every 50 ms over hours of
simulated time costs nothing between decisions.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

from twin.policy.host import PolicyHost, RouterError, router_cause
from twin.policy.kv_events import KVEvent
from twin.policy.prefix_index import PreciseIndex
from twin.policy.views import FleetView, Gauges, InstanceConfig, InstanceView, Reject, RequestView
from twin.sim.environment import Environment
from twin.sim.events import Clock
from twin.sim.instance import ScrapeClock


class KVEventBus:
    """Delivers each instance's KV events to subscribers `delay_s` later (at once when 0)."""

    def __init__(self, env: Environment, delay_s: float) -> None:
        self.env = env
        self.time: Clock = env.clock  # the time, as a native field (twin.sim.events)
        self.delay_s = delay_s
        self.subscribers: list[PreciseIndex] = []
        self._pending: list[tuple[str, KVEvent]] | None = None
        self._pending_t = -1.0
        self.published = 0

    def sink_for(self, instance_id: str) -> Callable[[KVEvent], None]:
        return partial(self.publish, instance_id)

    def publish(self, instance_id: str, event: KVEvent) -> None:
        self.published += 1
        now = self.time.now
        if self.delay_s <= 0:
            for s in self.subscribers:
                s.apply(instance_id, event, now)
            return
        if self._pending is None or self._pending_t != now:
            batch: list[tuple[str, KVEvent]] = []
            self._pending = batch
            self._pending_t = now
            self.env.timeout(self.delay_s).callbacks.append(partial(self._deliver, batch, now))
        self._pending.append((instance_id, event))

    def _deliver(self, batch: list[tuple[str, KVEvent]], ts: float, _event: object) -> None:
        for s in self.subscribers:
            for inst, ev in batch:
                s.apply(inst, ev, ts)


class Dispatcher:
    """Builds the fleet view for each decision and keeps it honest (stale gauges, fresh books)."""

    def __init__(self, env: Environment, router: Any, instances: Sequence[Any], *,
                 scrape_interval_s: float = 0.05, prefix_index: str | None = None,
                 prefix_index_capacity_blocks: int = 100_000, kv_event_delay_s: float = 0.0,
                 on_error: str = "raise") -> None:
        self.env = env
        self.time: Clock = env.clock  # the time, as a native field (twin.sim.events)
        self.router = router
        self.router_name = getattr(router, "name", type(router).__name__)
        self.instances = list(instances)
        self.by_id = {inst.id: inst for inst in self.instances}
        self.scrape_interval_s = scrape_interval_s
        self.host = PolicyHost(router, prefix_index=prefix_index,
                               prefix_index_capacity_blocks=prefix_index_capacity_blocks, on_error=on_error,
                               observed_since=self.time.now)
        self.bookkeeping = self.host.bookkeeping
        self.index = self.host.index
        self.bus: KVEventBus | None = None
        if isinstance(self.index, PreciseIndex):
            self.bus = KVEventBus(env, kv_event_delay_s)
            self.bus.subscribers.append(self.index)
            for inst in self.instances:
                inst.pool.event_sink = self.bus.sink_for(inst.id)
        self.views: dict[str, InstanceView] = {}
        for inst in self.instances:
            self.views[inst.id] = self._new_view(inst)
        self.signals = self.host.signals
        self.fleet = FleetView(self.time.now, [], self.bookkeeping, self.index, signals=self.signals)
        self._refresh_lists()
        self.inflight: dict[int, tuple[RequestView, str]] = {}  # engine idx -> (view, instance id)
        self.explicit_scrapes = 0  # scrapes asked for outside the poller's ticks (the scaler's, exact mode)
        self.clock: ScrapeClock | None = None
        self._views_tick = self.time.now  # the tick the views were last brought to (they start fresh now)
        # a router that never reads the gauges (`RouterBase.reads_gauges`) gets none kept for it: the instances
        # keep no snapshot at each tick, and a decision brings no view to the last tick (a scaler still scrapes)
        self.reads_gauges: bool = bool(getattr(router, "reads_gauges", True))
        if scrape_interval_s > 0:
            self.clock = ScrapeClock(self.time.now, scrape_interval_s)
            for inst in self.instances:
                inst.scrape_clock = self._instance_clock()

    # -- views ---------------------------------------------------------------------------------------
    def _instance_clock(self) -> ScrapeClock | None:
        """The clock an instance keeps its gauges by for the decisions: none when the router reads none."""
        return self.clock if self.reads_gauges else None

    def _new_view(self, inst: Any) -> InstanceView:
        cfg = inst.config
        ic = InstanceConfig(num_gpu_blocks=inst.pool.num_gpu_blocks, block_size=cfg.block_size,
                            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                            max_model_len=cfg.max_model_len or 0)
        return InstanceView(inst.id, inst.state, self._gauges(inst), ic, self.bookkeeping.load(inst.id),
                            getattr(inst, "serving_since", 0.0))

    def _gauges(self, inst: Any) -> Gauges:
        return Gauges(inst.num_running, inst.num_waiting, inst.kv_usage, self.time.now)

    def _refresh_lists(self) -> None:
        views = [self.views[inst.id] for inst in self.instances]
        self.fleet.all_instances = views
        self.fleet.instances = [v for v in views if v.state == "serving"]

    @property
    def scrapes(self) -> int:
        """Scrapes made so far: the poller's ticks through now plus the explicit ones."""
        ticks = self.clock.ticks_through(self.time.now) if self.clock is not None else 0
        return ticks + self.explicit_scrapes

    def _follow_state(self, inst: Any) -> InstanceView:
        """The instance's view, replaced by one in its current lifecycle state if that changed."""
        v = self.views[inst.id]
        if v.state != inst.state:
            self.views[inst.id] = v = InstanceView(inst.id, inst.state, v.gauges, v.config, v._load,
                                                   getattr(inst, "serving_since", 0.0))
        return v

    def scrape(self) -> None:
        """Sample every instance's gauges now (what a /metrics scrape returns)."""
        self.explicit_scrapes += 1
        for inst in self.instances:
            self._follow_state(inst).gauges = self._gauges(inst)
        if self.clock is not None:
            self._views_tick = self.clock.last_tick(self.time.now)
        self._refresh_lists()

    def _bring_to_tick(self) -> None:
        """The views as the poller's last scrape left them: each instance's gauges as of that tick."""
        clock = self.clock
        assert clock is not None
        tick = clock.last_tick(self.time.now)
        if tick <= self._views_tick:
            return  # nothing scraped since the views were last brought up to date
        self._views_tick = tick
        views = self.views
        replaced = False
        for inst in self.instances:
            v = views[inst.id]
            if v.state != inst.state:  # `_follow_state`, inlined
                v = self._follow_state(inst)
                replaced = True
            if v.gauges.as_of < tick:
                running, waiting, kv = inst.gauges_at(tick)
                v.gauges = Gauges(running, waiting, kv, tick)
        if replaced:
            self._refresh_lists()

    def lifecycle_changed(self) -> None:
        """An instance was added or changed state: views follow at once (the registry knows)."""
        for inst in self.instances:
            if inst.id not in self.views:
                self.views[inst.id] = self._new_view(inst)
                self.by_id[inst.id] = inst
        for inst in self.instances:
            self._follow_state(inst)
        self._refresh_lists()

    def add_instance(self, inst: Any) -> None:
        self.instances.append(inst)
        self.by_id[inst.id] = inst
        if self.bus is not None:
            inst.pool.event_sink = self.bus.sink_for(inst.id)
        inst.scrape_clock = self._instance_clock()
        self.lifecycle_changed()

    # -- a decision ----------------------------------------------------------------------------------
    def route(self, req: RequestView) -> str | Reject:
        """Ask the router, through the host (its error rule: a RouterError, or a rejection with `reject`)."""
        clock = self.clock
        now = self.time.now
        if clock is None:
            self.scrape()
        elif self.reads_gauges and not (clock.cur <= now < clock.nxt and clock.cur <= self._views_tick):
            self._bring_to_tick()  # (else: no tick since the views were brought to one, `ScrapeClock.last_tick`)
        fleet = self.fleet
        fleet.now = now
        return self.host.choose(req, fleet)

    def dispatched(self, idx: int, req: RequestView, instance_id: str) -> None:
        self.inflight[idx] = (req, instance_id)
        self.host.dispatched(req, instance_id, self.time.now)

    def first_token(self, idx: int, t: float) -> None:
        rec = self.inflight.get(idx)
        if rec is not None:
            self.host.first_token(rec[0], rec[1], t)

    def finished(self, idx: int, output_tokens: int) -> None:
        rec = self.inflight.pop(idx, None)
        if rec is not None:
            self.host.finished(rec[0], rec[1], self.time.now, output_tokens)


__all__ = ["Dispatcher", "KVEventBus", "RouterError", "router_cause"]
