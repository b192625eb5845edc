"""The twin's async scheduling decides every step as vLLM 0.32's real `AsyncScheduler` does when driven as
`EngineCore.step_with_batch_queue` drives it (batch queue of depth 2: schedule(k+1) before update(k)).

vLLM's CPU build resolves async scheduling off, but the `AsyncScheduler` class itself runs on any platform;
the fake model samples one token for every scheduled request that is not mid-prefill (the placeholders).
"""

from __future__ import annotations

import pytest

from twin.lab import parity as P
from twin.engine.block_pool import BlockPool
from twin.engine.async_scheduler import make_scheduler
from twin.engine.scheduler import SchedulerConfig
from twin.engine.records import RequestLog

SEEDS = range(4)
RANDOM_SEEDS = range(20)


def run_vllm_async(wl, model_dir, max_steps=20000):
    """vLLM's AsyncScheduler in `EngineCore.step_with_batch_queue` order: schedule(k+1), then update(k).

    An empty schedule is no step (vLLM schedules again after the update); a request due at step s is
    added before schedule(s); a closed-loop follower is added once its predecessor's finish is known."""
    P.hermetic_env()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VRequest
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager
    sync, hasher, vcfg = P.vllm_engine(wl, model_dir)
    sched = AsyncScheduler(vllm_config=vcfg, kv_cache_config=sync.kv_cache_config,
                           structured_output_manager=StructuredOutputManager(vcfg), block_size=wl.block_size,
                           log_stats=True)
    arrivals = P.Arrivals(wl)  # its maps only: async drivers time followers their own way
    byst, foll = arrivals.by_step, arrivals.followers
    plan = {r.rid: r for r in wl.requests}
    live = {}
    tr = P.Trace()
    step = 0
    inflight = None  # (out, sampled req ids)
    while step < max_steps:
        due = [p for k in sorted(k for k in byst if k <= step) for p in byst.pop(k)]
        for p in due:
            vr = VRequest(f"{p.rid:06d}", list(p.prompt), SamplingParams(max_tokens=len(p.output), ignore_eos=True),
                          None, arrival_time=float(step), block_hasher=hasher, priority=p.priority)
            live[vr.request_id] = vr
            sched.add_request(vr)
        if not live and inflight is None:
            if not byst:
                return tr
            nxt = min(byst)
            while step < nxt:
                tr.steps.append(({}, frozenset()))
                step += 1
            continue
        out = sched.schedule()
        tokens = {int(k): v for k, v in out.num_scheduled_tokens.items()}
        for nr in out.scheduled_new_reqs:
            tr.cached.setdefault(int(nr.req_id), nr.num_computed_tokens)
        samp = [rid for rid in out.num_scheduled_tokens if not live[rid].is_prefill_chunk]
        if inflight is not None:
            pout, psamp = inflight
            req_ids = list(pout.num_scheduled_tokens)
            sampled = []
            for rid in req_ids:
                vr = live.get(rid)
                if rid in psamp and vr is not None:
                    sampled.append([plan[int(rid)].output[min(len(vr.output_token_ids), len(plan[int(rid)].output) - 1)]])
                else:
                    sampled.append([])
            mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                    sampled_token_ids=sampled)
            sched.update_from_output(pout, mro)
            for rid in req_ids:  # in vLLM's output order, so same-step finishers' followers arrive in it
                vr = live.get(rid)
                if vr is None:
                    continue
                i = int(rid)
                if vr.output_token_ids and i not in tr.first_token:
                    tr.first_token[i] = step - 1
                if vr.is_finished():
                    tr.finish[i] = step - 1
                    del live[rid]
                    for f in foll.pop(i, ()):  # known after schedule(step): arrives by step + 1 at the earliest
                        byst.setdefault(max(step - 1 + f.delay, step + 1), []).append(f)
            inflight = None
        if not tokens:  # an empty schedule is no step: schedule again after the update
            continue
        tr.steps.append((tokens, frozenset(int(i) for i in out.preempted_req_ids)))
        inflight = (out, set(samp))
        step += 1
    tr.error = "no finish"
    return tr


class UnitSteps:
    """Unit steps with a CPU part, so async overlap has something to hide."""

    def step_time(self, b): return 1.0
    def host_time_s(self, n): return 0.1
    def decode_run_times(self, nd, ctx, k): return [1.0] * k


def run_twin_async(wl, max_steps=20000):
    """The twin's scheduler with async scheduling, in its own order (update(k), schedule(k+1), then the
    frees of step k), with arrivals timed so the decision for step s (made at s-1) sees those due at s."""
    pool = BlockPool(wl.num_gpu_blocks, wl.block_size, True)
    cfg = SchedulerConfig(max_num_batched_tokens=wl.max_num_batched_tokens, max_num_seqs=wl.max_num_seqs,
                          long_prefill_token_threshold=wl.long_prefill_token_threshold, async_scheduling=True,
                          policy=wl.policy, max_num_active_seqs=wl.max_num_active_seqs,
                          long_prefill_token_threshold_adaptive=wl.long_prefill_token_threshold_adaptive)
    log = RequestLog(len(wl.requests))
    sched = make_scheduler(cfg, pool, UnitSteps(), log)
    arrivals = P.Arrivals(wl)  # its maps only: async drivers time followers their own way
    byst, foll = arrivals.by_step, arrivals.followers
    tr = P.Trace()
    seen = set()
    step = 0
    while step < max_steps:
        # requests due at `step` are visible to schedule(step), decided at step-1
        for p in byst.pop(step, []):
            sched.add_request(P.twin_request(wl, p, step), float(step) - 1.0)
        if not sched.has_unfinished_requests():
            if not byst:
                return tr
            nxt = min(byst)
            while step < nxt:
                tr.steps.append(({}, frozenset()))
                step += 1
            continue
        if sched.is_idle():
            sched.wake(float(step) - 1.0)
        sched.admit_inbox()
        out = sched.schedule(float(step))
        released = sched.release_finished()
        if out.is_empty:
            sched.prev_gpu_s = 0.0
            sched.next_decision_t = float(step) - 1.0  # decided again before anything new arrives
            assert released or sched.inbox or sched.waiting, "stuck"
            continue
        for r in sched.running:
            if r.idx not in seen and r.num_cached_tokens >= 0:
                seen.add(r.idx); tr.cached[r.idx] = r.num_cached_tokens
        tokens = {r.idx: n for r, n, _ in out.prefills}
        sk = set(out.skipped)
        for r in sched.running:
            if r.in_decode and r not in sk:
                tokens[r.idx] = 1
        tr.steps.append((tokens, frozenset(r.idx for r in out.preempted)))
        fin = sched.update_from_output(out, float(step + 1))
        for r in list(sched.running) + fin:
            if r.first_token_time >= 0 and r.idx not in tr.first_token:
                tr.first_token[r.idx] = int(r.first_token_time) - 1
        for r in fin:
            tr.finish[r.idx] = step
            for f in foll.pop(r.idx, ()):
                byst.setdefault(max(step + f.delay, step + 2), []).append(f)
            if r.idx not in tr.cached:
                tr.cached[r.idx] = r.num_cached_tokens
        step += 1
    tr.error = "no finish"
    return tr


def check(wl, model_dir):
    ref = run_vllm_async(wl, model_dir)
    assert not ref.error, ref.error
    assert len(ref.finish) == len(wl.requests)
    twin = run_twin_async(wl)
    d = P.first_divergence(ref, twin, ("vllm-async", "twin-async"))
    assert d is None, f"{wl.name}:\n{d}"
    return twin


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", [n for n in P.WORKLOADS if n != "random"])
def test_named_workload_under_async(name, seed, tiny_llama_dir):
    check(P.WORKLOADS[name](seed), tiny_llama_dir)


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_mix_under_async(seed, tiny_llama_dir):
    check(P.WORKLOADS["random"](seed), tiny_llama_dir)


def test_async_schedules_differently_from_sync_on_these_workloads(tiny_llama_dir):
    """The comparison is not vacuous: on most mixes the async schedule is not the synchronous one."""
    differ = sum(P.first_divergence(run_twin_async(P.WORKLOADS["random"](s)), P.run_twin(P.WORKLOADS["random"](s)))
                 is not None for s in range(6))
    assert differ >= 4
