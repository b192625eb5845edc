"""From per-request records and engine counters to the numbers a user compares: TTFT, TPOT, ITL, E2E, goodput."""

from __future__ import annotations

import numpy as np

from typing import TYPE_CHECKING, Callable

from twin.engine.config import EngineConfig, num_gpu_blocks
from twin.engine.records import RequestLog, account
from twin.perf.base import StepTimeModel
from twin.sim.build import build_perf, engine_config
from twin.sim.events import BUILD

if TYPE_CHECKING:
    from twin.sim.cluster import SimResult

QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}


def linear_quantile(value_at, n: int, q: float) -> float:
    """numpy's default percentile (linear between the samples at ranks floor(h) and floor(h) + 1, h = (n - 1) q):
    what `vllm bench serve` prints (`np.percentile`, `np.median`: `vllm/benchmarks/serve.py: calculate_metrics`).
    `value_at(r)` is the sample at 0-based rank r."""
    h = (n - 1) * q
    r0 = int(np.floor(h))
    t = h - r0
    a = value_at(r0)
    if t == 0.0 or r0 + 1 >= n:
        return a
    b = value_at(r0 + 1)
    return float(a + (b - a) * t) if t < 0.5 else float(b - (b - a) * (1.0 - t))  # numpy's `_lerp`


def _ranked(values: np.ndarray, weights: np.ndarray) -> tuple[Callable[[int], float], int]:
    """(the sample at each 0-based rank, the count) of samples with integer multiplicities, sorted once."""
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    last = len(v) - 1

    def at(r: int) -> float:
        return float(v[min(int(np.searchsorted(cum, r + 1, side="left")), last)])

    return at, int(cum[-1])


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, qs) -> list[float]:
    """Quantiles of samples with integer multiplicities, as `np.percentile` gives them on the samples repeated."""
    if len(values) == 0 or weights.sum() == 0:
        return [float("nan")] * len(qs)
    at, n = _ranked(values, weights)
    return [linear_quantile(at, n, q) for q in qs]


def latencies(log: RequestLog, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(TTFT, TPOT, E2E) samples of the finished requests (among `mask`), as `vllm bench serve` takes them: TPOT =
    (finish - first token) / (output - 1), only for requests with more than one output token."""
    fin = log.status == 4 if mask is None else (log.status == 4) & mask
    multi = fin & (log.output_tokens > 1)
    return ((log.first_token_s - log.arrival_s)[fin],
            ((log.finish_s - log.first_token_s) / np.maximum(log.output_tokens - 1, 1))[multi],
            (log.finish_s - log.arrival_s)[fin])


def describe(values: np.ndarray, weights: np.ndarray | None = None) -> dict:
    values = np.asarray(values, dtype=np.float64)
    if weights is None:
        weights = np.ones(len(values), dtype=np.int64)
    ok = ~np.isnan(values)
    values, weights = values[ok], weights[ok]
    n = int(weights.sum())
    if n == 0:
        return {"count": 0, "mean": None, **{k: None for k in QUANTILES}}
    qs = weighted_quantiles(values, weights, list(QUANTILES.values()))
    mean = float(np.dot(values, weights) / n)
    return {"count": n, "mean": mean, **dict(zip(QUANTILES, qs))}


_BINS = 4096  # histogram bins per refinement of a quantile's range
_SORT_AT_MOST = 1 << 20  # samples left in a quantile's range that are sorted outright


def _weight_in(parts: list, a: float, b: float) -> tuple[int, int]:
    """(weight of the samples below a, samples in [a, b]) over every part, exactly."""
    below = 0
    inside = 0
    for v, w in parts:
        below += int(w[v < a].sum())
        inside += int(np.count_nonzero((v >= a) & (v <= b)))
    return below, inside


def _quantile_in_parts(parts: list, target: float, lo: float, hi: float) -> float | None:
    """The smallest sample value whose cumulative weight reaches `target` (None: give up, sort instead).

    Narrows [a, b] by weighted histograms until few samples are left in it, then sorts only those; the
    weight below `a` is recounted exactly each time and each range is widened by a bin on both sides, so a
    sample that floating-point binning puts in a neighbouring bin is still inside."""
    a, b = lo, hi
    for _ in range(12):
        below, inside = _weight_in(parts, a, b)
        edges = np.linspace(a, b, _BINS + 1)  # numpy's own edges for uniform bins over (a, b)
        if inside <= _SORT_AT_MOST or not (np.diff(edges) > 0).all():  # few left, or too narrow to bin
            vs = [v[(v >= a) & (v <= b)] for v, _w in parts]
            ws = [w[(v >= a) & (v <= b)] for v, w in parts]
            cv, cw = np.concatenate(vs), np.concatenate(ws)
            if not len(cv):
                return None
            order = np.argsort(cv, kind="stable")
            cum = below + np.cumsum(cw[order])
            if not below < target <= cum[-1]:
                return None
            return float(cv[order][int(np.searchsorted(cum, target, side="left"))])
        hist = np.zeros(_BINS)
        for v, w in parts:
            hist += np.histogram(v, bins=_BINS, range=(a, b), weights=w)[0]
        k = int(np.searchsorted(below + np.cumsum(hist), target, side="left"))
        na, nb = float(edges[max(k - 1, 0)]), float(edges[min(k + 2, _BINS)])
        if (na, nb) == (a, b):
            return None
        a, b = na, nb
    return None


def describe_parts(parts: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """`describe` of the samples of several (values, multiplicities) arrays, without joining or sorting them.

    A long run's ITL has one sample per step and instance (77.6 M for 5.3 M requests on 16 instances): joining
    and sorting them, as `describe` does, took more memory than the whole simulation. The quantiles are
    `weighted_quantiles`'s (numpy's linear percentile; tested equal); the mean is summed part by part."""
    clean = []
    for v, w in parts:
        v = np.asarray(v, dtype=np.float64)
        w = np.asarray(w)
        if len(v) and np.isnan(v).any():
            ok = ~np.isnan(v)
            v, w = v[ok], w[ok]
        if len(v):
            clean.append((v, w))
    n = sum(int(w.sum()) for _v, w in clean)
    if n == 0:
        return {"count": 0, "mean": None, **{k: None for k in QUANTILES}}
    mean = sum(float(np.dot(v, w)) for v, w in clean) / n
    lo = min(float(v.min()) for v, _w in clean)
    hi = max(float(v.max()) for v, _w in clean)
    joined: list[Callable[[int], float]] = []  # the reference way, on the joined samples (sorted once, if needed)

    def at(r: int) -> float:
        x = _quantile_in_parts(clean, r + 1, lo, hi)
        if x is None:  # a range binning could not narrow
            if not joined:
                joined.append(_ranked(np.concatenate([v for v, _w in clean]),
                                      np.concatenate([w for _v, w in clean]))[0])
            x = joined[0](r)
        return x

    qs = [linear_quantile(at, n, q) for q in QUANTILES.values()]
    return {"count": n, "mean": mean, **dict(zip(QUANTILES, qs))}


def itl_samples(result: SimResult) -> tuple[np.ndarray, np.ndarray]:
    """All instances' inter-token latencies as (values, multiplicities)."""
    parts = [inst.scheduler.stats.itl.arrays() for inst in result.instances]
    if not parts:
        return np.empty(0), np.empty(0, dtype=np.int64)
    return np.concatenate([v for v, _ in parts]), np.concatenate([w for _, w in parts])


def slo_mask(log: RequestLog, slo) -> np.ndarray:
    """Finished requests that meet every SLO bound that is set."""
    return slo_met(log.status, log.arrival_s, log.first_token_s, log.finish_s, log.output_tokens, slo)


def slo_met(status: np.ndarray, arrival_s: np.ndarray, first_token_s: np.ndarray, finish_s: np.ndarray,
            output_tokens: np.ndarray, slo) -> np.ndarray:
    """`slo_mask` over columns: a run still going judges its requests' client-side times before its log has them."""
    ok = status == 4  # FINISHED
    ttft = first_token_s - arrival_s
    e2e = finish_s - arrival_s
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output_tokens > 1, (finish_s - first_token_s) / (output_tokens - 1), 0.0)
    if slo.ttft_s is not None:
        ok &= ttft <= slo.ttft_s
    if slo.tpot_s is not None:
        ok &= tpot <= slo.tpot_s
    if slo.e2e_s is not None:
        ok &= e2e <= slo.e2e_s
    return ok


def summarize(result: SimResult) -> dict:
    """The summary.json of a run (fields documented in the README)."""
    log = result.log
    sc = result.scenario
    counts = account(log)
    fin = log.status == 4
    ttft, tpot, e2e = latencies(log)
    sim_t = result.sim_time_s if result.sim_time_s > 0 else float("nan")
    stats = [inst.scheduler.stats for inst in result.instances]
    queries = sum(s.prefix_cache_queries for s in stats)
    hits = sum(s.prefix_cache_hits for s in stats)
    generated = sum(s.generated_tokens for s in stats)
    usable = result.instances[0].pool.num_usable_blocks if result.instances else 1
    fleet = result.fleet
    lifetimes = fleet.instance_seconds(result.sim_time_s) if fleet is not None else {}
    inst_seconds = sum(lifetimes.values()) if lifetimes else len(stats) * sim_t
    kv_mean = sum(s.kv_used_block_seconds for s in stats) / (usable * inst_seconds) if stats and inst_seconds else 0.0
    kv_peak = max((s.kv_peak_used_blocks for s in stats), default=0) / usable
    good = int(slo_mask(log, sc.slo).sum())
    prompt_computed = int((log.prompt_tokens[fin] - log.cached_tokens[fin]).sum())
    ceiling = roofline_ceiling_tok_s(result)
    processed_rate = (prompt_computed + generated) / sim_t
    summary = {
        "scenario": sc.name,
        "seed": sc.seed,
        "mode": sc.sim.mode,
        "requests_total": log.n,
        "requests_finished": counts["finished"],
        "requests_rejected": counts["rejected"],
        "requests_running": counts["waiting"] + counts["running"] + counts["preempted"],
        "requests_not_arrived": counts["pending"],
        "reject_reasons": dict(log.reject_counts),
        "sim_time_s": result.sim_time_s,
        "wall_time_s": result.wall_time_s,
        "requests_per_wall_s": (log.n - counts["pending"]) / result.wall_time_s if result.wall_time_s > 0 else None,
        "sim_speedup": result.sim_time_s / result.wall_time_s if result.wall_time_s > 0 else None,
        "build": BUILD,  # the wall figures above depend on it (about 6x)
        "ttft_s": describe(ttft),
        "tpot_s": describe(tpot),
        "itl_s": describe_parts([inst.scheduler.stats.itl.arrays() for inst in result.instances]),
        "e2e_s": describe(e2e),
        # `vllm bench serve`'s output throughput: the finished requests' tokens (equal to all generated when every
        # request finishes; a run cut at max_sim_time_s has tokens of unfinished ones in generated_tok_s only)
        "throughput_output_tok_s": float(log.output_tokens[fin].sum()) / sim_t,
        "generated_tok_s": generated / sim_t,
        "throughput_req_s": counts["finished"] / sim_t,
        "goodput_req_s": good / sim_t,
        "slo": sc.slo.model_dump(),
        "slo_attainment": good / counts["finished"] if counts["finished"] else None,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_queries_tokens": queries,
        "prefix_cache_hits_tokens": hits,
        "preemptions": sum(s.num_preemptions for s in stats),
        "kv_usage_mean": kv_mean,
        "kv_usage_peak": kv_peak,
        "num_gpu_blocks": result.num_gpu_blocks,
        "engine_steps": sum(s.num_steps for s in stats),
        "roofline_ceiling_tok_s": ceiling,
        "processed_tok_s": processed_rate,  # prompt tokens computed + generated, per second: <= the ceiling
        "physics_ok": bool(processed_rate <= ceiling * (1 + 1e-9)),
        "engine": engine_summary(sc, result.instances[0].config if result.instances else engine_config(sc),
                                 result.num_gpu_blocks, result.perf),
        "perf_model": result.perf.describe(),
        "whatif": {k: v for k, v in sc.whatif.model_dump().items() if v["enabled"]},  # actions on (twin.whatif)
        "router": result.router_info,
        "gpu_seconds": fleet.gpu_seconds(result.sim_time_s) if fleet is not None
        else len(result.instances) * sc.cluster.tensor_parallel * result.sim_time_s,
        "fleet": fleet.summary(result.sim_time_s) if fleet is not None else None,
        "workload": result.stream_stats,
        "by_priority": by_priority(log, sc.slo, sim_t),
        "instances": [
            {"id": inst.id, "dispatched": inst.num_dispatched, "steps": inst.scheduler.stats.num_steps,
             "busy_frac": inst.scheduler.stats.busy_time_s / sim_t,
             "preemptions": inst.scheduler.stats.num_preemptions}
            for inst in result.instances
        ],
    }
    return summary


def by_priority(log, slo, sim_t: float) -> dict | None:
    """TTFT, TPOT, E2E and goodput per request priority (`workload.priorities`), None when all share one."""
    values = np.unique(log.priority)
    if len(values) < 2:
        return None
    fin = log.status == 4
    good = slo_mask(log, slo)
    out = {}
    for p in values.tolist():
        mine = log.priority == p
        ttft, tpot, e2e = latencies(log, mine)
        n_fin = int((fin & mine).sum())
        n_good = int((good & mine).sum())
        out[str(p)] = {
            "requests": int(mine.sum()),
            "requests_finished": n_fin,
            "ttft_s": describe(ttft),
            "tpot_s": describe(tpot),
            "e2e_s": describe(e2e),
            "goodput_req_s": n_good / sim_t,
            "slo_attainment": n_good / n_fin if n_fin else None,
        }
    return out


def roofline_ceiling_tok_s(result: SimResult) -> float:
    """Tokens/s the cluster's GPUs could process at 100 % of peak FLOP/s (linear layers only: a hard bound)."""
    fleet = result.fleet
    if fleet is not None and result.sim_time_s > 0:  # a fleet that changed size: its mean instance count
        mean_instances = sum(fleet.instance_seconds(result.sim_time_s).values()) / result.sim_time_s
        return max(mean_instances, 1e-9) * result.perf.peak_tokens_per_s()
    return len(result.instances) * result.perf.peak_tokens_per_s()


def engine_summary(sc, cfg: EngineConfig, num_blocks: int, perf: StepTimeModel) -> dict:
    """The engine limits and KV sizing a run used, resolved (vLLM's per-GPU defaults filled in)."""
    gib = float(1 << 30)
    e = sc.cluster.engine
    defaulted = [k for k in ("max_num_batched_tokens", "max_num_seqs", "max_model_len") if getattr(e, k) is None]
    return {
        "vllm_version": e.vllm_version,  # the release modelled, and what it resolved (twin.specs.vllm_versions)
        "async_scheduling": cfg.async_scheduling,
        "scheduling_policy": cfg.scheduling_policy,
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": cfg.max_model_len,
        "defaults_applied": defaulted,
        "block_size": cfg.block_size,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "device_memory_gib": perf.gpu.device_memory / gib,
        "weights_gib_per_gpu": perf.weight_bytes_per_gpu / gib,
        "activation_reserve_gb": cfg.activation_reserve_gb,
        "num_gpu_blocks": num_blocks,
        "num_gpu_blocks_overridden": bool(cfg.num_gpu_blocks_override),
        "kv_cache_tokens": num_blocks * cfg.block_size,
        "kv_cache_gib_per_gpu": num_blocks * cfg.block_size * perf.kv_bytes_per_token_per_gpu / gib,
    }


def resolved_engine(sc) -> dict:
    """`engine_summary` for a scenario before running it (for `twin validate`)."""
    perf = build_perf(sc)
    cfg = engine_config(sc)
    n = num_gpu_blocks(cfg, perf.gpu.device_memory, perf.weight_bytes_per_gpu, perf.kv_bytes_per_token_per_gpu)
    return engine_summary(sc, cfg, n, perf)
