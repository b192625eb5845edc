"""The engine reports through its sink (twin.engine.sink): a subscriber hears every request and step event,
the run's log is one such sink, and the SimPy instance and the fork run one loop (twin.engine.core)."""

import numpy as np
import pytest

from twin.engine.core import EngineCore
from twin.engine.fork import fork_instance
from twin.engine.sink import EngineSink, FanOut, StepRecorder
from twin.sim.cluster import Cluster

from conftest import kv_blocks, make_scenario, stream_of


class Heard(EngineSink):
    """A user's subscriber: it overrides some events only."""

    def __init__(self):
        self.events = []

    def first_token(self, r, t):
        self.events.append(("first", r.idx, t))

    def request_finished(self, r, t):
        self.events.append(("finished", r.idx, t, r.num_output_tokens))

    def request_preempted(self, r):
        self.events.append(("preempted", r.idx))


def workload(n=60, seed=3):
    rng = np.random.default_rng(seed)
    arr = np.sort(rng.uniform(0, 0.5, n))
    return stream_of(arr, rng.integers(20, 700, n), rng.integers(1, 90, n))


@pytest.mark.parametrize("mode,async_on,blocks", [("fast", True, 2000), ("fast", False, 2000), ("step", True, 60),
                                                  ("step", False, 60)])
def test_a_subscriber_hears_what_the_log_records(mode, async_on, blocks):
    sc = make_scenario(**{"sim.mode": mode, "cluster.engine.async_scheduling": async_on,
                          **kv_blocks(blocks), "cluster.engine.max_num_seqs": 16,
                          "cluster.engine.max_num_batched_tokens": 512, "sim.timeline_interval_s": 0})
    cl = Cluster(sc, workload())
    heard, steps = Heard(), StepRecorder()
    cl.instances[0].subscribe(heard)
    cl.instances[0].subscribe(steps)
    res = cl.run()
    log, stats = res.log, cl.instances[0].scheduler.stats
    first = {e[1]: e[2] for e in heard.events if e[0] == "first"}
    fin = {e[1]: e for e in heard.events if e[0] == "finished"}
    assert set(fin) == set(range(log.n))  # every request finished, and was heard finishing once
    shift = cl.api_token_s()  # the log has the client's times: the engine's plus the API server's token time
    for i, (_, _, t, n_out) in fin.items():
        assert t + shift == pytest.approx(log.finish_s[i], abs=1e-12) and n_out == log.output_tokens[i]
        assert first[i] + shift == pytest.approx(log.first_token_s[i], abs=1e-12)
        assert first[i] <= t
    assert sum(1 for e in heard.events if e[0] == "preempted") == int(log.preemptions.sum())
    if blocks == 60:
        assert log.preemptions.sum() > 0  # the small pool makes the preemption event happen
    # steps: as many as the engine counted, end to end, busy as long as the engine was
    assert len(steps.starts) == stats.num_steps
    assert all(s < e for s, e in zip(steps.starts, steps.ends))
    assert all(e <= s2 + 1e-12 for e, s2 in zip(steps.ends, steps.starts[1:]))
    assert sum(e - s for s, e in zip(steps.starts, steps.ends)) == pytest.approx(stats.busy_time_s, rel=1e-9)
    assert sum(b.num_decode_tokens + b.num_prefill_sampled for b in steps.batches) == stats.generated_tokens


def test_fanout_calls_only_the_sinks_that_act_on_an_event():
    class Nothing:  # duck-typed, not an EngineSink: it acts on nothing
        pass

    heard = Heard()
    fan = FanOut([Nothing(), heard, EngineSink()])
    assert fan._first_token == [heard.first_token] and fan._request_queued == [] and not fan.wants_steps
    assert FanOut([StepRecorder()]).wants_steps


def test_no_step_events_unless_asked():
    """The log does not want steps, so the engine never builds a step event for it."""
    class Counting(EngineSink):
        calls = 0

        def step(self, out, t_end, used_blocks):
            Counting.calls += 1

    sc = make_scenario(**{"sim.timeline_interval_s": 0})
    cl = Cluster(sc, workload(20))
    cl.instances[0].subscribe(Counting())  # overrides `step` but leaves wants_steps False
    cl.run()
    assert Counting.calls == 0 and cl.instances[0].scheduler.stats.num_steps > 0


def test_the_instance_and_its_fork_run_one_loop():
    sc = make_scenario(**{"sim.timeline_interval_s": 0})
    cl = Cluster(sc, workload(40))
    cl.env.run(until=0.6)
    inst = cl.instances[0]
    assert isinstance(inst.core, EngineCore)
    f = fork_instance(inst, cl.env.now)
    assert type(f) is type(inst.core) and f.sink is not inst.scheduler.sink
    f.advance()
    assert f.drained_at is not None and not f.is_busy()


def test_the_runs_compiled_sink_writes_what_the_request_log_writes():
    """The cluster's own sink (`_RunSink`, compiled with the engine) records exactly what `RequestLog`'s sink
    methods record, with the same hooks after them: the same run through both gives the same columns."""
    from twin.engine.sink import EVENTS
    from twin.sim.cluster import _RunSink

    assert all(callable(getattr(_RunSink, e, None)) for e in EVENTS)

    class Hooks(EngineSink):
        def __init__(self, cl):
            self.cl = cl

        def first_token(self, r, t):
            self.cl._first_token(r.idx, t)

        def request_finished(self, r, t):
            self.cl._finished(r.idx)

    sc = make_scenario(**{"cluster.num_instances": 2, **kv_blocks(80),
                          "sim.timeline_interval_s": 0})
    runs = []
    for via_log in (False, True):
        cl = Cluster(sc, workload(80, seed=9))
        if via_log:
            for inst in cl.instances:
                inst.scheduler.sink = FanOut([cl.log, Hooks(cl)])
        runs.append(cl.run().log)
    a, b = runs
    assert a.preemptions.sum() > 0
    for col in ("status", "scheduled_s", "cached_tokens", "preemptions", "first_token_s", "finish_s", "output_tokens"):
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)


def test_the_log_columns_are_views_of_the_arrays_the_run_writes():
    """RequestLog's columns (numpy, what every reader takes) and `buffers` (memoryviews of array.array, what the run
    writes one element at a time) are the same memory, column by column, with the same dtype and initial values."""
    import numpy as np

    from twin.engine.records import RequestLog

    log = RequestLog(3)
    assert set(log.buffers) == {"arrival_s", "scheduled_s", "first_token_s", "finish_s", "instance", "prompt_tokens",
                                "max_tokens", "output_tokens", "cached_tokens", "preemptions", "status", "session_id",
                                "priority"}
    assert np.isnan(log.finish_s).all() and (log.instance == -1).all() and (log.status == 0).all()
    for name, buf in log.buffers.items():
        col = getattr(log, name)
        first = col[0]
        assert col.dtype.itemsize == buf.itemsize and len(col) == len(buf) == 3
        buf[1] = 7
        assert col[1] == 7
        col[2] = 5
        assert buf[2] == 5
        assert col[0] == first or (np.isnan(col[0]) and np.isnan(first))  # one element each, not the column
    assert len(RequestLog(0).status) == 0
