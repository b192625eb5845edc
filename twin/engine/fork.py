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
    c = runs.get(id(x))
    if c is not None:
        return c
    cls = x.__class__
    if cls is Run:  # the common entry: a finished request's unshareable blocks
        c = Run(x.count)
    elif cls is Dup:
        c = Dup(x.key, x.ref)
    elif isinstance(x, Seg):
        c = Seg(x.chain, x.gen, x.j0, x.count, x.ref)
    elif isinstance(x, Run):
        c = Run(x.count)
    elif isinstance(x, Dup):
        c = Dup(x.key, x.ref)
    else:
        return x
    runs[id(x)] = c
    return c


def _fork_pool(pool: BlockPool, runs: dict) -> BlockPool:
    if isinstance(pool, SegmentPool):  # ranges and their LRU links, copied by the pool itself
        return pool.fork(runs)
    new = BlockPool(pool.num_gpu_blocks, pool.block_size, pool.enable_caching)
    _copier("BlockPool", pool, _POOL_RULES, "runs")(pool, new, runs)
    return new


def _lru_copy(lru: OrderedDict, runs: dict) -> OrderedDict:
    """The free queue with its Runs and Dups replaced by the fork's copies (int keys kept)."""
    return OrderedDict.fromkeys([e if e.__class__ is int else _same(runs, e) for e in lru])


_POOL_RULES = {
    "free_lru": "lru_copy($, runs)",
    "dups": "{k: [same(runs, d) for d in v] for k, v in $.items()} if $ else {}",
    "cached_block_hash_to_ref": "$.copy()",  # hash -> ref count (ints)
    "event_sink": "None",  # the fork emits no KV events
}


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


_MUTABLE = (list, dict, deque, set)  # an attribute holding one needs a copy rule, or fork and original share it
_copiers: dict = {}


def _copier(what: str, obj, rules: dict, args: str):
    """A function `copy(src, new, <args>)` setting each attribute of `new` from `src`, generated from the
    attribute names `obj` has (once per class and layout: a fork runs it per candidate, and one statement per
    attribute is several times faster than a loop over vars()). `rules` gives the expression for an attribute
    (`$` stands for `src.<name>`; None: keep `new`'s own); any other is copied by reference, and raises
    TypeError if it holds a mutable container, which the fork and the original would then share."""
    d = getattr(obj, "__dict__", None)
    names = tuple(d) if d is not None else None
    hit = _copiers.get((what, type(obj)))
    if hit is not None and (names is None or hit[0] == names):
        return hit[1]
    if names is None:  # slotted or compiled: its attributes are the class's
        names = tuple(vars_of(obj))
    lines = [f"def copy(src, new, {args}):"]
    for n in names:
        rule = rules.get(n, "")
        if rule is None:
            continue
        if rule:
            lines.append(f"    new.{n} = " + rule.replace("$", f"src.{n}"))
        else:
            lines += [f"    v = src.{n}",
                      "    if isinstance(v, MUTABLE):",
                      f"        raise TypeError(f'fork: {what}.{n} ({{type(v).__name__}}) needs an explicit copy rule')",
                      f"    new.{n} = v"]
    ns: dict = {"MUTABLE": _MUTABLE, "same": _same, "lru_copy": _lru_copy, "deque": deque,
                "members": _members, "RefusedHead": RefusedHead}
    exec("\n".join(lines), ns)  # noqa: S102 - generated from the object's own attribute names
    _copiers[(what, type(obj))] = (names, ns["copy"])
    return ns["copy"]


def _bare_request_maker():
    """`Request.__new__` where it makes a settable object; else (a compiled class that refuses it) a maker
    through `__init__`, whose defaults the copier overwrites."""
    try:
        r = Request.__new__(Request)
        r.idx = 0
        return Request.__new__
    except (TypeError, AttributeError):
        return lambda cls: cls(0, 0.0, 0, 0)


def _make_request_copier():
    """A function making a copy of a Request, generated from its slots: a fork copies hundreds of them, and one
    attribute statement each (on an object made by `__new__`, not `__init__`, whose defaults would all be
    overwritten) is several times faster than a getattr/setattr loop."""
    special = {"own_run", "keyed"}
    lines = ["def clone(r, runs):",
             "    new = new_request(Request)"]
    lines += [f"    new.{n} = r.{n}" for n in _attr_names(Request) if n not in special]
    lines += ["    keyed = r.keyed",  # the request's own list of held copies: appended to as blocks fill
              "    new.keyed = [h if h.__class__ is int else same(runs, h) for h in keyed] if keyed else []",
              "    run = r.own_run",
              "    new.own_run = None if run is None else same(runs, run)",
              "    return new"]
    ns: dict = {"Request": Request, "new_request": _bare_request_maker(), "same": _same}
    exec("\n".join(lines), ns)  # noqa: S102 - generated from the class's own attribute names
    return ns["clone"]


_clone_request = _make_request_copier()


def _fork_request(r: Request, runs: dict) -> Request:
    """A copy of `r` whose pool handles are the fork's (`runs`: id(old handle) -> its copy)."""
    return _clone_request(r, runs)


EngineFork = EngineCore  # a fork is an engine core with copied state and its own ForkLog (`core.sink`)


def _fork_group(g: DecodeGroup, new: DecodeGroup, reqs: dict, R) -> DecodeGroup:
    """The decode group's state with every member replaced by its copy (`reqs`: id(member) -> copy, `R` for
    one not copied yet)."""
    _copier("DecodeGroup", g, _GROUP_RULES, "reqs, R")(g, new, reqs, R)
    return new


def _fork_group_no_heap(g: DecodeGroup, new: DecodeGroup, reqs: dict, R) -> DecodeGroup:
    """`_fork_group` leaving the finish heap empty, for a caller that rebuilds it (new stop lengths)."""
    _copier("DecodeGroup-no-heap", g, _GROUP_RULES_NO_HEAP, "reqs, R")(g, new, reqs, R)
    return new


def _members(d: dict, reqs: dict, R) -> dict:
    """A dict keyed by members, with the copies as keys (values kept)."""
    get = reqs.get
    return {(get(id(r)) or R(r)): v for r, v in d.items()}


_GROUP_RULES = {
    "finish_heap": "[(d, seq, reqs.get(id(r)) or R(r)) for d, seq, r in $]",
    "stale": "members($, reqs, R) if $ else {}",
    "phase_count": "list($)",
    "reg_buckets": "[members(b, reqs, R) if b else {} for b in $]",
    "reg_by_first_key": "{k: members(d, reqs, R) for k, d in $.items()} if $ else {}",
}

_GROUP_RULES_NO_HEAP = {**_GROUP_RULES, "finish_heap": None}

_SCHED_RULES = {
    "config": None, "pool": None, "perf": None, "sink": None, "wants_steps": None,  # the new pool; no hooks
    "kv": None,  # the new scheduler's manager is over the new pool; only its counter is state (set below)
    "running": "copies($)",
    "waiting": "deque(copies($))",
    "prefilling": "copies($)",
    "finishing": "copies($)",
    "group": "fork_group($, new.group, reqs, R)",
    "stats": None,  # the new scheduler's, empty: a fork's statistics are its own
    "refused_head": "None if $ is None else RefusedHead(R($.request), $.num_running, $.num_decode, "
                    "$.free_blocks, $.num_registrations)",
    "inbox": "[(R(r), t) for r, t in $]",
    "run_x": "list($)",
    "decode_params_memo": None,  # the fork's own, empty: it fills from the same step model
}


def fork_scheduler(sched: Scheduler, runs: dict | None = None, finish_heap: bool = True) -> tuple[Scheduler, dict]:
    """A deep copy of a scheduler's state (requests, pool, decode group) with a ForkLog and no callbacks.

    Returns the copy and the map id(original request) -> its copy. `finish_heap=False` leaves the decode
    group's finish heap empty, for a caller that rebuilds it (`twin.sim.forecaster.apply_stop_lengths`)."""
    runs = {} if runs is None else runs
    pool = _fork_pool(sched.pool, runs)
    new = make_scheduler(sched.config, pool, sched.perf, ForkLog())
    reqs: dict[int, Request] = {}
    clone = _clone_request

    def R(r: Request) -> Request:
        c = reqs.get(id(r))
        if c is None:
            c = reqs[id(r)] = clone(r, runs)
        return c

    def copies(rs) -> list[Request]:
        """[R(r) for r in rs], without a call per request (the running list and the queue hold most)."""
        out = []
        get = reqs.get
        for r in rs:
            c = get(id(r))
            if c is None:
                c = reqs[id(r)] = clone(r, runs)
            out.append(c)
        return out

    _copier("Scheduler", sched, _SCHED_RULES, "reqs, R, copies, fork_group")(sched, new, reqs, R, copies,
                                                                              _fork_group if finish_heap
                                                                              else _fork_group_no_heap)
    new.kv.num_registrations = sched.kv.num_registrations
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


def fork_instance(inst, now: float, finish_heap: bool = True) -> EngineFork:
    """Fork `inst` at simulated time `now` (its current time), with the work it has in progress
    (`finish_heap=False`: see `fork_scheduler`)."""
    sched, reqs = fork_scheduler(inst.scheduler, finish_heap=finish_heap)
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
