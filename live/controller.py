"""The controller's state and background work: registry, router, bookkeeping, indexes, scrapes, health, scaling.

It is the live mirror of `twin.sim.dispatcher.Dispatcher`: the router gets the same `RequestView`s and
`FleetView`s, built from real signals. Gauges come from each worker's `/metrics` every
`router.scrape_interval_s` (floored at `min_scrape_interval_s`); bookkeeping is updated at dispatch, first
chunk and finish by the proxy (`live.proxy`); the approximate index is fed at dispatch, the precise one by
KV events (`live.kv_subscriber`). All times a policy sees are `time.monotonic()` seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import random
import sys
import time
import traceback
from typing import Any, Mapping

import aiohttp

from twin.engine.config import tokens_held
from twin.errors import TwinInputError
from twin.policy.base import build_router as build_router_from
from twin.policy.host import PolicyHost
from twin.policy.prefix_index import PreciseIndex
from twin.policy.scalers import ACTIVE
from twin.policy.views import FleetView, InstanceConfig
from twin.scenario import human_int

from live.config import LiveConfig
from live.kv_subscriber import KVEventSubscriber
from live.metrics import ControllerMetrics
from live.registry import Registry, Worker
from live.scaling import ScaleAction, ScalePlan, make_scaler, plan_scale
from live.signals import parse_metrics
from live.tokens import PromptTokenizer

def launch_int(v: Any) -> int | None:
    """An engine argument's count as vLLM's command line reads it (`twin.scenario.human_int`: 8k is 8,000, 8K is
    8,192); None where it is unset, -1 or "auto" (max_model_len: vLLM fits it to memory) or not a count (vLLM
    judges that at start)."""
    if v is None or isinstance(v, bool):
        return None
    n = human_int(v)
    if isinstance(n, float):
        n = int(n)
    return n if isinstance(n, int) and n > 0 else None


def worker_auth(w: Worker) -> dict[str, str] | None:
    """The header the controller's own calls to a worker's /v1 carry: its `--api-key` (or VLLM_API_KEY), which vLLM
    asks of every /v1 request (`AuthenticationMiddleware`, vllm/entrypoints/serve/middleware/authenticate.py)."""
    return {"Authorization": f"Bearer {w.api_key}"} if w.api_key else None


ROUTE_SWITCH_INTERVAL_S = 0.001  # the GIL's switch interval while a look-ahead router decides off the loop
_switch = {"holders": 0, "saved": 0.0}  # the setting is the process's: lowered by the first controller, restored by
# the last (controllers can overlap: tests, an embedding program)


def _lower_switch_interval() -> None:
    if _switch["holders"] == 0:
        _switch["saved"] = sys.getswitchinterval()
        sys.setswitchinterval(min(_switch["saved"], ROUTE_SWITCH_INTERVAL_S))
    _switch["holders"] += 1


def _restore_switch_interval() -> None:
    _switch["holders"] -= 1
    if _switch["holders"] == 0:
        sys.setswitchinterval(_switch["saved"])

log = logging.getLogger("llmtwin.live")


def prepare_scaler_slo(scaler: Any, cfg: LiveConfig) -> None:
    """A scaler with an `slo` attribute gets `shadow.slo` when it has none (as the simulator's fleet gives it
    the scenario's), and a mapping given in `scaler.params.slo` becomes the scenario's SLO object. The
    threshold scaler takes its default metric and threshold from it, shadow or not."""
    from live.config import SLO_SCALERS, scaler_slo

    if not hasattr(scaler, "slo"):
        return
    try:
        if scaler.slo is None:
            scaler.slo = cfg.shadow.slo
        elif isinstance(scaler.slo, dict) or getattr(scaler, "name", None) in SLO_SCALERS:
            scaler.slo = scaler_slo(scaler.slo, getattr(scaler, "needs_forecaster", False))
    except TwinInputError:
        raise
    except ValueError as e:
        raise TwinInputError(f"scaler.params: {e}") from None


def build_predictor(cfg: LiveConfig) -> Any:
    """The config's length predictor (as a scenario names it), or None; it fills `predicted_output_tokens`."""
    if cfg.predictor is None:
        return None
    from twin.policy.predictors import make_predictor

    return make_predictor(cfg.predictor.name, **cfg.predictor.params)


def build_router(cfg: LiveConfig) -> Any:
    """The config's router by name and parameters, exactly as the simulator builds it."""
    return build_router_from(cfg.router, cfg.seed)


class Controller:
    """Everything but HTTP serving; `live.proxy` wraps it in an aiohttp application."""

    def __init__(self, cfg: LiveConfig, router: Any = None) -> None:
        self.cfg = cfg
        self.metrics = ControllerMetrics()
        self.router = router if router is not None else build_router(cfg)
        # the shared seam (twin.policy.host): router and hooks, books, prefix index, recent window, predictor,
        # and the error rule, exactly as the simulator's dispatcher holds them
        self.host = PolicyHost(self.router, prefix_index=cfg.router.prefix_index, resolve_index=True,
                               prefix_index_capacity_blocks=cfg.router.prefix_index_capacity_blocks,
                               predictor=build_predictor(cfg), on_error=cfg.router.on_error,
                               observed_since=time.monotonic())
        self.router_name = self.host.router_name
        self.bookkeeping = self.host.bookkeeping
        kind = self.host.index_kind
        self.index_kind = kind
        index: Any = self.host.index
        # the precise index is kept from KV events whether or not the router reads it (observability)
        self.precise: PreciseIndex = index if kind == "precise" else PreciseIndex()
        self.registry = Registry(self.bookkeeping, index)
        self.index = index
        tk = cfg.tokenizer
        mode = tk.mode
        if mode == "auto":
            mode = "local" if tk.path else ("worker" if kind is not None else "estimate")
        path = str(cfg.resolve_path(tk.path)) if tk.path else None
        self.tokenizer = PromptTokenizer(mode, path, tk.chars_per_token)
        self.scaler = make_scaler(cfg.scaler.name, **cfg.scaler.params)
        # shadow mode (live.shadow): the twin forecasts the next window from mirrored arrivals
        self.shadow: Any = None
        if cfg.shadow.enabled:
            from live.shadow import Shadow

            self.shadow = Shadow(self)
        prepare_scaler_slo(self.scaler, cfg)
        # the online chunk planner (live.chunk_plan): its pick goes to the workers launched after it
        self.chunk_plan: Any = None
        if cfg.chunk_plan.online:
            from live.chunk_plan import LiveChunkPlanner

            self.chunk_plan = LiveChunkPlanner(self)
        # a look-ahead router (Block) simulates each candidate for tens of ms a decision: on the event loop, every
        # stream the proxy relays would stall that long. It decides on a thread of its own, one decision at a time
        self._route_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._route_lock = asyncio.Lock()
        self._switch_held = False  # this controller holds the lowered switch interval (from its first decision)
        if self.shadow is not None and getattr(self.router, "needs_forecaster", False):
            self.registry.fleet.forecaster = self.shadow.instance_forecaster()  # Block's look-ahead, live
            self._route_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmtwin-route")
        # recent arrivals and completions, as the simulator's dispatcher keeps them: scalers read it
        self.signals = self.host.signals
        self.registry.fleet.signals = self.signals
        self.api_key = cfg.server.resolved_api_keys()
        self.worker_keys = [ws.resolved_api_key(i) for i, ws in enumerate(cfg.workers)]  # the static workers' own
        self.session: aiohttp.ClientSession | None = None
        self.kv: KVEventSubscriber | None = None
        self.actuator: Any = None
        self.tasks: list[asyncio.Task] = []
        self._kv_checks: dict[str, asyncio.Task] = {}
        self._reading: set[str] = set()  # workers whose /v1/models is being read again after a restart
        self._launch_failures = 0  # scaler rounds in a row with a failed launch
        self._launch_retry_at = 0.0  # no launch before this (monotonic): the back-off after failed launches
        self.accepting = True
        self._ids = 0
        self._idle: dict[str, asyncio.Event] = {}
        self.started = False
        self.port: int | None = None

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        # idle pooled connections are closed after 4 s, before the worker's own keep-alive timeout closes them
        # (vLLM's uvicorn: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s, vllm/envs.py): a request sent on a connection
        # the worker is closing would fail before its first byte and mark a healthy worker down
        conn = aiohttp.TCPConnector(limit=0, limit_per_host=cfg.server.max_connections_per_worker,
                                    keepalive_timeout=4, ttl_dns_cache=300)
        # no cookie jar: a worker's Set-Cookie must not be replayed on other clients' requests (and the jar's
        # per-request filtering is work on the hot path)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                             timeout=aiohttp.ClientTimeout(total=None))
        if any(w.kv_events_endpoint for w in cfg.workers) or (cfg.launcher and cfg.launcher.kv_events):
            self.kv = KVEventSubscriber(self.precise, self.metrics)
        for wid, ws, key in zip(cfg.worker_ids(), cfg.workers, self.worker_keys):
            given = {k: getattr(ws, k) for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                                                 "performance_mode")}
            w = Worker(wid, ws.url, state="starting", kv_events_endpoint=ws.kv_events_endpoint,
                       launch_args={k: v for k, v in given.items() if v is not None}, api_key=key)
            w.config = self.launch_config(w.launch_args)
            self.add_worker(w)
        await asyncio.gather(*(self._first_contact(w) for w in self.registry))
        if cfg.launcher is not None:
            from live.launcher import LocalActuator

            self.actuator = LocalActuator(cfg.launcher, self)
            if cfg.launcher.num_workers:
                await asyncio.gather(*(self.actuator.start(self.launch_spec())
                                       for _ in range(cfg.launcher.num_workers)))
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._scrape_loop()), loop.create_task(self._health_loop())]
        if cfg.scaler.name != "none":
            self.tasks.append(loop.create_task(self._scale_loop()))
        if self.shadow is not None:
            self.tasks.append(loop.create_task(self.shadow.loop()))
        if self.chunk_plan is not None:
            self.tasks.append(loop.create_task(self.chunk_plan.loop()))
        self.started = True

    async def _first_contact(self, w: Worker) -> None:
        if not await self.try_ready(w):
            # its models and context are read when it comes up (`scrape`, from the health loop): without them its
            # /v1/models cards are missing and model-aware routing cannot tell what it serves
            w.models_stale = True
            self.registry.set_state(w, "serving", time.monotonic())
            self.registry.mark_down(w, time.monotonic(), w.last_error or "not ready at start",
                                    self.cfg.health.backoff_initial_s, self.cfg.health.backoff_max_s)
            log.warning("worker %s (%s): down at start: %s", w.id, w.url, w.last_error)

    async def stop(self) -> None:
        self.accepting = False
        self.tasks += list(self._kv_checks.values())
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self.tasks = []
        if self.actuator is not None:
            await self.actuator.close()
        if self.kv is not None:
            self.kv.close()
        if self.shadow is not None:
            self.shadow.close()
        if self._route_thread is not None:  # a decision asked after this runs inline (an embedder's, a test's)
            self._route_thread.shutdown(wait=False, cancel_futures=True)
            self._route_thread = None
        if self._switch_held:
            _restore_switch_interval()
            self._switch_held = False
        if self.session is not None:
            await self.session.close()
            self.session = None

    # -- registry ------------------------------------------------------------------------------------
    def launch_spec(self, engine_args: Mapping[str, Any] | None = None) -> Any:
        """What the actuator starts the next worker with: the chunk planner's pick over `launcher.engine_args`
        (the actuator lays these over them), and `engine_args` (a scale action's own) over the pick."""
        from live.launcher import LaunchSpec

        pick = self.chunk_plan.engine_args if self.chunk_plan is not None else {}
        return LaunchSpec({**pick, **(engine_args or {})})

    def launch_config(self, args: Mapping[str, Any]) -> InstanceConfig:
        """What a policy knows of a worker's launch arguments before its first scrape: those given (`args`, by
        vLLM's names), and for the batch limits left unset vLLM's defaults on `shadow.hardware`."""
        d = InstanceConfig()

        def get(k: str, default: int) -> int:
            v = launch_int(args.get(k))
            return v if v is not None else default

        mml = get("max_model_len", 0)
        tokens, seqs = self.batch_limits(args, mml)
        return InstanceConfig(num_gpu_blocks=0, block_size=get("block_size", d.block_size), max_num_seqs=seqs,
                              max_num_batched_tokens=tokens, max_model_len=mml)

    def batch_limits(self, args: Mapping[str, Any], max_model_len: int) -> tuple[int, int]:
        """(max_num_batched_tokens, max_num_seqs) a worker runs with: given ones win; unset ones are what
        `vllm serve` picks on `shadow.hardware` (`twin.engine.defaults.resolve_batch_limits`, after vLLM's
        `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`), 2048 / 128 on a CPU host. Where no
        hardware is named, or it is unknown, `InstanceConfig`'s placeholders stand in (8192 / 256)."""
        d = InstanceConfig()
        given = (launch_int(args.get("max_num_batched_tokens")), launch_int(args.get("max_num_seqs")))
        hw = self.cfg.shadow.hardware
        if hw is not None and None in given:
            from twin.engine.defaults import resolve_batch_limits
            from twin.specs.hardware import get_gpu

            ranks = (launch_int(args.get("tensor_parallel_size")) or self.cfg.shadow.tensor_parallel) * (
                launch_int(args.get("pipeline_parallel_size")) or 1)
            chunked = args.get("enable_chunked_prefill")
            chunked = chunked is None or bool(chunked)
            try:
                if not max_model_len:  # before first contact (where /v1/models tells it): the model's, if named
                    from live.shadow import model_context

                    max_model_len = model_context(self.cfg)
                if not max_model_len:  # provisional until first contact: vLLM's clamps by the context left out
                    max_model_len, chunked = 1 << 30, True
                return resolve_batch_limits(get_gpu(hw), given[0], given[1], max_model_len, chunked,
                                            world_size=ranks,
                                            performance_mode=str(args.get("performance_mode") or "balanced"))
            except TwinInputError:  # the worker runs, so vLLM took its limits: an unknown name, or a guess
                pass
        return (given[0] if given[0] is not None else d.max_num_batched_tokens,
                given[1] if given[1] is not None else d.max_num_seqs)

    def add_worker(self, w: Worker) -> None:
        self.registry.add(w)
        self._idle[w.id] = asyncio.Event()
        self._idle[w.id].set()
        if self.kv is not None and w.kv_events_endpoint:
            try:
                self.kv.subscribe(w.id, w.kv_events_endpoint)
            except Exception as e:  # noqa: BLE001 - the address is in use or malformed: say so, route anyway
                log.error("worker %s: cannot bind KV-event endpoint %s: %s", w.id, w.kv_events_endpoint, e)

    def retire(self, worker_id: str) -> None:
        w = self.registry.get(worker_id)
        if w is None:
            return
        self.registry.set_state(w, "stopped")
        if self.kv is not None:
            self.kv.unsubscribe(worker_id)
        check = self._kv_checks.pop(worker_id, None)
        if check is not None:
            check.cancel()
        self.registry.remove(worker_id)
        idle = self._idle.pop(worker_id, None)
        if idle is not None:  # a drain waiting for its last request (a worker that died while draining) ends
            idle.set()

    async def drain(self, worker_id: str) -> None:
        """No new requests to it from now; returns after its last in-flight request ends."""
        w = self.registry.get(worker_id)
        if w is None:
            return
        self.registry.set_state(w, "draining")
        log.info("worker %s: draining (%d in flight)", worker_id, self.bookkeeping.load(worker_id).requests)
        ev = self._idle.get(worker_id)
        if ev is not None and self.bookkeeping.load(worker_id).requests > 0:
            ev.clear()
            await ev.wait()

    async def try_ready(self, w: Worker) -> bool:
        """Models, launch config and one tiny completion; on success the worker is serving and healthy."""
        try:
            if not await self.read_models(w):
                return False
            await self.scrape(w)
            if not await self.probe(w):
                return False
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as e:
            w.last_error = f"{type(e).__name__}: {e}"
            return False
        now = time.monotonic()
        self.registry.mark_up(w)
        self.registry.set_state(w, "serving", now)
        log.info("worker %s (%s): serving %s, block size %d, %d KV blocks", w.id, w.url, ",".join(w.models),
                 w.config.block_size, w.config.num_gpu_blocks)
        if self.kv is not None and w.kv_events_endpoint and not w.kv_events_seen:
            old = self._kv_checks.pop(w.id, None)
            if old is not None:
                old.cancel()
            self._kv_checks[w.id] = asyncio.get_running_loop().create_task(self._check_kv_events(w))
        return True

    async def probe(self, w: Worker) -> bool:
        """One tiny completion: a broken engine can answer 200 on /health and fail the first request."""
        body = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
        if w.models:
            body["model"] = w.models[0]
        try:
            async with self.session.post(w.url + "/v1/completions", json=body, headers=worker_auth(w),
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.health.timeout_s)) as r:
                data = await r.read()
                if r.status != 200 or b'"choices"' not in data:
                    w.last_error = f"probe completion answered {r.status}: {data[:200]!r}"
                    return False
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            w.last_error = f"probe completion failed: {type(e).__name__}: {e}"
            return False
        return True

    async def _check_kv_events(self, w: Worker) -> None:
        """Start-up check: a fresh prompt of one full block must come back as a BlockStored from this worker.

        The first probe goes out once our SUB socket is bound; ZMQ drops what a publisher sends before its
        (re)connection to that socket is up (the slow joiner: its reconnect interval is 100 ms), and a prompt
        already cached produces no event, so a new random prompt is sent every second, at most
        `startup_check_s` of them. Without an event by then a warning names the endpoint and the gauge
        `llmtwin_kv_events_arriving` stays 0; the check keeps listening, and a late first event is logged."""
        kv = self.kv
        timeout = self.cfg.kv_events.startup_check_s
        if timeout <= 0 or kv is None:
            return
        deadline = time.monotonic() + timeout
        if not await kv.wait_bound(w.id, timeout):
            log.warning("worker %s: KV-event socket %s: %s: the precise index will not know its cache", w.id,
                        w.kv_events_endpoint, kv.state(w.id))
            return
        rng = random.Random()  # fresh tokens each time: a probe must not hit (or seed) the prefix cache
        probes = 0
        while not await kv.wait_first(w.id, 0.0) and time.monotonic() < deadline:
            if w.routable:  # a worker marked down meanwhile gets no probes until it is back
                bs = w.config.block_size  # read each time: a scrape may have corrected the default
                body: dict[str, Any] = {"prompt": [rng.randrange(10, 100) for _ in range(bs + 1)],
                                        "max_tokens": 1}
                if w.models:
                    body["model"] = w.models[0]
                probes += 1
                try:
                    async with self.session.post(w.url + "/v1/completions", json=body, headers=worker_auth(w),
                                                 timeout=aiohttp.ClientTimeout(
                                                     total=max(1.0, deadline - time.monotonic()))) as r:
                        await r.read()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
            await kv.wait_first(w.id, min(1.0, max(0.0, deadline - time.monotonic())))
        if await kv.wait_first(w.id, 0.0):
            w.kv_events_seen = 1
            log.info("worker %s: KV events arrive (%d probes, lag %.1f ms)", w.id, probes,
                     1e3 * kv.lag_s.get(w.id, 0.0))
            return
        log.warning("worker %s: no KV event within %.0f s (%d probe prompts) on %s: the precise index will not "
                    "know its cache (is --kv-events-config's endpoint this address?)", w.id, timeout, probes,
                    w.kv_events_endpoint)
        ev = kv.first_event.get(w.id)
        if ev is not None:
            await ev.wait()  # cancelled by stop() or retire(); a late first event is still worth a line
            w.kv_events_seen = 1
            log.info("worker %s: KV events arrive, late", w.id)

    def fail(self, w: Worker, error: str) -> None:
        """An upstream failure: the worker is down until a health probe succeeds."""
        if self.registry.mark_down(w, time.monotonic(), error, self.cfg.health.backoff_initial_s,
                                   self.cfg.health.backoff_max_s):
            log.warning("worker %s: marked down: %s", w.id, error)

    # -- background loops ----------------------------------------------------------------------------
    def forget_cache(self, worker_id: str) -> None:
        """A worker's KV cache is gone (it restarted): no index credits it with blocks any more."""
        for idx in {id(i): i for i in (self.registry.fleet.prefix_index, self.precise) if i is not None}.values():
            idx.remove_instance(worker_id)

    async def read_models(self, w: Worker) -> bool:
        """What `/v1/models` tells: the models a worker serves and its context (then vLLM's clamps of its unset
        batch limits by it). Read at first contact and again when the worker restarted (`scrape`). False (with
        `w.last_error`) for an answer that is not vLLM's list of model cards."""
        async with self.session.get(w.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5),
                                    headers=worker_auth(w)) as r:
            if r.status != 200:
                w.last_error = f"/v1/models answered {r.status}"
                return False
            data = await r.json(content_type=None)
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
            w.last_error = "/v1/models answered something other than a list of model cards"
            return False
        models = tuple(c["id"] for c in cards)
        mml = next((m for c in cards if (m := launch_int(c.get("max_model_len")))), None)
        config = w.config
        if mml and not launch_int(w.launch_args.get("max_model_len")):  # the config's value, where given, wins
            tokens, seqs = self.batch_limits(w.launch_args, mml)
            config = InstanceConfig(config.num_gpu_blocks, config.block_size, seqs, tokens, mml)
        w.cards = tuple(cards)
        if models != w.models or config != w.config:
            w.models, w.config = models, config
            self.registry.changed()  # the routers' views and the proxy's served models are rebuilt on it
        return True

    async def _reread_models(self, w: Worker) -> None:
        """After a restart, or once a worker that was down at start-up comes up: /v1/models (again), until one read
        succeeds (`w.models_stale`), one read at a time."""
        if w.id in self._reading:
            return
        self._reading.add(w.id)
        try:
            if await self.read_models(w):
                w.models_stale = False
            else:
                log.warning("worker %s: /v1/models: %s (tried again at the next scrape)", w.id, w.last_error)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.warning("worker %s: /v1/models: %s: %s (tried again at the next scrape)", w.id, type(e).__name__, e)
        finally:
            self._reading.discard(w.id)

    async def scrape(self, w: Worker) -> bool:
        t0 = time.perf_counter()
        try:
            async with self.session.get(w.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status, message="not 200")
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            w.scrape_failures += 1
            self.metrics.scrape_errors.labels(w.id).inc()
            if isinstance(e, aiohttp.ClientConnectorError) and w.state == "serving":
                self.fail(w, f"/metrics: {e}")
            return False
        page = parse_metrics(text)
        if page.process_start is not None:
            if w.process_start is not None and page.process_start != w.process_start:
                # restarted between two looks (perhaps with another model or context): /v1/models was read once.
                # Noted before any await, so a scrape overlapping this one (the health loop's) sees it once
                log.warning("worker %s: restarted (its process start time changed): its prefix cache forgotten, "
                            "/v1/models read again", w.id)
                self.forget_cache(w.id)
                w.models_stale = True
            w.process_start = page.process_start
        if w.models_stale:
            await self._reread_models(w)
        now = time.monotonic()
        config = page.config(w.config) if page.cache_info else None
        if config is not None and config != w.config and 2 <= config.num_gpu_blocks and config.max_model_len > (
                held := tokens_held(config.num_gpu_blocks, config.block_size)):  # vLLM runs no worker so: one is stale
            log.warning("worker %s: its KV cache (%d blocks of %d tokens) holds %d tokens, less than the max_model_len "
                        "%d known since its first contact: restarted with other settings? (the shadow twin takes %d)",
                        w.id, config.num_gpu_blocks, config.block_size, held, config.max_model_len, held)
        self.registry.update_gauges(w, page.gauges(now), config)
        w.counters = page.values
        w.last_scrape = now
        self.metrics.scrape_duration.observe(time.perf_counter() - t0)
        return True

    async def _scrape_loop(self) -> None:
        dt = self.cfg.scrape_interval_s
        while True:
            ws = [w for w in self.registry if w.state in ("serving", "draining") and w.healthy]
            if ws:
                await asyncio.gather(*(self.scrape(w) for w in ws))
            await asyncio.sleep(dt)

    async def _health_loop(self) -> None:
        h = self.cfg.health
        last: dict[str, float] = {}
        while True:
            reap = getattr(self.actuator, "reap", None)
            if reap is not None:  # launched workers whose process ended: retired, so the scaler can replace them
                try:
                    await reap()
                except Exception:  # noqa: BLE001 - logged; health checks go on
                    log.error("reaping exited workers raised:\n%s", traceback.format_exc())
            now = time.monotonic()
            due = []
            for w in self.registry:
                if w.state not in ("serving", "draining"):
                    continue
                if not w.healthy and now >= w.retry_at:
                    due.append(w)
                elif w.healthy and now - last.get(w.id, 0.0) >= h.interval_s:
                    due.append(w)
            for w in due:
                last[w.id] = now
            results = await asyncio.gather(*(self.probe(w) for w in due))
            for w, ok in zip(due, results):
                if ok:
                    if self.registry.mark_up(w):
                        log.info("worker %s: back up", w.id)
                        await self.scrape(w)
                else:
                    self.fail(w, w.last_error)
            await asyncio.sleep(min(0.5, h.interval_s))

    async def _scale_loop(self) -> None:
        dt = self.cfg.scaler.interval_s
        while True:
            await asyncio.sleep(dt)
            try:
                await self.scale_once()
            except Exception:  # noqa: BLE001 - a scaler bug is logged, the proxy keeps serving
                log.error("scaler %s raised:\n%s", self.cfg.scaler.name, traceback.format_exc())

    async def scale_once(self) -> Any:
        """Ask the scaler once and apply its action through the actuator."""
        fleet = self.registry.fleet_view(time.monotonic())
        if self.shadow is not None and getattr(self.scaler, "needs_forecaster", False):
            # the twin scaler simulates in its decide(): a thread keeps the event loop serving meanwhile
            forecast = self.shadow.fleet_forecaster(fleet.now)
            view = fleet.snapshot(forecast)  # the loop keeps changing the fleet meanwhile
            decided = await asyncio.to_thread(self.scaler.decide, view.now, view, forecast)
        else:
            decided = self.scaler.decide(fleet.now, fleet, None)
        launcher = self.cfg.launcher
        plan = self.launched_only(decided, plan_scale(decided, fleet, 0, launcher.max_workers if launcher is not None
                                                      else None), fleet)
        if plan.start and fleet.now < self._launch_retry_at:  # launches failed lately: none until the back-off ends
            log.debug("scaling: %d launches wanted, none before the back-off ends in %.1f s", plan.start,
                      self._launch_retry_at - fleet.now)
            plan = dataclasses.replace(plan, start=0)
        if plan.is_noop:
            return plan
        if self.actuator is None:
            log.warning("scaler wants %s but no launcher is configured", plan)
            return plan
        log.info("scaling: start %d, drain %s (%s)", plan.start, list(plan.drain), plan.reason)
        jobs = [self.actuator.start(self.launch_spec(plan.engine_args)) for _ in range(plan.start)]
        jobs += [self.actuator.drain(wid) for wid in plan.drain]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        from live.launcher import LaunchRefused

        for e in results:
            if isinstance(e, BaseException):  # a worker that failed to start: its reason and log tail, not nothing
                (log.warning if isinstance(e, LaunchRefused) else log.error)("scaling: %s", str(e) or type(e).__name__)
        if plan.start:
            tried = [e for e in results[:plan.start] if not isinstance(e, LaunchRefused)]  # refusals tried nothing
            if tried:
                self._launched(sum(isinstance(e, BaseException) for e in tried), len(tried))
        return plan

    def _launched(self, failed: int, tried: int) -> None:
        """A round of launches ended: one that failed doubles the wait before the next (from
        `launcher.launch_backoff_initial_s` up to `launch_backoff_max_s`), so a worker that cannot start (a bad
        engine argument, a model that does not load) is not retried every `scaler.interval_s`; a round whose
        launches all succeeded ends the back-off. Launches refused for want of room (`LaunchRefused`) are neither."""
        if not failed:
            if self._launch_failures:
                log.info("scaling: launches succeed again after %d failed rounds", self._launch_failures)
            self._launch_failures, self._launch_retry_at = 0, 0.0
            return
        from live.config import LauncherSpec

        sp = self.cfg.launcher
        keys = ("launch_backoff_initial_s", "launch_backoff_max_s")
        first, cap = (getattr(sp, k) if sp is not None else LauncherSpec.model_fields[k].default  # another actuator's
                      for k in keys)
        self._launch_failures += 1
        wait = min(cap, first * 2 ** (self._launch_failures - 1))
        self._launch_retry_at = time.monotonic() + wait
        log.warning("scaling: %d of %d launches failed (%d rounds in a row): the next launch in %g s at the earliest",
                    failed, tried, self._launch_failures, wait)

    def launched_only(self, decided: Any, plan: ScalePlan, fleet: FleetView) -> ScalePlan:
        """Only the workers the launcher started are drained: a static worker (`workers:`) is not the controller's to
        stop, and a drained one could never come back. It counts in the fleet the scaler sizes (its capacity serves),
        so a target below the active fleet drains that many launched workers, chosen by the same planner among them
        (`plan_scale`); an explicit drain that names a static worker leaves it serving, with a warning."""
        static = [d for d in plan.drain if (w := self.registry.get(d)) is not None and w.handle is None]
        if not static:
            return plan
        if getattr(decided, "target", None) is None:
            log.warning("scaling: not draining %s: only workers the launcher started are scaled", ", ".join(static))
            return dataclasses.replace(plan, drain=tuple(d for d in plan.drain if d not in static))
        launched = [v for v in fleet.all_instances
                    if (w := self.registry.get(v.id)) is not None and w.handle is not None]
        active = sum(1 for v in launched if v.state in ACTIVE)
        among = FleetView(fleet.now, [v for v in launched if v.state == "serving"], fleet.bookkeeping,
                          all_instances=launched)
        drain = plan_scale(ScaleAction(max(0, active - len(plan.drain))), among).drain
        log.info("scaling: static worker%s %s kept (not the launcher's); draining %s instead",
                 "s" if len(static) > 1 else "", ", ".join(static), ", ".join(drain) or "none")
        return dataclasses.replace(plan, drain=drain)

    # -- bookkeeping (called by the proxy) -----------------------------------------------------------
    def next_id(self) -> str:
        self._ids += 1
        return f"live-{self._ids}"

    @property
    def decides_off_loop(self) -> bool:
        """The router decides on the routing thread (a look-ahead router, until stop)."""
        return self._route_thread is not None

    def routing(self) -> contextlib.AbstractAsyncContextManager:
        """Held by the proxy from the fleet view to the dispatch when the router decides off the loop: decisions come
        one at a time and each sees the dispatches before it, as on the loop (else a burst would all go to the one
        worker that looked idlest). A no-op for routers that decide on the loop."""
        return self._route_lock if self.decides_off_loop else contextlib.nullcontext()

    async def choose(self, req: Any, fleet: FleetView) -> Any:
        """The router's decision through the host (its error rule): inline for most routers (microseconds), on the
        routing thread for a look-ahead router, so the loop relays other streams meanwhile.

        The two threads share the GIL, and each pass of the loop gives it up (its poll) and waits up to the switch
        interval to have it back. At CPython's 5 ms a stream waited 20 ms of a 30 ms decision (a few passes a chunk),
        barely better than on the loop: from its first decision off the loop to its stop, the controller sets 1 ms,
        for the whole process (the last such controller to stop restores it). On an idle loop: 0.4-1.8 ms late at
        the median, 8 ms at most, decisions as fast (benchmarks/bench_live_block.py). A loop busy relaying takes its
        share of the GIL, so decisions then take longer than on the loop, where they took it all. The collector's full
        passes hold the GIL too: `llmtwin live` freezes what it loaded at start (`live.cli`)."""
        if self._route_thread is None:
            return self.host.choose(req, fleet)
        if not self._switch_held:
            _lower_switch_interval()
            self._switch_held = True
        # on a snapshot: the loop records first tokens and finishes meanwhile (the lock keeps dispatches out)
        return await asyncio.get_running_loop().run_in_executor(self._route_thread, self._decide, req,
                                                                fleet.snapshot(window=False))

    def _decide(self, req: Any, fleet: FleetView) -> Any:
        """One decision on the routing thread: the forecaster keeps one context for all its candidates, though the
        loop changes the mirror meanwhile (`ShadowInstanceForecaster.decision`)."""
        fc = fleet.forecaster
        with fc.decision() if hasattr(fc, "decision") else contextlib.nullcontext():
            return self.host.choose(req, fleet)

    def dispatched(self, req: Any, worker_id: str, now: float) -> None:
        self.host.dispatched(req, worker_id, now)
        if self.shadow is not None:
            self.shadow.dispatched(req, worker_id, now)

    def first_token(self, req: Any, worker_id: str, now: float) -> None:
        self.host.first_token(req, worker_id, now)
        if self.shadow is not None:
            self.shadow.first_token(req, now)

    def finished(self, req: Any, worker_id: str, now: float, output_tokens: int) -> None:
        """Completed requests only enter the recent window and teach the predictor: failures carry no latency."""
        self.host.finished(req, worker_id, now, output_tokens)
        if self.shadow is not None:
            self.shadow.finished(req, now, output_tokens)
        if self.chunk_plan is not None and output_tokens > 0:  # as the simulator's planner: finished requests
            self.chunk_plan.observe(req.arrival_time, req.num_prompt_tokens, output_tokens)
        if self.bookkeeping.load(worker_id).requests == 0:
            ev = self._idle.get(worker_id)
            if ev is not None:
                ev.set()

    def streamed(self, req: Any, stream: bool) -> None:
        """The proxy says whether a request streams (its first chunk is then a first token, not the answer)."""
        if self.shadow is not None:
            self.shadow.mirror.streamed(req.id, stream)

    def served_models(self) -> set[str]:
        out: set[str] = set()
        for w in self.registry:
            out.update(w.models)
        if self.cfg.model:
            out.add(self.cfg.model)
        return out

    def status(self) -> dict[str, Any]:
        """What an operator asks first: the workers, their states, signals and errors."""
        now = time.monotonic()
        workers = [{"id": w.id, "url": w.url, "state": w.status, "healthy": w.healthy,
                    "models": list(w.models), "in_flight": self.bookkeeping.load(w.id).requests,
                    "running": w.gauges.num_running, "waiting": w.gauges.num_waiting,
                    "kv_usage": w.gauges.kv_usage, "block_size": w.config.block_size,
                    "num_gpu_blocks": w.config.num_gpu_blocks, "max_model_len": w.config.max_model_len,
                    "scrape_age_s": None if not w.last_scrape else now - w.last_scrape,
                    "prefix_cache_hits": w.counters.get("prefix_hits"),
                    "prefix_cache_queries": w.counters.get("prefix_queries"),
                    "kv_blocks_indexed": self.precise.num_blocks(w.id),
                    "kv_events": self.kv.state(w.id) if self.kv is not None else "off",
                    "last_error": w.last_error or None} for w in self.registry]
        out: dict[str, Any] = {"router": self.router_name, "prefix_index": self.index_kind,
                               "tokenizer": self.tokenizer.mode, "in_flight": self.bookkeeping.in_flight(),
                               "accepting": self.accepting, "workers": workers}
        if self.cfg.launcher is not None:  # the back-off after failed launches (`_launched`)
            out["launches"] = {"failed_rounds": self._launch_failures,
                               "next_launch_in_s": max(0.0, self._launch_retry_at - now) if self._launch_failures
                               else None}
        if self.chunk_plan is not None:
            out["chunk_plan"] = self.chunk_plan.status()
        return out
