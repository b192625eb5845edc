"""The workers the proxy routes to, static or launched, and the views of them a router reads.

A worker's lifecycle follows the seam's states (starting, serving, draining, stopped); on top of it the
registry keeps health: a serving worker that fails (connection refused, a 5xx, a failed health probe) is
*down* until a probe succeeds, retried with exponential back-off. A down worker is shown to policies as
"stopped" (the seam has no state for "serving but unhealthy"), so no router picks it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from twin.policy.bookkeeping import Bookkeeping
from twin.policy.views import FleetView, Gauges, InstanceConfig, InstanceView

LIFECYCLE = ("starting", "serving", "draining", "stopped")


@dataclass
class Worker:
    """One vLLM server and what the controller knows of it."""

    id: str
    url: str
    state: str = "starting"
    healthy: bool = True
    config: InstanceConfig = field(default_factory=InstanceConfig)
    gauges: Gauges = field(default_factory=Gauges)
    counters: dict[str, float] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    cards: tuple[dict, ...] = ()  # its /v1/models cards, as vLLM wrote them
    kv_events_endpoint: str | None = None
    started_at: float = 0.0  # when it began serving (monotonic)
    created_at: float = 0.0  # when the controller registered it: a launched worker's launch (monotonic)
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""
    last_scrape: float = 0.0
    scrape_failures: int = 0
    kv_events_seen: int = 0
    handle: Any = None  # the launcher's process handle, None for static workers
    launch_args: dict[str, Any] = field(default_factory=dict)  # the engine arguments known given (vLLM's names)
    process_start: float | None = None  # its server's process_start_time_seconds: a change is a restart
    models_stale: bool = False  # restarted (or down at first contact), /v1/models not yet read (again)
    api_key: str | None = field(default=None, repr=False)  # its --api-key: the controller's calls to its /v1 send it

    @property
    def view_state(self) -> str:
        """The state routers see (the twin's `InstanceState`): a serving worker that failed is `stopped`."""
        if self.state == "serving" and not self.healthy:
            return "stopped"
        return self.state

    @property
    def status(self) -> str:
        """The state operators see (/health, /workers, `llmtwin_workers`): a serving worker that failed is
        `down` (its process may still run; health probes bring it back), not `stopped`."""
        if self.state == "serving" and not self.healthy:
            return "down"
        return self.state

    @property
    def routable(self) -> bool:
        return self.state == "serving" and self.healthy


class Registry:
    """Workers by id, in a stable order, plus the `FleetView` the router reads (rebuilt on change)."""

    def __init__(self, bookkeeping: Bookkeeping, prefix_index: Any = None) -> None:
        self.bookkeeping = bookkeeping
        self.workers: dict[str, Worker] = {}
        self._views: dict[str, InstanceView] = {}
        self.fleet = FleetView(0.0, [], bookkeeping, prefix_index)
        self.version = 0
        self._off: dict[str, frozenset[str]] = {}  # model -> the workers that do not serve it (rebuilt on change)
        # launched workers' measured start-ups (launch to serving, seconds), the latest last: the shadow twin's
        # start-up delay when `shadow.startup_delay_s` is not set
        self.startups: deque[float] = deque(maxlen=16)

    def add(self, worker: Worker) -> Worker:
        if worker.id in self.workers:
            raise ValueError(f"worker id {worker.id!r} is registered already")
        if not worker.created_at:
            worker.created_at = time.monotonic()
        self.workers[worker.id] = worker
        self.bookkeeping.load(worker.id)
        self.changed()
        return worker

    def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self._views.pop(worker_id, None)
        idx = self.fleet.prefix_index
        if idx is not None:
            idx.remove_instance(worker_id)
        self.changed()

    def get(self, worker_id: str) -> Worker | None:
        return self.workers.get(worker_id)

    def __iter__(self):
        return iter(list(self.workers.values()))

    def __len__(self) -> int:
        return len(self.workers)

    def routable(self, model: str | None = None) -> list[Worker]:
        """Serving, healthy workers; with `model`, those that serve it (or whose models are not read yet)."""
        off = self.not_serving(model)
        return [w for w in self.workers.values() if w.routable and w.id not in off]

    def not_serving(self, model: str | None) -> frozenset[str]:
        """The workers whose /v1/models lacks `model`: a fleet of several models routes a request only among
        the workers that serve its model, as vLLM's own server serves only its own. An empty name is any."""
        if not model:
            return frozenset()
        off = self._off.get(model)
        if off is None:
            off = frozenset(w.id for w in self.workers.values() if w.models and model not in w.models)
            if any(model in w.models for w in self.workers.values()):  # a served name only: clients send any
                self._off[model] = off
        return off

    def set_state(self, worker: Worker, state: str, now: float | None = None) -> None:
        if state not in LIFECYCLE:
            raise ValueError(state)
        if state == "serving" and worker.state != "serving" and now is not None:
            worker.started_at = now
            if worker.state == "starting" and worker.handle is not None and now > worker.created_at > 0:
                self.startups.append(now - worker.created_at)  # a launch's start-up (not a static URL's)
        worker.state = state
        self.changed()

    def mark_down(self, worker: Worker, now: float, error: str, backoff_initial_s: float,
                  backoff_max_s: float) -> bool:
        """Record a failure; returns True when this took a healthy worker down."""
        was = worker.healthy
        worker.healthy = False
        worker.failures += 1
        worker.last_error = error
        worker.retry_at = now + min(backoff_max_s, backoff_initial_s * 2 ** (worker.failures - 1))
        if was:
            self.changed()
        return was

    def mark_up(self, worker: Worker) -> bool:
        was = worker.healthy
        worker.healthy = True
        worker.failures = 0
        worker.last_error = ""
        if not was:
            self.changed()
        return not was

    def update_gauges(self, worker: Worker, gauges: Gauges, config: InstanceConfig | None = None) -> None:
        worker.gauges = gauges
        v = self._views.get(worker.id)
        if config is not None and config != worker.config:
            worker.config = config
            self.changed()
        elif v is not None:
            v.gauges = gauges

    def changed(self) -> None:
        """A worker was added, removed or changed state: rebuild the views (cheap, and rare)."""
        self.version += 1
        self._off.clear()
        views = []
        for w in self.workers.values():
            views.append(InstanceView(w.id, w.view_state, w.gauges, w.config,  # type: ignore[arg-type]
                                      self.bookkeeping.load(w.id), w.started_at))
        self._views = {v.id: v for v in views}
        self.fleet.all_instances = views
        self.fleet.instances = [v for v in views if v.state == "serving"]

    def fleet_view(self, now: float, exclude: Iterable[str] = (), model: str | None = None) -> FleetView:
        """The fleet as the router sees it now; `exclude` hides workers (a retry goes elsewhere), and so does
        `model` (workers that do not serve it)."""
        fleet = self.fleet
        fleet.now = now
        ex = set(exclude) | self.not_serving(model)
        if not ex:
            return fleet
        return FleetView(now, [v for v in fleet.instances if v.id not in ex], fleet.bookkeeping,
                         fleet.prefix_index, fleet.forecaster, fleet.all_instances, signals=fleet.signals,
                         extras=fleet.extras)

    def block_size(self) -> int:
        """The hash block size: the serving workers' own (vLLM CPU: 128; GPU: 16 by default)."""
        for w in self.workers.values():
            if w.routable:
                return w.config.block_size
        for w in self.workers.values():
            return w.config.block_size
        return 16
