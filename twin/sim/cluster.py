"""The simulated cluster: arrivals -> router policy -> instances, in one SimPy environment."""

from __future__ import annotations

import gc
import math
import inspect
import threading
import time
from collections import deque
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import numpy as np
import simpy

from twin.sim.api_server import ApiServer
from twin.engine.config import num_gpu_blocks
from twin.sim.instance import Instance
from twin.engine.request import BlockKeys, KeyBases, Request, RequestStatus, engine_block_keys, engine_block_runs
from twin.sim.environment import Environment
from twin.sim.events import Clock, Proc, Timer
from twin.sim.events import run as run_events
from twin.sim.dispatcher import Dispatcher, RouterError
from twin.perf.base import StepTimeModel
from twin.sim.build import build_perf, build_router, engine_config
from twin.policy.base import Router, prefix_index_kind
from twin.policy.scalers import Scaler
from twin.policy.views import Reject, RequestView, new_request_view
from twin.engine.records import RequestLog, account
from twin.scenario import Scenario
from twin.sim.timeline import Timeline, timeline_interval
from twin.workload.stream import RequestStream
from twin.workload.text_prefix import with_text_prefixes


@dataclass
class SimResult:
    """Everything a run produced: per-request records, per-instance engines, timings."""

    scenario: Scenario
    log: RequestLog
    instances: list[Instance]
    sim_time_s: float
    wall_time_s: float
    num_gpu_blocks: int
    perf: StepTimeModel
    stream_stats: dict = field(default_factory=dict)
    router_info: dict = field(default_factory=dict)
    timeline: Timeline | None = None  # when sim.timeline_interval_s > 0
    fleet: object | None = None  # twin.sim.fleet.Fleet: lifetimes, scale events, GPU-seconds


class _RunSink:
    """The run's engine events (twin.engine.sink), compiled with the engine: into the log's columns as
    `RequestLog`'s own sink methods write them (tested equal), then to what the run acts on: a first token and
    a finish reach the dispatcher's books and the router's hooks, the API server's delivery, the chunk planner
    and the session's next turn. One compiled object instead of a fan-out over interpreted ones: each request
    has half a dozen events."""

    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        buf = cluster.log.buffers  # the columns' memoryviews (twin.engine.records): cheaper per element than numpy
        self.status = buf["status"]
        self.scheduled_s = buf["scheduled_s"]
        self.cached_tokens = buf["cached_tokens"]
        self.preemptions = buf["preemptions"]
        self.first_token_s = buf["first_token_s"]
        self.finish_s = buf["finish_s"]
        self.output_tokens = buf["output_tokens"]
        self.wants_steps = False

    def request_queued(self, r: Request, now: float) -> None:
        self.status[r.idx] = RequestStatus.WAITING

    def request_scheduled(self, r: Request, t_decided: float, cached_tokens: int) -> None:
        self.scheduled_s[r.idx] = t_decided
        self.cached_tokens[r.idx] = cached_tokens

    def request_running(self, r: Request) -> None:
        self.status[r.idx] = RequestStatus.RUNNING

    def request_preempted(self, r: Request) -> None:
        self.preemptions[r.idx] = r.num_preemptions
        if r.status is RequestStatus.PREEMPTED:  # not one finished in the step in flight (async), taken as a victim
            self.status[r.idx] = RequestStatus.PREEMPTED

    def first_token(self, r: Request, t: float) -> None:
        self.first_token_s[r.idx] = t
        self.cluster._first_token(r.idx, t)

    def request_finished(self, r: Request, t: float) -> None:
        i = r.idx
        self.finish_s[i] = t
        self.output_tokens[i] = r.num_output_tokens
        self.status[i] = RequestStatus.FINISHED
        self.cluster._finished(i)

    def step(self, out: Any, t_end: float, used_blocks: int) -> None:
        pass

    def decode_run(self, num_decode: int, decode_context: int, t0: float, ends: list[float],
                   used_blocks: int) -> None:
        pass


class Cluster:
    """Instances and a router in one SimPy environment, fed by a request stream."""

    def __init__(self, sc: Scenario, stream: RequestStream, router: Router | None = None,
                 scaler: Scaler | None = None, perf: StepTimeModel | None = None, pool: str = "auto") -> None:
        self.scenario = sc
        self.stream = stream
        trace = sc.workload.trace
        # texts without prefix hashes: ids from the text, so shared text prefixes hit (twin.workload.text_prefix)
        with_text_prefixes(stream, trace.chars_per_token if trace is not None else 4.0)
        # what the per-request paths read of the stream, once it is complete (compiled: a field, not an attribute
        # lookup or a Python-level __len__ each time)
        self._hash_ids = stream.hash_ids
        # engine-block keys of requests made before they arrive (`live.shadow.warm` places a request's prompt in
        # the cache first): taken at the arrival instead of chaining the prompt's ids a second time
        self.premade_keys: dict[int, Sequence[int] | BlockKeys] = {}
        self._texts = stream.texts
        self._num_requests = len(stream)
        self.env = Environment()  # SimPy's, with the twin's clock (twin.sim.environment)
        self.clock: Clock = self.env.clock
        self.perf: StepTimeModel = build_perf(sc) if perf is None else perf
        self.engine_config = engine_config(sc)
        # KV pool: "segment" (ranges, twin/engine/segment_pool.py) or "per-block" (the reference BlockPool);
        # "auto" takes ranges when trace ids cover several engine blocks each (Mooncake: 512 / 16), where
        # the per-block pool would do ~800 dict operations per request. Both give the same schedules.
        if pool not in ("auto", "segment", "per-block"):
            raise ValueError(f"pool must be 'auto', 'segment' or 'per-block', got {pool!r}")
        self.segmented = pool == "segment" or (
            pool == "auto" and stream.hash_ids is not None
            and stream.hash_block_size != self.engine_config.block_size)
        self.num_blocks = num_gpu_blocks(
            self.engine_config, self.perf.gpu.device_memory, self.perf.weight_bytes_per_gpu,
            self.perf.kv_bytes_per_token_per_gpu,
        )
        self.log = RequestLog(len(stream))
        cols = self.log.buffers  # the log's columns as memoryviews: the per-request writes and reads below, each
        self._arrival_col = cols["arrival_s"]  # one field (compiled: native, where a dict lookup by name was not)
        self._prompt_col = cols["prompt_tokens"]
        self._max_tokens_col = cols["max_tokens"]
        self._session_col = cols["session_id"]
        self._priority_col = cols["priority"]
        self._instance_col = cols["instance"]
        self._status_col = cols["status"]
        self._finish_col = cols["finish_s"]
        self._output_col = cols["output_tokens"]
        self.log.arrival_s[:] = stream.arrival_s
        self.log.prompt_tokens[:] = stream.prompt_tokens
        cap = sc.workload.max_tokens
        # the length at which the engine stops each request: its true length, or the client's cap
        self.log.max_tokens[:] = stream.output_tokens if cap is None else np.minimum(stream.output_tokens, cap)
        if stream.session_id is not None:
            self.log.session_id[:] = stream.session_id
        if stream.priority is not None:
            self.log.priority[:] = stream.priority
        self.instances: list[Instance] = []
        self.by_id: dict[str, Instance] = {}
        # every engine's events: into the log, then the hooks (the log first: the hooks read it)
        self.sink = _RunSink(self)
        for _ in range(sc.cluster.num_instances):
            self._build_instance()
        if router is None:
            router = build_router(sc)
        self.router: Router = router
        assert self.engine_config.max_model_len is not None  # engine_config() fills it in
        self.max_model_len: int = self.engine_config.max_model_len
        self.max_tokens_cap = sc.workload.max_tokens
        # vLLM 0.32's API-server admission control (`Instance.admission_refusal`), checked only when configured
        self.admission_limits: bool = (self.engine_config.max_num_queued_reqs is not None
                                       or self.engine_config.max_num_queued_tokens is not None)
        # what-if semantic batching: regroups an instance's waiting queue as requests enter it (twin.whatif.semantic)
        self.queue_order: Callable[[deque], None] | None = None
        if sc.whatif.semantic_batching.enabled:
            from twin.whatif.semantic import queue_order

            self.queue_order = queue_order(sc, self.max_model_len)
        rs = sc.router
        self.dispatcher = Dispatcher(
            self.env, router, self.instances, scrape_interval_s=rs.scrape_interval_s,
            prefix_index=prefix_index_kind(router, rs.prefix_index),
            prefix_index_capacity_blocks=rs.prefix_index_capacity_blocks, kv_event_delay_s=rs.kv_event_delay_s,
            on_error=rs.on_error)
        self.predictor = None
        if sc.predictor is not None:
            from twin.policy.predictors import make_predictor

            self.predictor = make_predictor(sc.predictor.name, **sc.predictor.params)
            prime = getattr(self.predictor, "prime", None)
            if prime is not None and stream.texts is not None:
                prime([t for t in stream.texts if t])  # a text model embeds known prompts in batches
            self.dispatcher.host.predictor = self.predictor  # it predicts at arrival, learns at each finish
        if getattr(router, "needs_forecaster", False):
            from twin.sim.forecaster import SimForecaster

            self.dispatcher.fleet.forecaster = SimForecaster(self)
        self.in_transit: dict[str, dict[int, tuple[Request, float]]] = {}  # routed, not yet in the engine
        # trace ids naming several engine blocks: continued prefixes share key ranges (twin.engine.request.KeyBases)
        self.trace_runs: list | None = None
        if stream.hash_ids is not None and stream.hash_block_size != self.engine_config.block_size:
            self.trace_runs = trace_key_runs(stream)
        self.num_arrived = 0
        # the run ends exactly when the last request does (finished or rejected), not at a progress slice's end
        self.num_ended = 0
        self.all_ended = self.env.event()
        self.all_ended.callbacks.append(simpy.core.StopSimulation.callback)
        self._next_turn: np.ndarray | None = None
        if stream.after is not None:
            self._next_turn = np.full(len(stream), -1, dtype=np.int64)
            has = np.flatnonzero(stream.after >= 0)
            self._next_turn[stream.after[has]] = has
        # the API server of each instance as a queue (twin.sim.api_server), when it has work to queue: per request
        # and per token; the waits its tokens had for queued pre-processing (first token, finish)
        # the step model's API-server functions, looked up once: they are called at every request and token
        self._api_request_fn: Callable[[int], float] | None = getattr(self.perf, "api_request_s", None)
        self._api_token_fn: Callable[[], float] | None = getattr(self.perf, "api_token_s", None)
        self.api_cap, self.api_handoff_s, self.api_discipline = self._api_queue_settings()
        self.api_servers: dict[str, ApiServer] = {}
        self._api_by_index: list[ApiServer | None] = []  # the same servers by instance index (delivery waits)
        self._api_timer_cb = self._api_timer  # one bound method for every wake-up timer (its value says whose)
        self.api_record: bool = False  # the fit's gradients (twin.lab.calibrate)
        n_api = len(stream) if self.api_cap is not None else 0
        self.api_wait_first = np.zeros(n_api)
        self.api_wait_finish = np.zeros(n_api)
        # written a request at a time through memoryviews (numpy's item assignment is the dearer per element)
        self._wait_first_col: Any = self.api_wait_first.data  # (a memoryview of the array)
        self._wait_finish_col: Any = self.api_wait_finish.data
        from twin.sim.fleet import Fleet

        c = sc.cluster
        self.fleet = Fleet(self, c.min_instances, c.max_instances, c.startup_delay_s, c.tensor_parallel)
        self._chunk_online = sc.chunk_plan.online  # the fleet's planner starts with its process (`chunk_process`)
        if scaler is not None:
            self.fleet.scaler = scaler
        for inst in self.instances:
            self.fleet.register_initial(inst)
        if sc.chunk_plan.online:
            self.env.process(self.fleet.chunk_process())
        if getattr(self.fleet.scaler, "name", "") != "none":
            self._prepare_scaler()
            self.env.process(self.fleet.scaler_process())
        self.timeline: Timeline | None = None
        if sc.sim.timeline_interval_s > 0:
            span = float(stream.arrival_s[-1]) if len(stream) else 0.0
            scaling = getattr(self.fleet.scaler, "name", "") != "none"
            interval, note = timeline_interval(sc.sim.timeline_interval_s, span,
                                               max(c.num_instances, (c.max_instances or 0) if scaling else 0))
            if note is not None and note not in stream.stats.notes:
                stream.stats.notes.append(note)
            self.timeline = Timeline(self.env, self.dispatcher, interval)
            self.timeline.note = note
        Proc(self.env, self.arrivals())  # twin.sim.events: SimPy's process, compiled

    def _build_instance(self) -> Instance:
        i = len(self.instances)
        inst = Instance(self.env, f"instance-{i}", i, self.engine_config, self.perf, self.num_blocks, self.log,
                        fast_forward=self.scenario.sim.mode == "fast", segmented=self.segmented,
                        sink=self.sink)
        inst.on_idle = self._instance_idle
        self.instances.append(inst)
        self.by_id[inst.id] = inst
        return inst

    def new_instance(self, state: str = "starting") -> Instance:
        """An instance added by the fleet while the run goes on (the dispatcher learns of it at once)."""
        inst = self._build_instance()
        inst.state = state
        self.dispatcher.add_instance(inst)
        if self.timeline is not None:
            self.timeline.attach(inst)
        return inst

    def _first_token(self, i: int, t: float) -> None:
        self.dispatcher.first_token(i, t)
        if self.api_cap is not None:
            self._wait_first_col[i] = self._api_delivery_wait(i, t, 1)

    def _prepare_scaler(self) -> None:
        """Scalers that need a measured per-instance capacity get it from the twin before the run."""
        scaler = self.fleet.scaler
        if getattr(scaler, "capacity_req_s", 0) is None:
            from twin.sim.capacity import measure_capacity

            cap = measure_capacity(self.scenario, self.stream.prompt_tokens, self.stream.output_tokens,
                                   simulate=simulate)
            setattr(scaler, "capacity_req_s", cap.req_s)
            setattr(scaler, "capacity_tokens", cap.tokens_per_request)
            self.capacity = cap

    def make_request(self, i: int) -> Request:
        """Request i for the engine, from the log's columns (filled from the stream at the start: the prompt, the
        length the engine stops at, the session; its arrival, which `dispatch` sets to the clock's time) rather
        than the stream's numpy arrays, dearer per element."""
        p: int = self._prompt_col[i]
        keys: Sequence[int] | BlockKeys = []
        s = self.stream
        hash_ids = self._hash_ids
        if hash_ids is not None and hash_ids[i] is not None and self.engine_config.enable_prefix_caching:
            pre = self.premade_keys
            if pre and i in pre:
                return Request(i, self._arrival_col[i], p, self._max_tokens_col[i], pre.pop(i), self._session_col[i],
                               self._priority_col[i])
            covered = p + int(s.output_tokens[i]) if s.hashes_cover_output else p
            bs = self.engine_config.block_size
            tr = self.trace_runs[i] if self.trace_runs is not None else None
            if self.segmented:  # runs, O(runs): the range pool works on them
                keys = engine_block_runs(hash_ids[i], s.hash_block_size, bs, covered, tr)
            else:
                keys = engine_block_keys(hash_ids[i], s.hash_block_size, bs, covered, tr)
        stop: int = self._max_tokens_col[i]  # the true length, capped by the client's max_tokens
        sid: int = self._session_col[i]  # -1: none
        arrival: float = self._arrival_col[i]
        prio: int = self._priority_col[i]
        return Request(i, arrival, p, stop, keys, sid, prio)

    def request_view(self, r: Request) -> RequestView:
        """What the router may know: the client's cap, never the true length; the prompt's block hashes."""
        bs = self.engine_config.block_size
        keys = r.block_keys
        n_prompt = r.num_prompt_tokens // bs
        # runs stay runs (a `BlockKeys` prefix, O(runs)): expanded to per-block hashes only if a router reads them
        prefix = keys if len(keys) <= n_prompt else keys[:n_prompt]
        texts = self._texts
        sid = None if r.session_id < 0 else str(r.session_id)
        text = None if texts is None else texts[r.idx]
        view = new_request_view(str(r.idx), r.arrival_time, r.num_prompt_tokens, self.max_tokens_cap, prefix, bs,
                                sid, r.priority, None, text)
        p = self.predictor
        if p is None:
            return view
        if getattr(p, "needs_truth", False):  # the oracle (or noise around it) is handed the true length
            p.reveal(view.id, r.stop_at_tokens)
        return new_request_view(view.id, view.arrival_time, view.num_prompt_tokens, view.max_tokens, prefix, bs,
                                sid, 0, self.dispatcher.host.predict(view), text)

    def arrivals(self) -> Generator[Any, Any, None]:
        """Each request at its arrival time goes to the router; closed-loop turns wait for their predecessor."""
        clock = self.clock
        arrival = self.stream.arrival_s
        after = self.stream.after
        for i in range(len(arrival)):
            if after is not None and after[i] >= 0:
                continue  # sent by `_turn_ended` when the turn before it ends
            t = float(arrival[i])
            if t > clock.now:
                yield Timer(clock, t - clock.now)
            self.dispatch(i)

    def dispatch(self, i: int) -> None:
        """Request i arrives now: checked, routed and queued, or rejected with a reason."""
        log = self.log
        self.num_arrived += 1
        now = self.clock.now
        self._arrival_col[i] = now  # the clock's value: t - now + now can differ from t by an ulp
        r = self.make_request(i)  # arriving now: its arrival is the column's, just written
        max_len = self.max_model_len
        cap = self.max_tokens_cap if self.max_tokens_cap is not None else r.stop_at_tokens
        if r.num_prompt_tokens + cap > max_len:  # vLLM refuses prompt + max_tokens > max_model_len (HTTP 400)
            self._reject(i, "longer than max_model_len", f"{r.num_prompt_tokens} + {cap} tokens > {max_len}")
            return
        view = self.request_view(r)
        try:
            target = self.dispatcher.route(view)
        except RouterError:
            log.reject(i, "router error", "the run stopped here")
            raise
        if isinstance(target, Reject):  # the policy's choice, or (on_error: reject) the router raised
            if target.router_error:
                self._reject(i, "router error", target.reason.removeprefix("router error: "))
            else:
                self._reject(i, "rejected by the router", target.reason)
            return
        inst = self.by_id.get(target)
        if inst is None or inst.state != "serving":
            what = "an unknown instance" if inst is None else f"an instance that is {inst.state}"
            self._reject(i, f"router returned {what}", repr(target))
            return
        if not inst.fits(r.num_prompt_tokens + r.stop_at_tokens):
            self._reject(i, "larger than the instance's KV cache", f"{inst.id} has {inst.pool.num_usable_blocks} blocks")
            return
        if self.admission_limits:
            why = inst.admission_refusal()
            if why is not None:  # vLLM answers 503 so the client may retry elsewhere: not modelled, it is counted
                self._reject(i, "refused by vLLM's admission (503)", f"{inst.id}: {why}")
                return
        if now >= inst.timeline_next:  # its in-flight count changes: the timeline records the ticks before
            inst.timeline.fill(inst, now)  # (`Instance.touch`; its gauges do not change until the engine sees it)
        self.dispatcher.dispatched(i, view, inst.id)
        fn = self._api_request_fn
        delay = float(fn(r.num_prompt_tokens)) if fn is not None else 0.0
        if delay > 0 and self.api_cap is not None:  # the API server's queue, stretched by the token stream
            srv = self.api_servers.get(inst.id)
            if srv is None:
                srv = self.api_server(inst.id)
            if srv.discipline == "ps":  # shares the event loop with every request in pre-processing
                srv.arrive(now, delay, r.num_prompt_tokens, self.api_token_s(), inst.token_rate(), r.idx)
                transit = self.in_transit.get(inst.id)
                if transit is None:
                    transit = self.in_transit[inst.id] = {}
                transit[r.idx] = (r, srv.backlog_end()[0] + self.api_handoff_s)
                self._status_col[i] = RequestStatus.WAITING
                self._api_wake(inst, srv)
                return
            delay = srv.preprocess(now, delay, r.num_prompt_tokens, self.api_token_s(), inst.token_rate(),
                                   r.idx) - now  # FIFO behind earlier requests
        delay += self.api_handoff_s
        if delay > 0:  # the API server's work (HTTP, tokenization) before the engine sees the request
            self.in_transit.setdefault(inst.id, {})[r.idx] = (r, now + delay)
            self._status_col[i] = RequestStatus.WAITING  # arrived: queued in the API server
            Timer(self.clock, delay, callback=partial(self._to_engine, inst, r))
        else:
            self._enter_engine(inst, r)

    def _to_engine(self, inst: Instance, r: Request, _event: object) -> None:
        self.in_transit[inst.id].pop(r.idx, None)
        self._enter_engine(inst, r)

    def _enter_engine(self, inst: Instance, r: Request) -> None:
        inst.add_request(r)
        if self.queue_order is not None:
            self.queue_order(inst.scheduler.waiting)

    def _api_request_s(self, prompt_tokens: int) -> float:
        fn = self._api_request_fn
        return float(fn(prompt_tokens)) if fn is not None else 0.0

    def _api_queue_settings(self) -> tuple[float | None, float, str]:
        """(the cap on the token stream's share of the API server when it is a queue, else None: fixed delays;
        the hand-off latency to the engine; the queue's discipline)."""
        fn = getattr(self.perf, "api_queue_settings", None)
        cap, handoff, discipline = fn() if fn is not None else (None, 0.0, "off")
        if cap is None or (self._api_request_s(0) <= 0 and self._api_request_s(1) <= 0):
            cap = None  # nothing to queue: the engine sees every request at once, as without an API server
        return (None if cap is None else float(cap)), float(handoff), str(discipline)

    def _api_wake(self, inst: Instance, srv: ApiServer) -> None:
        """One timer per API server, at its next end of pre-processing (an arrival makes the last one stale)."""
        srv.generation += 1
        t = srv.next_done()
        if t < math.inf:
            dt = t - self.clock.now
            wake = Timer(self.clock, dt if dt > 0.0 else 0.0, callback=self._api_timer_cb)
            wake._value = (inst, srv, srv.generation)  # (no process waits on it: its value is only this)

    def _api_timer(self, event: Timer) -> None:
        """A wake-up timer of an API server fired (`_api_wake` put whose it is in its value)."""
        inst, srv, generation = event._value
        self._api_done(inst, srv, generation)

    def _api_done(self, inst: Instance, srv: ApiServer, generation: int) -> None:
        """Pre-processing ended: the requests go to the engine (after the hand-off)."""
        if generation != srv.generation:
            return
        transit = self.in_transit[inst.id]
        handoff = self.api_handoff_s
        for idx in srv.pop_done(self.clock.now):
            if handoff > 0:
                r = transit[idx][0]
                transit[idx] = (r, self.clock.now + handoff)
                Timer(self.clock, handoff, callback=partial(self._to_engine, inst, r))
            else:  # `_to_engine` at once
                self._enter_engine(inst, transit.pop(idx)[0])
        self._api_wake(inst, srv)

    def api_server(self, instance_id: str) -> ApiServer:
        """The instance's API server queue (made on its first request)."""
        srv = self.api_servers.get(instance_id)
        if srv is None:
            assert self.api_cap is not None
            srv = ApiServer(self.api_cap, self.api_discipline, record={} if self.api_record else None)
            self.api_servers[instance_id] = srv
            inst = self.by_id.get(instance_id)
            if inst is not None:
                by_index = self._api_by_index
                while len(by_index) <= inst.index:
                    by_index.append(None)
                by_index[inst.index] = srv
        return srv

    def api_entry_s(self, instance_id: str, prompt_tokens: int) -> float:
        """When a request sent now to this instance would reach its engine (forecasts; the queue unchanged)."""
        now = self.clock.now
        if self.api_cap is None:
            return now + self._api_request_s(prompt_tokens) + self.api_handoff_s
        srv = self.api_server(instance_id)
        inst = self.by_id.get(instance_id)
        return srv.entry_if_sent(now, self._api_request_s(prompt_tokens), self.api_token_s(),
                                 inst.token_rate() if inst is not None else 0.0) + self.api_handoff_s

    def _api_delivery_wait(self, i: int, t: float, which: int) -> float:
        """A token of request i the engine emitted at t waits this long for pre-processing queued ahead of it."""
        k: int = self._instance_col[i]  # (typed: compiled, the list index and the server's call are native)
        by_index = self._api_by_index
        srv = by_index[k] if k < len(by_index) else None
        return srv.delivery_wait(t, i, which) if srv is not None else 0.0

    def api_token_s(self) -> float:
        """The API server's per-output-token time (detokenize, stream): each token reaches the client this late."""
        fn = self._api_token_fn
        return float(fn()) if fn is not None else 0.0

    def _reject(self, i: int, reason: str, detail: str) -> None:
        self.log.reject(i, reason, detail)
        self._turn_ended(i)

    def _finished(self, i: int) -> None:
        """The engine finished request i: the books and the router's hook hear of it, then the session."""
        if self.api_cap is not None:
            self._wait_finish_col[i] = self._api_delivery_wait(i, self._finish_col[i], 2)
        self.dispatcher.finished(i, self._output_col[i])
        planner = self.fleet.chunk_planner if self._chunk_online else None
        if planner is not None:
            planner.observe(float(self.log.arrival_s[i]), int(self.log.prompt_tokens[i]), int(self.log.output_tokens[i]))
        self._turn_ended(i)  # a draining instance stops when its engine runs out of work (`_instance_idle`)

    def _instance_idle(self, inst: Instance) -> None:
        """An engine ran out of work: a draining one stops. The one place that stops it after its last request:
        under async scheduling that request keeps its blocks until the step after it finished."""
        if inst.state == "draining":
            self.fleet.maybe_stop(inst)

    def _turn_ended(self, i: int) -> None:
        """Request i finished or was rejected: the session's next turn is sent after its think time."""
        self.num_ended += 1
        if self.num_ended == self._num_requests:
            self.all_ended.succeed()  # stops env.run at this instant (StopSimulation)
        j = int(self._next_turn[i]) if self._next_turn is not None else -1
        if j < 0:
            return
        think_s = self.stream.think_s
        assert think_s is not None  # set together with `after`
        think = float(think_s[j])
        if self._status_col[i] == 4:  # the client sees the last token after the API server streamed it
            think += self.api_token_s()
            if self.api_cap is not None:
                think += float(self._wait_finish_col[i])
        if think > 0:
            Timer(self.clock, think).then(partial(self._dispatch_later, j))
        else:
            self.dispatch(j)

    def _dispatch_later(self, i: int, _event: object) -> None:
        self.dispatch(i)

    def done(self) -> bool:
        """Every request has arrived and no instance has work left."""
        return self.num_arrived == len(self.stream) and not any(self.in_transit.values()) and not any(
            inst.scheduler.has_unfinished_requests() for inst in self.instances)

    def run(self, progress: Callable[[float, int], None] | None = None, slices: int = 200,
            stop: Callable[[], bool] | None = None) -> SimResult:
        """Run to completion (or `sim.max_sim_time_s`), calling `progress(sim_now, arrived)` between slices.

        The run stops when the last request ends (`all_ended`), so `sim_time_s` does not depend on `slices`; or,
        with `stop`, at the first slice's end where `stop()` is true (a caller that has its answer: the live twin
        scaler's verdict), leaving later requests unfinished as a horizon does."""
        env = self.env
        # Requests waiting in a long queue are many young objects and no cycles: Python's collector
        # rescanning them was ~15 % of a million-request run. Collect rarely; restore afterwards. The collector's
        # settings are the whole process's: a run in another thread (the live controller's shadow twin, a Block
        # forecast) leaves them to the program that owns them.
        if threading.current_thread() is not threading.main_thread():
            return self._run(progress, slices, stop)
        gc_threshold = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(max(gc_threshold[0], 100_000), gc_threshold[1], max(gc_threshold[2], 100))
        try:
            return self._run(progress, slices, stop)
        finally:
            gc.set_threshold(*gc_threshold)
            gc.unfreeze()

    def _run(self, progress, slices: int, stop: Callable[[], bool] | None = None) -> SimResult:
        env = self.env
        t_wall = time.perf_counter()
        horizon = self.scenario.sim.max_sim_time_s
        last_arrival = float(self.stream.arrival_s[-1]) if len(self.stream) else 0.0
        step = max((horizon or last_arrival) / (slices if progress is not None else 1), 1e-3)
        if stop is not None:  # looks at the arrivals' pace: a horizon far past them would look too seldom
            step = min(step, max((last_arrival or horizon or 0.0) / slices, 1e-3))
        t = self.clock.now  # a run may resume after env.run(until=...) (forks, tests)
        while not self.done():
            nxt = env.peek()
            if nxt == math.inf:
                break
            t = max(t + step, nxt)
            if horizon is not None and t >= horizon:
                run_events(env, until=horizon)
                break
            run_events(env, until=t)
            if progress is not None:
                progress(self.clock.now, self.num_arrived)
            if stop is not None:
                if stop():
                    break
                if t > last_arrival and progress is None:  # draining: each look costs a pass over the log
                    step *= 1.25
        if self.timeline is not None:
            self.timeline.finish(self.clock.now)
        wall = time.perf_counter() - t_wall
        # client-side times: every token, the first and the last included, reaches the client api_token_s late
        shift = self.api_token_s()
        if shift > 0:
            self.log.first_token_s += shift
            self.log.finish_s += shift
        if self.api_servers:  # and after any pre-processing queued ahead of them in the API server
            self.log.first_token_s += self.api_wait_first
            self.log.finish_s += self.api_wait_finish
        if progress is not None:
            progress(self.clock.now, self.num_arrived)
        return SimResult(self.scenario, self.log, self.instances, float(self.clock.now), wall, self.num_blocks,
                         self.perf, self.stream.stats.to_dict(), self.router_info(), self.timeline, self.fleet)

    def predictor_info(self) -> dict | None:
        """The length predictor's name, and whether it reads the truth (oracle, or noise around it)."""
        spec = self.scenario.predictor
        if self.predictor is None or spec is None:
            return None
        describe = getattr(self.predictor, "describe", None)
        return {"name": spec.name, "describe": describe() if describe is not None else spec.name,
                "oracle": bool(getattr(self.predictor, "is_oracle", False)
                               or getattr(self.predictor, "needs_truth", False))}

    def router_info(self) -> dict:
        """What routed this run, for the report: name, parameters, signals and prefix index."""
        d = self.dispatcher
        rs = self.scenario.router
        return {"name": getattr(self.router, "name", type(self.router).__name__), "params": dict(rs.params),
                "scrape_interval_s": rs.scrape_interval_s,
                "prefix_index": None if d.index is None else d.index.kind,
                "kv_event_delay_s": rs.kv_event_delay_s if d.bus is not None else None,
                "kv_events_published": d.bus.published if d.bus is not None else 0,
                "predictor": self.predictor_info(),
                "scrapes": d.scrapes,
                # policy errors that dropped nothing (twin.policy.host): hooks, predictor.observe, choose on reject
                "hook_errors": dict(d.host.hook_errors)}


def trace_key_runs(stream: RequestStream) -> list:
    """Each request's prefix as trace-block runs of continued keys (`twin.engine.request.KeyBases`), worked out
    once per stream and kept on it: every simulation of the stream (a sweep's, a fork's) reads the same keys."""
    if stream._key_runs is None:
        kb = KeyBases()
        stream._key_runs = [kb.runs_of(h) if h else [] for h in (stream.hash_ids or [])]
    return stream._key_runs


def simulate(sc: Scenario, stream: RequestStream, progress=None, router=None) -> SimResult:
    return Cluster(sc, stream, router).run(progress)


# what callers import from here: the run, and the parts a scenario is turned into (twin.sim.build)
__all__ = ["Cluster", "SimResult", "account", "build_perf", "build_router", "engine_config", "simulate", "trace_key_runs"]
