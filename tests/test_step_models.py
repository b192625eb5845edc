"""Step models by name (`perf.kind`), the fitted model's basis and file format, and any protocol object in a Cluster."""

import json
import typing

import pytest
import yaml

from conftest import make_scenario, run_checked, stream_of
from twin.sim.cluster import Cluster, build_perf
from twin.errors import TwinInputError
from twin.sim.metrics import summarize
from twin.perf import STEP_MODELS, FittedModel, RooflineModel, StepBatch, StepTimeModel
from twin.perf.base import decode_run_times_by_steps
from twin.perf.fitted import COEFFICIENTS
from twin.scenario import PerfSpec

ONES = {**{k: 1.0 for k in ("linear", "prefill_attn", "decode_attn", "lm_head", "allreduce")},
        "step_s": 0.0, "per_request_s": 0.0}
BATCHES = [StepBatch(num_prefill_tokens=700, prefill_attn_tokens=700 * 701 / 2, prefill_kv_read_tokens=700,
                     num_prefill_sampled=1, num_prefill_reqs=1),
           StepBatch(num_decode_tokens=90, decode_context_tokens=90 * 1200),
           StepBatch(num_prefill_tokens=300, prefill_attn_tokens=300 * 2000.0, prefill_kv_read_tokens=2000,
                     num_prefill_reqs=2, num_decode_tokens=40, decode_context_tokens=40 * 800)]


def write_fit(tmp_path, coefficients=None, name="fit.yaml", **extra):
    doc = {"basis": "roofline-groups/1", "coefficients": dict(ONES if coefficients is None else coefficients),
           "fit": {"data": "test"}, **extra}
    p = tmp_path / name
    p.write_text(json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc))
    return p


def fitted_scenario(path, **kw):
    return make_scenario(**{"cluster.perf": {"kind": "fitted", "fit_path": str(path), "api_request_overhead_s": 0.0,
                                             "api_prompt_token_s": 0.0, "api_output_token_s": 0.0}, **kw})


def test_registry_covers_every_perf_kind():
    kinds = typing.get_args(PerfSpec.model_fields["kind"].annotation)
    assert set(STEP_MODELS) == set(kinds) - {"auto"} == {"roofline", "fitted"}  # auto: resolved by the cluster
    assert isinstance(build_perf(make_scenario()), RooflineModel)  # the tests' base pins the roofline


@pytest.mark.parametrize("tp", [1, 2])
def test_unit_coefficients_reproduce_the_ideal_roofline(tmp_path, tp):
    """The basis is the ideal roofline's group times: all-ones coefficients and no CPU terms give the floor."""
    fm = build_perf(fitted_scenario(write_fit(tmp_path), **{"cluster.tensor_parallel": tp}))
    assert isinstance(fm, FittedModel)
    for b in BATCHES:
        assert fm.step_time(b) == pytest.approx(fm.ideal().step_time(b), rel=1e-12)


def test_each_coefficient_scales_its_own_term(tmp_path):
    for key in COEFFICIENTS:
        coef = dict(ONES)
        coef[key] += 2.0
        fm = build_perf(fitted_scenario(write_fit(tmp_path, coef, name=f"{key}.yaml"), **{"cluster.tensor_parallel": 2}))
        b = BATCHES[2]
        g = fm.ideal().group_times(b)
        extra = {"step_s": 1.0, "per_request_s": b.num_requests}.get(key, g.get(key, 0.0))
        assert fm.step_time(b) - fm.ideal().step_time(b) == pytest.approx(2.0 * extra, rel=1e-9), key
        assert fm.step_time(StepBatch()) == 0.0


def test_fitted_decode_runs_equal_its_steps_and_it_runs_in_a_cluster(tmp_path):
    coef = {"linear": 1.4, "prefill_attn": 1.2, "decode_attn": 1.9, "lm_head": 1.1, "allreduce": 1.8,
            "step_s": 1.26e-4, "per_request_s": 4e-6}
    sc = fitted_scenario(write_fit(tmp_path, coef, name="fit.json"))
    fm = build_perf(sc)
    for nd, c0, k in ((37, 37 * 900, 50), (1, 3, 9)):
        assert fm.decode_run_times(nd, c0, k) == decode_run_times_by_steps(fm, nd, c0, k)
    res = run_checked(sc, stream_of([0.0, 0.05, 0.1], [500, 800, 300], [30, 20, 40]))
    s = summarize(res)
    assert s["perf_model"]["kind"] == "fitted" and s["perf_model"]["coefficients"] == coef
    assert s["perf_model"]["fit"] == {"data": "test"}
    assert s["physics_ok"]
    ttft = res.log.first_token_s[0] - res.log.arrival_s[0]
    lone = StepBatch(num_prefill_tokens=500, prefill_attn_tokens=500 * 501 / 2, prefill_kv_read_tokens=500,
                     num_prefill_sampled=1, num_prefill_reqs=1)
    assert ttft == pytest.approx(fm.step_time(lone), rel=1e-12)


@pytest.mark.parametrize("kind", ["fitted", "roofline", "moe fitted"])
def test_the_engines_closed_form_of_a_decode_step_is_the_models_own_to_the_bit(tmp_path, kind):
    """The engine plans a decode run from `decode_params` (twin.engine.scheduler `decode_run_plan`), so its
    closed form must be each step's time exactly as `decode_run_times` and `step_time` give it; a model that
    wraps another (forwarding unknown attributes to it), or any other protocol object, is not taken for closed form."""
    from twin.perf.fitted import closed_form_decode
    from twin.perf.generation import GenerationModel
    from twin.specs.vllm_versions import generation

    coef = {"linear": 1.4, "prefill_attn": 1.2, "decode_attn": 1.9, "lm_head": 1.1, "allreduce": 1.8,
            "step_s": 1.26e-4, "per_request_s": 4e-6, "per_layer_s": 2e-5, "per_request_gpu_s": 1.5e-5}
    kw = {"cluster.tensor_parallel": 2}
    if kind == "moe fitted":
        kw.update({"cluster.model": "gpt-oss-120b"})
    sc = make_scenario(**kw) if kind == "roofline" else fitted_scenario(write_fit(tmp_path, coef), **kw)
    m = build_perf(sc)
    assert closed_form_decode(m)
    for nd, c0, k in ((37, 37 * 900, 50), (1, 3, 9), (256, 256 * 7000, 20)):
        attn_s, kv_s, cd, rest = m.decode_params(nd)
        steps, ctx = [], c0
        for _ in range(k):
            a, c = attn_s * ctx, kv_s * (ctx + nd)
            steps.append((0.0 + cd * (a if a > c else c)) + rest)
            ctx += nd
        assert steps == m.decode_run_times(nd, c0, k) == decode_run_times_by_steps(m, nd, c0, k)
    wrapped = GenerationModel(m, generation("0.5.4"), v0_seq_host_s=1e-4)
    assert hasattr(wrapped, "decode_params") and not closed_form_decode(wrapped)  # forwarded, not its own
    assert not closed_form_decode(Doubled(m))  # any other protocol object: its own decode_run_times


@pytest.mark.parametrize("kind", ["fitted", "roofline"])
@pytest.mark.parametrize("tp", [1, 8])  # at TP 8 a decode step's GPU time is below the 2 ms of CPU
def test_an_async_decode_runs_closed_form_plan_is_the_general_plan_to_the_bit(tmp_path, kind, tp):
    """`AsyncScheduler.decode_run_plan` drops the hidden-CPU selection once a step of the run covers the host
    time. The step before the run (a prefill, say) may have covered it while the run's first step does not:
    the plan must still equal, to the bit, the general plan from the model's `decode_run_times`."""
    kw = {"cluster.engine.async_scheduling": True, "cluster.tensor_parallel": tp}
    sc = make_scenario(**kw) if kind == "roofline" else fitted_scenario(write_fit(tmp_path), **kw)
    sched = Cluster(sc, stream_of([0.0], [16], [4])).instances[0].scheduler
    assert sched.async_scheduling and sched._closed_form
    g = sched.group
    checked = 0
    for nd in (1, 2, 3, 8, 64, 200):
        c = sched._host_s(nd)
        attn_s, kv_s, cd, rest = sched.perf.decode_params(nd)
        x0 = (0.0 + cd * max(attn_s * nd * 50, kv_s * nd * 51)) + rest
        for ctx in (nd * 50, nd * 900, nd * 4000):
            for prev in (0.0, c / 2, c, x0 - c, 2 * c, 0.5):  # below, at and above the CPU time, and a long prefill's
                plans = []
                for closed in (True, False):
                    sched._closed_form = closed
                    g.num_decode, g.decode_context, sched.prev_gpu_s = nd, ctx, prev
                    plans.append(sched.decode_run_plan(40, 3.0))
                sched._closed_form = True
                assert plans[0] == plans[1], (nd, ctx, prev)
                checked += 1
    assert checked == 6 * 3 * 6


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("basis"), "basis must be 'roofline-groups/1'"),
    (lambda d: d["coefficients"].pop("decode_attn"), "missing decode_attn"),
    (lambda d: d["coefficients"].update(gpu_bubble=1.0), "unknown gpu_bubble"),
    (lambda d: d["coefficients"].update(linear=-1), "coefficients.linear must be a number >= 0"),
    (lambda d: d["coefficients"].update(linear="fast"), "coefficients.linear must be a number >= 0"),
    # physics first: a slowdown under 1 runs a group faster than the hardware's peak
    (lambda d: d["coefficients"].update(decode_attn=0.5), "coefficients.decode_attn is a slowdown .* at least 1"),
    (lambda d: d["coefficients"].update(compute=0.9), "coefficients.compute is a slowdown .* at least 1"),
    (lambda d: d.update(hardware="A100-SXM-80GB"), "fitted for hardware 'A100-SXM-80GB'"),
    (lambda d: d.update(tensor_parallel=4), "fitted for tensor_parallel 4"),
    (lambda d: d.pop("coefficients"), "coefficients: missing"),
])
def test_bad_coefficient_files_get_one_clear_line(tmp_path, edit, message):
    doc = {"basis": "roofline-groups/1", "coefficients": dict(ONES)}
    edit(doc)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(TwinInputError, match=message):
        build_perf(fitted_scenario(p))


def test_fit_for_the_same_hardware_and_model_by_alias_is_accepted(tmp_path):
    fm = build_perf(fitted_scenario(write_fit(tmp_path, hardware="h100", model="meta-llama/Meta-Llama-3-8B",
                                              dtype="bf16", tensor_parallel=1)))
    assert isinstance(fm, FittedModel)


def test_fitted_needs_a_readable_file(tmp_path):
    with pytest.raises(TwinInputError, match="needs fit_path"):
        make_scenario(**{"cluster.perf": {"kind": "fitted"}})
    with pytest.raises(TwinInputError, match="is not a file"):
        build_perf(fitted_scenario(tmp_path / "nope.yaml"))
    bad = tmp_path / "binary.yaml"
    bad.write_bytes(b"\xff\xfe\x00garbage: [")
    with pytest.raises(TwinInputError, match="not a valid YAML/JSON"):
        build_perf(fitted_scenario(bad))


class Doubled:
    """A user's own step model: twice the roofline. Only the protocol's members."""

    def __init__(self, inner: RooflineModel):
        self.inner = inner
        self.gpu = inner.gpu

    def step_time(self, b):
        return 2 * self.inner.step_time(b)

    def decode_run_times(self, num_decode, context0, k):
        return [2 * t for t in self.inner.decode_run_times(num_decode, context0, k)]

    weight_bytes_per_gpu = property(lambda self: self.inner.weight_bytes_per_gpu)
    kv_bytes_per_token_per_gpu = property(lambda self: self.inner.kv_bytes_per_token_per_gpu)

    def peak_tokens_per_s(self):
        return self.inner.peak_tokens_per_s()

    def ideal(self):
        return self.inner.ideal()

    def describe(self):
        return {"kind": "doubled"}

    def api_request_s(self, prompt_tokens):
        return 0.0

    def api_token_s(self):
        return 0.0


@pytest.mark.parametrize("mode", ["fast", "step"])
def test_a_cluster_takes_any_step_model_object(mode):
    sc = make_scenario(**{"sim.mode": mode})
    mine: StepTimeModel = Doubled(build_perf(sc))
    stream = stream_of([0.0, 0.01, 0.02], [400, 300, 200], [50, 60, 70])
    base = Cluster(sc, stream).run()
    res = Cluster(sc, stream, perf=mine).run()
    assert res.perf is mine
    e2e = lambda r: r.log.finish_s - r.log.arrival_s  # noqa: E731
    assert (e2e(res) > 1.9 * e2e(base)).all() and (e2e(res) < 2.1 * e2e(base)).all()
    s = summarize(res)
    assert s["perf_model"] == {"kind": "doubled"} and s["physics_ok"]


@pytest.mark.parametrize("knob", ["layer_overhead_s", "step_overhead_s", "compute_efficiency"])
def test_a_roofline_correction_beside_a_fitted_profile_is_refused_not_ignored(knob):
    """The fitted model fits its own fixed costs (per_layer_s is layer_overhead_s's term): one line, no silent loss."""
    with pytest.raises(TwinInputError, match=f"{knob}: roofline corrections"):
        make_scenario(**{"cluster.perf": {"kind": "fitted", "profile": "h100-vllm", knob: 0.5}})
    assert make_scenario(**{"cluster.perf": {"kind": "roofline", knob: 0.5}}).cluster.perf.kind == "roofline"


def test_a_coefficients_file_is_parsed_once_per_version_and_handed_out_as_a_copy(tmp_path):
    """Every Cluster of a fitted scenario reads its file (the live Block router: one per candidate per decision):
    it is parsed once per version, a caller's edits never reach the next reader, and a rewritten file is re-read."""
    import os

    from twin.perf.fitted import _read_fit, read_fit

    p = write_fit(tmp_path)
    _read_fit.cache_clear()
    a = read_fit(p)
    a["coefficients"]["linear"] = 99.0
    b = read_fit(p)
    assert b["coefficients"]["linear"] == 1.0 and _read_fit.cache_info().hits == 1
    doc = yaml.safe_load(p.read_text())
    doc["coefficients"]["linear"] = 1.5
    p.write_text(yaml.safe_dump(doc))
    os.utime(p, ns=(os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns + 1_000_000))  # a later version, whatever its size
    assert read_fit(p)["coefficients"]["linear"] == 1.5
