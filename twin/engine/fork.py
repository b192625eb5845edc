"""Fork an engine and run it forward without SimPy: the look-ahead behind Block routing and the twin scaler.

`fork_instance(inst)` copies an instance's scheduler, block pool and requests (plain data: no SimPy, no
shared log, no callbacks), together with the step or decode run it is in the middle of. `EngineFork.advance`
then runs the same loop as `Instance.run` (twin/sim/instance.py), step for step and with the same clock
arithmetic, so a fork advanced alone gives exactly what the original gives with no further arrivals, and a
request added to the fork at its fork time is handled as an arrival at that time would be. The original is
never touched. What the fork did is read from its own `ForkLog` (dicts keyed by request index).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict, deque

from twin.engine.block_pool import BlockPool, Dup, Run
from twin.engine.request import Request
from twin.engine.segment_pool import Seg, SegmentPool
from twin.engine.scheduler import EngineStats, Scheduler, SchedulerOutput
from twin.engine.records import RequestLog


class ForkLog(RequestLog):
    """A request log that records into dicts: a fork writes nowhere shared and reports what it did."""

    def __init__(self) -> None:
        super().__init__(0)
        for col in ("arrival_s", "scheduled_s", "first_token_s", "finish_s", "instance", "prompt_tokens",
                    "max_tokens", "output_tokens", "cached_tokens", "preemptions", "status", "session_id"):
            setattr(self, col, {})


def _same(runs: dict, x):
    """The fork's copy of a shared mutable pool entry (a Run or a Dup), made once: the pool's queue, its
    duplicate lists and the requests' handles must keep pointing at the same object."""
    if isinstance(x, Seg):
        c = runs.get(id(x))
        if c is None:
            c = runs[id(x)] = Seg(x.chain, x.gen, x.j0, x.count, x.ref)
        return c
    if isinstance(x, Run):
        c = runs.get(id(x))
        if c is None:
            c = runs[id(x)] = Run(x.count)
        return c
    if isinstance(x, Dup):
        c = runs.get(id(x))
        if c is None:
            c = runs[id(x)] = Dup(x.key, x.ref)
        return c
    return x


def _fork_pool(pool: BlockPool, runs: dict) -> BlockPool:
    if isinstance(pool, SegmentPool):  # ranges and their LRU links, copied by the pool itself
        return pool.fork(runs)
    new = BlockPool(pool.num_gpu_blocks, pool.block_size, pool.enable_caching)
    for name, value in vars_of(pool).items():
        if name == "free_lru":
            lru: OrderedDict = OrderedDict()
            for entry in value:
                lru[_same(runs, entry)] = None
            setattr(new, name, lru)
        elif name == "dups":
            setattr(new, name, {k: [_same(runs, d) for d in v] for k, v in value.items()})
        elif name == "event_sink":
            setattr(new, name, None)
        elif isinstance(value, dict):
            setattr(new, name, {k: (list(v) if isinstance(v, list) else v) for k, v in value.items()})
        elif isinstance(value, list):
            setattr(new, name, list(value))
        else:
            setattr(new, name, value)
    return new


def vars_of(obj) -> dict:
    """Attributes of a plain, slotted or mypyc-compiled object."""
    names = getattr(type(obj), "__mypyc_attrs__", None)
    if names is None:
        if hasattr(obj, "__dict__"):
            return dict(vars(obj))
        names = []
        for cls in type(obj).__mro__:
            names.extend(getattr(cls, "__slots__", ()))
    out = {}
    for n in names:
        if n in ("__dict__", "__weakref__"):
            continue
        try:
            out[n] = getattr(obj, n)
        except AttributeError:
            pass
    return out


def _attr_names(cls) -> list[str]:
    names = getattr(cls, "__mypyc_attrs__", None)
    if names is None:
        names = [n for c in cls.__mro__ for n in getattr(c, "__slots__", ())]
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def _make_request_copier():
    """A function copying every Request attribute, generated from its slots: a fork copies hundreds of them,
    and one attribute statement each is several times faster than a getattr/setattr loop."""
    special = {"block_keys", "own_run", "keyed"}
    lines = ["def copy_into(r, new, runs):"]
    lines += [f"    new.{n} = r.{n}" for n in _attr_names(Request) if n not in special]
    lines += ["    new.keyed = [h if h.__class__ is int else same(runs, h) for h in r.keyed]",
              "    run = r.own_run",
              "    if run is not None:",
              "        new.own_run = same(runs, run)"]
    ns: dict = {"Run": Run, "same": _same}
    exec("\n".join(lines), ns)  # noqa: S102 - generated from the class's own attribute names
    return ns["copy_into"]


_copy_request = _make_request_copier()


def _fork_request(r: Request, runs: dict) -> Request:
    new = Request(r.idx, r.arrival_time, r.num_prompt_tokens, r.max_tokens, r.block_keys, r.session_id)
    _copy_request(r, new, runs)
    return new


class EngineFork:
    """A copied engine with its own clock; `advance` runs it forward, `add_request` gives it an arrival."""

    def __init__(self, sched: Scheduler, perf, now: float, fast_forward: bool, max_run_steps: int,
                 pending_step=None, pending_run=None, pending_tail=None) -> None:
        self.scheduler = sched
        self.perf = perf
        self.now = now
        self.fast_forward = fast_forward
        self.max_run_steps = max_run_steps
        self.pending_step = pending_step
        self.pending_run = pending_run
        self.pending_tail = pending_tail
        self.log: ForkLog = sched.log  # type: ignore[assignment]
        self.steps = 0
        self.drained_at: float | None = None  # when the last request ended, once the fork has run dry

    # -- arrivals --------------------------------------------------------------------------------------
    def add_request(self, r: Request) -> None:
        """`r` arrives at the fork's current time (an interruption of a decode run in progress, as in Instance)."""
        self.scheduler.add_request(r, self.now)
        if self.pending_run is not None:
            k, durations, ends, _t0 = self.pending_run
            now = self.now
            j = min(bisect_left(ends, now) + (2 if self.scheduler.async_scheduling else 1), k)
            self.pending_run = None
            if now < ends[j - 1]:
                self.pending_tail = (j, durations, ends, now)
            else:
                self.scheduler.commit_decode_run(j, durations, ends)

    def arrive(self, r: Request, at: float) -> None:
        """Run to `at`, then `r` arrives (as the engine sees a request the API server hands over then)."""
        if at > self.now:
            self.advance(until=at)
        self.add_request(r)

    # -- the loop --------------------------------------------------------------------------------------
    def _finish_pending(self, until: float) -> bool:
        """Complete work in progress if it ends by `until`; False if it would end later."""
        sched = self.scheduler
        if self.pending_step is not None:
            out, t_end = self.pending_step
            if t_end > until:
                return False
            self.pending_step = None
            self.now = t_end
            sched.update_from_output(out, t_end)
        if self.pending_tail is not None:
            j, durations, ends, t_resume = self.pending_tail
            t = t_resume + (ends[j - 1] - t_resume)
            if t > until:
                return False
            self.pending_tail = None
            self.now = t
            sched.commit_decode_run(j, durations, ends)
        if self.pending_run is not None:
            k, durations, ends, t0 = self.pending_run
            t = t0 + (ends[-1] - t0)
            if t > until:
                return False
            self.pending_run = None
            self.now = t
            sched.commit_decode_run(k, durations, ends)
        return True

    def advance(self, until: float = math.inf, stop=None) -> float:
        """Run until `until`, until idle, or until `stop()` is true after a step.

        At a finite `until` the clock stops there with the step or decode run in progress kept pending, so
        `add_request` then is an arrival at `until`, and a later `advance` resumes exactly.
        """
        sched = self.scheduler
        if not self._finish_pending(until):
            self.now = max(self.now, until)
            return self.now
        asy = sched.async_scheduling
        while sched.has_unfinished_requests():
            if stop is not None and stop():
                break
            now = self.now
            if asy:  # Instance._run_async's boundary
                if sched.is_idle():
                    sched.wake(now)
                sched.admit_inbox()
            k = sched.plan_decode_run(self.max_run_steps) if self.fast_forward else 0
            if k >= 2:
                durations, ends = sched.decode_run_plan(k, now)
                t = now + (ends[-1] - now)
                if t > until:
                    self.pending_run = (k, durations, ends, now)
                    self.now = until
                    break
                self.now = t
                sched.commit_decode_run(k, durations, ends)
                self.steps += k
                continue
            out = sched.schedule(now)
            if asy:
                released = sched.release_finished()
                if out.is_empty:
                    sched.prev_gpu_s = 0.0
                    if not released and not sched.inbox:
                        raise RuntimeError(f"fork: scheduler made no progress with {len(sched.waiting)} waiting")
                    continue
            if out.is_empty:
                raise RuntimeError(f"fork: scheduler made no progress with {len(sched.waiting)} waiting")
            t = now + sched.step_duration(out)
            if t > until:
                self.pending_step = (out, t)
                self.now = until
                break
            self.now = t
            sched.update_from_output(out, t)
            self.steps += 1
        else:
            self.drained_at = self.now  # the clock below idles on to the horizon; Block's makespan reads this
            if until != math.inf and self.now < until:
                self.now = until  # idle until the horizon
        return self.now


def fork_scheduler(sched: Scheduler, runs: dict | None = None) -> tuple[Scheduler, dict]:
    """A deep copy of a scheduler's state (requests, pool, decode group) with a ForkLog and no callbacks."""
    runs = {} if runs is None else runs
    pool = _fork_pool(sched.pool, runs)
    new = Scheduler(sched.config, pool, sched.perf, ForkLog())
    reqs: dict[int, Request] = {}

    def R(r: Request) -> Request:
        c = reqs.get(id(r))
        if c is None:
            c = reqs[id(r)] = _fork_request(r, runs)
        return c

    for name, value in vars_of(sched).items():
        if name in ("config", "pool", "seg", "perf", "log", "on_finish", "on_first_token"):  # seg: the new pool
            continue
        if name in ("running", "prefilling"):
            value = [R(r) for r in value]
        elif name == "waiting":
            value = deque(R(r) for r in value)
        elif name == "finish_heap":
            value = [(d, seq, R(r)) for d, seq, r in value]
        elif name == "stale":
            value = {R(r): t for r, t in value.items()}
        elif name == "phase_count":
            value = list(value)
        elif name == "stats":
            value = EngineStats()
        elif name == "reg_buckets":
            value = [{R(r): None for r in b} for b in value]
        elif name == "_reg_by_first_key":
            value = {k: {R(r): None for r in d} for k, d in value.items()}
        elif name == "_blocked":
            value = None if value is None else (R(value[0]), *value[1:])
        elif name == "finishing":
            value = [R(r) for r in value]
        elif name == "inbox":
            value = [(R(r), t) for r, t in value]
        elif name == "run_x":
            value = list(value)
        elif isinstance(value, (list, dict, deque)):
            raise TypeError(f"fork: Scheduler.{name} ({type(value).__name__}) needs an explicit copy rule")
        setattr(new, name, value)
    return new, reqs


def _fork_out(out: SchedulerOutput, reqs: dict, sched: Scheduler) -> SchedulerOutput:
    def R(r):
        c = reqs.get(id(r))
        if c is None:  # a request scheduled this step that has since left (cannot happen mid-step)
            c = reqs[id(r)] = _fork_request(r, {})
        return c

    new = SchedulerOutput(out.t_start, [(R(r), n, c) for r, n, c in out.prefills], out.num_decode,
                          out.decode_context, [R(r) for r in out.skipped], [R(r) for r in out.preempted])
    for name, value in vars_of(out).items():
        if name not in ("t_start", "prefills", "num_decode", "decode_context", "skipped", "preempted"):
            setattr(new, name, value)
    return new


def fork_instance(inst, now: float) -> EngineFork:
    """Fork `inst` at simulated time `now` (its current time), with the work it has in progress."""
    sched, reqs = fork_scheduler(inst.scheduler)
    step = None
    if inst.pending_step is not None:
        out, t_end = inst.pending_step
        step = (_fork_out(out, reqs, sched), t_end)
    return EngineFork(sched, inst.perf, now, inst.fast_forward, inst.max_run_steps, step,
                      inst.pending_run, inst.pending_tail)
