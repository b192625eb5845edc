"""The scaling actuator: what turns a `ScaleAction` into workers. An interface, and a local-process one.

`Actuator` is three calls, so a Kubernetes actuator (a Deployment's replicas, or one pod per worker) can
replace the local one without the controller changing:

- `start(spec) -> worker_id`: bring a worker up with these engine arguments, wait until it serves (a tiny
  completion succeeds), register it with the controller;
- `drain(worker_id)`: stop routing to it at once, wait for its last in-flight request, then `stop`;
- `stop(worker_id)`: end it now (in-flight requests fail) and deregister it;
- `reap()` (optional): retire the workers whose process ended by itself, so the scaler can replace them (the
  controller's health loop calls it; a Kubernetes actuator would watch its pods).

`LocalActuator` runs `python -m vllm.entrypoints.openai.api_server` processes, each in its own session
(process group) so that stopping signals the API server, EngineCore and Worker together
(../shared/notes/vllm-cpu.md: SIGKILL to the API server alone orphans the other two).

A worker's port is `base_port + slot`. vLLM binds it without SO_REUSEPORT, so a second server on a taken port dies
(EADDRINUSE) while the first answers every readiness probe: a slot whose port another process holds is skipped,
and a worker counts as ready only once its own process group listens on its port (`group_listens`). After that,
its process is watched: vLLM's API server exits when its EngineCore dies, and `reap` then retires it (its slot and
port freed, its in-flight requests already failed) so that the scaler starts a replacement.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from live.config import LauncherSpec
from live.registry import Worker
from live.vllm_server import (FLAG_KINDS_SCRIPT, VLLM_FLAGS, FlagKinds, bind_error, group_listens,
                              kv_events_config, needs_flag_kinds, parse_flag_kinds, server_command, spawn,
                              stop_group, tail)

if TYPE_CHECKING:
    from live.controller import Controller

log = logging.getLogger("llmtwin.live")
FLAG_KINDS_TIMEOUT_S = 180  # importing vLLM to read its parser: 7 s on an idle 2-core machine


@dataclass(frozen=True)
class LaunchSpec:
    """One worker to start: engine arguments over the launcher's (e.g. the chunk planner's
    `max_num_batched_tokens`) and extra environment."""

    engine_args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


class Actuator(Protocol):
    async def start(self, spec: LaunchSpec) -> str: ...

    async def drain(self, worker_id: str) -> None: ...

    async def stop(self, worker_id: str) -> None: ...


def launch_api_key(args: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    """The key a worker launched with these engine arguments and environment asks on /v1: its `api_key` (one or a
    list: the first), else VLLM_API_KEY, as vLLM picks them (`init_entrypoints_middleware`,
    vllm/entrypoints/serve/middleware/register.py: `args.api_key or [envs.VLLM_API_KEY]`)."""
    given = args.get("api_key")
    keys = [given] if isinstance(given, str) else list(given or [])
    return next((str(k) for k in (keys or [env.get("VLLM_API_KEY")]) if k), None)


class LaunchError(RuntimeError):
    """A worker did not come up; the message carries the end of its log."""


class LaunchRefused(LaunchError):
    """No launch was tried: no room for another worker now (`launcher.max_workers`, or no free port). Not a failed
    launch, so no reason to back off: room comes back when a worker is retired."""


@dataclass
class _Proc:
    popen: subprocess.Popen
    log_path: Path
    slot: int
    port: int
    ready: bool = False  # past start-up: its exit is `reap`'s to see (`_wait_ready` sees it before)


class LocalActuator:
    """Local vLLM server processes on consecutive ports, registered with `controller` when ready."""

    def __init__(self, spec: LauncherSpec, controller: "Controller") -> None:
        self.spec = spec
        self.controller = controller
        self.procs: dict[str, _Proc] = {}
        self._ids = itertools.count()
        self._slots: set[int] = set()
        self._flag_kinds: FlagKinds | None = None  # the workers' vLLM's parser, read once when needed
        self._flag_lock = asyncio.Lock()
        self.log_dir = Path(spec.log_dir) if spec.log_dir else Path(tempfile.mkdtemp(prefix="llmtwin-workers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def _slot(self, wid: str) -> int:
        """The lowest slot of `launcher.max_workers` that no worker of ours holds and whose port vLLM can bind: a port
        another process listens on is skipped (a warning names it), as vLLM would die there while the other answered
        its readiness probes. None free, or an address vLLM cannot bind at all: a LaunchError."""
        sp = self.spec
        taken: list[int] = []
        for s in range(sp.max_workers):
            if s in self._slots:
                continue
            err = bind_error(sp.host, sp.base_port + s)
            if err is not None and err.errno != errno.EADDRINUSE:  # no port of this host would do
                raise LaunchError(f"worker {wid}: cannot bind launcher.host {sp.host} port {sp.base_port + s}: "
                                  f"{err.strerror or err}")
            if err is not None:
                taken.append(sp.base_port + s)
                continue
            self._slots.add(s)
            if taken:
                log.warning("worker %s: port %s in use by another process; it takes port %d", wid,
                            ", ".join(map(str, taken)), sp.base_port + s)
            return s
        why = ([f"{', '.join(map(str, taken))} in use by other processes"] if taken else []) + (
            [f"{len(self._slots)} held by this launcher's workers"] if self._slots else [])
        raise LaunchRefused(f"worker {wid}: no free port in launcher.base_port {sp.base_port} to "
                            f"{sp.base_port + sp.max_workers - 1} ({'; '.join(why)})")

    async def flag_kinds(self, args: Mapping[str, Any], env: Mapping[str, str]) -> FlagKinds | None:
        """The workers' vLLM's flags (`FLAG_KINDS_SCRIPT` run by `launcher.python`, once), where the command line
        depends on them (a false or a list among `args`); vLLM 0.32's (`VLLM_FLAGS`) if that interpreter cannot
        tell."""
        if not needs_flag_kinds(args):
            return None
        async with self._flag_lock:
            if self._flag_kinds is None:
                self._flag_kinds = await self._read_flag_kinds(env)
        return self._flag_kinds

    async def _read_flag_kinds(self, env: Mapping[str, str]) -> FlagKinds:
        python = self._python()
        try:
            p = await asyncio.create_subprocess_exec(python, "-c", FLAG_KINDS_SCRIPT, stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.STDOUT, env=dict(env),
                                                     start_new_session=True)
        except OSError as e:
            why = str(e.strerror or e)
        else:
            try:
                out, _ = await asyncio.wait_for(p.communicate(), FLAG_KINDS_TIMEOUT_S)
                text = out.decode(errors="replace")
                kinds = parse_flag_kinds(text, f"the vLLM of {python}")
                if kinds is not None:
                    return kinds
                why = (text.strip().splitlines() or ["no output"])[-1]
            except asyncio.TimeoutError:
                why = f"no answer in {FLAG_KINDS_TIMEOUT_S} s"
            finally:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        log.warning("launcher: cannot read vLLM's flags with %s (%s); going by %s", python, why, VLLM_FLAGS.source)
        return VLLM_FLAGS

    def command(self, slot: int, engine_args: Mapping[str, Any],
                kinds: FlagKinds | None = None) -> tuple[list[str], str | None]:
        sp = self.spec
        args = dict(sp.engine_args)
        args.update(engine_args)
        kv_endpoint = None
        if sp.kv_events:
            kv_endpoint = f"tcp://127.0.0.1:{sp.kv_events_base_port + slot}"
            args["kv_events_config"] = kv_events_config(kv_endpoint)
        model = str(self.controller.cfg.resolve_path(sp.model)) if Path(
            self.controller.cfg.resolve_path(sp.model)).exists() else sp.model
        return server_command(self._python(), model, sp.host, sp.base_port + slot, args,
                              sp.served_model_name, kinds), kv_endpoint

    def _python(self) -> str:
        p = self.controller.cfg.resolve_path(self.spec.python)
        return str(p) if p.exists() else self.spec.python

    async def start(self, spec: LaunchSpec | None = None) -> str:
        spec = spec or LaunchSpec()
        sp = self.spec
        # the workers of ours alive (a crashed one was retired by `reap`, which freed its place)
        if len(self.procs) >= sp.max_workers:
            raise LaunchRefused(f"launcher.max_workers ({sp.max_workers}) reached")
        env = dict(os.environ)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.update(sp.env)
        env.update(spec.env)
        kinds = await self.flag_kinds({**sp.engine_args, **spec.engine_args}, env)
        if len(self.procs) >= sp.max_workers:  # others started while the flags were read
            raise LaunchRefused(f"launcher.max_workers ({sp.max_workers}) reached")
        wid = f"local-{next(self._ids)}"
        slot = self._slot(wid)
        try:
            cmd, kv_endpoint = self.command(slot, spec.engine_args, kinds)
        except ValueError as e:  # an engine argument vLLM's command line cannot say
            self._slots.discard(slot)
            raise LaunchError(f"worker {wid}: {e}") from None
        if sp.cpu_binds:
            env["VLLM_CPU_OMP_THREADS_BIND"] = sp.cpu_binds[slot % len(sp.cpu_binds)]
        log_path = self.log_dir / f"{wid}.log"
        args = {**sp.engine_args, **spec.engine_args}
        url = f"http://{sp.host}:{sp.base_port + slot}"
        worker = Worker(wid, url, state="starting", kv_events_endpoint=kv_endpoint, launch_args=args,
                        api_key=launch_api_key(args, env))
        worker.config = self.controller.launch_config(args)
        self.controller.add_worker(worker)  # binds the KV-event socket before the publisher connects
        try:
            popen = spawn(cmd, log_path, env, cwd=str(self.controller.cfg.resolve_path(".")))
        except OSError as e:  # the interpreter or the working folder is missing, not executable, ...
            self._slots.discard(slot)
            self.controller.retire(wid)
            raise LaunchError(f"worker {wid}: cannot start {cmd[0]} (launcher.python): {e.strerror or e}") from None
        proc = self.procs[wid] = _Proc(popen, log_path, slot, sp.base_port + slot)
        worker.handle = proc
        self.controller.metrics.scale_events.labels("start").inc()
        log.info("worker %s: starting on %s (pid %d, log %s)", wid, url, popen.pid, log_path)
        try:
            await self._wait_ready(worker, proc)
        except BaseException:
            await self.stop(wid)
            raise
        proc.ready = True
        return wid

    async def _wait_ready(self, worker: Worker, proc: _Proc) -> None:
        """Until one tiny completion succeeds on the worker's port, while its own process group listens there
        (before that, an answer there is another server's); a LaunchError with its log's end if it exits first or
        `launcher.ready_timeout_s` passes."""
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while True:
            if proc.popen.poll() is not None:
                raise LaunchError(f"worker {worker.id} exited with {proc.popen.returncode} while starting:\n"
                                  f"{tail(proc.log_path)}")
            if time.monotonic() > deadline:
                raise LaunchError(f"worker {worker.id} not ready after {self.spec.ready_timeout_s:.0f} s:\n"
                                  f"{tail(proc.log_path)}")
            if group_listens(proc.popen.pid, proc.port) is not False and await self.controller.try_ready(worker):
                return
            await asyncio.sleep(0.5)

    async def reap(self) -> list[str]:
        """Retire the workers whose process exited after start-up (vLLM's API server ends when its EngineCore
        dies): the rest of its process group is killed, its slot and port are freed and it leaves the registry, so
        it no longer counts toward `launcher.max_workers` and the scaler can start a replacement. Its requests in
        flight have failed already, as they do on any worker that dies. Returns their ids."""
        gone = [(wid, p) for wid, p in self.procs.items() if p.ready and p.popen.poll() is not None]
        for wid, p in gone:
            log.error("worker %s: its process exited with %s; retired (port %d free again). Its log ends:\n%s", wid,
                      p.popen.returncode, p.port, tail(p.log_path))
            self.controller.metrics.scale_events.labels("exited").inc()
            await self.stop(wid)
        return [wid for wid, _ in gone]

    async def drain(self, worker_id: str) -> None:
        await self.controller.drain(worker_id)
        self.controller.metrics.scale_events.labels("drain").inc()
        await self.stop(worker_id)

    async def stop(self, worker_id: str) -> None:
        proc = self.procs.pop(worker_id, None)
        if proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, stop_group, proc.popen,
                                                             self.spec.stop_timeout_s)
            self._slots.discard(proc.slot)
            self.controller.metrics.scale_events.labels("stop").inc()
            log.info("worker %s: stopped (exit %s)", worker_id, proc.popen.returncode)
        self.controller.retire(worker_id)

    async def close(self) -> None:
        for wid in list(self.procs):
            await self.stop(wid)
