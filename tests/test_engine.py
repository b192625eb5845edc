"""The engine behaves as vLLM V1 does, and accounts for every request and every KV block."""

import numpy as np
import pytest

from twin.sim.cluster import Cluster, build_perf
from twin.perf import StepBatch
from twin.workload import build_stream

from conftest import kv_blocks, make_scenario, run_checked, stream_of


def prefill_batch(n, c=0, sampled=1):
    return StepBatch(num_prefill_tokens=n, prefill_attn_tokens=n * c + n * (n + 1) / 2,
                     prefill_kv_read_tokens=c + n, num_prefill_sampled=sampled, num_prefill_reqs=1)


def test_lone_request_ttft_is_the_step_models_prefill_time():
    sc = make_scenario()
    res = run_checked(sc, stream_of([1.0], [1000], [5]))
    ttft = res.log.first_token_s[0] - res.log.arrival_s[0]
    assert ttft == pytest.approx(build_perf(sc).step_time(prefill_batch(1000)), rel=1e-12)
    assert res.log.scheduled_s[0] == res.log.arrival_s[0]


def test_chunked_prefill_ttft_is_the_sum_of_its_chunks():
    sc = make_scenario(**{"cluster.engine.max_num_batched_tokens": 512})
    res = run_checked(sc, stream_of([0.0], [1200], [3]))
    perf = build_perf(sc)
    expected = (perf.step_time(prefill_batch(512, 0, 0)) + perf.step_time(prefill_batch(512, 512, 0))
                + perf.step_time(prefill_batch(176, 1024, 1)))
    assert res.log.first_token_s[0] == pytest.approx(expected, rel=1e-12)


def test_decode_steps_follow_the_first_token():
    sc = make_scenario()
    res = run_checked(sc, stream_of([0.0], [100], [4]))
    perf = build_perf(sc)
    d = [perf.step_time(StepBatch(num_decode_tokens=1, decode_context_tokens=101 + s)) for s in range(3)]
    assert res.log.finish_s[0] - res.log.first_token_s[0] == pytest.approx(sum(d), rel=1e-12)


def test_prefix_cache_hits_when_two_requests_share_a_prefix():
    sc = make_scenario()
    shared = list(range(10))  # 10 blocks of 16 tokens
    ids = [shared + [100, 101], shared + [200, 201]]
    res = run_checked(sc, stream_of([0.0, 5.0], [192, 192], [4, 4], ids, hash_block_size=16))
    assert res.log.cached_tokens[0] == 0
    assert res.log.cached_tokens[1] == 160
    stats = res.instances[0].scheduler.stats
    assert stats.prefix_cache_hits == 160 and stats.prefix_cache_queries == 384


@pytest.mark.parametrize("prompt,hit", [(32, 16), (33, 32)])
def test_the_last_token_is_always_recomputed(prompt, hit):
    sc = make_scenario()
    ids = [[1, 2, 3], [1, 2, 3]]
    res = run_checked(sc, stream_of([0.0, 5.0], [prompt, prompt], [2, 2], ids, hash_block_size=16))
    assert res.log.cached_tokens[1] == hit


def test_mooncake_style_512_token_ids_map_onto_16_token_blocks():
    sc = make_scenario()
    ids = [[7, 8, 9], [7, 8, 10]]  # share the first two 512-token blocks
    res = run_checked(sc, stream_of([0.0, 5.0], [1500, 1500], [2, 2], ids, hash_block_size=512))
    assert res.log.cached_tokens[1] == 1024


def test_without_prefix_caching_nothing_hits():
    sc = make_scenario(**{"cluster.engine.enable_prefix_caching": False})
    ids = [[1, 2, 3, 4], [1, 2, 3, 4]]
    res = run_checked(sc, stream_of([0.0, 5.0], [64, 64], [2, 2], ids, hash_block_size=16))
    assert res.log.cached_tokens[1] == 0


def test_preemption_under_a_tiny_kv_pool_and_everyone_still_finishes():
    sc = make_scenario(**{**kv_blocks(60),
                          "workload.num_requests": 30, "workload.arrival.rate": 50})
    res = run_checked(sc, build_stream(sc))
    assert res.log.preemptions.sum() > 0
    assert (res.log.status == 4).all()


def test_preempted_request_recomputes_and_reports_one_large_itl():
    sc = make_scenario(**kv_blocks(30))
    # two requests that cannot both hold their full sequences: the later one is preempted
    res = run_checked(sc, stream_of([0.0, 0.0], [200, 200], [100, 100]))
    assert res.log.preemptions.sum() >= 1
    itl = res.instances[0].scheduler.stats.itl.arrays()[0].max()
    step = build_perf(sc).step_time(StepBatch(num_decode_tokens=1, decode_context_tokens=300))
    assert itl > 5 * step


def test_a_request_longer_than_max_model_len_is_rejected_with_a_reason():
    """vLLM answers prompt + max_tokens past max_model_len with HTTP 400; on a small pool max_model_len is small
    (vLLM refuses to start a pool short of one such request: tests/test_vllm_refusals.py)."""
    sc = make_scenario(**kv_blocks(10))
    res = run_checked(sc, stream_of([0.0, 1.0], [500, 50], [10, 10]))
    assert res.log.status[0] == 5 and "max_model_len" in res.log.reject_reason[0]
    assert res.log.status[1] == 4


def peak_running(**overrides) -> int:
    """The most requests the running list ever held, stepping the run event by event."""
    sc = make_scenario(**{"workload.num_requests": 20, "workload.arrival.rate": 1000, **overrides})
    cl = Cluster(sc, build_stream(sc))
    peak = 0
    sched = cl.instances[0].scheduler
    while cl.env.peek() < float("inf") and not cl.done():
        cl.env.step()
        peak = max(peak, len(sched.running))
    return peak


def test_max_num_seqs_caps_the_running_batch():
    assert peak_running(**{"cluster.engine.max_num_seqs": 4}) == 4


def test_max_num_active_seqs_caps_admission_below_max_num_seqs():
    """vLLM 0.32's --max-num-active-seqs admits at most that many into RUNNING; max_num_seqs keeps its meaning."""
    assert peak_running(**{"cluster.engine.max_num_seqs": 16, "cluster.engine.max_num_active_seqs": 3}) == 3


def test_max_num_active_seqs_above_max_num_seqs_is_refused_as_vllm_refuses():
    from twin.errors import TwinInputError

    sc = make_scenario(**{"cluster.engine.max_num_seqs": 16, "cluster.engine.max_num_active_seqs": 17})
    with pytest.raises(TwinInputError, match="max_num_active_seqs .17. cannot be greater than max_num_seqs .16."):
        Cluster(sc, build_stream(sc))


ADMISSION_LOAD = {"workload.num_requests": 400, "workload.arrival.rate": 200, "workload.lengths.prompt_tokens": 500,
                  "workload.lengths.output_tokens": 200}


@pytest.mark.parametrize("knob, value", [("max_num_queued_reqs", 20), ("max_num_queued_tokens", 3000)])
def test_vllms_admission_limits_answer_503_and_bound_the_queue(knob, value):
    """vLLM 0.32's --max-num-queued-reqs / --max-num-queued-tokens (`AsyncLLM.check_admission`): past them a new
    request is refused (503) at the API server; every request is still accounted for, and TTFT stays bounded."""
    from twin.sim.metrics import summarize

    free = summarize(run_checked(make_scenario(**ADMISSION_LOAD), build_stream(make_scenario(**ADMISSION_LOAD))))
    sc = make_scenario(**ADMISSION_LOAD, **{f"cluster.engine.{knob}": value})
    res = run_checked(sc, build_stream(sc))
    s = summarize(res)
    assert free["requests_rejected"] == 0
    assert s["reject_reasons"] == {"refused by vLLM's admission (503)": s["requests_rejected"]}
    assert 0 < s["requests_rejected"] < 400
    assert s["ttft_s"]["p99"] < free["ttft_s"]["p99"] / 5
    reasons = [r for r in res.log.reject_reason.values()]
    assert all(knob in r for r in reasons)


def test_the_admission_count_is_the_engines_own_requests_at_the_arrival():
    sc = make_scenario(**ADMISSION_LOAD, **{"cluster.engine.max_num_queued_reqs": 1})
    res = run_checked(sc, build_stream(sc))
    log = res.log
    fin = np.flatnonzero(log.status == 4)
    # with one request at a time, the finished ones never overlap
    order = fin[np.argsort(log.arrival_s[fin])]
    assert (log.arrival_s[order][1:] >= log.finish_s[order][:-1]).all()


def test_same_seed_same_results_and_another_seed_differs():
    sc = make_scenario(**{"workload.num_requests": 200, "workload.arrival.rate": 40,
                          "cluster.num_instances": 3, "router.name": "random"})
    a = run_checked(sc, build_stream(sc)).log.to_frame()
    b = run_checked(sc, build_stream(sc)).log.to_frame()
    assert a.equals(b)
    sc2 = make_scenario(**{"workload.num_requests": 200, "workload.arrival.rate": 40, "seed": 2,
                           "cluster.num_instances": 3, "router.name": "random"})
    c = run_checked(sc2, build_stream(sc2)).log.to_frame()
    assert not a["finish_s"].equals(c["finish_s"])


def test_max_sim_time_leaves_requests_running_not_lost():
    sc = make_scenario(**{"workload.num_requests": 100, "workload.arrival.rate": 10,
                          "sim.max_sim_time_s": 3.0})
    res = run_checked(sc, build_stream(sc))
    st = res.log.status
    assert (st == 0).sum() > 0  # not yet arrived
    assert ((st == 1) | (st == 2)).sum() > 0 or (st == 4).sum() > 0
    assert res.sim_time_s == pytest.approx(3.0)


def test_a_preempted_request_hits_its_own_surviving_blocks_when_resumed():
    """vLLM keeps a preempted request's full blocks hashed in the free queue; its recompute hits them."""
    sc = make_scenario(**kv_blocks(30))
    stream = stream_of([0.0, 0.0], [200, 200], [100, 100])
    cl = Cluster(sc, stream)
    sched = cl.instances[0].scheduler
    seen = []
    while cl.env.peek() < float("inf") and not cl.done():
        cl.env.step()
        for r in sched.waiting:
            if r.num_preemptions and r.own_run is not None:
                seen.append(sched.kv.lookup(r)[1])
    assert seen and max(seen) >= 200 // 16  # at least its prompt's full blocks are still there


def test_a_turn_sent_while_the_previous_answer_streams_hits_the_blocks_it_filled():
    """vLLM caches each decode block as it fills (`allocate_slots` caches up to num_tokens)."""
    from twin.lab.parity import ParityRequest, Workload, run_twin

    prompt = list(range(1, 33))  # 2 blocks
    answer = list(range(100, 164))  # 64 output tokens
    a = ParityRequest(0, prompt, answer, arrival_step=0)
    b = ParityRequest(1, prompt + answer + [7] * 10, [5, 5], arrival_step=40)
    for mode in ("step", "fast"):
        tr = run_twin(Workload("streaming", [a, b]), mode)
        # step 0 prefills A; at step s A's decode caches up to 32 + s tokens: at step 40, 4 full blocks
        assert tr.cached == {0: 0, 1: 64}, mode
        assert tr.finish[0] == 63


def test_the_run_ends_when_the_last_request_does_whatever_the_progress_slices():
    """sim_time_s is the engine's last finish (it drives cost and GPU-seconds), not a progress slice's end."""
    sc = make_scenario(**{"workload.num_requests": 60, "workload.arrival.rate": 20, "cluster.num_instances": 2,
                          "cluster.perf.api_queue": "off"})
    ends = []
    for slices, progress in ((200, lambda now, n: None), (7, lambda now, n: None), (200, None)):
        cl = Cluster(sc, build_stream(sc))
        res = cl.run(progress, slices=slices)
        assert (res.log.status == 4).all()
        shift = cl.api_token_s()  # client-side times are the engine's plus the API server's per-token time
        assert res.sim_time_s == pytest.approx(float(np.max(res.log.finish_s)) - shift, abs=1e-12)
        ends.append(res.sim_time_s)
    assert ends[0] == ends[1] == ends[2]


def test_a_stop_test_ends_the_run_at_a_slice_and_changes_nothing_before():
    """`run(stop=...)`: a caller with its answer (the live twin scaler's verdict) ends the run at the first slice
    where stop() is true; one never true changes no result (the slices only cut the event loop)."""
    sc = make_scenario(**{"workload.num_requests": 200, "workload.arrival.rate": 40, "cluster.num_instances": 2})
    full = Cluster(sc, build_stream(sc)).run()
    looks: list[float] = []
    cl = Cluster(sc, build_stream(sc))
    same = cl.run(stop=lambda: looks.append(cl.clock.now) or False)
    assert len(looks) > 100  # it looked while requests arrived and while the engines drained
    for col in ("first_token_s", "finish_s", "status"):
        assert np.array_equal(getattr(same.log, col), getattr(full.log, col), equal_nan=col != "status")
    cl = Cluster(sc, build_stream(sc))
    cut = cl.run(stop=lambda: cl.num_arrived >= 50)
    assert 50 <= cut.log.n - int((cut.log.status == 0).sum()) < 200  # later requests never arrived
    assert cut.sim_time_s < full.sim_time_s and (cut.log.status == 4).sum() < 200
