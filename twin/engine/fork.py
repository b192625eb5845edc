"""Fork an engine and run it forward without SimPy: the look-ahead behind Block routing and the twin scaler.

`fork_instance(inst)` copies an instance's scheduler, block pool and requests (plain data: no SimPy, no
shared log, no hooks), together with the step or decode run it is in the middle of, into a new
`EngineCore` (twin.engine.core). Its `advance` is the very loop the instance's SimPy process runs, so a fork
advanced alone gives exactly what the original gives with no further arrivals, and a request added to the
fork at its fork time is handled as an arrival at that time would be. The original is never touched. What
the fork did is read from its own `ForkLog` (dicts keyed by request index), the fork's sink (`fork.sink`).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from twin.engine.block_pool import BlockPool, Dup, Run
from twin.engine.core import EngineCore
from twin.engine.decode_group import DecodeGroup
from twin.engine.request import Request
from twin.engine.segment_pool import Seg, SegmentPool
from twin.engine.async_scheduler import make_scheduler
from twin.engine.output import SchedulerOutput
from twin.engine.scheduler import RefusedHead, Scheduler
from twin.engine.stats import EngineStats
from twin.engine.records import RequestLog


class ForkLog(RequestLog):
    """A request log that records into dicts: a fork writes nowhere shared and reports what it did."""

    def __init__(self) -> None:  # not RequestLog's: its twelve arrays would be made only to be thrown away
        self.n = 0
        for col in ("arrival_s", "scheduled_s", "first_token_s", "finish_s", "instance", "prompt_tokens",
                    "max_tokens", "output_tokens", "cached_tokens", "preemptions", "status", "session_id"):
            setattr(self, col, {})
        self.reject_reason: dict[int, str] = {}
        self.reject_counts: dict[str, int] = {}


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
    new = Request(r.idx, r.arrival_time, r.num_prompt_tokens, r.stop_at_tokens, r.block_keys, r.session_id)
    _copy_request(r, new, runs)
    return new


EngineFork = EngineCore  # a fork is an engine core with copied state and its own ForkLog (`core.sink`)


def _fork_group(g: DecodeGroup, new: DecodeGroup, R) -> DecodeGroup:
    """The decode group's state with every member replaced by its copy (`R`)."""
    for name, value in vars_of(g).items():
        if name == "finish_heap":
            value = [(d, seq, R(r)) for d, seq, r in value]
        elif name == "stale":
            value = {R(r): t for r, t in value.items()}
        elif name == "phase_count":
            value = list(value)
        elif name == "reg_buckets":
            value = [{R(r): None for r in b} for b in value]
        elif name == "reg_by_first_key":
            value = {k: {R(r): None for r in d} for k, d in value.items()}
        elif isinstance(value, (list, dict, deque)):
            raise TypeError(f"fork: DecodeGroup.{name} ({type(value).__name__}) needs an explicit copy rule")
        setattr(new, name, value)
    return new


def fork_scheduler(sched: Scheduler, runs: dict | None = None) -> tuple[Scheduler, dict]:
    """A deep copy of a scheduler's state (requests, pool, decode group) with a ForkLog and no callbacks."""
    runs = {} if runs is None else runs
    pool = _fork_pool(sched.pool, runs)
    new = make_scheduler(sched.config, pool, sched.perf, ForkLog())
    reqs: dict[int, Request] = {}

    def R(r: Request) -> Request:
        c = reqs.get(id(r))
        if c is None:
            c = reqs[id(r)] = _fork_request(r, runs)
        return c

    for name, value in vars_of(sched).items():
        if name in ("config", "pool", "perf", "sink", "wants_steps"):  # the new pool; no hooks
            continue
        if name == "kv":  # the new scheduler's manager is over the new pool; only its counter is state
            new.kv.num_registrations = value.num_registrations
            continue
        if name in ("running", "prefilling"):
            value = [R(r) for r in value]
        elif name == "waiting":
            value = deque(R(r) for r in value)
        elif name == "group":
            value = _fork_group(value, new.group, R)
        elif name == "stats":
            value = EngineStats()
        elif name == "refused_head":
            value = None if value is None else RefusedHead(R(value.request), value.num_running, value.num_decode,
                                                           value.free_blocks, value.num_registrations)
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
    core = inst.core
    fork = EngineCore(sched, inst.perf, now, inst.fast_forward, inst.max_run_steps, "fork")
    fork.pending_step = step
    fork.pending_run = core.pending_run
    fork.pending_tail = core.pending_tail
    fork.wait_s = core.wait_s
    return fork
