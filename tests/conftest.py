"""Shared helpers: small scenarios built in code, and a run that checks the always-true invariants."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from twin.sim.cluster import Cluster, account
from twin.scenario import parse_scenario
from twin.workload import RequestStream

BASE = {
    "name": "test",
    "seed": 1,
    "cluster": {"num_instances": 1, "hardware": "H100", "model": "Llama-3-8B",
                # the synchronous engine loop: exact timings in engine-level tests (tests/test_async.py covers
                # async scheduling, vLLM's GPU default)
                "engine": {"block_size": 16, "max_num_batched_tokens": 2048, "max_num_seqs": 64,
                           "async_scheduling": False},
                # engine-level tests: no API-server time (tests/test_api_time.py covers it), and the roofline,
                # whose step times they derive by hand (the H100 default is the fitted profile: test_h100_profile.py)
                "perf": {"kind": "roofline", "api_request_overhead_s": 0.0, "api_prompt_token_s": 0.0, "api_output_token_s": 0.0}},
    "workload": {"num_requests": 10, "arrival": {"process": "poisson", "rate": 5},
                 "lengths": {"kind": "fixed", "prompt_tokens": 100, "output_tokens": 20}},
}


def make_scenario(**overrides):
    """BASE with dotted-path overrides, e.g. make_scenario(**{"cluster.num_instances": 2})."""
    raw = copy.deepcopy(BASE)
    for path, value in overrides.items():
        node = raw
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return parse_scenario(raw, "test")


def kv_blocks(n: int, block_size: int = 16, model_len: int = 8192) -> dict:
    """A KV pool of `n` blocks, with max_model_len no longer than vLLM starts with on it (all but its null block:
    `twin.engine.config._check_one_request_fits`); BASE's model, Llama-3-8B, is 8,192 long: 513 blocks."""
    return {"cluster.engine.num_gpu_blocks_override": n,
            "cluster.engine.max_model_len": min((n - 1) * block_size, model_len)}


def stream_of(arrivals, prompts, outputs, hash_ids=None, **kw) -> RequestStream:
    return RequestStream(np.asarray(arrivals, float), np.asarray(prompts), np.asarray(outputs), hash_ids, **kw)


def run_checked(sc, stream, router=None):
    """Run and assert what must hold after any complete run: nothing lost, no leaked blocks."""
    cl = Cluster(sc, stream, router)
    res = cl.run()
    log = res.log
    counts = account(log)
    assert sum(counts.values()) == len(stream)
    if sc.sim.max_sim_time_s is None:
        assert counts["finished"] + counts["rejected"] == len(stream), counts
        for inst in res.instances:
            pool = inst.pool
            pool.check()
            assert pool.get_num_free_blocks() == pool.num_usable_blocks, inst.id
            assert pool.all_unreferenced()
            assert inst.scheduler.num_decode == 0 and not inst.scheduler.running
    fin = log.status == 4
    assert np.all(log.arrival_s[fin] <= log.scheduled_s[fin])
    assert np.all(log.scheduled_s[fin] < log.first_token_s[fin])
    assert np.all(log.first_token_s[fin] <= log.finish_s[fin])
    assert np.all(log.output_tokens[fin] == log.max_tokens[fin])
    return res


@pytest.fixture
def scenario():
    return make_scenario()
