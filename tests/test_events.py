"""twin.sim.events against SimPy: the same processes, timers, interrupts and stops give the same steps in the same order."""

import random

import pytest
import simpy

from twin.sim.environment import Environment
from twin.sim.events import Proc, Timer, run


class SimPyKit:
    """SimPy's own classes."""

    def env(self):
        return simpy.Environment()

    def process(self, env, gen):
        return env.process(gen)

    def timeout(self, env, d):
        return env.timeout(d)

    def call_later(self, env, d, fn):
        env.timeout(d).callbacks.append(fn)

    def run(self, env, until=None):
        return env.run(until)


class TwinKit:
    """twin.sim.events' classes in SimPy's environment with the twin's clock (twin.sim.environment)."""

    def env(self):
        return Environment()

    def process(self, env, gen):
        return Proc(env, gen)

    def timeout(self, env, d):
        return Timer(env.clock, d)

    def call_later(self, env, d, fn):
        Timer(env.clock, d).then(fn)

    def run(self, env, until=None):
        return run(env, until)


def world(kit, seed, slices=None):
    """Random processes that wait, wake each other, interrupt each other and set timers; the log of every step."""
    rng = random.Random(seed)
    env = kit.env()
    log = []
    procs = {}
    wakeups = {}
    delays = [0.0, 0.0, 0.25, 0.5, 0.5, 1.0, 1.75]  # zeros and ties: the order among equal times matters

    def worker(name, n):
        for k in range(n):
            act = rng.random()
            try:
                if act < 0.15:  # wait for another to wake me (or a timer as a fallback)
                    ev = env.event()
                    wakeups[name] = ev
                    kit.call_later(env, rng.choice(delays) + 2.0, lambda _e, ev=ev: ev.triggered or ev.succeed("late"))
                    got = yield ev
                    log.append((env.now, name, "woken", got))
                else:
                    d = rng.choice(delays)
                    got = yield kit.timeout(env, d)
                    log.append((env.now, name, "slept", d, got))
                if act > 0.8:  # wake someone, or interrupt someone
                    other = rng.choice(sorted(procs))
                    if other in wakeups and not wakeups[other].triggered:
                        wakeups.pop(other).succeed(name)
                        log.append((env.now, name, "woke", other))
                    elif other != name and procs[other].is_alive:
                        procs[other].interrupt(f"from {name}")
                        log.append((env.now, name, "interrupted", other))
                if act > 0.9:
                    kit.call_later(env, rng.choice(delays), lambda _e, k=k: log.append((env.now, name, "timer", k)))
                if 0.5 < act < 0.6:  # a process started now runs before the timeouts due now (SimPy: URGENT)
                    kit.process(env, child(f"{name}.{k}"))
            except simpy.Interrupt as i:
                log.append((env.now, name, "interrupt", i.cause))
        log.append((env.now, name, "done"))
        return name

    def child(name):
        log.append((env.now, name, "child"))
        yield kit.timeout(env, 0.0)
        log.append((env.now, name, "child done"))

    for j in range(6):
        name = f"p{j}"
        procs[name] = kit.process(env, worker(name, rng.randint(3, 25)))
    if slices is None:
        kit.run(env)
    else:
        t = 0.0
        while t < 150:  # not `env.peek() < inf`: SimPy keeps a stopped `until` event queued (no callbacks left)
            t += slices
            kit.run(env, until=t)
            log.append(("slice", env.now))
    return log


@pytest.mark.parametrize("seed", range(40))
def test_the_same_processes_take_the_same_steps_in_the_same_order(seed):
    want = world(SimPyKit(), seed)
    got = world(TwinKit(), seed)
    assert got == want and len(want) > 20


@pytest.mark.parametrize("seed", range(8))
def test_runs_in_slices_stop_and_resume_as_simpy_does(seed):
    assert world(TwinKit(), seed, slices=0.6) == world(SimPyKit(), seed, slices=0.6)


def test_a_stop_inside_a_timers_callbacks_runs_the_rest_first_on_resume():
    """An event whose callback stops the run (StopSimulation, as `Cluster.all_ended` does) keeps the
    callbacks after it for when the run resumes, before anything else at that time."""
    for kit in (SimPyKit(), TwinKit()):
        env = kit.env()
        seen = []
        stop = env.event()
        stop.callbacks.append(simpy.core.StopSimulation.callback)
        stop.callbacks.append(lambda _e: seen.append(("after stop", env.now)))
        kit.call_later(env, 1.0, lambda _e: stop.succeed("stopped"))
        kit.call_later(env, 1.0, lambda _e: seen.append(("same time", env.now)))
        assert kit.run(env) == "stopped"
        kit.run(env)
        assert seen == [("same time", 1.0), ("after stop", 1.0)], (kit, seen)


def test_simpys_own_step_and_run_handle_twin_events():
    """Tests and forks step a cluster's environment with `env.step()` / `env.run()`, and call `env.peek()`:
    the environment's own methods take both queues (a SimPy timeout among the twin's timers here)."""
    env = Environment()
    seen = []

    def loop():
        for d in (0.5, 0.0, 1.0):
            yield Timer(env.clock, d)
            seen.append(env.now)

    p = Proc(env, loop())
    Timer(env.clock, 0.75).then(lambda _e: seen.append(("timer", env.now)))
    env.timeout(0.6).callbacks.append(lambda _e: seen.append(("simpy", env.now)))
    assert env.peek() == 0.0
    env.step()  # the process's start
    assert env.peek() == 0.5
    env.run(until=1.0)
    env.run()
    assert seen == [0.5, 0.5, ("simpy", 0.6), ("timer", 0.75), 1.5] and not p.is_alive
    assert env.peek() == float("inf")


def test_a_failing_process_stops_the_run_with_its_exception():
    env = Environment()

    def bad():
        yield Timer(env.clock, 1.0)
        raise KeyError("boom")

    Proc(env, bad())
    with pytest.raises(KeyError, match="boom"):
        run(env)
    assert env.now == 1.0


def test_misuse_is_refused_as_simpy_refuses_it():
    env = Environment()
    with pytest.raises(ValueError, match="Negative delay"):
        Timer(env.clock, -1.0)

    def yields_junk():
        yield 42

    Proc(env, yields_junk())
    with pytest.raises(RuntimeError, match="Invalid yield value"):
        run(env)

    env = Environment()

    def short():
        yield Timer(env.clock, 0.1)

    p = Proc(env, short())
    run(env)
    with pytest.raises(RuntimeError, match="terminated"):
        p.interrupt()
    with pytest.raises(RuntimeError, match="until"):
        run(env, until=env.event())


def test_the_worlds_exercise_every_path():
    """The comparison above is only as good as what the worlds do: interrupts, wake-ups, timers, ties at zero."""
    kinds = set()
    for seed in range(40):
        log = world(TwinKit(), seed)
        assert sum(1 for e in log if e[2] == "done") == 6
        kinds |= {e[2] for e in log}
        assert max(e[0] for e in log) < 150
    assert {"slept", "woken", "woke", "interrupted", "interrupt", "timer", "child", "child done"} <= kinds
