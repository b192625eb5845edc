"""Routers are pure objects over views: no simulator imports, no engine objects, deterministic decisions."""

import ast
import dataclasses
from pathlib import Path

import pytest

import twin.policy
from twin.policy import (ApproxPrefixIndex, BlockRemoved, BlockStored, Bookkeeping, LeastKV, LeastOutstanding,
                         PowerOfTwo, PreciseIndex, Random, Reject, RoundRobin, make_router)
from twin.policy.kv_events import AllBlocksCleared, decode_event

from conftest import make_scenario, run_checked, stream_of
from policy_fakes import fleet_of, req


def test_policy_package_imports_nothing_from_the_simulator_or_live():
    root = Path(twin.policy.__file__).parent
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for n in names:
                assert not n.startswith(("twin.sim.cluster", "twin.engine", "twin.sim.dispatcher", "live", "simpy")), \
                    (path.name, n)


def test_round_robin_cycles_over_serving_instances_only():
    fleet = fleet_of({"id": "i0"}, {"id": "i1", "state": "draining"}, {"id": "i2"})
    rr = RoundRobin()
    assert [rr.choose(req(), fleet) for _ in range(5)] == ["i0", "i2", "i0", "i2", "i0"]


def test_no_serving_instance_is_a_rejection_not_a_crash():
    fleet = fleet_of({"id": "a", "state": "starting"})
    for r in (RoundRobin(), Random(), LeastOutstanding(), LeastKV(), PowerOfTwo()):
        assert isinstance(r.choose(req(), fleet), Reject)


def test_random_is_reproducible_with_a_seed_and_covers_all():
    fleet = fleet_of(*({"id": f"i{k}"} for k in range(4)))
    seq1 = [Random(seed=3).choose(req(), fleet)] + [None]
    r1, r2 = Random(seed=3), Random(seed=3)
    a = [r1.choose(req(), fleet) for _ in range(50)]
    b = [r2.choose(req(), fleet) for _ in range(50)]
    assert a == b and a[0] == seq1[0]
    assert set(a) == {"i0", "i1", "i2", "i3"}


def test_least_outstanding_reads_the_books_and_breaks_ties_at_random():
    fleet = fleet_of({"id": "a", "inflight": 3}, {"id": "b", "inflight": 1}, {"id": "c", "inflight": 1},
                     {"id": "d", "inflight": 2})
    picks = {LeastOutstanding(seed=s).choose(req(), fleet) for s in range(20)}
    assert picks == {"b", "c"}  # both tied instances get picked: ties do not herd onto the lowest index


def test_inflight_counts_follow_the_routable_instances_and_the_books():
    fleet = fleet_of({"id": "a", "inflight": 3}, {"id": "b", "inflight": 1, "state": "draining"},
                     {"id": "c", "inflight": 5})
    assert fleet.inflight_counts() == [v.inflight_requests for v in fleet.instances] == [3, 5]
    fleet.bookkeeping.load("c").requests = 0  # the books, not a copy: the next decision sees the change
    assert fleet.inflight_counts() == [3, 0]


def test_least_outstanding_on_gauges_reads_running_plus_waiting():
    fleet = fleet_of({"id": "a", "running": 1, "waiting": 0, "inflight": 9}, {"id": "b", "running": 3})
    assert LeastOutstanding(signal="gauges").choose(req(), fleet) == "a"
    assert LeastOutstanding().choose(req(), fleet) == "b"
    with pytest.raises(ValueError):
        LeastOutstanding(signal="magic")


def test_least_kv_and_power_of_two():
    fleet = fleet_of({"id": "a", "kv": 0.7}, {"id": "b", "kv": 0.2}, {"id": "c", "kv": 0.5})
    assert LeastKV().choose(req(), fleet) == "b"
    fleet = fleet_of({"id": "a", "inflight": 5}, {"id": "b", "inflight": 0})
    assert all(PowerOfTwo(seed=s).choose(req(), fleet) == "b" for s in range(10))


def test_registry_names_aliases_and_parameter_errors():
    assert isinstance(make_router("round-robin"), RoundRobin)
    assert isinstance(make_router("rr"), RoundRobin)
    assert isinstance(make_router("least_outstanding_requests"), LeastOutstanding)
    with pytest.raises(KeyError):
        make_router("nope")
    with pytest.raises(TypeError, match="it takes: signal='bookkeeping', seed=0"):
        make_router("least-outstanding", window=3)
    assert make_router("random", seed=7).seed == 7


def test_user_router_loads_from_a_file(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("from twin.policy import RouterBase\n"
                 "class Last(RouterBase):\n"
                 "    name = 'last'\n"
                 "    def choose(self, req, fleet):\n"
                 "        return fleet.instances[-1].id\n")
    sc = make_scenario(**{"cluster.num_instances": 3, "router.name": f"{f}:Last"})
    res = run_checked(sc, stream_of([0, 0.1, 0.2], [10] * 3, [5] * 3))
    assert [i.num_dispatched for i in res.instances] == [0, 0, 3]


def test_bookkeeping_tracks_dispatch_first_token_and_finish():
    b = Bookkeeping()
    b.dispatched("r1", "a", 100, 20)
    b.dispatched("r2", "a", 50, 10)
    ld = b.load("a")
    assert (ld.requests, ld.prompt_tokens, ld.decode_tokens) == (2, 150, 0)
    b.first_token("r1")
    assert (ld.requests, ld.prompt_tokens, ld.decode_tokens) == (2, 50, 120)
    b.finished("r1")
    b.finished("r2")
    b.finished("r2")  # a second finish (an abort after the end) changes nothing
    assert (ld.requests, ld.prompt_tokens, ld.decode_tokens) == (0, 0, 0)


def test_approximate_index_matches_leading_blocks_and_stays_bounded():
    idx = ApproxPrefixIndex(capacity_blocks=4)
    idx.on_dispatch([1, 2, 3], "a")
    idx.on_dispatch([1, 2, 9], "b")
    assert idx.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 2}
    assert idx.match([7, 2, 3], ["a", "b"]) == {}  # no leading block: nothing, whatever follows
    idx.on_dispatch([5, 6], "a")  # capacity 4: blocks 1 and 2 of a are the oldest and go
    assert idx.match([1, 2, 3], ["a", "b"]) == {"b": 2}
    for k in range(10_000):
        idx.on_dispatch([100 + k, 200 + k], "a")
    assert idx.num_blocks() <= 4 + 3


def test_precise_index_follows_stored_removed_and_cleared_counting_copies():
    idx = PreciseIndex()
    idx.apply("a", BlockStored([1, 2, 3]))
    idx.apply("a", BlockStored([2]))  # a duplicate copy of block 2 (vLLM keeps both)
    idx.apply("b", BlockStored([1]))
    idx.apply("a", BlockRemoved([2]))  # one copy gone, one left: still hittable
    assert idx.match([1, 2, 3], ["a", "b"]) == {"a": 3, "b": 1}
    idx.apply("a", BlockRemoved([2]))
    assert idx.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 1}
    idx.apply("a", AllBlocksCleared())
    assert idx.match([1, 2, 3], ["a", "b"]) == {"b": 1}
    idx.apply("b", BlockRemoved([42]))  # removal of a block stored before we listened: ignored


def test_kv_events_decode_from_vllms_wire_forms():
    stored = decode_event({"type": "BlockStored", "block_hashes": [b"\x01", 2], "parent_block_hash": None,
                           "token_ids": [1, 2], "block_size": 16, "lora_id": None, "medium": "GPU"})
    assert isinstance(stored, BlockStored) and list(stored.block_hashes) == [1, 2]
    removed = decode_event(["BlockRemoved", [5], "GPU"])
    assert isinstance(removed, BlockRemoved) and list(removed.block_hashes) == [5]
    assert isinstance(decode_event(["AllBlocksCleared"]), AllBlocksCleared)
    with pytest.raises(ValueError):
        decode_event({"type": "Nope"})


def test_least_outstanding_spreads_a_burst_evenly_in_the_simulator():
    sc = make_scenario(**{"cluster.num_instances": 4, "router.name": "least-outstanding"})
    res = run_checked(sc, stream_of([0.0] * 8, [100] * 8, [50] * 8))
    assert [i.num_dispatched for i in res.instances] == [2, 2, 2, 2]


def test_a_router_that_raises_stops_the_run_with_the_request_named():
    from twin.sim.dispatcher import RouterError

    class Broken:
        name = "broken"

        def choose(self, req, fleet):
            if req.id == "1":
                raise RuntimeError("boom")
            return fleet.instances[0].id

    sc = make_scenario()
    with pytest.raises(RouterError, match=r"router 'broken' raised RuntimeError: boom while routing request 1"):
        run_checked(sc, stream_of([0, 1, 2, 3], [10] * 4, [5] * 4), router=Broken())


def test_with_on_error_reject_a_failing_router_loses_no_request():
    class Broken:
        name = "broken"

        def choose(self, req, fleet):
            if int(req.id) % 2:
                raise RuntimeError("boom")
            return "no-such-instance" if req.id == "2" else fleet.instances[0].id

    sc = make_scenario(**{"router.on_error": "reject"})
    res = run_checked(sc, stream_of([0, 1, 2, 3], [10] * 4, [5] * 4), router=Broken())
    assert list(res.log.status) == [4, 5, 5, 5]
    assert res.log.reject_reason[1] == "router error: RuntimeError: boom"
    assert res.log.reject_counts["router error"] == 2  # counted as the router's failure, in both worlds
    assert "rejected by the router" not in res.log.reject_counts
    assert "unknown instance" in res.log.reject_reason[2]


def test_routers_never_see_the_true_output_length_or_engine_objects():
    seen = []

    class Spy:
        name = "spy"

        def choose(self, req, fleet):
            seen.append((req, list(fleet.instances)))
            return fleet.instances[0].id

    sc = make_scenario(**{"cluster.num_instances": 2})
    run_checked(sc, stream_of([0, 1], [100, 100], [37, 41]), router=Spy())
    for r, views in seen:
        assert r.max_tokens is None  # the client's cap (none given), not 37 or 41
        assert 37 not in (getattr(r, f.name) for f in dataclasses.fields(r))
        for v in views:
            assert not any(hasattr(v, a) for a in ("scheduler", "pool", "env"))


def test_views_pickle_and_copy_equal_in_both_builds():
    """Views cross processes (Ray sweeps, users' multiprocessing) and get copied. The compiled build
    (twin.policy.views is compiled) refuses pickle's default of setting frozen fields one by one, so each view
    rebuilds through its constructor: this checks it does, in whichever build runs the suite."""
    import copy
    import pickle

    from twin.policy.views import Forecast, Gauges, InstanceConfig

    books = Bookkeeping()
    values = [req(3, 120, prefix=(1, 2), session="s"), Reject("full", router_error=True), Gauges(2, 1, 0.25, 4.0),
              InstanceConfig(100, 16, 64, 2048, 4096), Forecast("i0", 0.5, 2.0, None, 7, True, 3)]
    for v in values:
        for twin_of in (lambda x: pickle.loads(pickle.dumps(x)), copy.copy, copy.deepcopy):
            w = twin_of(v)
            assert w == v and type(w) is type(v)
    view = fleet_of({"id": "i0", "running": 3, "waiting": 1, "inflight": 4}, bookkeeping=books).instances[0]
    for twin_of in (lambda x: pickle.loads(pickle.dumps(x)), copy.copy):
        w = twin_of(view)
        assert (w.id, w.state, w.gauges, w.config, w.inflight_requests) == ("i0", "serving", view.gauges,
                                                                             view.config, 4)
    assert copy.copy(view).load is view.load  # a shallow copy reads the same live books


def test_new_request_view_equals_the_constructor_and_stays_frozen_in_both_builds():
    """The simulator builds a view per request without the dataclass's interpreted __init__ (compiled: native
    stores; pure Python: the slots' setters). It must be the very value the constructor gives, and as frozen."""
    import copy
    import pickle

    from twin.policy.views import RequestView, new_request_view

    args = ("7", 1.25, 300, None, (11, 12, 13), 16, "s1", 2, 41.5, "hello")
    v = new_request_view(*args)
    w = RequestView(*args)
    assert type(v) is RequestView and v == w and hash(v) == hash(w) and repr(v) == repr(w)
    assert pickle.loads(pickle.dumps(v)) == w and copy.copy(v) == w
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.id = "8"  # type: ignore[misc]
