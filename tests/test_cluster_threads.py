"""A run outside the main thread (the live controller's shadow twin, a forecast in a worker thread) leaves the
process's garbage-collector settings alone: they belong to the program that owns the process."""

import gc
import threading

from conftest import make_scenario, run_checked, stream_of


def test_a_run_in_a_thread_does_not_touch_the_collector(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "set_threshold", lambda *a: calls.append(("set_threshold", a)))
    out = {}

    def work():
        out["log"] = run_checked(make_scenario(), stream_of([0.0, 0.1], [100, 200], [10, 20])).log

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert (out["log"].status == 4).all()  # both finished
    assert calls == []


def test_a_run_in_the_main_thread_collects_rarely_and_restores(monkeypatch):
    before = gc.get_threshold()
    seen = []
    real = gc.set_threshold
    monkeypatch.setattr(gc, "set_threshold", lambda *a: (seen.append(a), real(*a)))
    run_checked(make_scenario(), stream_of([0.0], [100], [10]))
    assert seen[0][0] >= 100_000 and seen[-1] == before
    assert gc.get_threshold() == before
