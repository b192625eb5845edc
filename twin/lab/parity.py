"""Differential test of the twin's engine against vLLM 0.32's real scheduler, step by step.

Both get the same requests (explicit token ids, so prefix sharing is exact) at the same steps; each step's
decision (tokens per request, who is preempted) and each request's cached tokens at first admission, first
token step and finish step are compared. vLLM's `vllm.v1.core.sched.scheduler.Scheduler` is built the way
its own unit tests build it (`tests/v1/core/utils.py: create_scheduler`), over a tiny Llama `config.json`
with no weights, a hand-made `KVCacheConfig`, and a fake `ModelRunnerOutput` that samples one token for
every request whose prompt is computed. vLLM is imported only inside functions: the light install can
import this module; running it needs the heavy environment (`scripts/setup_vllm_env.sh`).

    .venv-vllm/bin/python -m twin.lab.parity --workload random --seed 7 [--mode step|fast]
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable

from twin.engine.block_pool import BlockPool
from twin.engine.request import Request
from twin.engine.async_scheduler import make_scheduler
from twin.engine.scheduler import Scheduler, SchedulerConfig
from twin.perf.base import StepBatch
from twin.engine.records import RequestLog
from twin.workload.prefix_hash import TRACE_ROOT, token_block_hashes

VOCAB = 4096
MAX_MODEL_LEN = 8192


# -- workloads --------------------------------------------------------------------------------------

@dataclass
class ParityRequest:
    """One request: its token ids, what it will generate, and when it arrives.

    `arrival_step` is the step before whose `schedule()` it joins the waiting queue. With `after` set it
    instead arrives `delay` steps after request `after` finished, on each side by that side's own finish.
    """

    rid: int
    prompt: list[int]
    output: list[int]
    arrival_step: int = 0
    after: int = -1
    delay: int = 1
    priority: int = 0  # vLLM's request priority (read under the priority policy only)


@dataclass
class Workload:
    """Engine knobs (vLLM's names) and the requests."""

    name: str
    requests: list[ParityRequest]
    block_size: int = 16
    num_gpu_blocks: int = 1000
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    keys: str = "all"  # twin block keys cover: "all" (prompt + output), "prompt", "none" (unshareable)
    policy: str = "fcfs"  # vLLM's scheduling policy: "fcfs" or "priority"
    max_num_active_seqs: int | None = None  # vLLM 0.32's admission limit into RUNNING (None: max_num_seqs)
    long_prefill_token_threshold_adaptive: bool = False  # vLLM 0.32: the cap floored at the budget's fair share


@dataclass
class Trace:
    """What one engine did: per step {request: tokens} and preempted ids; per request the outcomes."""

    steps: list[tuple[dict[int, int], frozenset[int]]] = field(default_factory=list)
    cached: dict[int, int] = field(default_factory=dict)
    first_token: dict[int, int] = field(default_factory=dict)
    finish: dict[int, int] = field(default_factory=dict)
    error: str = ""


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _req(reqs: list[ParityRequest], prompt: list[int], n_out: int, rng: random.Random, **kw) -> ParityRequest:
    r = ParityRequest(len(reqs), prompt, _tokens(rng, n_out), **kw)
    reqs.append(r)
    return r


def wl_plain(seed: int) -> Workload:
    rng = random.Random(seed)
    reqs: list[ParityRequest] = []
    for i in range(30):
        _req(reqs, _tokens(rng, rng.randint(5, 300)), rng.randint(1, 60), rng, arrival_step=rng.randint(0, 60))
    reqs.sort(key=lambda r: r.arrival_step)
    return Workload("plain", _renumber(reqs), keys="none", max_num_batched_tokens=512, max_num_seqs=16)


def wl_shared_prefix(seed: int) -> Workload:
    rng = random.Random(seed)
    systems = [_tokens(rng, n) for n in (16, 64, 100, 200)]
    reqs: list[ParityRequest] = []
    for i in range(40):
        sysp = rng.choice(systems)
        tail = _tokens(rng, rng.choice([0, 1, 15, 16, 17, 40]))
        _req(reqs, sysp + tail if sysp + tail else sysp, rng.randint(1, 40), rng, arrival_step=rng.randint(0, 40))
    reqs.sort(key=lambda r: r.arrival_step)
    return Workload("shared-prefix", _renumber(reqs), max_num_batched_tokens=256, num_gpu_blocks=200)


def _sessions(rng: random.Random, n_sessions: int, turns: int, streaming: bool) -> list[ParityRequest]:
    """Multi-turn sessions: each turn's prompt = previous prompt + previous output + new user tokens."""
    reqs: list[ParityRequest] = []
    for s in range(n_sessions):
        prompt = _tokens(rng, rng.randint(10, 120))
        start = rng.randint(0, 30)
        prev: ParityRequest | None = None
        for t in range(turns):
            n_out = rng.randint(5, 70)
            if prev is None:
                r = _req(reqs, prompt, n_out, rng, arrival_step=start)
            elif streaming:  # sent at a fixed step: the previous answer may still be streaming
                r = _req(reqs, prompt, n_out, rng, arrival_step=prev.arrival_step + rng.randint(2, 60))
            else:  # closed loop: a think time after the previous answer ended
                r = _req(reqs, prompt, n_out, rng, after=prev.rid, delay=rng.randint(1, 8))
            prompt = prompt + r.output + _tokens(rng, rng.randint(1, 40))
            prev = r
    return reqs


def wl_multi_turn(seed: int) -> Workload:
    rng = random.Random(seed)
    return Workload("multi-turn", _sessions(rng, 8, 4, streaming=False), max_num_batched_tokens=512,
                    num_gpu_blocks=400)


def wl_streaming_turns(seed: int) -> Workload:
    rng = random.Random(seed)
    reqs = _sessions(rng, 8, 3, streaming=True)
    reqs.sort(key=lambda r: r.arrival_step)
    return Workload("streaming-turns", _renumber(reqs), max_num_batched_tokens=512, num_gpu_blocks=400)


def wl_preemption(seed: int) -> Workload:
    rng = random.Random(seed)
    base = _tokens(rng, 48)
    reqs: list[ParityRequest] = []
    for i in range(24):
        p = (base if rng.random() < 0.5 else []) + _tokens(rng, rng.randint(10, 120))
        _req(reqs, p, rng.randint(20, 100), rng, arrival_step=rng.randint(0, 20))
    reqs.sort(key=lambda r: r.arrival_step)
    return Workload("preemption", _renumber(reqs), num_gpu_blocks=40, max_num_batched_tokens=256)


def wl_priority(seed: int) -> Workload:
    """vLLM's priority policy under KV pressure: the queue by (priority, arrival), and victims from anywhere in the
    running list, some already scheduled in the step (their tokens and blocks go back)."""
    rng = random.Random(seed)
    base = _tokens(rng, 48)
    reqs: list[ParityRequest] = []
    for i in range(28):
        p = (base if rng.random() < 0.4 else []) + _tokens(rng, rng.randint(10, 140))
        _req(reqs, p, rng.randint(10, 100), rng, arrival_step=rng.randint(0, 24), priority=rng.choice([0, 1, 1, 2]))
    reqs.sort(key=lambda r: r.arrival_step)
    return Workload("priority", _renumber(reqs), num_gpu_blocks=40, max_num_batched_tokens=256, policy="priority")


def wl_random_priority(seed: int) -> Workload:
    """The random mix of the same seed under the priority policy, with priorities drawn apart."""
    wl = wl_random(seed)
    rng = random.Random(10_000 + seed)
    levels = rng.choice([[0, 1], [0, 1, 2, 3], [-5, 0, 7]])
    for r in wl.requests:
        r.priority = rng.choice(levels)
    if wl.max_num_seqs > 1 and rng.random() < 0.3:
        wl.max_num_active_seqs = rng.randint(1, wl.max_num_seqs - 1)
    wl.long_prefill_token_threshold_adaptive = wl.long_prefill_token_threshold > 0 and rng.random() < 0.5
    wl.name = f"random-priority-{seed}"
    wl.policy = "priority"
    return wl


def wl_long_prompts(seed: int) -> Workload:
    rng = random.Random(seed)
    reqs: list[ParityRequest] = []
    shared = _tokens(rng, 160)
    for i in range(16):
        p = (shared if i % 3 == 0 else []) + _tokens(rng, rng.randint(100, 600))
        _req(reqs, p, rng.randint(2, 30), rng, arrival_step=rng.randint(0, 30))
    reqs.sort(key=lambda r: r.arrival_step)
    return Workload("long-prompts", _renumber(reqs), max_num_batched_tokens=64, max_num_seqs=8)


def wl_long_prefill_threshold(seed: int) -> Workload:
    rng = random.Random(seed)
    reqs: list[ParityRequest] = []
    for i in range(24):
        _req(reqs, _tokens(rng, rng.randint(20, 400)), rng.randint(2, 40), rng, arrival_step=rng.randint(0, 30))
    reqs.sort(key=lambda r: r.arrival_step)
    return Workload("long-prefill-threshold", _renumber(reqs), max_num_batched_tokens=256,
                    long_prefill_token_threshold=48, keys="prompt")


def wl_adaptive_threshold(seed: int) -> Workload:
    """The long-prefill threshold floored at the budget's fair share per request (vLLM 0.32's adaptive one)."""
    wl = wl_long_prefill_threshold(seed)
    wl.name = "adaptive-threshold"
    wl.long_prefill_token_threshold = 16
    wl.long_prefill_token_threshold_adaptive = True
    return wl


def wl_max_num_seqs(seed: int) -> Workload:
    rng = random.Random(seed)
    reqs: list[ParityRequest] = []
    for i in range(30):
        _req(reqs, _tokens(rng, rng.randint(5, 80)), rng.randint(5, 50), rng, arrival_step=rng.randint(0, 10))
    reqs.sort(key=lambda r: r.arrival_step)
    return Workload("max-num-seqs", _renumber(reqs), max_num_seqs=4, max_num_batched_tokens=128)


def wl_max_num_active_seqs(seed: int) -> Workload:
    """Admission into RUNNING capped below max_num_seqs (vLLM 0.32's `--max-num-active-seqs`)."""
    wl = wl_max_num_seqs(seed)
    wl.name = "max-num-active-seqs"
    wl.max_num_seqs, wl.max_num_active_seqs = 16, 3
    return wl


def wl_two_finishers(seed: int) -> Workload:
    """Two requests finish in one step with their decode-group join order opposite to their running order.

    A (48-token prompt) is admitted first but, chunked by the long-prefill threshold, samples its first
    token two steps after B (16 tokens); B is given three more outputs, so both finish in the same step.
    vLLM frees them in running order (A, then B: `Scheduler.update_from_output`), so A's blocks reach the
    tail of the free queue first (each tail block first: `SingleTypeKVCacheManager.free`). C then takes the
    anonymous blocks and evicts two cached ones from the front: A's last two in vLLM's order, B's and A's
    last in join order. D opens with B's block (even seeds: hit 16 vs 0) or A's first two (odd: 16 vs 32).
    """
    rng = random.Random(seed)
    bs = 16
    reqs: list[ParityRequest] = []
    a = _req(reqs, _tokens(rng, 3 * bs), 4, rng, arrival_step=0)
    b = _req(reqs, _tokens(rng, bs), 6, rng, arrival_step=0)
    fin = 5  # B's first token in step 0, A's in step 2 (three 16-token chunks): both finish in step 5
    _req(reqs, _tokens(rng, 4 * bs), 3, rng, arrival_step=fin + 1 + seed % 3)  # evicts from the LRU front
    shared = (b.prompt if seed % 2 == 0 else a.prompt[:2 * bs]) + _tokens(rng, bs)
    _req(reqs, shared, 2, rng, arrival_step=fin + 2 + seed % 3)
    return Workload("two-finishers", reqs, block_size=bs, num_gpu_blocks=8, max_num_batched_tokens=64,
                    max_num_seqs=8, long_prefill_token_threshold=bs)


def wl_random(seed: int) -> Workload:
    """A seeded mix under KV pressure: sharing, sessions, duplicates, chunking, thresholds, caps."""
    rng = random.Random(seed)
    bs = rng.choice([16, 16, 32])
    share = rng.random() < 0.8  # else nothing is shared, and the twin may treat content as unshareable
    n_sessions = rng.randint(0, 4) if share else 0
    reqs: list[ParityRequest] = []
    systems = [_tokens(rng, rng.randint(1, 6) * bs + rng.choice([0, 0, 1, bs // 2])) for _ in range(3)]
    for i in range(rng.randint(15, 40)):
        kind = rng.random() if share else 1.0
        if kind < 0.35:
            p = rng.choice(systems) + _tokens(rng, rng.randint(0, 80))
        elif kind < 0.45 and reqs:  # an exact repeat of an earlier prompt
            p = list(rng.choice(reqs).prompt)
        else:
            p = _tokens(rng, rng.randint(1, 300))
        _req(reqs, p, rng.randint(1, 80), rng, arrival_step=rng.randint(0, 80))
    for s in _sessions(rng, n_sessions, rng.randint(2, 3), streaming=rng.random() < 0.5):
        s.rid += 10_000  # renumbered below, `after` fixed up with it
        if s.after >= 0:
            s.after += 10_000
        reqs.append(s)
    # block keys must name every block anyone shares: outputs too once sessions carry them
    keys = "all" if n_sessions else rng.choice(["all", "prompt"] if share else ["all", "prompt", "none"])
    fixed = sorted((r for r in reqs if r.after < 0), key=lambda r: r.arrival_step)
    reqs = _renumber(fixed + [r for r in reqs if r.after >= 0])
    longest = max(len(r.prompt) + len(r.output) for r in reqs)
    blocks_needed = -(-longest // bs) + 1
    num_gpu_blocks = max(blocks_needed + 1, int(blocks_needed * rng.uniform(1.0, 4.0)))
    seqs = rng.choice([4, 8, 32, 128])
    tokens = max(seqs, rng.choice([32, 64, 128, 512, 2048]))
    thr = rng.choice([0, 0, 0, 16, 64])
    return Workload(f"random-{seed}", reqs, block_size=bs, num_gpu_blocks=num_gpu_blocks,
                    max_num_batched_tokens=tokens, max_num_seqs=seqs, long_prefill_token_threshold=thr,
                    keys=keys)


def _renumber(reqs: list[ParityRequest]) -> list[ParityRequest]:
    """Ids in list order (the order same-step arrivals join the queue), with `after` links kept."""
    new_id = {r.rid: i for i, r in enumerate(reqs)}
    for r in reqs:
        r.rid = new_id[r.rid]
        if r.after >= 0:
            r.after = new_id[r.after]
    return reqs


WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "plain": wl_plain,
    "shared-prefix": wl_shared_prefix,
    "multi-turn": wl_multi_turn,
    "streaming-turns": wl_streaming_turns,
    "preemption": wl_preemption,
    "long-prompts": wl_long_prompts,
    "long-prefill-threshold": wl_long_prefill_threshold,
    "adaptive-threshold": wl_adaptive_threshold,
    "max-num-seqs": wl_max_num_seqs,
    "max-num-active-seqs": wl_max_num_active_seqs,
    "two-finishers": wl_two_finishers,
    "priority": wl_priority,
    "random": wl_random,
    "random-priority": wl_random_priority,
}


# -- arrivals, shared by both drivers ---------------------------------------------------------------

class Arrivals:
    """Requests due at each step: fixed ones by step, closed-loop ones once their predecessor finished."""

    def __init__(self, wl: Workload) -> None:
        self.by_step: dict[int, list[ParityRequest]] = {}
        self.followers: dict[int, list[ParityRequest]] = {}
        for r in wl.requests:
            if r.after >= 0:
                self.followers.setdefault(r.after, []).append(r)
            else:
                self.by_step.setdefault(r.arrival_step, []).append(r)
        self.left = len(wl.requests)

    def finished(self, rid: int, step: int) -> None:
        """`rid` finished in `step`: its followers arrive `delay` steps after the next one."""
        for f in self.followers.pop(rid, ()):
            self.by_step.setdefault(step + f.delay, []).append(f)

    def take(self, step: int) -> list[ParityRequest]:
        due = self.by_step.pop(step, [])
        self.left -= len(due)
        return due

    def next_step(self) -> int | None:
        return min(self.by_step) if self.by_step else None


# -- the twin ---------------------------------------------------------------------------------------

def block_keys(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `tokens` (as vLLM hashes them: parent hash + block tokens)."""
    return token_block_hashes(tokens, block_size, TRACE_ROOT)


class _UnitSteps:
    """Every step takes 1 s, so times are step counts."""

    def step_time(self, batch: StepBatch) -> float:
        return 1.0

    def decode_run_times(self, num_decode: int, context0: int, k: int) -> list[float]:
        return [1.0] * k


def twin_engine(wl: Workload) -> tuple[Scheduler, BlockPool, RequestLog]:
    """The twin's scheduler and pool with the workload's knobs (no SimPy)."""
    pool = BlockPool(wl.num_gpu_blocks, wl.block_size, True)
    cfg = SchedulerConfig(max_num_batched_tokens=wl.max_num_batched_tokens, max_num_seqs=wl.max_num_seqs,
                          long_prefill_token_threshold=wl.long_prefill_token_threshold, policy=wl.policy,
                          max_num_active_seqs=wl.max_num_active_seqs,
                          long_prefill_token_threshold_adaptive=wl.long_prefill_token_threshold_adaptive)
    log = RequestLog(len(wl.requests))
    return make_scheduler(cfg, pool, _UnitSteps(), log), pool, log


def twin_request(wl: Workload, p: ParityRequest, step: int | None = None) -> Request:
    """The twin's request for `p`, arriving at `step` (default its `arrival_step`; a follower's is its own)."""
    if wl.keys == "all":
        keys = block_keys(p.prompt + p.output, wl.block_size)
    elif wl.keys == "prompt":
        keys = block_keys(p.prompt, wl.block_size)
    else:
        keys = []
    t = float(p.arrival_step if step is None else step)
    return Request(p.rid, t, len(p.prompt), len(p.output), keys, priority=p.priority)


def run_twin(wl: Workload, mode: str = "step", max_steps: int = 100_000,
             on_step: Callable[[Scheduler], None] | None = None,
             on_start: Callable[[Scheduler], None] | None = None) -> Trace:
    """Drive the twin's scheduler; in fast mode homogeneous decode runs go through the fast-forward.

    `on_start` sees the scheduler before the first step, `on_step` after every step (or decode run).
    """
    sched, pool, log = twin_engine(wl)
    if on_start is not None:
        on_start(sched)
    arrivals = Arrivals(wl)
    tr = Trace()
    seen: set[int] = set()
    step = 0

    def outcomes(finished: Iterable[Request], step_end: int) -> None:
        for r in sched.running:
            if r.idx not in seen and r.num_cached_tokens >= 0:
                seen.add(r.idx)
                tr.cached[r.idx] = r.num_cached_tokens
        for r in list(sched.running) + list(finished):
            if r.first_token_time >= 0 and r.idx not in tr.first_token:
                tr.first_token[r.idx] = int(r.first_token_time) - 1
        for r in finished:
            if r.idx not in tr.cached:
                tr.cached[r.idx] = r.num_cached_tokens
            tr.finish[r.idx] = step_end
            arrivals.finished(r.idx, step_end)

    while step < max_steps:
        for p in arrivals.take(step):
            sched.add_request(twin_request(wl, p, step))
        if not sched.has_unfinished_requests():
            nxt = arrivals.next_step()
            if nxt is None:
                return tr
            while step < nxt:
                tr.steps.append(({}, frozenset()))
                step += 1
            continue
        if mode == "fast":
            k = sched.plan_decode_run(4096)
            if k >= 2:
                nxt = arrivals.next_step()
                j = k if nxt is None else min(k, nxt - step)
                if j >= 1:
                    members = {r.idx: 1 for r in sched.running if r.in_decode}
                    ends = [float(step + s + 1) for s in range(k)]
                    finished = sched.commit_decode_run(j, ends, float(step))
                    for _ in range(j):
                        tr.steps.append((dict(members), frozenset()))
                    step += j
                    outcomes(finished, step - 1)
                    if on_step is not None:
                        on_step(sched)
                    continue
        out = sched.schedule(float(step))
        tokens = {r.idx: n for r, n, _ in out.prefills}
        skipped = set(out.skipped)
        for r in sched.running:
            if r.in_decode and r not in skipped:
                tokens[r.idx] = 1
        tr.steps.append((tokens, frozenset(r.idx for r in out.preempted)))
        finished = sched.update_from_output(out, float(step + 1))
        outcomes(finished, step)
        if on_step is not None:
            on_step(sched)
        step += 1
    tr.error = f"twin did not finish within {max_steps} steps"
    return tr


# -- vLLM -------------------------------------------------------------------------------------------

_MODEL_DIR: str | None = None


def write_tiny_llama(folder: str) -> str:
    """A Llama `config.json` with no weights: enough for vLLM's `ModelConfig` with skip_tokenizer_init."""
    os.makedirs(folder, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
           "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
           "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": MAX_MODEL_LEN,
           "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def hermetic_env() -> None:
    """Offline, CPU, no usage stats, caches in a temporary folder (set before vLLM is imported)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if "VLLM_CACHE_ROOT" not in os.environ:
        os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-cache-")


def _model_dir() -> str:
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = write_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    return _MODEL_DIR


_HASHER_READY: list = []


def vllm_engine(wl: Workload, model_dir: str | None = None):
    """vLLM's real scheduler over a hand-made KV pool (`tests/v1/core/utils.py: create_scheduler`)."""
    hermetic_env()
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig as VSchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler as VScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=model_dir or _model_dir(), skip_tokenizer_init=True,
                               max_model_len=MAX_MODEL_LEN, dtype="float32", seed=0)
    sched_config = VSchedulerConfig(
        max_num_seqs=wl.max_num_seqs, max_num_batched_tokens=wl.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=wl.long_prefill_token_threshold,
        enable_chunked_prefill=True, is_encoder_decoder=False, policy=wl.policy,
        max_num_active_seqs=wl.max_num_active_seqs,
        long_prefill_token_threshold_adaptive=wl.long_prefill_token_threshold_adaptive)
    cache_config = CacheConfig(block_size=wl.block_size, enable_prefix_caching=True)
    vcfg = VllmConfig(model_config=model_config, scheduler_config=sched_config, cache_config=cache_config)
    if vcfg.scheduler_config.async_scheduling:
        raise AssertionError("vLLM's CPU build resolved async scheduling on; the harness compares the sync path")
    kv = KVCacheConfig(num_blocks=wl.num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=wl.block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    vcfg.cache_config.num_gpu_blocks = wl.num_gpu_blocks
    sched = VScheduler(vllm_config=vcfg, kv_cache_config=kv,
                       structured_output_manager=StructuredOutputManager(vcfg), block_size=wl.block_size,
                       log_stats=True)
    hash_fn = get_hash_fn_by_name(vcfg.cache_config.prefix_caching_hash_algo)
    if not _HASHER_READY:
        init_none_hash(hash_fn)
        _HASHER_READY.append(True)
    return sched, get_request_block_hasher(wl.block_size, hash_fn), vcfg


def run_vllm(wl: Workload, max_steps: int = 100_000, model_dir: str | None = None) -> Trace:
    """Drive vLLM's scheduler with the workload; the fake model samples each request's planned tokens."""
    hermetic_env()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VRequest

    sched, hasher, _ = vllm_engine(wl, model_dir)
    arrivals = Arrivals(wl)
    plan = {r.rid: r for r in wl.requests}
    live: dict[str, VRequest] = {}
    tr = Trace()
    step = 0
    while step < max_steps:
        for p in arrivals.take(step):
            # ids zero-padded: vLLM breaks priority ties by request id, as strings
            vr = VRequest(f"{p.rid:06d}", list(p.prompt), SamplingParams(max_tokens=len(p.output), ignore_eos=True),
                          None, arrival_time=float(step), block_hasher=hasher, priority=p.priority)
            live[vr.request_id] = vr
            sched.add_request(vr)
        if not live:
            nxt = arrivals.next_step()
            if nxt is None:
                return tr
            while step < nxt:
                tr.steps.append(({}, frozenset()))
                step += 1
            continue
        out = sched.schedule()
        for nr in out.scheduled_new_reqs:
            tr.cached.setdefault(int(nr.req_id), nr.num_computed_tokens)
        tokens = {int(k): v for k, v in out.num_scheduled_tokens.items()}
        tr.steps.append((tokens, frozenset(int(i) for i in out.preempted_req_ids)))
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            vr = live[rid]
            if vr.num_computed_tokens >= vr.num_tokens:
                sampled.append([plan[int(rid)].output[len(vr.output_token_ids)]])
            else:
                sampled.append([])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        sched.update_from_output(out, mro)
        for rid in req_ids:  # in vLLM's output order, so same-step finishers' followers arrive in it
            vr = live[rid]
            i = int(rid)
            if vr.output_token_ids and i not in tr.first_token:
                tr.first_token[i] = step
            if vr.is_finished():
                tr.finish[i] = step
                del live[rid]
                arrivals.finished(i, step)
        step += 1
    tr.error = f"vLLM did not finish within {max_steps} steps"
    return tr


# -- comparison -------------------------------------------------------------------------------------

def first_divergence(a: Trace, b: Trace, names: tuple[str, str] = ("vllm", "twin")) -> str | None:
    """A one-paragraph description of where two traces first differ, or None if identical."""
    if a.error or b.error:
        return f"{names[0]}: {a.error or 'ok'}; {names[1]}: {b.error or 'ok'}"
    for s, (sa, sb) in enumerate(zip(a.steps, b.steps)):
        if sa != sb:
            ta, tb = sa[0], sb[0]
            diff = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
            lines = [f"step {s}: scheduled tokens differ for requests {diff[:10]}"
                     if diff else f"step {s}: preempted differ"]
            for k in diff[:10]:
                lines.append(f"  request {k}: {names[0]} {ta.get(k, 0)}, {names[1]} {tb.get(k, 0)}")
            if sa[1] != sb[1]:
                lines.append(f"  preempted: {names[0]} {sorted(sa[1])}, {names[1]} {sorted(sb[1])}")
            return "\n".join(lines)
    if len(a.steps) != len(b.steps):
        return f"{names[0]} ran {len(a.steps)} steps, {names[1]} {len(b.steps)}"
    for what in ("cached", "first_token", "finish"):
        da, db = getattr(a, what), getattr(b, what)
        if da != db:
            ks = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
            k = ks[0]
            return f"{what} differs for request {k}: {names[0]} {da.get(k)}, {names[1]} {db.get(k)}"
    return None


def compare(wl: Workload, modes: Iterable[str] = ("step", "fast"), reference: Trace | None = None) -> dict[str, str | None]:
    """First divergence of each twin mode from vLLM (None where identical)."""
    ref = reference if reference is not None else run_vllm(wl)
    return {m: first_divergence(ref, run_twin(wl, m)) for m in modes}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m twin.lab.parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="random", choices=sorted(WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["step", "fast", "both"], default="both")
    a = ap.parse_args(argv)
    if a.seed < 0:
        print("error: --seed must be >= 0", file=sys.stderr)
        return 2
    wl = WORKLOADS[a.workload](a.seed)
    try:
        ref = run_vllm(wl)
    except ImportError as e:
        print(f"error: vLLM is not installed here ({e}); run in .venv-vllm (scripts/setup_vllm_env.sh)",
              file=sys.stderr)
        return 2
    modes = ["step", "fast"] if a.mode == "both" else [a.mode]
    rc = 0
    for m in modes:
        d = first_divergence(ref, run_twin(wl, m))
        if d is None:
            print(f"{wl.name} seed {a.seed}, {m} mode: identical over {len(ref.steps)} steps "
                  f"({len(wl.requests)} requests)")
        else:
            rc = 1
            print(f"{wl.name} seed {a.seed}, {m} mode: first divergence\n{d}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
