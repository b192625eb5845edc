"""The step replay (twin.perf.replay, twin.lab.steps): given a server's own step durations, the twin's request
times follow the server's whatever its speed did, and the step log's lines become the right frames."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from twin.errors import TwinInputError
from twin.lab.calibrate import Observation, Profile, twin_scenario
from twin.lab.steps import (STEP_COLS, batch_of, describe_live, engine_entry, engine_frames, fit_steps, live_fidelity,
                            machine_drift, read_step_log, replay_observation, scheduling_rows, step_time_rows)
from twin.perf.base import StepBatch
from twin.perf.fitted import FittedModel
from twin.perf.registry import roofline
from twin.perf.replay import RecordedStep, ReplayStepModel

META = {"engine": {"block_size": 128, "max_num_batched_tokens": 2048, "max_num_seqs": 16, "max_model_len": 512,
                   "num_gpu_blocks": 256}, "twin": {"hardware": "CPU-2core-AVX512", "model": "tiny-llama"}}
PARAMS = {"linear": 2.0, "attn": 3.0, "step_s": 0.0015, "per_request_s": 5e-5}
ZERO_API = {"api_request_overhead_s": 0.0, "api_prompt_token_s": 0.0, "api_output_token_s": 0.0, "api_handoff_s": 0.0}


class Machine:
    """A server whose speed moves step by step (a loaded machine: each step 0.5x to 3x the model's), recording
    what the plugin would: every step's batch and duration."""

    def __init__(self, model, seed: int = 0) -> None:
        self.model = model
        self.rng = np.random.default_rng(seed)
        self.steps: list[tuple[StepBatch, float, float]] = []
        self.env = None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def step_time(self, b: StepBatch) -> float:
        d = self.model.step_time(b) * float(self.rng.uniform(0.5, 3.0))
        self.steps.append((StepBatch(**{c: getattr(b, c) for c in STEP_COLS}), d, self.env.now))
        return d


def load(seed: int = 4):
    """Poisson arrivals near saturation with mixed lengths: queueing, chunked mixed steps, many batch shapes."""
    rng = np.random.default_rng(seed)
    n = 50
    return np.cumsum(rng.exponential(0.02, n)), rng.integers(8, 400, n), rng.integers(4, 64, n)


def serve(tmp_path, model_factor: float = 1.0, seed: int = 0):
    """Run the 'server' (the twin on a moving machine) and write what `twin observe` keeps of its steps."""
    from twin.lab.calibrate import observed_stream
    from twin.sim.cluster import Cluster

    arr, p, o = load()
    req = pd.DataFrame({"request_id": np.arange(len(arr)), "arrival_s": arr, "first_token_s": np.nan,
                        "finish_s": np.nan, "prompt_tokens": p, "max_tokens": o, "output_tokens": o,
                        "status": "finished"})
    obs = Observation(tmp_path, req, None, META)
    sc = twin_scenario(META, ZERO_API, 1).model_copy(deep=True)
    sc.sim.mode = "step"
    sc.cluster.perf.api_queue = "off"
    prof = Profile.from_params({**PARAMS, **ZERO_API})
    m = Machine(FittedModel(roofline(sc), prof.coefficients), seed)
    stream, _ = observed_stream(obs)
    cl = Cluster(sc, stream, perf=m)
    m.env = cl.env
    for inst in cl.instances:
        inst.perf = inst.scheduler.perf = m
    log = cl.run().log.to_frame()
    steps = pd.DataFrame([{"step": k, "start_s": t, "replay_start_s": t, "end_s": t + d, "duration_s": d,
                           **{c: getattr(b, c) for c in STEP_COLS}} for k, (b, d, t) in enumerate(m.steps)])
    er = pd.DataFrame({"request_id": np.arange(len(arr)), "queued_s": log["arrival_s"], "prompt_tokens": p,
                       "first_token_s": log["first_token_s"], "finish_s": log["finish_s"], "output_tokens": o})
    obs.requests = obs.requests.assign(first_token_s=log["first_token_s"].to_numpy(),
                                       finish_s=log["finish_s"].to_numpy())
    steps.to_parquet(tmp_path / "steps.parquet")
    er.to_parquet(tmp_path / "engine_requests.parquet")
    return obs, prof, steps


@pytest.mark.parametrize("match", ["composition", "order"])
def test_replay_follows_a_moving_machine_exactly(tmp_path, match):
    obs, prof, steps = serve(tmp_path)
    rep = replay_observation(obs, prof, match=match)
    r = rep.requests
    assert r["finished"].all() and len(r) == 50
    assert np.allclose(r["ttft_s"], r["real_ttft_s"], rtol=1e-9, atol=1e-8)
    assert np.allclose(r["e2e_s"], r["real_e2e_s"], rtol=1e-9, atol=1e-8)
    assert rep.stats["agreement"] == 1.0 and rep.stats["twin_steps"] == len(steps)
    rows = {x["metric"]: x for x in scheduling_rows("s", rep)}
    assert rows["e2e"]["mean_ape_pct"] < 1e-4 and rows["ttft"]["per_request_mape_pct"] < 1e-4


def test_the_model_alone_misses_the_moving_machine(tmp_path):
    """The same twin with the step model instead of the recording: the machine's swings show as error, which
    is why the replay's figure is the scheduling one and the model's is reported with the drift."""
    obs, prof, steps = serve(tmp_path)
    base = FittedModel(roofline(twin_scenario(META)), prof.coefficients)
    row = step_time_rows("s", steps, base, "true coefficients")
    assert row["step_mape_pct"] > 20 and row["median_ratio"] > 1.2  # uniform(0.5, 3): median 1.75
    fitted, _ = fit_steps(steps, prof, META)
    again = step_time_rows("s", steps, fitted, "step fit")
    assert abs(again["total_ape_pct"]) < row["total_ape_pct"]
    slower = steps.assign(duration_s=steps["duration_s"] * 1.1)  # the same steps on a machine 10 % slower
    drift = machine_drift({"calibration": steps, "later": slower, "same": steps})
    assert drift["per_slice_pct"]["later"] == pytest.approx(10.0) and drift["per_slice_pct"]["same"] == 0.0
    assert drift["matched_steps"]["later"] > 50 and drift["max_abs_pct"] == pytest.approx(10.0)


def test_composition_matching_survives_a_diverging_schedule(tmp_path):
    """Recorded steps shifted by one (the twin admitted a request a step later): order matching gives steps
    their neighbour's duration whatever its shape; composition matching gives each a step of its own shape
    from the same moment (the step itself, or its same-shaped neighbour)."""
    from twin.perf.replay import shape

    obs, prof, steps = serve(tmp_path)
    rec = [RecordedStep(StepBatch(**{c: r[c] for c in STEP_COLS}), r["duration_s"]) for r in steps.to_dict("records")]
    base = FittedModel(roofline(twin_scenario(META)), prof.coefficients)
    shifted = [RecordedStep(StepBatch(num_decode_tokens=1, decode_context_tokens=10), 0.5)] + rec
    by_comp, by_order = ReplayStepModel(shifted, base), ReplayStepModel(shifted, base, match="order")
    for k, s in enumerate(rec):
        d = by_comp.step_time(s.batch)
        near = [x.duration_s for x in shifted[max(0, k - 1): k + 3] if shape(x.batch) == shape(s.batch)]
        assert d in near, k
        by_order.step_time(s.batch)
    assert by_comp.stats()["agreement"] == 1.0
    assert by_order.stats()["mismatched"] > 0.2 * len(rec) and by_order.stats()["agreement"] < 0.8
    odd = StepBatch(num_prefill_tokens=777, prefill_attn_tokens=777 * 778 / 2, prefill_kv_read_tokens=777,
                    num_prefill_sampled=1, num_prefill_reqs=1)
    assert by_comp.step_time(odd) > 0 and by_comp.stats()["scaled"] >= 1


def test_bad_input_is_one_line():
    base = FittedModel(roofline(twin_scenario(META)), Profile.from_params({**PARAMS, **ZERO_API}).coefficients)
    with pytest.raises(TwinInputError, match="match must be"):
        ReplayStepModel([RecordedStep(StepBatch(num_decode_tokens=1), 0.01)], base, match="nearest")
    with pytest.raises(TwinInputError, match="no recorded steps"):
        ReplayStepModel([], base)


def test_step_log_lines_become_frames(tmp_path):
    """The plugin's lines: a busy step lasts to the next step's start, the last before idle to its own end;
    a decode is one token past the prompt, a chunk anything else; requests are named by the load's tag."""
    a, b = "cmpl-ltab12-0-0-deadbeef", "cmpl-ltab12-1-0-cafef00d"
    lines = [{"add": a, "t": 100.0, "p": 3}, {"add": "cmpl-other-0-0-x", "t": 100.0, "p": 5},
             {"t0": 100.001, "t1": 100.011, "el": 9.0, "r": [[a, 3, 0, 3, 3]], "o": [[a, 1, 0]]},
             {"add": b, "t": 100.0115, "p": 130},
             {"t0": 100.012, "t1": 100.020, "el": None, "r": [[a, 1, 3, 3, 4], [b, 128, 0, 130, 130]],
              "o": [[a, 1, 1]]},
             {"t0": 100.021, "t1": 100.024, "el": None, "r": [[b, 2, 128, 130, 130]], "o": [[b, 1, 1]]}]
    p = tmp_path / "steps.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"t0": 1')  # a line still being written
    got, off = read_step_log(p)
    assert got == lines and off < p.stat().st_size
    st, er = engine_frames(got, 100.0, "ab12")
    # periods: the first from the waking entry, then from the previous step's end
    assert st["duration_s"].tolist() == pytest.approx([0.011, 0.009, 0.004])
    assert st["busy_after"].tolist() == [True, True, False]
    assert st.loc[1, "num_decode_tokens"] == 1 and st.loc[1, "decode_context_tokens"] == 4
    assert st.loc[1, "num_prefill_tokens"] == 128 and st.loc[1, "num_prefill_sampled"] == 0
    assert st.loc[2, "num_prefill_sampled"] == 1 and st.loc[2, "num_decode_tokens"] == 0
    assert er["request_id"].tolist() == [0, 1]
    # b was stamped in the loop's gap before step 1: it enters the twin where step 1's period began
    assert engine_entry(st, er["queued_s"].to_numpy()) == pytest.approx([0.0, 0.011], abs=1e-8)
    assert er["first_token_s"].tolist() == pytest.approx([0.011, 0.024])
    assert er["finish_s"].tolist() == pytest.approx([0.020, 0.024])
    assert batch_of([[a, 5, 0, 5, 5]]).prefill_attn_tokens == 15
    with pytest.raises(TwinInputError, match="not JSON"):
        (tmp_path / "bad.jsonl").write_text("nope\n")
        read_step_log(tmp_path / "bad.jsonl")


def test_live_fidelity_splits_the_error(tmp_path):
    """Two loads on the moving machine: the scheduling figure is exact, the step model's is not, and on the
    client side (no API server here) the measured steps remove what the model got wrong."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    obs_a, prof, _ = serve(tmp_path / "a", seed=1)
    obs_b, _, _ = serve(tmp_path / "b", seed=2)
    s = live_fidelity({"calibration": obs_a, "later": obs_b}, prof, tmp_path)
    assert max(s["scheduling"]["max_mean_ape_pct"].values()) < 1e-4
    assert s["step_time"]["held_out_step_mape_pct"]["calibrated"] > 20
    c = s["client"]["held_out_mean_ape_pct"]
    assert c["measured steps e2e"] < 1e-3 < c["calibrated model e2e"]
    assert (tmp_path / "live_fidelity.json").is_file() and len(describe_live(s)) == 5


def test_the_plugin_is_found_by_its_entry_point(tmp_path):
    """vLLM finds plugins by entry point (vllm/plugins/__init__.py: load_plugins_by_group): with the folder on
    the path, `vllm.general_plugins` names ours, and without LLMTWIN_STEP_LOG it wraps nothing."""
    import importlib.metadata as md
    import subprocess
    import sys

    from live.vllm_server import PLUGIN_DIR, step_log_env

    env = step_log_env({"PYTHONPATH": "/x", "VLLM_PLUGINS": "other"}, tmp_path / "s.jsonl")
    assert env["PYTHONPATH"].split(":")[0] == str(PLUGIN_DIR) and env["LLMTWIN_STEP_LOG"].endswith("s.jsonl")
    assert env["VLLM_PLUGINS"] == "other,llmtwin_steplog"
    code = ("import importlib.metadata as md; e = [p for p in md.entry_points(group='vllm.general_plugins') "
            "if p.name == 'llmtwin_steplog']; print(e[0].value); e[0].load()()")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(PLUGIN_DIR), "PATH": "/usr/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "llmtwin_steplog:register"
    # and nowhere else: vLLM run inside the project's own processes (the parity harness) is never wrapped
    assert not any(p.name == "llmtwin_steplog" for p in md.entry_points(group="vllm.general_plugins"))
