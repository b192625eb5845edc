"""The twin's scheduler decides every step as vLLM 0.32's real scheduler does, in step and fast mode."""

from __future__ import annotations

import pytest

from twin.lab.parity import WORKLOADS, first_divergence, run_twin, run_vllm, vllm_engine

NAMED = [n for n in WORKLOADS if n != "random"]  # "random-priority" too: the random mixes under the priority policy
NAMED_SEEDS = range(3)
RANDOM_SEEDS = [*range(60), 267]  # 267: two requests finish in one step (the free order, issue #20)
PRIORITY_SEEDS = range(3, 30)  # beyond NAMED_SEEDS


def check(wl, model_dir):
    ref = run_vllm(wl, model_dir=model_dir)
    assert not ref.error, ref.error
    assert ref.finish and len(ref.finish) == len(wl.requests)  # every request ran to its end in vLLM
    for mode in ("step", "fast"):
        d = first_divergence(ref, run_twin(wl, mode))
        assert d is None, f"{wl.name}, {mode} mode:\n{d}"
    return ref


def test_the_cpu_build_schedules_synchronously(tiny_llama_dir):
    _, _, vcfg = vllm_engine(WORKLOADS["plain"](0), tiny_llama_dir)
    assert not vcfg.scheduler_config.async_scheduling


@pytest.mark.parametrize("seed", NAMED_SEEDS)
@pytest.mark.parametrize("name", NAMED)
def test_named_workload(name, seed, tiny_llama_dir):
    ref = check(WORKLOADS[name](seed), tiny_llama_dir)
    if name == "preemption":
        assert any(pre for _, pre in ref.steps)
    if name in ("shared-prefix", "multi-turn", "streaming-turns"):
        assert sum(ref.cached.values()) > 0
    if name == "two-finishers":  # A and B finish in one step, B having joined the decodes first; D hits
        assert ref.finish[0] == ref.finish[1] and ref.first_token[1] < ref.first_token[0]
        assert ref.cached[3] > 0


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_mix(seed, tiny_llama_dir):
    check(WORKLOADS["random"](seed), tiny_llama_dir)


@pytest.mark.parametrize("seed", PRIORITY_SEEDS)
def test_random_mix_under_the_priority_policy(seed, tiny_llama_dir):
    check(WORKLOADS["random-priority"](seed), tiny_llama_dir)


def test_priority_victims_come_from_anywhere_in_the_running_list(tiny_llama_dir):
    """Not vacuous: vLLM preempts under the priority policy, and not always the request FCFS would (the last
    admitted): the twin's victim choice and its un-scheduling are exercised."""
    differ = 0
    for seed in range(4):
        wl = WORKLOADS["priority"](seed)
        ref = run_vllm(wl, model_dir=tiny_llama_dir)
        assert any(p for _, p in ref.steps)
        wl.policy = "fcfs"
        differ += first_divergence(ref, run_twin(wl, "step")) is not None
    assert differ >= 3


def test_the_adaptive_threshold_is_not_the_fixed_one(tiny_llama_dir):
    """Not vacuous: on its workload vLLM's adaptive long-prefill threshold schedules otherwise than the fixed one."""
    for seed in range(3):
        wl = WORKLOADS["adaptive-threshold"](seed)
        ref = run_vllm(wl, model_dir=tiny_llama_dir)
        wl.long_prefill_token_threshold_adaptive = False
        assert first_divergence(ref, run_twin(wl, "step")) is not None


def test_the_random_mixes_cover_what_they_claim(tiny_llama_dir):
    """Across the seeds: preemptions, prefix hits, long-prefill thresholds and seq caps all occur."""
    pre = hits = 0
    for seed in range(12):
        wl = WORKLOADS["random"](seed)
        ref = run_vllm(wl, model_dir=tiny_llama_dir)
        pre += sum(len(p) for _, p in ref.steps)
        hits += sum(ref.cached.values())
    assert pre > 0 and hits > 0
    wls = [WORKLOADS["random"](s) for s in RANDOM_SEEDS]
    assert any(w.long_prefill_token_threshold for w in wls) and any(w.max_num_seqs <= 8 for w in wls)
    assert {w.keys for w in wls} == {"all", "prompt", "none"}
