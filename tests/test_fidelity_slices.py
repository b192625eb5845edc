"""The fidelity harness's slices and fit safeguards, without a real server (tests_vllm/ runs them for real)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from twin.lab.calibrate import Observation, Profile, api_gap, fit_schedule, router_block, simulate_observation
from twin.errors import TwinInputError
from twin.lab.fidelity import slice_load, slices
from twin.lab.observe import Load, _drive, block_ids, bursty_load, session_load

from test_calibrate import META, TRUE, deterministic_load, synthetic

SG = "traces/sharegpt_lengths.sample.csv"


def test_session_turns_wait_for_their_predecessor_and_carry_it():
    lo = session_load(SG, sessions=30, max_model_len=512, seed=5)
    later = np.flatnonzero(lo.after >= 0)
    assert len(later) > 10, "sessions must have later turns (prefix reuse)"
    for i in later:
        j = lo.after[i]
        assert j < i and lo.session[j] == lo.session[i]
        # the previous prompt, the previous answer, then the new message
        assert lo.prompt_tokens[i] == lo.prompt_tokens[j] + lo.output_tokens[j] + lo.new_tokens[i]
    assert np.all(lo.prompt_tokens + lo.output_tokens < 512)
    assert [len(p) for p in lo.prompts(4096)] == np.where(lo.after >= 0, lo.new_tokens, lo.prompt_tokens).tolist()
    with pytest.raises(TwinInputError, match="after the turn"):
        Load("bad", [0, 1], [4, 4], [2, 2], after=[1, -1], think_s=[0, 0], new_tokens=[4, 4])


def test_bursty_slice_keeps_the_trace_lengths_and_has_the_asked_burstiness():
    lo = bursty_load("traces/azure_conv.sample.csv", 800, 0, rate=8.0, cv=4.0, max_model_len=512)
    gaps = np.diff(lo.arrival_s)
    cv = gaps.std() / gaps.mean()
    assert 2.5 < cv < 6.0 and 4.0 < 1 / gaps.mean() < 16.0
    assert np.all(lo.prompt_tokens + lo.output_tokens < 512)
    names = [s.name for s in slices("short", __import__("pathlib").Path("."))]
    assert {"azure-conv", "azure-code", "bursty", "sharegpt-sessions"} <= set(names)


def _fake_server(seen: list):
    """An OpenAI-like streaming endpoint that answers token ids (`return_token_ids`), recording each prompt."""

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        n = int([h for h in head.decode().split("\r\n") if h.lower().startswith("content-length")][0].split(":")[1])
        body = json.loads(await reader.readexactly(n))
        seen.append(body)
        out = [1000 + len(body["prompt"]) + k for k in range(body["max_tokens"])]
        chunks = [{"choices": [{"text": "x", "token_ids": [t]}]} for t in out]
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                "completion_tokens": len(out)}})
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(data)
                     + data)
        await writer.drain()
        writer.close()

    return handle


def test_session_turn_is_sent_with_the_servers_own_answer():
    seen: list = []
    lo = Load("s", [0.0, 0.0, 0.01], [5, 12, 3], [4, 2, 2], after=[-1, 0, -1], think_s=[0.0, 0.01, 0.0],
              new_tokens=[5, 3, 3], session=[0, 0, 1])

    async def run():
        srv = await asyncio.start_server(_fake_server(seen), "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        async with srv:
            return await _drive([f"http://127.0.0.1:{port}"], lo, "m", 4096, 30.0)

    recs = asyncio.run(run())
    assert all(not r.error for r in recs), [r.error for r in recs]
    first = next(b for b in seen if len(b["prompt"]) == 5)
    second = next(b for b in seen if len(b["prompt"]) == 12)
    assert second["prompt"][:5] == first["prompt"]
    assert second["prompt"][5:9] == recs[0].output_ids == [1005, 1006, 1007, 1008]
    assert recs[1].sent >= recs[0].tokens[-1]  # closed loop: after the answer ended
    ids = block_ids(recs[1].prompt + recs[1].output_ids, 4)
    assert ids[0] == block_ids(first["prompt"], 4)[0] and len(ids) == 4


def test_twin_hits_the_prefix_a_session_carries_and_nothing_without_ids():
    lo = session_load(SG, sessions=10, max_model_len=512, seed=5)
    rng = np.random.default_rng(0)
    toks, hashes = [], {}
    for i in range(len(lo)):
        j = lo.after[i]
        prompt = (toks[j] if j >= 0 else []) + rng.integers(16, 4096, lo.new_tokens[i] if j >= 0 else
                                                            lo.prompt_tokens[i]).tolist()
        if j >= 0:
            prompt = toks[j] + prompt[len(toks[j]):]
        full = prompt + rng.integers(16, 4096, lo.output_tokens[i]).tolist()
        toks.append(full)
        hashes[str(i)] = block_ids(full)
    meta = {**META, "hash_ids": hashes, "hash_block_size": 16, "hashes_cover_output": True,
            "session": lo.session.tolist()}
    arr = np.arange(len(lo)) * 2.0  # far apart: each turn after the previous one finished
    prompts = np.array([len(t) for t in toks]) - lo.output_tokens
    import pandas as pd

    req = pd.DataFrame({"request_id": np.arange(len(lo)), "arrival_s": arr, "first_token_s": arr + 0.1,
                        "finish_s": arr + 0.5, "prompt_tokens": prompts, "max_tokens": lo.output_tokens,
                        "output_tokens": lo.output_tokens, "status": "finished"})
    sim = simulate_observation(Observation(None, req, None, meta), Profile.from_params(TRUE))
    cached = sim.requests["cached_tokens"].to_numpy()
    later = lo.after >= 0
    expect = np.array([(prompts[lo.after[i]] + lo.output_tokens[lo.after[i]]) // 128 * 128 if later[i] else 0
                       for i in range(len(lo))])
    assert np.all(cached[~later] == 0) and cached[later].sum() > 0
    assert np.all(cached <= np.minimum(expect, (prompts - 1) // 128 * 128 + 128))
    none = simulate_observation(Observation(None, req, None, META), Profile.from_params(TRUE))
    assert (none.requests["cached_tokens"] == 0).all()


def with_histograms(obs: Observation, server_ttft_mean: float) -> Observation:
    n = len(obs.requests)
    obs.meta = {**obs.meta, "server": {"histogram_deltas": [{"vllm:time_to_first_token_seconds_count": float(n),
                                                             "vllm:time_to_first_token_seconds_sum":
                                                                 server_ttft_mean * n}]}}
    return obs


def twin_api_share(obs: Observation, prof: Profile) -> float:
    """The twin's mean client TTFT minus its server's own (vLLM's TTFT histogram: from the request's arrival at
    the engine's input processor, after the API server's queue, to its first token there)."""
    sim = simulate_observation(obs, prof)
    s = sim.requests
    client = float((s["first_token_s"] - s["arrival_s"]).mean())
    engine_first = s["first_token_s"].to_numpy() - prof.api["api_output_token_s"] - sim.first_token_wait_s
    return client - float(np.mean(engine_first - sim.entry_s))


def test_the_servers_own_ttft_pins_the_api_share():
    truth = Profile.from_params(TRUE)
    obs = synthetic(truth, *deterministic_load())
    f = obs.requests
    client = float((f["first_token_s"] - f["arrival_s"]).mean())
    api = twin_api_share(obs, truth)  # bursts queue in the API server: more than one request's work
    one = TRUE["api_request_overhead_s"] + TRUE["api_prompt_token_s"] * f["prompt_tokens"].mean() + \
        TRUE["api_output_token_s"]
    assert api > 1.5 * one
    with_histograms(obs, client - api)
    gap, p_mean = api_gap(obs)
    assert gap == pytest.approx(api, rel=1e-6) and p_mean == pytest.approx(f["prompt_tokens"].mean())
    got = fit_schedule([obs]).profile.params()  # the data-driven start takes the gap too
    assert twin_api_share(obs, Profile.from_params(got)) == pytest.approx(api, rel=0.1)
    assert got["step_s"] == pytest.approx(TRUE["step_s"], rel=0.1)
    # histograms of another load (counts that do not match) are not used
    obs.meta["server"]["histogram_deltas"][0]["vllm:time_to_first_token_seconds_count"] = 3 * len(f)
    assert api_gap(obs) is None


def test_fit_keeps_the_roofline_floor_and_shrugs_off_stalled_requests():
    truth = dict(TRUE, linear=1.0, attn=1.0)
    obs = synthetic(Profile.from_params(truth), *deterministic_load())
    # a few requests the client saw stalled: all their tokens delivered 0.4 s late, at once
    stalled = obs.requests.index[[3, 9, 20]]
    obs.requests.loc[stalled, "first_token_s"] = obs.requests.loc[stalled, "finish_s"] + 0.4
    obs.requests.loc[stalled, "finish_s"] += 0.4
    fit = fit_schedule([obs], init=dict(truth, linear=0.3, attn=0.3))
    got = fit.profile.params()
    assert got["linear"] >= 1.0 and got["attn"] >= 1.0  # never faster than the hardware's floor
    assert got["step_s"] == pytest.approx(truth["step_s"], rel=0.15)
    assert got["per_request_s"] < 5 * truth["per_request_s"] + 1e-5


def test_router_block_and_slice_kinds():
    assert router_block("cache-aware", {"cache_threshold": 0.5}) == {
        "name": "cache-aware", "params": {"cache_threshold": 0.5}, "scrape_interval_s": 0.0}
    from twin.lab.fidelity import SliceSpec

    with pytest.raises(TwinInputError, match="unknown kind"):
        slice_load(SliceSpec("x", "nope", SG, 3), 512)


def test_the_start_takes_the_measured_api_gap():
    from twin.lab.calibrate import initial_params

    obs = with_histograms(synthetic(Profile.from_params(TRUE), *deterministic_load()), 0.0)
    f = obs.requests
    client = float((f["first_token_s"] - f["arrival_s"]).mean())
    obs.meta["server"]["histogram_deltas"][0]["vllm:time_to_first_token_seconds_sum"] = (client - 0.01) * len(f)
    p = initial_params([obs])
    total = p["api_request_overhead_s"] + p["api_handoff_s"] + p["api_output_token_s"]
    assert total == pytest.approx(0.01, rel=0.05)


def test_cli_fidelity_router_bad_input(tmp_path):
    from typer.testing import CliRunner

    from twin.cli import app

    r = CliRunner().invoke(app, ["fidelity", "--workers", "2", "--router", "nope", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "unknown router" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["fidelity", "--router", "round-robin", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--workers 2" in r.output
    r = CliRunner().invoke(app, ["fidelity", "--reuse", "--out", str(tmp_path / "none")])
    assert r.exit_code == 2 and "--reuse" in r.output


def test_the_servers_own_itl_pins_the_engine_speed_when_the_client_saw_bursts():
    from twin.lab.calibrate import server_itl

    obs = synthetic(Profile.from_params(TRUE), *deterministic_load())
    f = obs.requests
    n_itl = float((f["output_tokens"] - 1).sum())
    true_itl = float((f["finish_s"] - f["first_token_s"]).sum()) / n_itl
    obs.meta = {**obs.meta, "server": {"histogram_deltas": [{"vllm:inter_token_latency_seconds_count": n_itl,
                                                             "vllm:inter_token_latency_seconds_sum": true_itl * n_itl}]}}
    assert server_itl(obs) == pytest.approx(true_itl)
    # the client saw a third of the requests' tokens arrive all at once, late (a starved API server)
    burst = obs.requests.index[::3]
    obs.requests.loc[burst, "first_token_s"] = obs.requests.loc[burst, "finish_s"] + 0.05
    obs.requests.loc[burst, "finish_s"] += 0.0501
    got = fit_schedule([obs]).profile.params()
    assert got["step_s"] == pytest.approx(TRUE["step_s"], rel=0.25)
    obs.meta["server"]["histogram_deltas"][0]["vllm:inter_token_latency_seconds_count"] = 2 * n_itl
    assert server_itl(obs) is None  # another load's counts: not used


def test_the_api_share_is_what_the_engine_did_not_spend(tmp_path):
    """With vLLM's queue and prefill histograms (EngineCore's stamps), the API share is the client's TTFT
    minus the engine's part, read from the saved /metrics scrapes."""
    obs = synthetic(Profile.from_params(TRUE), *deterministic_load())
    f = obs.requests
    n = len(f)
    client = float((f["first_token_s"] - f["arrival_s"]).mean())

    def prom(ttft, queue, prefill, count):
        lines = []
        for name, v in (("time_to_first_token", ttft), ("request_queue_time", queue),
                        ("request_prefill_time", prefill)):
            lines += [f'vllm:{name}_seconds_sum{{engine="0"}} {v * n}', f'vllm:{name}_seconds_count{{engine="0"}} {count}']
        return "\n".join(lines) + "\n"

    (tmp_path / "metrics_before.prom").write_text(prom(0, 0, 0, 0))
    (tmp_path / "metrics_after.prom").write_text(prom(client - 0.004, 0.001, 0.010, n))
    obs.path = tmp_path
    obs.meta = {**obs.meta, "server": {"histogram_deltas": [{}]}}
    gap, _ = api_gap(obs)
    assert gap == pytest.approx(client - 0.011)


def test_speed_probes_tell_a_steady_machine_from_one_that_slowed(tmp_path):
    """The same probe before every load: a server that got 30 % slower mid-run is flagged, a steady one is not."""
    import pandas as pd

    from twin.lab.fidelity import DRIFT_LIMIT_PCT, probe_drift, probe_load

    load = probe_load(512)
    slow = dict(TRUE, linear=TRUE["linear"] * 1.3, attn=TRUE["attn"] * 1.3, step_s=TRUE["step_s"] * 1.3,
                per_request_s=TRUE["per_request_s"] * 1.3)

    def probe_dir(name, params):
        obs = synthetic(Profile.from_params(params), load.arrival_s, load.prompt_tokens, load.output_tokens)
        d = tmp_path / name
        d.mkdir()
        pd.DataFrame(obs.requests).to_parquet(d / "requests.parquet", index=False)
        (d / "observe.json").write_text(json.dumps(META))
        return d

    a, b, c = probe_dir("00-before-calibration", TRUE), probe_dir("01-before-x", TRUE), probe_dir("02-after-x", slow)
    steady = probe_drift([a, b])
    assert steady["steady"] and steady["max_drift_pct"] < 1e-6
    assert steady["probes"][0]["requests"] == len(load) and steady["probes"][0]["burst_tpot_ms"] > steady["probes"][0]["tpot_ms"]
    drifted = probe_drift([a, b, c])
    assert not drifted["steady"] and drifted["max_drift_pct"] > DRIFT_LIMIT_PCT
    assert drifted["probes"][2]["drift_tpot_pct"] == pytest.approx(30, abs=6)


def test_a_probe_sent_late_still_tells_its_isolated_requests_from_its_burst(tmp_path):
    """A loaded client sends the first probe request late: its burst is still the burst (CI once saw none)."""
    import pandas as pd

    from twin.lab.fidelity import PROBE_ALONE, probe_load, probe_speed

    load = probe_load(512)
    obs = synthetic(Profile.from_params(TRUE), load.arrival_s, load.prompt_tokens, load.output_tokens)
    on_time = probe_speed(obs)
    late = pd.DataFrame(obs.requests).copy()
    shift = 0.6  # the first send this late put every request within 3 s of it, so the old rule saw no burst
    late.loc[0, ["arrival_s", "first_token_s", "finish_s"]] += shift
    obs.requests = late
    sp = probe_speed(obs)
    assert sp["requests"] == len(load) and sp["failed"] == 0 and sp["unresolved"] == 0
    assert sp["burst_tpot_ms"] == pytest.approx(on_time["burst_tpot_ms"])
    assert sp["tpot_ms"] == pytest.approx(on_time["tpot_ms"]) and PROBE_ALONE == 8


def test_a_probe_answer_read_in_one_piece_has_no_cadence_rather_than_a_zero_one(tmp_path):
    """Through the controller on 2 cores a whole answer sometimes reaches the client in one read (first token
    and last at the same instant): that request is unresolved, not a decode time of 0 that halves the median."""
    import pandas as pd

    from twin.lab.fidelity import probe_load, probe_speed

    load = probe_load(512)
    obs = synthetic(Profile.from_params(TRUE), load.arrival_s, load.prompt_tokens, load.output_tokens)
    req = pd.DataFrame(obs.requests).copy()
    tpot = (req.finish_s - req.first_token_s) / (req.output_tokens - 1)
    lumped = [2, 9, 10, 11, 12, 13]  # one isolated request, five of the burst of 8
    req.loc[lumped, "first_token_s"] = req.loc[lumped, "finish_s"]
    obs.requests = req
    sp = probe_speed(obs)
    assert sp["unresolved"] == len(lumped) and sp["requests"] == len(load)
    keep = [i for i in range(8, 16) if i not in lumped]
    assert sp["burst_tpot_ms"] == pytest.approx(float(np.median(tpot[keep])) * 1e3)
    assert sp["tpot_ms"] == pytest.approx(float(np.median(tpot[[i for i in range(8) if i not in lumped]])) * 1e3)
