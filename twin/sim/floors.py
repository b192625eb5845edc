"""Floors under an engine's step times: what Block's pruning stands on (`twin.sim.forecaster`).

Each is a time no schedule of the given work can beat on the roofline and the fitted model, read from their
`step_time` alone: both price a step as a sum of per-group terms, each increasing in the work, affine or the larger
of affine terms but for an MoE model's touched experts (concave in the tokens). A floor that passed the truth would
change Block's choices:
`tests/test_block_prune.py` and `benchmarks/block_bounds.py` check them against forks run to the end.
"""

from __future__ import annotations

from twin.engine.fork import EngineFork
from twin.engine.request import Request
from twin.perf.base import StepBatch
from twin.perf.fitted import FittedModel
from twin.perf.roofline import RooflineModel


def prefill_floor_s(perf, new_tokens: int, attn_pairs: float) -> float:
    """The least time the steps computing `new_tokens` prompt tokens (`attn_pairs` (query, key) pairs of
    attention in all) and sampling the first token can take together, however the scheduler chunks them and
    whatever shares their steps; 0 where the step model does not say.

    Only for the roofline and the fitted model, read as written (a subclass may price steps otherwise, so the
    types are matched exactly): a step's time is its GPU terms plus the CPU term `host_time_s(requests)`, and
    async scheduling hides at most that CPU term (`AsyncScheduler.step_duration`), so the steps last at least
    their GPU terms. Each term is subadditive in its tokens (affine or concave with a fixed part >= 0, times a
    coefficient >= 0), so the chunks' sum is at least that of one step holding all the tokens, alone, sampling
    one token: its `step_time` less its CPU term."""
    if type(perf) is not RooflineModel and type(perf) is not FittedModel:
        return 0.0
    b = StepBatch(num_prefill_tokens=new_tokens, prefill_attn_tokens=attn_pairs, num_prefill_sampled=1,
                  num_prefill_reqs=1)
    v = perf.step_time(b) - perf.host_time_s(1)
    return v * (1 - 1e-6) if v > 0.0 else 0.0  # a hair under: the engine's sums round


def prompt_pairs(tokens: int, done: int) -> float:
    """The (query, key) pairs of attention in computing a prompt's tokens `done` + 1 .. `tokens`
    (twin.engine.output: n x c + n (n + 1) / 2 a chunk)."""
    return (tokens * (tokens + 1) - done * (done + 1)) / 2


def least_prompt_work(tokens: int, keyed_blocks: int, block_size: int) -> tuple[int, float]:
    """The prompt tokens a request computes at least, and their attention pairs: the prefix cache can spare at
    most the blocks its keys cover, and never the last token (vLLM recomputes it:
    `KVCacheManager.get_computed_blocks`)."""
    hit = min(tokens - 1, keyed_blocks * block_size) if keyed_blocks else 0
    return tokens - hit, prompt_pairs(tokens, hit)


def is_dense(perf) -> bool:
    """Whether the step model's model is dense (its decode step is jointly convex: `decode_steps_floor_s`)."""
    if type(perf) is FittedModel:
        return not perf.roofline.model.is_moe
    return type(perf) is RooflineModel and not perf.model.is_moe


def _exact_model(perf) -> bool:
    """The step models whose terms the bounds below are proved on, matched exactly (a subclass may price
    steps otherwise)."""
    return type(perf) is RooflineModel or type(perf) is FittedModel


def decode_gpu_s(perf, num_decode: int, context: int, host: bool = False) -> float:
    """The GPU time of one decode-only step of `num_decode` requests attending `context` tokens in all: its
    `step_time` less its CPU term, which is all that async scheduling can hide (`prefill_floor_s`); with
    `host`, the whole step, as a synchronous engine runs it."""
    x = perf.step_time(StepBatch(num_decode_tokens=num_decode, decode_context_tokens=context))
    return x if host else x - perf.host_time_s(num_decode)


def least_step_gpu_s(perf) -> float:
    """A time no step of the engine's can take less than: the GPU time of its smallest batch (one decode
    token, or one prompt token that samples nothing)."""
    one = perf.step_time(StepBatch(num_prefill_tokens=1, prefill_attn_tokens=1.0, prefill_kv_read_tokens=1,
                                   num_prefill_reqs=1)) - perf.host_time_s(1)
    return min(one, decode_gpu_s(perf, 1, 1))


def decode_steps_floor_s(perf, steps: int, decode_tokens: int, context_tokens: float, dense: bool,
                         host: bool = False, spans: list[tuple[int, int]] | None = None) -> float:
    """A floor under the GPU time of `steps` decode-only steps holding `decode_tokens` decodes and attending
    `context_tokens` tokens over all of them (each step at least one decode).

    On the roofline and the fitted model a decode step's GPU time is increasing in its decodes and its context,
    convex in its context (decode attention is the larger of two affine terms), and, for a dense model, jointly
    convex in both (every other term is affine or the larger of affine ones). So by Jensen's inequality the steps
    take at least `steps` times the time of their mean step, the means rounded down. An MoE model's touched
    experts are concave in the tokens, so there the step splits into its time at no context, increasing in the
    decodes and summed over `spans` (each (first, last) step of a decode; a step holds as many decodes as spans
    cover it) level by level (a step of N decodes takes at least that time at the largest power of two <= N),
    and the rest, decode attention above its no-context value, which is
    jointly convex (Jensen, decodes rounded up: it falls with them); without spans, one decode a step. `host` adds
    each step's CPU term (affine in its decodes), which a synchronous engine runs in series."""
    if steps <= 0:
        return 0.0
    if dense or not spans:
        n = decode_tokens // steps if dense else 1
        return steps * decode_gpu_s(perf, max(1, n), int(context_tokens / steps), host) * (1 - 1e-6)  # sums round
    # steps holding at least q decodes, for q = 1, 2, 4, ...: a sweep over the spans' ends
    events: dict[int, int] = {}
    for a, b in spans:
        events[a] = events.get(a, 0) + 1
        events[b + 1] = events.get(b + 1, 0) - 1
    levels: dict[int, int] = {}  # q -> steps with at least q decodes
    cover = 0
    last = 0
    for m in sorted(events):
        if cover > 0:
            q = 1
            while q <= cover:
                levels[q] = levels.get(q, 0) + (m - last)
                q *= 2
        cover += events[m]
        last = m
    bare = 0.0  # the no-context part, layer by layer: R(N) >= R(1) + sum over q of [N >= 2q] (R(2q) - R(q))
    prev = 0.0
    for q in sorted(levels):
        r = decode_gpu_s(perf, q, 0, host)
        bare += levels[q] * (r - prev)
        prev = r
    n = -(-decode_tokens // steps)
    c = int(context_tokens / steps)
    attn = decode_gpu_s(perf, n, c, host) - decode_gpu_s(perf, n, 0, host)
    return (bare + steps * attn) * (1 - 1e-6)


def fork_finish_floor(f: EngineFork, request: Request, perf, dense: bool) -> float | None:
    """A time a fork's decoding `request` cannot finish before, read from the fork between two of its steps: when
    it holds only decodes (nothing queued or in its prompt, no work in progress; the caller has no arrival left to
    give it) and its free blocks cover every decode's growth to its end, every step holds every decode still to go
    (`SimForecaster._finish_bound`), so the request's remaining steps last at least `decode_steps_floor_s` of
    them. None when that does not hold, or off the roofline and the fitted model."""
    s = f.scheduler
    if s.waiting or s.inbox or s.prefilling or f.is_busy() or not request.in_decode or not _exact_model(perf):
        return None
    running = s.running
    if len(running) > s.config.max_num_batched_tokens:
        return None
    g = s.group
    bs = s.block_size
    member_output = g.member_output
    left = request.stop_at_tokens - member_output(request)
    if left <= 0:
        return None
    demand = tokens = 0
    ctx = 0.0
    each: list[tuple[int, int]] = []
    for r in running:
        if not r.in_decode:
            return None
        done = member_output(r)
        go = r.stop_at_tokens - done
        demand += go // bs + 2
        k = go if go < left else left
        if k <= 0:
            continue
        tokens += k
        ctx += k * (r.num_prompt_tokens + done) + k * (k - 1) / 2
        if not dense:
            each.append((1, k))
    if demand > s.pool.get_num_free_blocks() - s._watermark_blocks:
        return None
    return f.now + decode_steps_floor_s(perf, left, tokens, ctx, dense, not s.async_scheduling, each)
