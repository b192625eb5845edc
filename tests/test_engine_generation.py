"""Engine generation as a setting (`engine.vllm_version`, twin.specs.vllm_versions / twin.perf.generation): the
defaults follow the release, V0's prefill-only steps and in-process API server cost what they should, and the
host time kept in series under async scheduling is paid."""

import numpy as np
import pytest

import conftest
import test_fast_forward
import test_fork
from twin.sim.cluster import engine_config
from twin.specs.vllm_versions import generation, parse_vllm_version
from twin.errors import TwinInputError
from twin.perf.base import StepBatch
from twin.perf.registry import build_perf
from twin.scenario import parse_scenario
from twin.workload import build_stream

from conftest import make_scenario, run_checked, stream_of


def engine_of(**engine):
    raw = {k: v for k, v in conftest.BASE.items()}
    raw["cluster"] = dict(raw["cluster"], engine=engine)
    return parse_scenario(raw, "t")


@pytest.mark.parametrize("v, want", [("0.32", (0, 32)), ("0.5.4", (0, 5)), ("v0.6.3.post1", (0, 6)),
                                     ("0.10.1rc2", (0, 10)), ("1.0", (1, 0))])
def test_release_strings(v, want):
    assert parse_vllm_version(v) == want


def test_an_unambiguous_number_is_read_as_its_release():
    assert engine_of(vllm_version=0.32).cluster.engine.async_scheduling is True
    assert engine_of(vllm_version=0.12).cluster.engine.async_scheduling is False


@pytest.mark.parametrize("v", ["latest", "", "0", "0.x", "zero.5", "0.5.4 beta", None, 0.10, 0.5, True])
def test_bad_version_is_one_line(v):
    with pytest.raises(TwinInputError) as e:
        engine_of(vllm_version=v)
    msg = str(e.value)
    assert "\n" not in msg and "vllm_version" in msg and "Traceback" not in msg


def test_defaults_follow_the_release():
    e = engine_of().cluster.engine
    assert (e.vllm_version, e.async_scheduling, e.enable_chunked_prefill, e.enable_prefix_caching) == \
        ("0.32", True, True, True)
    e = engine_of(vllm_version="0.12").cluster.engine
    assert (e.async_scheduling, e.enable_chunked_prefill, e.enable_prefix_caching) == (False, True, True)
    e = engine_of(vllm_version="0.5.4").cluster.engine
    assert (e.async_scheduling, e.enable_chunked_prefill, e.enable_prefix_caching) == (False, False, False)
    # the scenario's own values win
    e = engine_of(vllm_version="0.12", async_scheduling=True, enable_prefix_caching=False).cluster.engine
    assert (e.async_scheduling, e.enable_prefix_caching) == (True, False)


def test_v0_batch_defaults():
    sc = engine_of(vllm_version="0.5.4", max_num_batched_tokens=None, max_num_seqs=None)
    cfg = engine_config(sc)
    assert cfg.max_num_seqs == 256
    assert cfg.max_num_batched_tokens == max(cfg.max_model_len, 2048)
    assert cfg.vllm_version == "0.5.4"


@pytest.mark.parametrize("v", ["0.5.4", "0.7", "0.9"])
def test_async_scheduling_refused_where_the_release_lacks_it(v):
    with pytest.raises(TwinInputError) as e:
        engine_of(vllm_version=v, async_scheduling=True)
    assert "\n" not in str(e.value) and "async_scheduling" in str(e.value)


def test_v1_default_is_unwrapped():
    sc = make_scenario()
    assert type(build_perf(sc)).__name__ == "RooflineModel"


def test_v0_prices_a_mixed_step_as_two_passes_plus_per_sequence_host():
    sc = make_scenario(**{"cluster.engine.vllm_version": "0.5.4"})
    perf = build_perf(sc)
    base = perf.base
    pre = StepBatch(num_prefill_tokens=512, prefill_attn_tokens=512 * 513 / 2, prefill_kv_read_tokens=512,
                    num_prefill_sampled=1, num_prefill_reqs=1)
    dec = StepBatch(num_decode_tokens=32, decode_context_tokens=32 * 600)
    mixed = StepBatch(num_prefill_tokens=512, prefill_attn_tokens=512 * 513 / 2, prefill_kv_read_tokens=512,
                      num_prefill_sampled=1, num_prefill_reqs=1, num_decode_tokens=32,
                      decode_context_tokens=32 * 600)
    host = sc.cluster.engine.v0_seq_host_s
    assert perf.step_time(mixed) == pytest.approx(base.step_time(pre) + base.step_time(dec) + 33 * host)
    assert perf.step_time(mixed) > base.step_time(mixed) + 33 * host  # the second pass's fixed costs
    assert perf.decode_run_times(32, 32 * 600, 3) == pytest.approx(
        [base.step_time(StepBatch(num_decode_tokens=32, decode_context_tokens=32 * 600 + s * 32)) + 32 * host
         for s in range(3)])
    # 0.6 moved the API server out of the engine's process: no per-sequence surcharge, still two passes
    p6 = build_perf(make_scenario(**{"cluster.engine.vllm_version": "0.6.3"}))
    assert p6.step_time(dec) == pytest.approx(base.step_time(dec))
    assert p6.step_time(mixed) == pytest.approx(base.step_time(pre) + base.step_time(dec))


def test_ideal_v0_stays_under_the_model():
    perf = build_perf(make_scenario(**{"cluster.engine.vllm_version": "0.5.4"}))
    b = StepBatch(num_prefill_tokens=300, prefill_attn_tokens=300 * 301 / 2, prefill_kv_read_tokens=300,
                  num_prefill_sampled=1, num_prefill_reqs=1, num_decode_tokens=8, decode_context_tokens=8 * 200)
    assert 0 < perf.ideal().step_time(b) < perf.step_time(b)
    assert "v0_seq_host_s" in perf.describe()["engine_generation"]["assumptions"]


def itl_of(version, exposed=0.0, **eng):
    """Mean ITL and E2E of a small steady load: 24 requests, 300-token prompts, 64 outputs, 40 req/s."""
    kw = {"cluster.engine.vllm_version": version, "cluster.engine.async_scheduling": None,
          "cluster.engine.async_exposed_request_s": exposed,
          "cluster.engine.max_num_batched_tokens": None}  # each release's default: 8192 on an H100 for all
    kw.update({f"cluster.engine.{k}": v for k, v in eng.items()})
    sc = make_scenario(**kw)
    n = 24
    arr = np.arange(n) / 40.0
    res = run_checked(sc, stream_of(arr, [300] * n, [64] * n))
    itl = res.instances[0].scheduler.stats.itl.arrays()
    mean_itl = float(np.sum(itl[0] * itl[1]) / np.sum(itl[1]))
    e2e = float(np.mean(res.log.finish_s - res.log.arrival_s))
    return mean_itl, e2e


def test_itl_ordering_v0_then_v1_then_v1_async():
    v0, v0_6 = itl_of("0.5.4"), itl_of("0.7")
    v1, v1a = itl_of("0.12"), itl_of("0.32")
    assert v0[0] > v0_6[0] > v1[0] > v1a[0]
    assert v0[1] > v0_6[1] > v1[1] > v1a[1]


def test_exposed_host_time_is_paid_under_async():
    free, part = itl_of("0.32"), itl_of("0.32", exposed=20e-6)
    sync = itl_of("0.12")
    assert free[0] < part[0] <= sync[0]
    # exposing more than the host time exposes all of it: the synchronous step's time again (the decisions
    # still come one step early, which moves a few steps: hence not to the bit)
    assert itl_of("0.32", exposed=1.0)[0] == pytest.approx(sync[0], rel=1e-3)


@pytest.fixture
def v0_base(monkeypatch):
    """V0 with chunked prefill on (its 0.5 option): the shared scenarios' budgets are below max_model_len."""
    monkeypatch.setitem(conftest.BASE["cluster"]["engine"], "vllm_version", "0.5.4")
    monkeypatch.setitem(conftest.BASE["cluster"]["engine"], "enable_chunked_prefill", True)


@pytest.mark.parametrize("name", [n for n in test_fast_forward.SCENARIOS if "priority" not in n])  # V1's policy
def test_fast_and_step_modes_agree_on_v0(name, v0_base):
    sc = make_scenario(**test_fast_forward.SCENARIOS[name])
    assert type(build_perf(sc)).__name__ == "GenerationModel"
    fast, step = test_fast_forward.both_modes(sc, build_stream(sc))
    test_fast_forward.assert_same(fast, step)


@pytest.mark.parametrize("mode", ["fast", "step"])
def test_the_fork_is_exact_on_v0(mode, v0_base):
    test_fork.test_fork_advanced_alone_equals_the_original_with_no_more_arrivals(mode, 60, 0)
    test_fork.test_a_request_added_to_a_fork_is_served_as_the_original_serves_an_arrival(mode, 60, 0)


def test_no_chunked_prefill_needs_a_budget_of_max_model_len():
    """vLLM refuses max_num_batched_tokens < max_model_len without chunked prefill (a longer prompt would never
    be scheduled); V0 leaves chunked prefill off by default, so a small budget there is refused too."""
    for engine in ({"enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
                   {"vllm_version": "0.5.4", "max_num_batched_tokens": 2048}):
        with pytest.raises(TwinInputError) as e:
            engine_config(engine_of(**engine))
        assert "\n" not in str(e.value) and "max_model_len" in str(e.value)
    assert engine_config(engine_of(vllm_version="0.5.4", max_num_batched_tokens=2048, max_model_len=2048))
