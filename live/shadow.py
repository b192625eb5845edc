"""Shadow mode: the twin runs beside the live controller on what the controller observes.

Every `shadow.interval_s` the controller's recent arrivals (mirrored from the proxy's bookkeeping hooks:
arrival, prompt tokens and prefix hashes, worker, first token, finish, output tokens) become a twin workload
for the NEXT window. The load model is pluggable (`LOAD_MODELS`); the default `replay` is an ASSUMPTION:
the next window looks like the last one (the same arrivals, shifted forward one window). That workload is
simulated on a twin `Cluster` built like a scenario's (`twin.scenario.parse_scenario`, `twin.sim.cluster.Cluster`):
the live workers' engine settings (`vllm:cache_config_info`, launch arguments), the router by name and
parameters, the perf profile the config names (`shadow.perf`, as a scenario's `cluster.perf`). It runs for the
current configuration and alternatives (+1 / -1 instance, other `max_num_batched_tokens`), off the event loop
(a thread or a child process), and the forecasts are exported as Prometheus gauges. When a window has passed,
the forecast made for it is scored against what the proxy measured in it (`llmtwin_shadow_forecast_error_ratio`,
and a history at `/shadow`). The `twin` scaler reads `ShadowFleetForecaster.attainment`, the live side of the
simulator's `twin.sim.forecaster.FleetForecaster`.

ASSUMPTIONS of the forecast (documented in the README, "Shadow mode"; each is settable or pluggable): the
next window's arrivals come from the load model (`shadow.load`); each simulation starts from idle engines
plus the requests in flight now (`shadow.carry_in_flight`, see `with_in_flight`), each kept on the instance
standing for its worker (`placed`), a decoding one with its prompt's KV in that instance's cache (`warm`); a
worker still starting serves `shadow.startup_delay_s` after its launch and a new one (instances+1, the twin
scaler's larger sizes) that long after the window's start (default: the median of the launcher's measured
start-ups, 0 before any; `fleet_slots`); requests still running when a window is cut get the client's
`max_tokens`, else the window's mean output length; every output ends where the context does (`within_context`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import logging
import math
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from twin.engine.config import tokens_held
from twin.errors import TwinInputError

if TYPE_CHECKING:
    from live.config import LiveConfig
    from twin.scenario import Scenario

log = logging.getLogger("llmtwin.live.shadow")

# forecast metrics in seconds (the gauge `llmtwin_shadow_forecast_seconds{metric=...}`)
SECONDS = ("ttft_p50", "ttft_p99", "tpot_p50", "itl_p50", "e2e_p50", "e2e_p99", "queue_p50")
# those the proxy measures too, so they are scored. Not queue and ITL (the proxy does not see them per
# request), nor TPOT: the proxy sees chunks, and vLLM merges tokens into one SSE event when the reader lags,
# so a whole answer can come in the first chunk (TPOT ~0 measured on real workers); it is reported, not scored
SCORED = ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")


# -- the mirror: what the proxy saw of each request --------------------------------------------------------
@dataclass
class Mirrored:
    """One proxied request as the controller observed it (monotonic seconds)."""

    id: str
    arrival: float
    prompt_tokens: int
    max_tokens: int | None
    prefix: tuple = ()
    block_size: int = 16
    worker: str | None = None
    stream: bool | None = None  # None: not known; TTFT is only measured on streamed requests
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    priority: int = 0  # the body's vLLM priority (read by a twin under scheduling_policy: priority)

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def ok(self) -> bool:
        """Completed with tokens (failures carry no latency)."""
        return self.finish is not None and self.first_token is not None and self.output_tokens > 0


class Mirror:
    """The recent requests the proxy handled, kept for `keep_s` seconds after arrival."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.records: deque[Mirrored] = deque()
        self.by_id: dict[str, Mirrored] = {}
        self.total = 0
        self.version = 0  # bumped by every change to a record or the set of records

    def arrived(self, req: Any, worker: str, now: float) -> None:
        rec = self.by_id.get(req.id)
        self.version += 1
        if rec is not None:  # a retry on another worker: the same request, in flight again (the failed attempt's
            rec.worker = worker  # finish had it done with no tokens while the retry ran: out of every forecast)
            rec.first_token = rec.finish = None
            rec.output_tokens = 0
            return
        rec = Mirrored(req.id, float(req.arrival_time), int(req.num_prompt_tokens), req.max_tokens,
                       tuple(req.prefix or ()), int(req.prefix_block_size or 16), worker,
                       priority=int(req.priority or 0))
        self.records.append(rec)
        self.by_id[req.id] = rec
        self.total += 1
        self.trim(now)

    def streamed(self, rid: str, stream: bool) -> None:
        rec = self.by_id.get(rid)
        if rec is not None:
            rec.stream = stream
            self.version += 1

    def first_token(self, rid: str, now: float) -> None:
        rec = self.by_id.get(rid)
        if rec is not None and rec.first_token is None:
            rec.first_token = now
            self.version += 1

    def finished(self, rid: str, now: float, output_tokens: int) -> None:
        rec = self.by_id.get(rid)
        if rec is not None:
            rec.finish = now
            rec.output_tokens = int(output_tokens)
            self.version += 1

    def trim(self, now: float) -> None:
        cut = now - self.keep_s
        while self.records and self.records[0].arrival < cut:
            old = self.records.popleft()
            self.by_id.pop(old.id, None)
            self.version += 1

    def snapshot(self) -> list[Mirrored]:
        """The records as a list, for another thread: Block's live forecasts run on the routing thread while the
        event loop appends and trims (iterating the deque from Python there could raise mid-way). `list` copies it
        in one C call, which holds the GIL throughout, so the loop cannot change it within."""
        return list(self.records)

    def window(self, t0: float, t1: float, records: Sequence[Mirrored] | None = None) -> list[Mirrored]:
        """The records that arrived in [t0, t1): of `records` (a snapshot) where given, else of the mirror itself
        (on the loop)."""
        return [r for r in (self.records if records is None else records) if t0 <= r.arrival < t1]


# -- load models: the next window's arrivals from the last one ---------------------------------------------
@dataclass
class WindowLoad:
    """A twin workload: arrival offsets from the window's start, lengths, prefix hashes."""

    offsets: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    window_s: float
    hash_ids: list | None = None
    hash_block_size: int = 16
    carried: int = 0  # the first `carried` entries are requests in flight now (offset 0), not the window's
    tpot_s: float | None = None  # the observed window's median TPOT (streamed requests), when known
    carried_on: list | None = None  # the worker serving each carried request (None: not known), to pin it there
    carried_decoding: list | None = None  # per carried request: it has its first token (its prompt's KV is held)
    priority: np.ndarray | None = None  # each request's vLLM priority (None: all 0)

    def __len__(self) -> int:
        return len(self.offsets) - self.carried

    @property
    def rate(self) -> float:
        return len(self) / self.window_s if self.window_s > 0 else 0.0

    def part(self, idx: np.ndarray) -> tuple:
        return (self.offsets[idx], self.prompt_tokens[idx], self.output_tokens[idx],
                None if self.hash_ids is None else [self.hash_ids[i] for i in idx])

    def priorities(self, idx: np.ndarray) -> np.ndarray | None:
        return None if self.priority is None else self.priority[idx]

    def to_stream(self):
        from twin.workload.stream import RequestStream, TraceStats

        order = np.argsort(self.offsets, kind="stable")  # stable: the carried ones (offset 0, first) stay first
        hashes = None if self.hash_ids is None else [self.hash_ids[i] for i in order]
        return RequestStream(self.offsets[order], self.prompt_tokens[order], self.output_tokens[order], hashes,
                             self.hash_block_size, stats=TraceStats("live shadow", len(self), len(self)),
                             priority=self.priorities(order))


def observed_lengths(records: Sequence[Mirrored]) -> tuple[np.ndarray, np.ndarray, list | None, int]:
    """Prompt and output tokens per request: the observed output, or (still running, failed) the client's
    `max_tokens`, else the window's mean output (ASSUMPTION)."""
    outs = [r.output_tokens for r in records if r.ok]
    mean_out = max(1, round(sum(outs) / len(outs))) if outs else 16
    prompt = np.array([max(1, r.prompt_tokens) for r in records], dtype=np.int64)
    out = np.array([r.output_tokens if r.ok else (r.max_tokens or mean_out) for r in records], dtype=np.int64)
    bs = records[0].block_size if records else 16
    hashes = [list(r.prefix) or None for r in records]
    return prompt, np.maximum(out, 1), (hashes if any(h for h in hashes) else None), bs


def observed_priorities(records: Sequence[Mirrored]) -> np.ndarray | None:
    """Each request's priority, None when every one is 0 (the default, and all there is under fcfs)."""
    return np.array([r.priority for r in records], dtype=np.int64) if any(r.priority for r in records) else None


class LoadModel(Protocol):
    name: str

    def next_window(self, records: Sequence[Mirrored], start: float, window_s: float) -> WindowLoad:
        """The arrivals expected in [now, now + window_s) from those observed in [start, start + window_s)."""
        ...


class ReplayLoad:
    """ASSUMPTION: the next window repeats the last one exactly (arrival times shifted forward one window)."""

    name = "replay"

    def next_window(self, records: Sequence[Mirrored], start: float, window_s: float) -> WindowLoad:
        prompt, out, hashes, bs = observed_lengths(records)
        t = np.array([r.arrival - start for r in records], dtype=np.float64)
        return WindowLoad(t, prompt, out, window_s, hashes, bs, priority=observed_priorities(records))


class PoissonLoad:
    """ASSUMPTION: the next window keeps the last one's rate and (prompt, output) pairs, with Poisson arrivals."""

    name = "poisson"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def next_window(self, records: Sequence[Mirrored], start: float, window_s: float) -> WindowLoad:
        prompt, out, hashes, bs = observed_lengths(records)
        n = int(self.rng.poisson(len(records))) if records else 0
        pick = self.rng.integers(0, len(records), n) if records else np.empty(0, np.int64)
        t = np.sort(self.rng.uniform(0.0, window_s, n))
        prio = observed_priorities(records)
        return WindowLoad(t, prompt[pick], out[pick], window_s, None if hashes is None else [hashes[k] for k in pick],
                          bs, priority=None if prio is None else prio[pick])


LOAD_MODELS: dict[str, Callable[..., LoadModel]] = {"replay": ReplayLoad, "poisson": PoissonLoad}


def make_load_model(name: str, params: dict) -> LoadModel:
    try:
        return LOAD_MODELS[name](**params)
    except KeyError:
        raise TwinInputError(f"shadow.load.name: unknown load model {name!r} (known: {', '.join(LOAD_MODELS)})") from None
    except (TypeError, ValueError) as e:  # numpy refuses a negative seed with a ValueError (a traceback before)
        raise TwinInputError(f"shadow.load.params: {e} (got {params})") from None


def window_outputs(load: WindowLoad) -> tuple[list[int], int]:
    """The output lengths of the window's own requests (not those carried in) and their rounded mean: what a
    forecast's expected lengths start from (one request of 16 tokens, an ASSUMPTION, where there are none)."""
    outs = [int(x) for x in load.output_tokens[load.carried:]] or [16]
    return outs, max(1, round(sum(outs) / len(outs)))


def with_in_flight(load: WindowLoad, running: Sequence[Mirrored], now: float, max_requests: int,
                   residual: tuple[int, Any] | None = None) -> WindowLoad:
    """Prepend the requests in flight at `now` (offset 0), so the forecast starts from the backlog rather than
    idle engines. ASSUMPTIONS: one still waiting for its first token needs its whole prompt; one decoding finds
    its prompt's KV in its instance's prefix cache where the forecast pins it (`warm`; else it is re-prefilled:
    the twin cannot copy a worker's KV cache, and the tokens it produced are not in that cache) and needs its
    expected output less what it produced at the window's median TPOT. Its expected output is the simulator's
    (`expected_stop`): the mean of the window's output lengths above what it produced, within the client's cap
    (the window's mean at first). `residual`: the window's mean output and `ResidualLengths`, where the caller
    built them already (a live Block decision's candidates share them)."""
    from twin.policy.predictors import ResidualLengths, expected_stop

    running = list(running)[-max_requests:]
    if not running:
        return load
    if residual is None:
        outs, mean_out = window_outputs(load)
        lengths = ResidualLengths(outs)
    else:
        mean_out, lengths = residual
    prompt = np.array([max(1, r.prompt_tokens) for r in running], dtype=np.int64)
    left = []
    for r in running:
        # a TPOT of 0 (a whole answer in its first chunk, at the clock's resolution) is none known: it divided by 0
        made = 0 if r.first_token is None or not load.tpot_s else int((now - r.first_token) / load.tpot_s)
        left.append(max(1, expected_stop(None, r.max_tokens or None, made, lengths, mean_out) - made))
    hashes = None
    if load.hash_ids is not None or any(r.prefix for r in running):
        window_h = load.hash_ids if load.hash_ids is not None else [None] * len(load.offsets)
        hashes = [list(r.prefix) or None for r in running] + list(window_h)
    old_on = list(load.carried_on) if load.carried_on is not None else [None] * load.carried
    old_dec = list(load.carried_decoding) if load.carried_decoding is not None else [False] * load.carried
    on = [r.worker for r in running] + old_on
    dec = [r.first_token is not None for r in running] + old_dec
    prio = None
    if load.priority is not None or any(r.priority for r in running):
        window_p = load.priority if load.priority is not None else np.zeros(len(load.offsets), dtype=np.int64)
        prio = np.concatenate([np.array([r.priority for r in running], dtype=np.int64), window_p])
    return WindowLoad(np.concatenate([np.zeros(len(running)), load.offsets]),
                      np.concatenate([prompt, load.prompt_tokens]),
                      np.concatenate([np.array(left, dtype=np.int64), load.output_tokens]), load.window_s, hashes,
                      load.hash_block_size, load.carried + len(running), load.tpot_s, on, dec, prio)


def reshape(load: WindowLoad, horizon_s: float, rate: float | None, max_requests: int) -> WindowLoad:
    """The window's pattern stretched to `rate` req/s (times scaled) and repeated over `horizon_s`, at most
    `max_requests` requests (the horizon is cut, not thinned). For the scaler's look-ahead."""
    c = load.carried
    ct, cp, co, ch = load.part(np.arange(c))
    if len(load) == 0 or (rate is not None and rate <= 0):
        return WindowLoad(ct, cp, co, horizon_s, ch, load.hash_block_size, c, carried_on=load.carried_on,
                          carried_decoding=load.carried_decoding, priority=load.priorities(np.arange(c)))
    scale = 1.0 if rate is None or load.rate <= 0 else load.rate / rate
    span = load.window_s * scale
    reps = max(1, math.ceil(horizon_s / span))
    t = np.concatenate([load.offsets[c:] * scale + k * span for k in range(reps)])
    idx = c + np.tile(np.arange(len(load)), reps)
    keep = np.flatnonzero(t < horizon_s)[:max_requests]
    t, idx = t[keep], idx[keep]
    horizon = horizon_s if len(keep) < max_requests else float(t[-1]) + 1e-9
    _, p, o, h = load.part(idx)
    hashes = None if h is None else (ch or []) + h
    prio = load.priorities(np.concatenate([np.arange(c), idx]))
    return WindowLoad(np.concatenate([ct, t]), np.concatenate([cp, p]), np.concatenate([co, o]), horizon, hashes,
                      load.hash_block_size, c, carried_on=load.carried_on, carried_decoding=load.carried_decoding,
                      priority=prio)


def within_context(load: WindowLoad, max_model_len: int) -> WindowLoad:
    """Outputs end where the context does, as vLLM ends a request without max_tokens: the twin refused them past it."""
    from twin.policy.predictors import within_context as capped

    outs = capped(load.prompt_tokens, load.output_tokens, max_model_len)
    return load if outs is load.output_tokens else replace(load, output_tokens=outs)


# -- the fleet a forecast runs: who serves from when, and where the requests in flight stay ------------------
@dataclass(frozen=True)
class Slot:
    """One instance of a forecast fleet: the live worker it stands for (None: a new one) and when it takes
    requests, in seconds from the forecast's start."""

    worker: str | None
    ready_s: float = 0.0


def fleet_slots(workers: Sequence[Any], inflight: Callable[[str], int], now: float,
                startup_delay_s: float) -> list[Slot]:
    """The live fleet in the order the planner keeps it (`twin.policy.scalers.plan_scale`; the simulator's
    `FleetForecaster` orders its candidates alike): serving workers by requests in flight, most first (the least
    loaded drain first, the newest on ties), then starting ones by when they serve, `startup_delay_s` after their
    launch (the newest are cancelled first). A fleet of N is the first N slots, then new ones (`sized`)."""
    serving = sorted((w for w in workers if w.routable), key=lambda w: (-inflight(w.id), w.started_at))
    starting = sorted((max(0.0, w.created_at + startup_delay_s - now), w.created_at, w.id)
                      for w in workers if w.state == "starting")
    return [Slot(w.id) for w in serving] + [Slot(wid, ready) for ready, _, wid in starting]


def sized(slots: Sequence[Slot], n: int, startup_delay_s: float) -> list[Slot]:
    """The fleet of `n`: the first `n` slots, then new instances serving after the start-up delay."""
    return list(slots[:n]) + [Slot(None, startup_delay_s)] * max(0, n - len(slots))


def placed(load: WindowLoad, slots: Sequence[Slot]) -> tuple[WindowLoad, dict[str, int]]:
    """The load a fleet of `slots` runs, and the pins: a request in flight stays on the instance standing for
    its worker (stream index -> slot), as the proxy never moves one; one whose worker is not in the fleet
    (draining, down, or left out of a smaller fleet) leaves the forecast with it. One whose worker is not known
    is routed. The window's own arrivals are routed."""
    c = load.carried
    if c == 0 or load.carried_on is None:
        return load, {}
    pos = {sl.worker: k for k, sl in enumerate(slots) if sl.worker is not None}
    keep: list[int] = []
    pins: dict[str, int] = {}
    for i, w in enumerate(load.carried_on):
        k = None if w is None else pos.get(w)
        if w is not None and k is None:
            continue
        if k is not None:
            pins[str(len(keep))] = k  # the stream keeps the carried requests first, in order (`to_stream`)
        keep.append(i)
    idx = np.concatenate([np.array(keep, dtype=np.int64), np.arange(c, len(load.offsets))])
    t, p, o, h = load.part(idx)
    dec = None if load.carried_decoding is None else [load.carried_decoding[i] for i in keep]
    return WindowLoad(t, p, o, load.window_s, h, load.hash_block_size, len(keep), load.tpot_s,
                      [load.carried_on[i] for i in keep], dec, load.priorities(idx)), pins


WARM_HASH_BASE = 1 << 62  # synthetic prefix ids of carried requests that have none: far from any real hash


def with_warm_hashes(load: WindowLoad, block_size: int) -> WindowLoad:
    """Each carried request that is decoding gets prefix ids for its prompt when it has none (unique, synthetic),
    so `warm` can place its prompt's KV in its instance's cache; the stream's id block size is the engine's when
    the load had no ids."""
    dec = load.carried_decoding
    if not dec or not any(dec):
        return load
    bs = load.hash_block_size if load.hash_ids is not None else block_size
    hashes = list(load.hash_ids) if load.hash_ids is not None else [None] * len(load.offsets)
    for i, d in enumerate(dec):
        if d and not hashes[i]:
            base = WARM_HASH_BASE + i * (1 << 24)
            hashes[i] = [base + j for j in range(int(load.prompt_tokens[i]) // bs)]
    return WindowLoad(load.offsets, load.prompt_tokens, load.output_tokens, load.window_s, hashes, bs, load.carried,
                      load.tpot_s, load.carried_on, dec, load.priority)


def warm(cl: Any, load: WindowLoad, pins: dict[str, int]) -> int:
    """Place the prompt KV of each pinned carried request that is decoding in its instance's prefix cache (free,
    cached blocks), so its admission at the forecast's start is a prefix hit rather than a second prefill: the
    worker holds that KV. Only where the pool can be warmed (per-block pool, prefix caching on) and has room; the
    rest are re-prefilled. Returns the requests warmed."""
    dec = load.carried_decoding
    if not dec or cl.segmented:
        return 0
    warmed = 0
    for sidx, k in pins.items():
        i = int(sidx)
        if not dec[i]:
            continue
        pool = cl.instances[k].pool
        if not pool.enable_caching:
            return warmed
        r = cl.make_request(i)
        cl.premade_keys[i] = r.block_keys  # its arrival takes them: the prompt's ids chained once
        keys = list(r.block_keys[:max(0, (r.num_prompt_tokens - 1) // pool.block_size)])
        keys = keys[pool.num_cached_hits(keys, len(keys)):]  # a prefix shared with one warmed before is there
        if keys and pool.cache_free(keys):  # not where a key is cached already or the pool lacks room
            warmed += 1
    return warmed


class PinnedRouter:
    """The shadow twin's router: a pinned request (in flight on a worker now) goes to its instance; the rest to
    the configured router, whose hooks hear of every request."""

    def __init__(self, inner: Any, pins: dict[str, int]) -> None:
        self.inner = inner
        self.pins = pins
        self.ids: list[str] = []  # the twin's instance ids by slot, set once the cluster is built

    def __getattr__(self, name: str) -> Any:  # the router's name, prefix index, gauges it reads, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def choose(self, req: Any, fleet: Any) -> Any:
        k = self.pins.get(req.id)
        return self.inner.choose(req, fleet) if k is None else self.ids[k]

    def on_dispatch(self, *args: Any) -> None:
        fn = getattr(self.inner, "on_dispatch", None)
        if fn is not None:
            fn(*args)

    def on_first_token(self, *args: Any) -> None:
        fn = getattr(self.inner, "on_first_token", None)
        if fn is not None:
            fn(*args)

    def on_finish(self, *args: Any) -> None:
        fn = getattr(self.inner, "on_finish", None)
        if fn is not None:
            fn(*args)


# -- the twin: scenario, variants, one run ------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One configuration to forecast: a label, an instance count, engine settings over the base."""

    label: str
    num_instances: int
    engine: dict = field(default_factory=dict)


def base_engine(cfg: "LiveConfig", wcfg: Any | None) -> dict:
    """The engine settings a twin instance takes: the live worker's (scraped and launched), then `shadow.engine`."""
    eng: dict[str, Any] = {}
    if wcfg is not None:
        eng["block_size"] = int(wcfg.block_size)
        eng["max_num_seqs"] = int(wcfg.max_num_seqs)
        eng["max_num_batched_tokens"] = int(wcfg.max_num_batched_tokens)
        if wcfg.max_model_len:
            eng["max_model_len"] = int(wcfg.max_model_len)
        if wcfg.num_gpu_blocks and wcfg.num_gpu_blocks >= 2:
            eng["num_gpu_blocks_override"] = int(wcfg.num_gpu_blocks)
    if cfg.launcher is not None:  # the launch's engine arguments the twin models (performance_mode: the chunk
        # planner resolves the default chunk with it)
        for k in ("enable_prefix_caching", "enable_chunked_prefill", "long_prefill_token_threshold",
                  "long_prefill_token_threshold_adaptive", "performance_mode", "scheduling_policy",
                  "max_num_active_seqs", "max_num_queued_reqs", "max_num_queued_tokens"):
            if k in cfg.launcher.engine_args:
                eng[k] = cfg.launcher.engine_args[k]
    eng.update(cfg.shadow.engine)
    own = cfg.shadow.engine
    if "num_gpu_blocks_override" in eng and "num_gpu_blocks_override" not in own:
        bs = int(eng["block_size"])
        if bs != int(wcfg.block_size):  # the worker's cache memory in blocks of shadow.engine's size: its count of
            # blocks of its own size gave the twin a cache 8 times smaller at 16 against 128 (a fuzzing pass)
            eng["num_gpu_blocks_override"] = max(2, int(wcfg.num_gpu_blocks) * int(wcfg.block_size) // bs)
        cap = tokens_held(eng["num_gpu_blocks_override"], bs)
        # the worker started, so its context fits its blocks: where it is not reported (yet), or reported larger
        # (read once, at first contact; the blocks at every scrape: a worker restarted with a smaller cache had
        # every twin run refused, and Block answer every request 500), the context is what the blocks hold
        if "max_model_len" not in own and (eng.get("max_model_len") or model_context(cfg)) > cap:
            eng["max_model_len"] = cap
    return eng


def model_context(cfg: "LiveConfig") -> int:
    """The context of `shadow.model` from its config (0 when no model is named)."""
    from twin.specs.models import get_model

    return int(get_model(cfg.shadow.model).max_model_len) if cfg.shadow.model else 0


def _profile_api_times(cfg: "LiveConfig") -> dict:
    """A `twin calibrate` profile carries the API server's times under `fit.perf`; they apply unless the
    config's `shadow.perf` sets them itself."""
    p = cfg.shadow.perf
    if p.kind != "fitted" or not p.fit_path:
        return {}
    from twin.perf.fitted import read_fit

    raw = read_fit(cfg.resolve_path(p.fit_path))
    perf = (raw.get("fit") or {}).get("perf") or {}
    return {k: float(v) for k, v in perf.items() if k.startswith("api_") and k not in p.model_fields_set}


def shadow_scenario(cfg: "LiveConfig", num_instances: int, engine: dict, label: str = "current",
                    api: dict | None = None) -> "Scenario":
    """A scenario of the live fleet, as `twin.lab.calibrate.twin_scenario` builds one for an observed server."""
    from twin.scenario import parse_scenario, with_served_context

    s = cfg.shadow
    perf = s.perf.model_dump(exclude_unset=True)
    perf.update({k: v for k, v in (api or {}).items() if k not in perf})
    engine = with_served_context(engine, s.model)
    raw = {"name": f"shadow-{label}", "seed": cfg.seed,
           "cluster": {"num_instances": num_instances, "min_instances": 1, "max_instances": max(num_instances, 1),
                       "startup_delay_s": 0.0, "hardware": s.hardware, "model": s.model, "dtype": s.dtype,
                       "kv_cache_dtype": s.kv_cache_dtype, "tensor_parallel": s.tensor_parallel,
                       "engine": engine, "perf": perf},
           "workload": {"num_requests": 1, "arrival": {"rate": 1.0},
                        "lengths": {"kind": "fixed", "prompt_tokens": 1, "output_tokens": 1}},
           "router": cfg.router.model_dump(exclude_unset=True), "slo": s.slo.model_dump(),
           "sim": {"mode": "fast", "timeline_interval_s": 0}}
    return parse_scenario(raw, f"shadow [{label}]", cfg.base_dir)


def check_config(cfg: "LiveConfig") -> None:
    """Build the shadow twin once at load time, so a bad name, engine key or profile is one line now."""
    from twin.sim.cluster import engine_config
    from twin.perf.registry import build_perf

    try:
        sc = shadow_scenario(cfg, 1, dict(cfg.shadow.engine), api=_profile_api_times(cfg))
        build_perf(sc)
        engine_config(sc)
    except (TwinInputError, OSError, KeyError) as e:
        lines = [ln.replace("shadow [current]: cluster.", "shadow.", 1) for ln in str(e).splitlines()]
        first = lines[0]
        msg = "; ".join([first[len("shadow."):] if first.startswith("shadow.") else first] + lines[1:])
        raise ValueError(f"@shadow.{msg}" if first.startswith("shadow.") else f"@shadow: {msg}") from None


def variants(cfg: "LiveConfig", n: int, engine: dict) -> list[Variant]:
    """The current configuration and its alternatives: +1, -1 instance (while >= 1), other chunk sizes."""
    out = [Variant("current", n, {})]
    if not cfg.shadow.alternatives:
        return out
    out.append(Variant("instances+1", n + 1, {}))
    if n - 1 >= 1:
        out.append(Variant("instances-1", n - 1, {}))
    cur = int(engine.get("max_num_batched_tokens") or 0)
    chunks = list(cfg.shadow.chunk_sizes) or ([max(1, cur // 2), cur * 2] if cur else [])
    seqs = int(engine.get("max_num_seqs") or 1)
    for c in dict.fromkeys(chunks):
        if c != cur and c >= seqs:  # vLLM requires max_num_batched_tokens >= max_num_seqs
            out.append(Variant(f"chunk={c}", n, {"max_num_batched_tokens": int(c)}))
    return out


def _q(values, q: str) -> float | None:
    from twin.sim.metrics import describe

    v = describe(np.asarray(values, dtype=np.float64))[q]
    return None if v is None else float(v)


def forecast_metrics(result: Any, window_s: float, slo: Any, carried: int = 0) -> dict:
    """TTFT/TPOT/ITL/E2E/queue quantiles, goodput and SLO attainment of a simulated window's own requests
    (the `carried` in-flight ones first in the log are load, not counted; ITL is per step, so counts them)."""
    from twin.sim.metrics import itl_samples, latencies, slo_mask, weighted_quantiles

    lg = result.log
    mine = np.arange(lg.n) >= carried
    fin = (lg.status == 4) & mine
    ttft, tpot, e2e = latencies(lg, mine)
    queue = (lg.scheduled_s - lg.arrival_s)[fin]
    iv, iw = itl_samples(result)
    itl = weighted_quantiles(iv, iw, [0.5])[0] if len(iv) else float("nan")
    good = int((slo_mask(lg, slo) & mine).sum())
    n = int(mine.sum())
    return {"ttft_p50": _q(ttft, "p50"), "ttft_p99": _q(ttft, "p99"), "tpot_p50": _q(tpot, "p50"),
            "itl_p50": None if math.isnan(itl) else float(itl), "e2e_p50": _q(e2e, "p50"),
            "e2e_p99": _q(e2e, "p99"), "queue_p50": _q(queue, "p50"),
            "goodput_req_s": good / window_s if window_s > 0 else None,
            "attainment": good / n if n else 1.0, "requests": n, "finished": int(fin.sum()),
            "carried_in_flight": int(carried)}


@dataclass
class ShadowJob:
    """Everything one shadow run needs, picklable (it may run in a child process)."""

    cfg: Any  # LiveConfig
    engine: dict
    variants: list[Variant]
    load: WindowLoad
    api: dict = field(default_factory=dict)
    max_sim_time_s: float | None = None
    # the live fleet (`fleet_slots`); empty: every instance of a variant serves from the start, and the requests
    # in flight are routed like the window's
    fleet: list[Slot] = field(default_factory=list)
    startup_delay_s: float = 0.0  # a new instance's, in a variant larger than the fleet


def simulate(job: ShadowJob, v: Variant) -> tuple[Any, int]:
    """One variant's run, and how many requests in flight it carried (load, not counted in its metrics)."""
    cl, carried = build_cluster(job, v)
    return cl.run(), carried


def build_cluster(job: ShadowJob, v: Variant) -> tuple[Any, int]:
    """One variant's cluster, ready to run, and how many requests in flight it carries."""
    from twin.sim.build import build_router
    from twin.sim.cluster import Cluster

    sc = shadow_scenario(job.cfg, v.num_instances, {**job.engine, **v.engine}, v.label, job.api)
    if job.max_sim_time_s is not None:
        sc = sc.model_copy(update={"sim": sc.sim.model_copy(update={"max_sim_time_s": job.max_sim_time_s})})
    slots = sized(job.fleet, v.num_instances, job.startup_delay_s) if job.fleet else []
    load, pins = placed(job.load, slots) if slots else (job.load, {})
    router = build_router(sc)
    if pins:
        router = PinnedRouter(router, pins)
        load = with_warm_hashes(load, int(sc.cluster.engine.block_size))
    load = within_context(load, sc.cluster.max_model_len())
    cl = Cluster(sc, load.to_stream(), router)
    if pins:
        router.ids = [inst.id for inst in cl.instances]
        warm(cl, load, pins)
    for inst, sl in zip(list(cl.instances), slots):
        cl.fleet.serve_after(inst, sl.ready_s)
    return cl, load.carried


def run_job(job: ShadowJob) -> dict[str, dict]:
    """Simulate the window under every variant: label -> forecast metrics (or {"error": ...})."""
    out: dict[str, dict] = {}
    for v in job.variants:
        t0 = time.perf_counter()
        try:
            res, carried = simulate(job, v)
        except (TwinInputError, ValueError) as e:  # a variant vLLM would refuse (e.g. chunk < max_num_seqs)
            out[v.label] = {"error": str(e).splitlines()[0]}
            continue
        m = forecast_metrics(res, job.load.window_s, res.scenario.slo, carried)
        m["num_instances"] = v.num_instances
        m["engine"] = dict(v.engine)
        m["sim_wall_s"] = time.perf_counter() - t0
        out[v.label] = m
    return out


def attainment_job(job: ShadowJob, target: float | None = None) -> tuple[float, bool]:
    """SLO attainment of the job's single variant (the scaler's question), and whether it is exact.

    With `target`, the run stops once the answer's side of `target` is known (`WindowVerdict`), and the value is
    a bound on that side, as `twin.sim.forecaster.FleetForecaster.attainment` answers in the simulator."""
    cl, carried = build_cluster(job, job.variants[0])
    verdict = None if target is None else WindowVerdict(cl, carried, cl.scenario.slo, target)
    # 64 looks over the arrivals (fewer while draining): each is a pass over the log; at 200 a size that meets the
    # target, known only near its end, cost 5 % more than a run without looks (`bench_live_scaler.py`)
    res = cl.run() if verdict is None else cl.run(stop=verdict.known, slices=64)
    if verdict is not None and verdict.bound is not None:
        return verdict.bound, False
    return float(forecast_metrics(res, job.load.window_s, res.scenario.slo, carried)["attainment"]), True


class WindowVerdict:
    """A shadow run's window requests judged while it runs, for the twin scaler's `target`: met (finished
    within every bound), missed (ended otherwise; or a first token, or a finish, still to come already past
    its bound). Either count alone can settle the side of `target` long before an overloaded run drains its
    backlog, as the simulator's `twin.sim.forecaster._Verdict` does.

    Client-side times: a recorded token plus the API server's per-token time and its queueing wait (recorded
    with the token); a token still to come is no earlier than the clock, nor than the start of an instance's
    decode run not yet committed (`EngineCore.pending_run` / `pending_tail`: their tokens carry earlier times)."""

    def __init__(self, cl: Any, carried: int, slo: Any, target: float) -> None:
        self.cl, self.carried, self.slo, self.target = cl, carried, slo, target
        self.total = len(cl.log.arrival_s) - carried
        self.ok = self.missed = 0
        self.bound: float | None = None  # set once the side is known (the run stopped there)

    def _earliest_token(self) -> float:
        t = self.cl.clock.now
        for inst in self.cl.instances:
            run, tail = inst.core.pending_run, inst.core.pending_tail
            if run is not None:
                t = min(t, run[2])
            if tail is not None:
                t = min(t, tail[2], tail[3])
        return t

    def count(self) -> tuple[int, int]:
        """(met, missed) among the window's requests now."""
        from twin.sim.metrics import slo_met

        cl, c, slo = self.cl, self.carried, self.slo
        lg = cl.log
        shift = cl.api_token_s()
        arr = lg.arrival_s[c:]
        ft, fin = lg.first_token_s[c:] + shift, lg.finish_s[c:] + shift
        if len(cl.api_wait_first):
            ft, fin = ft + cl.api_wait_first[c:], fin + cl.api_wait_finish[c:]
        status = lg.status[c:]
        met = slo_met(status, arr, ft, fin, lg.output_tokens[c:], slo)
        ended = (status == 4) | (status == 5)  # finished or rejected
        late = np.zeros(len(arr), dtype=bool)
        soon = self._earliest_token() + shift  # no token still to come reaches the client before this
        with np.errstate(invalid="ignore"):
            if slo.ttft_s is not None:
                late |= np.where(np.isnan(ft), soon, ft) - arr > slo.ttft_s
            if slo.e2e_s is not None:
                late |= soon - arr > slo.e2e_s
        late &= ~ended & ~np.isnan(arr)  # arrived, still going, already past a bound
        return int(met.sum()), int((ended & ~met).sum() + late.sum())

    def known(self) -> bool:
        """True once the window's attainment is on a known side of `target` (the run may stop): `bound` is then the
        share met so far (at least `target`), or the share not yet missed (under it)."""
        from twin.sim.forecaster import side_bound

        self.ok, self.missed = self.count()
        self.bound = side_bound(self.ok, self.missed, self.total, self.target)
        return self.bound is not None


# -- realised: what the proxy measured -----------------------------------------------------------------------
def realised_metrics(records: Sequence[Mirrored]) -> dict:
    """The proxy's own per-request latencies. TTFT and TPOT only from streamed requests (a non-streamed
    answer's first byte is its last); TPOT counts SSE events, a lower bound on tokens, so it reads high."""
    ok = [r for r in records if r.ok]
    streamed = [r for r in ok if r.stream]
    ttft = [r.first_token - r.arrival for r in streamed]
    e2e = [r.finish - r.arrival for r in ok]
    tpot = [(r.finish - r.first_token) / (r.output_tokens - 1) for r in streamed if r.output_tokens > 1]
    return {"ttft_p50": _q(ttft, "p50"), "ttft_p99": _q(ttft, "p99"), "tpot_p50": _q(tpot, "p50"),
            "e2e_p50": _q(e2e, "p50"), "e2e_p99": _q(e2e, "p99"), "requests": len(records), "finished": len(ok),
            "streamed": len(streamed)}


def error_ratios(forecast: dict, realised: dict) -> dict[str, float]:
    """|forecast - realised| / realised for each metric both sides have."""
    out = {}
    for k in SCORED:
        f, r = forecast.get(k), realised.get(k)
        if f is not None and r is not None and r > 0 and math.isfinite(f):
            out[k] = abs(f - r) / r
    return out


@dataclass
class Pending:
    """A "current" forecast waiting for its window to pass."""

    seq: int
    start: float
    end: float
    forecast: dict
    made_at_unix: float


# -- the live side --------------------------------------------------------------------------------------------
class Shadow:
    """Mirror, periodic forecasts, scoring and the scaler's forecaster, for one controller."""

    def __init__(self, ctl: Any) -> None:
        self.ctl = ctl
        self.spec = s = ctl.cfg.shadow
        self.window_s = s.window
        self.mirror = Mirror(keep_s=3 * self.window_s + s.interval_s + 60.0)
        self.load_model = make_load_model(s.load.name, s.load.params)
        self.metrics = ctl.metrics.enable_shadow()
        self.pending: list[Pending] = []
        self.history: deque[dict] = deque(maxlen=s.history)
        self.latest: dict[str, dict] = {}
        self.latest_at: float | None = None
        self.last_error: tuple[float, str] | None = None  # (when, what) of the last failed run, for /shadow
        self.runs = 0
        self.api = _profile_api_times(ctl.cfg)
        self._executor: concurrent.futures.Executor | None = None

    # executor: one worker, so runs never overlap and never compete with each other for the CPU
    @property
    def executor(self) -> concurrent.futures.Executor:
        broken = getattr(self._executor, "_broken", False)  # a process pool whose child died (killed, out of memory)
        if broken:
            log.warning("shadow: the simulation process died (%s); starting another", broken)
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._executor is None:
            if self.spec.executor == "process":
                self._executor = concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"))
            else:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmtwin-shadow")
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- the controller's hooks
    def dispatched(self, req: Any, worker_id: str, now: float) -> None:
        self.mirror.arrived(req, worker_id, now)

    def first_token(self, req: Any, now: float) -> None:
        self.mirror.first_token(req.id, now)

    def finished(self, req: Any, now: float, output_tokens: int) -> None:
        self.mirror.finished(req.id, now, output_tokens)

    # -- one run
    def engine(self) -> dict:
        """The engine settings a twin instance takes: an active worker's (a serving one's first), `shadow.engine`."""
        serving = [w for w in self.ctl.registry if w.routable]
        starting = [w for w in self.ctl.registry if w.state == "starting"]
        wcfg = (serving or starting)[0].config if serving or starting else None
        return base_engine(self.ctl.cfg, wcfg)

    def startup_delay(self) -> tuple[float, str]:
        """A new worker's start-up delay in the forecasts, and where it comes from."""
        if self.spec.startup_delay_s is not None:
            return float(self.spec.startup_delay_s), "shadow.startup_delay_s"
        measured = sorted(self.ctl.registry.startups)
        if not measured:
            return 0.0, "no start-up measured yet: ASSUMED 0 (set shadow.startup_delay_s)"
        return float(np.median(measured)), f"median of the last {len(measured)} measured start-ups"

    def fleet(self, now: float) -> tuple[list[Slot], float]:
        """The live fleet as forecast slots (`fleet_slots`), and the start-up delay they assume."""
        delay, _ = self.startup_delay()
        books = self.ctl.registry.bookkeeping
        return fleet_slots(list(self.ctl.registry), lambda wid: books.load(wid).requests, now, delay), delay

    def window_load(self, now: float, count: bool = True) -> WindowLoad:
        """The next window's load from the last one (the load model), plus what is in flight now."""
        start = now - self.window_s
        recs = self.mirror.window(start, now)
        cap = self.spec.max_requests
        if len(recs) > cap:  # cost bound: the most recent requests, over their own (shorter) span
            recs = recs[-cap:]
            start = recs[0].arrival
            if count:
                self.metrics.truncated.inc()
        load = self.load_model.next_window(recs, start, now - start)
        load.tpot_s = realised_metrics(recs)["tpot_p50"]
        if self.spec.carry_in_flight:
            running = [r for r in self.mirror.records if r.arrival < now and not r.done]
            load = with_in_flight(load, running, now, cap)
        return load

    def build_job(self, now: float) -> ShadowJob | None:
        """The job for the window after `now`, or None (and why, counted) when there is nothing to run."""
        slots, delay = self.fleet(now)  # the active workers: serving and healthy, or starting
        if not slots:
            self.metrics.skipped.labels("no_worker").inc()
            return None
        load = self.window_load(now)
        if len(load) == 0:
            self.metrics.skipped.labels("no_requests").inc()
            return None
        engine = self.engine()
        return ShadowJob(self.ctl.cfg, engine, variants(self.ctl.cfg, len(slots), engine), load, self.api,
                         max_sim_time_s=max(60.0, 20 * self.window_s), fleet=slots, startup_delay_s=delay)

    async def run_once(self, now: float | None = None) -> dict[str, dict] | None:
        """Score what is due, then forecast the next window (off the event loop) and export it."""
        now = time.monotonic() if now is None else now
        self.score_due(now)
        job = self.build_job(now)
        if job is None:
            self.metrics.clear_forecasts()
            self.latest = {}
            return None
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self.executor, run_job, job)
        took = time.perf_counter() - t0
        self.runs += 1
        m = self.metrics
        m.runs.inc()
        m.run_seconds.observe(took)
        m.last_run_seconds.set(took)
        m.window_requests.set(len(job.load))
        m.clear_forecasts()
        for label, f in result.items():
            if "error" in f:
                m.skipped.labels("variant_refused").inc()
                log.info("shadow: variant %s not simulated: %s", label, f["error"])
                continue
            for k in SECONDS:
                if f.get(k) is not None:
                    m.forecast.labels(k, label).set(f[k])
            if f.get("goodput_req_s") is not None:
                m.goodput.labels(label).set(f["goodput_req_s"])
            m.attainment.labels(label).set(f["attainment"])
        self.latest = result
        self.latest_at = now
        cur = result.get("current")
        if cur is not None and "error" not in cur:
            self.pending.append(Pending(self.runs, now, now + self.window_s, cur, time.time()))
        return result

    def score_due(self, now: float) -> list[dict]:
        """Compare each forecast whose window has passed with what the proxy measured in it. A window waits
        for its requests to finish, up to one more window."""
        scored = []
        keep = []
        for p in self.pending:
            if now < p.end:
                keep.append(p)
                continue
            recs = self.mirror.window(p.start, p.end)
            if any(not r.done for r in recs) and now < p.end + self.window_s:
                keep.append(p)
                continue
            real = realised_metrics(recs)
            entry = {"seq": p.seq, "made_at_unix": p.made_at_unix, "window_s": p.end - p.start,
                     "forecast": {k: p.forecast.get(k) for k in SCORED + ("tpot_p50", "requests")}, "realised": real,
                     "error_ratio": {}}
            if real["finished"] >= self.spec.min_scored_requests:
                err = error_ratios(p.forecast, real)
                entry["error_ratio"] = err
                for k, v in err.items():
                    self.metrics.error.labels(k).set(v)
                self.metrics.scored.inc()
                log.info("shadow: window %d scored: %s", p.seq,
                         ", ".join(f"{k} {v:.0%}" for k, v in err.items()) or "no comparable metric")
            self.history.append(entry)
            scored.append(entry)
        self.pending = keep
        return scored

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.interval_s)
            try:
                await self.run_once()
            except Exception as e:  # noqa: BLE001 - a shadow failure is logged; the proxy keeps serving
                import traceback

                self.metrics.skipped.labels("error").inc()
                self.last_error = (time.monotonic(), f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                log.error("shadow run failed:\n%s", traceback.format_exc())

    def status(self) -> dict:
        """The `/shadow` page: the latest forecasts by variant, pending windows, the scored history."""
        delay, source = self.startup_delay()
        return {"interval_s": self.spec.interval_s, "window_s": self.window_s, "load_model": self.load_model.name,
                "startup_delay_s": delay, "startup_delay_from": source, "runs": self.runs,
                "mirrored_requests": self.mirror.total,
                "latest_age_s": None if self.latest_at is None else time.monotonic() - self.latest_at,
                "forecasts": self.latest, "pending": [{"seq": p.seq, "ends_in_s": p.end - time.monotonic()}
                                                      for p in self.pending],
                "history": list(self.history),
                # a failed run only aged `forecasts` on this page (its traceback is in the log)
                "last_error": None if self.last_error is None else {
                    "age_s": time.monotonic() - self.last_error[0], "error": self.last_error[1]}}

    def instance_forecaster(self) -> "ShadowInstanceForecaster":
        """The per-instance look-ahead a predictive router (Block) reads as `fleet.forecaster`."""
        return ShadowInstanceForecaster(self)

    def fleet_forecaster(self, now: float) -> "ShadowFleetForecaster":
        """A forecaster over the last window, for a scaler decision: its simulations run on the shadow's executor,
        one at a time with the shadow's own runs (a child process with `shadow.executor: process`)."""
        load = self.window_load(now, count=False)
        slots, delay = self.fleet(now)
        return ShadowFleetForecaster(self.ctl.cfg, self.engine(), load, self.api, self.spec.max_requests, slots,
                                     delay, self.executor)


class ShadowFleetForecaster:
    """The live twin scaler's `forecast` argument: `attainment(n_instances, horizon_s, rate, slo, oracle)`, as
    `twin.sim.forecaster.FleetForecaster` answers it in the simulator, from the observed window's pattern at the
    predicted rate (`reshape`). As there, a size is the live fleet in the planner's order (`fleet_slots`): starting
    workers serve when their start-up ends, new ones after the start-up delay, and the requests in flight stay on
    their workers (a backlogged worker takes new requests once the configured router sends it some). Blocking: the
    controller calls the scaler in a thread, and each size's simulation runs on `executor` (the shadow's) when one is
    given: until 2026-12-07 they ran in that thread whatever `shadow.executor` said, so a decision's simulations
    shared the GIL with the proxy even where the shadow's own runs were kept in a child process."""

    def __init__(self, cfg: Any, engine: dict, load: WindowLoad, api: dict, max_requests: int,
                 fleet: Sequence[Slot] = (), startup_delay_s: float = 0.0,
                 executor: concurrent.futures.Executor | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.load = load
        self.api = api
        self.max_requests = max_requests
        self.fleet = list(fleet)
        self.startup_delay_s = startup_delay_s
        self.executor = executor
        self.calls = 0  # simulations run
        self.stopped_early = 0  # of them, stopped once their side of the target was known
        self._cache: dict[tuple, float] = {}

    def attainment(self, n_instances: int, horizon_s: float, rate: float, slo: Any, oracle: bool = False,
                   target: float | None = None) -> float:
        """The window's SLO attainment with `n_instances`. With `target`, the run stops once the side of `target`
        is known and the value is a bound on that side (`WindowVerdict`), as in the simulator: an overloaded size
        used to simulate its backlog to the end, up to four horizons, for an answer known much sooner."""
        if oracle:
            raise TwinInputError("scaler.params.oracle: the live controller cannot see the future; drop oracle")
        if n_instances <= 0:
            return 0.0
        key = (n_instances, round(float(horizon_s), 3), round(float(rate), 4),
               getattr(slo, "ttft_s", None), getattr(slo, "tpot_s", None), getattr(slo, "e2e_s", None))
        tgt = None if target is None else float(target)
        for k in (key, (key, tgt)):  # the exact value, or a bound for this target
            if k in self._cache:
                return self._cache[k]
        load = reshape(self.load, horizon_s, rate, self.max_requests)
        if len(load) == 0:  # no window requests: nothing can miss the SLO
            return 1.0
        self.calls += 1
        slo_raw = {k: getattr(slo, k, None) for k in ("ttft_s", "tpot_s", "e2e_s")}
        cfg = self.cfg.model_copy(update={"shadow": self.cfg.shadow.model_copy(
            update={"slo": self.cfg.shadow.slo.model_copy(update=slo_raw)})})
        job = ShadowJob(cfg, self.engine, [Variant(f"scaler-n{n_instances}", n_instances)], load, self.api,
                        max_sim_time_s=max(60.0, 4 * horizon_s), fleet=self.fleet,
                        startup_delay_s=self.startup_delay_s)
        att, exact = (attainment_job(job, tgt) if self.executor is None
                      else self.executor.submit(attainment_job, job, tgt).result())
        if exact:
            self._cache[key] = att
        else:
            self.stopped_early += 1
            self._cache[key, tgt] = att
        return att


class ShadowInstanceForecaster:
    """Block's `fleet.forecaster` on the live side: `forecast(instance_id, extra_request, horizon_s, until)`, as
    `twin.sim.forecaster.SimForecaster` answers it in the simulator, from what the controller knows of the worker.

    The simulator forks the instance's exact engine; the controller cannot see a worker's batch, so it rebuilds
    one from the mirror: the requests in flight on that worker (`with_in_flight`: the same ASSUMPTIONS as the
    shadow runs: its prompt's KV in the instance's cache once decoding (`warm`), expected output the mean recent
    length above what was streamed, within the cap, less what was streamed at the recent median TPOT), plus the
    new request, on one twin instance with the worker's engine settings and `shadow.perf`. A decision pays one
    small simulation per candidate (the router's `max_candidates` bounds it; `calls` counts them), on the
    controller's routing thread (`Controller.choose`), not the event loop: what it reads of the mirror is a
    snapshot.
    """

    def __init__(self, shadow: "Shadow") -> None:
        self.shadow = shadow
        self.calls = 0
        self._scenarios: dict[tuple, tuple[Any, Any]] = {}  # by engine settings: (scenario, its step model)
        self._context: tuple[tuple, tuple] | None = None  # (key, (window load, mean output, running by worker))
        self._deciding = False  # within `decision()`
        self._decision_key: tuple | None = None  # the context key its first forecast used

    @contextlib.contextmanager
    def decision(self) -> Iterator[None]:
        """One router decision: its candidates share one context (the first forecast's key holds for the rest),
        though the event loop changes the mirror meanwhile (the controller's routing thread decides off the loop).
        Else, with `load: poisson`, a context rebuilt between candidates drew a new sample."""
        self._deciding = True
        try:
            yield
        finally:
            self._deciding = False
            self._decision_key = None

    def _scenario(self, engine: dict, horizon_s: float) -> tuple[Any, Any]:
        """The one-instance scenario for `engine` with `horizon_s` as its time limit, and its step model (built once
        per engine: immutable, shared by every forecast's cluster). Keyed by the engine alone: Block's horizons
        (its best score so far) differ at every decision, and keyed by them the cache grew without end."""
        key = tuple(sorted(engine.items()))
        hit = self._scenarios.get(key)
        if hit is None:
            from twin.sim.cluster import build_perf

            cfg = self.shadow.ctl.cfg
            # one instance, no routing to do: round-robin, never the predictive router itself (no recursion)
            one = cfg.model_copy(update={"router": cfg.router.model_copy(update={"name": "round-robin",
                                                                                 "params": {}})})
            sc = shadow_scenario(one, 1, engine, "block-forecast", self.shadow.api)
            hit = self._scenarios[key] = (sc, build_perf(sc))
        sc, perf = hit
        return sc.model_copy(update={"sim": sc.sim.model_copy(update={"max_sim_time_s": horizon_s})}), perf

    def context(self, now: float) -> tuple[WindowLoad, int, dict[str | None, list[Mirrored]], Any]:
        """What every candidate of a decision shares: the last window's load with its median TPOT, its mean output,
        the requests in flight by worker, and the window's `ResidualLengths` (the expected output of a request that
        made some tokens). Computed once per mirror version and quarter second: a decision's candidates used to
        rebuild it each (40 % of a forecast), and with the `poisson` load model each drew its own sample
        (candidates compared on different random lengths)."""
        from twin.policy.predictors import ResidualLengths

        sh = self.shadow
        key = self._decision_key or (sh.mirror.version, math.floor(now * 4.0))
        if self._deciding:
            self._decision_key = key
        if self._context is not None and self._context[0] == key:
            return self._context[1]
        records = sh.mirror.snapshot()  # on the routing thread: the loop changes the mirror meanwhile
        recent = sh.mirror.window(now - sh.window_s, now, records)
        base = sh.load_model.next_window(recent, now - sh.window_s, sh.window_s)
        base.tpot_s = realised_metrics(recent)["tpot_p50"]
        outs, mean_out = window_outputs(base)
        running: dict[str | None, list[Mirrored]] = {}
        for r in records:
            if r.arrival < now and not r.done:  # a copy: the loop sets its first token or finish meanwhile
                running.setdefault(r.worker, []).append(copy.copy(r))
        ctx = (base, mean_out, running, ResidualLengths(outs))
        self._context = (key, ctx)
        return ctx

    def forecast(self, instance_id: str, extra_request: Any = None, horizon_s: float | None = None,
                 until: str = "finish") -> Any:
        from twin.sim.cluster import Cluster
        from twin.policy.views import Forecast

        self.calls += 1
        sh = self.shadow
        now = time.monotonic()
        horizon = float(horizon_s if horizon_s is not None else 60.0)
        worker = sh.ctl.registry.get(instance_id)
        engine = base_engine(sh.ctl.cfg, worker.config) if worker is not None else sh.engine()
        base, mean_out, by_worker, lengths = self.context(now)
        running = by_worker.get(instance_id, [])
        load = with_in_flight(base, running, now, sh.spec.max_requests, (mean_out, lengths))
        keep = np.arange(load.carried)  # only what is on this worker now; the window's arrivals are not
        offsets, prompts, outs, hashes = load.part(keep)
        prio = load.priorities(keep)
        if extra_request is not None:
            from twin.policy.predictors import expected_stop

            # as the simulator's forecaster runs the extra request (`SimForecaster._output_tokens`)
            expect = expected_stop(extra_request.predicted_output_tokens, extra_request.max_tokens or None, 0, None,
                                   mean_out)
            offsets = np.append(offsets, 0.0)
            prompts = np.append(prompts, max(1, int(extra_request.num_prompt_tokens)))
            outs = np.append(outs, max(1, int(expect)))
            if prio is not None or extra_request.priority:
                prio = np.append(prio if prio is not None else np.zeros(len(offsets) - 1, dtype=np.int64),
                                 int(extra_request.priority or 0))
            prefix = list(extra_request.prefix or ()) or None
            if hashes is not None or prefix is not None:
                hashes = (hashes if hashes is not None else [None] * (len(offsets) - 1)) + [prefix]
        if len(offsets) == 0:
            return Forecast(instance_id, drain_s=0.0)
        block = load.hash_block_size if running else int(getattr(extra_request, "prefix_block_size", 0) or 16)
        dec = list(load.carried_decoding or [])[:load.carried] + [False] * (len(offsets) - load.carried)
        sc, perf = self._scenario(engine, horizon)
        one = with_warm_hashes(WindowLoad(offsets, prompts.astype(np.int64), outs.astype(np.int64), horizon, hashes,
                                          block, carried=len(offsets), carried_decoding=dec, priority=prio),
                               int(sc.cluster.engine.block_size))
        one = within_context(one, sc.cluster.max_model_len())
        cl = Cluster(sc, one.to_stream(), perf=perf)
        warm(cl, one, {str(i): 0 for i, d in enumerate(dec) if d})  # its decoding requests' KV is on the worker
        res = cl.run()
        log = res.log
        ttft = e2e = None
        x = len(offsets) - 1
        if extra_request is not None:
            ft, fin = float(log.first_token_s[x]), float(log.finish_s[x])
            ttft = ft - float(log.arrival_s[x]) if np.isfinite(ft) and ft >= 0 else None
            e2e = fin - float(log.arrival_s[x]) if np.isfinite(fin) and fin >= 0 and log.status[x] == 4 else None
        done = log.status == 4
        drain = float(np.max(log.finish_s[done])) if done.all() and len(done) else None
        want = {"first_token": ttft, "finish": e2e, "drain": drain}.get(until, e2e)
        return Forecast(instance_id, ttft_s=ttft, e2e_s=e2e, drain_s=drain, censored=want is None,
                        steps=sum(i.scheduler.stats.num_steps for i in res.instances))
