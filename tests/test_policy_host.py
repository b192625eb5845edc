"""One seam for both worlds (twin.policy.host): the simulator's dispatcher and the live controller are adapters
over the same PolicyHost. One event script driven through both must leave the same books, recent window,
prefix index and hook calls; a policy that raises is handled by one rule; a predictor runs live too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import make_scenario, run_checked, stream_of
from twin.policy import RouterBase
from twin.policy.host import PolicyHost, RouterError, expected_output_tokens
from twin.policy.views import Reject, RequestView
from twin.sim.dispatcher import Dispatcher
from twin.sim.environment import Environment

pytest.importorskip("aiohttp")
from live.config import parse_config  # noqa: E402
from live.controller import Controller  # noqa: E402


class Recorder(RouterBase):
    name = "recorder"
    prefix_index = "approximate"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def choose(self, req, fleet):
        return fleet.instances[0].id

    def on_dispatch(self, req, instance_id, now):
        self.calls.append(("dispatch", req.id, instance_id, now))

    def on_first_token(self, req, instance_id, now):
        self.calls.append(("first", req.id, instance_id, now))

    def on_finish(self, req, instance_id, now, output_tokens):
        self.calls.append(("finish", req.id, instance_id, now, output_tokens))


def fake_instance(i: int) -> SimpleNamespace:
    """What the dispatcher reads of an instance, without an engine."""
    cfg = SimpleNamespace(block_size=16, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096)
    return SimpleNamespace(id=f"w{i}", state="serving", config=cfg, pool=SimpleNamespace(num_gpu_blocks=100),
                           num_running=0, num_waiting=0, kv_usage=0.0, serving_since=0.0)


REQS = [RequestView(f"r{i}", float(i), 100 + 10 * i, 50, (1, 2, 3 + i), 16, None, 0, 30.0 + i, None)
        for i in range(3)]
# (time, event, request index, worker, output tokens)
SCRIPT = [(0.0, "dispatch", 0, "w0", 0), (1.0, "dispatch", 1, "w1", 0), (1.5, "first", 0, "w0", 0),
          (2.0, "dispatch", 2, "w0", 0), (2.5, "first", 1, "w1", 0), (3.0, "finish", 0, "w0", 40),
          (3.5, "first", 2, "w0", 0), (4.0, "finish", 1, "w1", 7)]


def drive_sim(router) -> PolicyHost:
    env = Environment()
    d = Dispatcher(env, router, [fake_instance(0), fake_instance(1)], scrape_interval_s=0.0,
                   prefix_index="approximate")
    idx = {r.id: k for k, r in enumerate(REQS)}
    for t, ev, k, w, out in SCRIPT:
        env.run(until=t) if t > env.now else None
        r = REQS[k]
        if ev == "dispatch":
            d.dispatched(idx[r.id], r, w)
        elif ev == "first":
            d.first_token(idx[r.id], t)
        else:
            d.finished(idx[r.id], out)
    return d.host


def drive_live(router) -> PolicyHost:
    cfg = parse_config({"workers": [{"id": "w0", "url": "http://127.0.0.1:1"},
                                    {"id": "w1", "url": "http://127.0.0.1:2"}],
                        "router": {"prefix_index": "approximate"}})
    ctl = Controller(cfg, router=router)
    for t, ev, k, w, out in SCRIPT:
        r = REQS[k]
        if ev == "dispatch":
            ctl.dispatched(r, w, t)
        elif ev == "first":
            ctl.first_token(r, w, t)
        else:
            ctl.finished(r, w, t, out)
    return ctl.host


def test_one_event_script_leaves_the_same_books_window_index_and_hook_calls_in_both_worlds():
    sim_router, live_router = Recorder(), Recorder()
    sim, live = drive_sim(sim_router), drive_live(live_router)
    assert sim_router.calls == live_router.calls and len(sim_router.calls) == len(SCRIPT)
    for w in ("w0", "w1"):
        assert sim.bookkeeping.load(w) == live.bookkeeping.load(w)
    assert sim.bookkeeping.load("w0").requests == 1  # r2 still in flight, decoding with its predicted length
    assert sim.bookkeeping.load("w0").decode_tokens == REQS[2].num_prompt_tokens + 32
    assert list(sim.signals.arrivals) == list(live.signals.arrivals) == [(0.0, 100), (1.0, 110), (2.0, 120)]
    assert [(c.t, c.ttft_s, c.e2e_s, c.output_tokens) for c in sim.signals.completions] == \
           [(c.t, c.ttft_s, c.e2e_s, c.output_tokens) for c in live.signals.completions] == \
           [(3.0, 1.5, 3.0, 40), (4.0, 1.5, 3.0, 7)]
    for r in REQS:
        assert sim.index.match(r.prefix, ["w0", "w1"]) == live.index.match(r.prefix, ["w0", "w1"])
    assert sim.index.kind == live.index.kind == "approximate"


def test_expected_output_is_the_prediction_then_the_cap_then_zero():
    r = REQS[0]
    assert expected_output_tokens(r) == 30
    assert expected_output_tokens(RequestView("a", 0.0, 10, 50)) == 50
    assert expected_output_tokens(RequestView("a", 0.0, 10, None)) == 0


class BadHooks(Recorder):
    def on_finish(self, req, instance_id, now, output_tokens):
        raise RuntimeError("hook bug")


def test_a_raising_hook_drops_nothing_and_is_counted_in_both_worlds():
    assert drive_sim(BadHooks()).hook_errors == {"on_finish": 2}
    live = drive_live(BadHooks())
    assert live.hook_errors == {"on_finish": 2}
    assert live.bookkeeping.in_flight() == 1  # the two finished requests left the books all the same


def test_a_simulation_with_a_raising_hook_finishes_every_request_and_reports_the_errors():
    res = run_checked(make_scenario(), stream_of([0.0, 0.1, 0.2], [100, 100, 100], [5, 5, 5]), router=BadHooks())
    assert (res.log.status == 4).all()
    assert res.router_info["hook_errors"] == {"on_finish": 3}


class Broken(RouterBase):
    name = "broken"

    def choose(self, req, fleet):
        raise RuntimeError("boom")


def test_a_raising_router_is_one_rule_raise_or_reject():
    fleet = SimpleNamespace(instances=[])
    host = PolicyHost(Broken())
    with pytest.raises(RouterError, match="router 'broken' raised RuntimeError: boom while routing request r0"):
        host.choose(REQS[0], fleet)
    host = PolicyHost(Broken(), on_error="reject")
    got = host.choose(REQS[0], fleet)
    assert isinstance(got, Reject) and got.reason == "router error: RuntimeError: boom" and got.router_error
    assert host.hook_errors == {"choose": 1}


def test_a_predictor_in_the_live_config_fills_the_view_and_learns_from_finishes():
    from test_live_proxy import Recorder as ProxyRecorder
    from test_live_proxy import fakes, proxy, run

    class Views(ProxyRecorder):
        def __init__(self):
            super().__init__()
            self.views = []

        def choose(self, req, fleet):
            self.views.append(req)
            return super().choose(req, fleet)

    async def main():
        ws = await fakes()
        rec = Views()
        async with proxy(ws, rec, predictor={"name": "mean", "params": {"prior": 11}}) as (ctl, url, c):
            for _ in range(2):
                async with c.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 7}) as r:
                    assert r.status == 200
                    await r.read()
            seen = list(rec.views)
        for w in ws:
            await w.stop()
        return seen

    seen = run(main())
    # the first request sees the prior; the second the mean of the first's 3 output tokens (clipped to the cap)
    assert [v.predicted_output_tokens for v in seen] == [7.0, 3.0]


def test_the_live_config_refuses_a_predictor_that_reads_the_truth():
    from twin.errors import TwinInputError

    with pytest.raises(TwinInputError, match="reads the true output length"):
        parse_config({"workers": [{"url": "http://127.0.0.1:1"}], "predictor": {"name": "oracle"}})


def test_forecasters_handed_to_policies_expose_forecasts_not_the_cluster():
    """Block's and the twin scaler's look-ahead: no public attribute leads to the run (and its true lengths)."""
    from twin.sim.cluster import Cluster
    from twin.sim.forecaster import FleetForecaster, SimForecaster

    cl = Cluster(make_scenario(), stream_of([0.0], [100], [5]))
    for fc in (SimForecaster(cl), FleetForecaster(cl)):
        public = {name: getattr(fc, name) for name in dir(fc) if not name.startswith("_")}
        assert not any(v is cl for v in public.values())
        assert not any(isinstance(v, type(cl.dispatcher)) or v is cl.stream for v in public.values())
        assert "forecast" in public or "attainment" in public
