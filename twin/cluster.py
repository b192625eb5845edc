"""The simulated cluster: arrivals -> router policy -> instances, in one SimPy environment."""

from __future__ import annotations

import gc
import time
from functools import partial
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import simpy

from twin.engine.defaults import resolve_batch_limits
from twin.engine.instance import EngineConfig, Instance, num_gpu_blocks
from twin.engine.request import Request, RequestStatus, engine_block_keys
from twin.errors import TwinInputError
from twin.hardware import get_gpu
from twin.models import get_model
from twin.perf.base import StepTimeModel
from twin.perf.registry import build_perf
from twin.policy.routers import make_router
from twin.policy.views import Router
from twin.records import RequestLog
from twin.scenario import Scenario
from twin.workload.stream import RequestStream


def engine_config(sc: Scenario) -> EngineConfig:
    """The engine's knobs with vLLM's per-GPU defaults filled in where the scenario leaves them unset."""
    e = sc.cluster.engine
    d = e.model_dump()
    if d["max_model_len"] is None:
        d["max_model_len"] = get_model(sc.cluster.model).max_model_len
    d["max_num_batched_tokens"], d["max_num_seqs"] = resolve_batch_limits(
        get_gpu(sc.cluster.hardware), e.max_num_batched_tokens, e.max_num_seqs, d["max_model_len"],
        e.enable_chunked_prefill)
    return EngineConfig(**d)


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


class Cluster:
    """Instances and a router in one SimPy environment, fed by a request stream."""

    def __init__(self, sc: Scenario, stream: RequestStream, router: Router | None = None,
                 perf: StepTimeModel | None = None) -> None:
        self.scenario = sc
        self.stream = stream
        self.env = simpy.Environment()
        self.perf: StepTimeModel = build_perf(sc) if perf is None else perf
        self.engine_config = engine_config(sc)
        self.num_blocks = num_gpu_blocks(
            self.engine_config, self.perf.gpu.device_memory, self.perf.weight_bytes_per_gpu,
            self.perf.kv_bytes_per_token_per_gpu,
        )
        self.log = RequestLog(len(stream))
        self.log.arrival_s[:] = stream.arrival_s
        self.log.prompt_tokens[:] = stream.prompt_tokens
        self.log.max_tokens[:] = stream.output_tokens
        if stream.session_id is not None:
            self.log.session_id[:] = stream.session_id
        fast = sc.sim.mode == "fast"
        self.instances = [
            Instance(self.env, f"instance-{i}", i, self.engine_config, self.perf, self.num_blocks, self.log,
                     fast_forward=fast)
            for i in range(sc.cluster.num_instances)
        ]
        self.by_id = {inst.id: inst for inst in self.instances}
        if router is None:
            try:
                router = make_router(sc.router.name, **sc.router.params)
            except TypeError as e:
                raise TwinInputError(f"router.params: {e}") from None
        self.router: Router = router
        assert self.engine_config.max_model_len is not None  # engine_config() fills it in
        self.max_model_len: int = self.engine_config.max_model_len
        self.num_arrived = 0
        self._next_turn: np.ndarray | None = None
        if stream.after is not None:
            self._next_turn = np.full(len(stream), -1, dtype=np.int64)
            has = np.flatnonzero(stream.after >= 0)
            self._next_turn[stream.after[has]] = has
            for inst in self.instances:
                inst.scheduler.on_finish = self._turn_ended
        self.env.process(self.arrivals())

    def make_request(self, i: int) -> Request:
        s = self.stream
        p = int(s.prompt_tokens[i])
        o = int(s.output_tokens[i])
        keys: list[int] = []
        if s.hash_ids is not None and s.hash_ids[i] is not None and self.engine_config.enable_prefix_caching:
            covered = p + o if s.hashes_cover_output else p
            keys = engine_block_keys(s.hash_ids[i], s.hash_block_size, self.engine_config.block_size, covered)
        sid = -1 if s.session_id is None else int(s.session_id[i])
        return Request(i, float(s.arrival_s[i]), p, o, keys, sid)

    def arrivals(self):
        """Each request at its arrival time goes to the router; closed-loop turns wait for their predecessor."""
        env = self.env
        arrival = self.stream.arrival_s
        after = self.stream.after
        for i in range(len(arrival)):
            if after is not None and after[i] >= 0:
                continue  # sent by `_turn_ended` when the turn before it ends
            t = float(arrival[i])
            if t > env.now:
                yield env.timeout(t - env.now)
            self.dispatch(i)

    def dispatch(self, i: int) -> None:
        """Request i arrives now: checked, routed and queued, or rejected with a reason."""
        env = self.env
        log = self.log
        self.num_arrived += 1
        log.arrival_s[i] = env.now  # the clock's value: t - now + now can differ from t by an ulp
        r = self.make_request(i)
        r.arrival_time = env.now
        max_len = self.max_model_len
        if r.num_prompt_tokens + r.max_tokens > max_len:
            self._reject(i, "longer than max_model_len", f"{r.num_prompt_tokens} + {r.max_tokens} tokens > {max_len}")
            return
        try:
            target = self.router.choose(r, self.instances)
        except Exception as e:  # a policy bug must not lose the request silently
            self._reject(i, "router error", f"{type(e).__name__}: {e}")
            return
        inst = self.by_id.get(target)
        if inst is None:
            self._reject(i, "router returned an unknown instance", repr(target))
            return
        if not inst.fits(r.num_prompt_tokens + r.max_tokens):
            self._reject(i, "larger than the instance's KV cache", f"{inst.id} has {inst.pool.num_usable_blocks} blocks")
            return
        inst.add_request(r)

    def _reject(self, i: int, reason: str, detail: str) -> None:
        self.log.reject(i, reason, detail)
        self._turn_ended(i)

    def _turn_ended(self, i: int) -> None:
        """Request i finished or was rejected: the session's next turn is sent after its think time."""
        j = int(self._next_turn[i]) if self._next_turn is not None else -1
        if j < 0:
            return
        think_s = self.stream.think_s
        assert think_s is not None  # set together with `after`
        think = float(think_s[j])
        if think > 0:
            self.env.timeout(think).callbacks.append(partial(self._dispatch_later, j))
        else:
            self.dispatch(j)

    def _dispatch_later(self, i: int, _event: object) -> None:
        self.dispatch(i)

    def done(self) -> bool:
        """Every request has arrived and no instance has work left."""
        return self.num_arrived == len(self.stream) and not any(
            inst.scheduler.has_unfinished_requests() for inst in self.instances)

    def run(self, progress: Callable[[float, int], None] | None = None, slices: int = 200) -> SimResult:
        """Run to completion (or `sim.max_sim_time_s`), calling `progress(sim_now, arrived)` between slices."""
        env = self.env
        # Requests waiting in a long queue are many young objects and no cycles: Python's collector
        # rescanning them was ~15 % of a million-request run. Collect rarely; restore afterwards.
        gc_threshold = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(max(gc_threshold[0], 100_000), gc_threshold[1], max(gc_threshold[2], 100))
        try:
            return self._run(progress, slices)
        finally:
            gc.set_threshold(*gc_threshold)
            gc.unfreeze()

    def _run(self, progress, slices: int) -> SimResult:
        env = self.env
        t_wall = time.perf_counter()
        horizon = self.scenario.sim.max_sim_time_s
        last_arrival = float(self.stream.arrival_s[-1]) if len(self.stream) else 0.0
        step = max((horizon or last_arrival) / slices, 1e-3)
        t = 0.0
        while not self.done():
            nxt = env.peek()
            if nxt == float("inf"):
                break
            t = max(t + step, nxt)
            if horizon is not None and t >= horizon:
                env.run(until=horizon)
                break
            env.run(until=t)
            if progress is not None:
                progress(env.now, self.num_arrived)
        wall = time.perf_counter() - t_wall
        if progress is not None:
            progress(env.now, self.num_arrived)
        return SimResult(self.scenario, self.log, self.instances, float(env.now), wall, self.num_blocks,
                         self.perf, self.stream.stats.to_dict())


def simulate(sc: Scenario, stream: RequestStream, progress=None, router=None) -> SimResult:
    return Cluster(sc, stream, router).run(progress)


def account(log: RequestLog) -> dict[str, int]:
    """How many requests ended in each state; they always add up to the total."""
    counts = np.bincount(log.status, minlength=len(RequestStatus))
    return {s.name.lower(): int(counts[s]) for s in RequestStatus}
