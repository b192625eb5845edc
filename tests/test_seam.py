"""The policy seam in the simulator: stale gauges vs fresh books, prefix indexes, hooks, compare/plot/routers."""

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from twin.cli import app
from twin.policy import RouterBase

from conftest import kv_blocks, make_scenario, run_checked, stream_of
from test_fast_forward import assert_same, both_modes

runner = CliRunner()


class MostCached(RouterBase):
    """Test router: most leading blocks cached, then fewest in flight (reads the index and the books)."""

    name = "most-cached"
    prefix_index = "any"

    def choose(self, req, fleet):
        hits = fleet.cached_blocks(req)
        return min(fleet.instances, key=lambda v: (-hits.get(v.id, 0), v.inflight_requests, v.id)).id


class KvReader(RouterBase):
    """Test router: least scraped KV use, then fewest free-block-implied load; deterministic."""

    name = "kv-reader"

    def choose(self, req, fleet):
        return min(fleet.instances, key=lambda v: (round(v.kv_usage, 9), -v.free_blocks, v.num_waiting, v.id)).id


class Recorder(RouterBase):
    name = "recorder"

    def __init__(self):
        self.events = []

    def choose(self, req, fleet):
        return fleet.instances[0].id

    def on_dispatch(self, req, instance_id, now):
        self.events.append(("dispatch", req.id, instance_id, now))

    def on_first_token(self, req, instance_id, now):
        self.events.append(("first", req.id, instance_id, now))

    def on_finish(self, req, instance_id, now, output_tokens):
        self.events.append(("finish", req.id, instance_id, now, output_tokens))


def shared_prefix_stream(n=60, groups=4, seed=0):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.05, n))
    g = rng.integers(0, groups, n)
    prompts = rng.integers(300, 900, n)
    outputs = rng.integers(5, 60, n)
    hashes = [[1000 * int(k) + j for j in range(int(p) // 16)] for k, p in zip(g, prompts)]
    return stream_of(arrivals, prompts, outputs, hashes, hash_block_size=16)


def test_hooks_fire_once_each_in_order_with_the_engine_times():
    rec = Recorder()
    sc = make_scenario(**{"router.scrape_interval_s": 0.0})
    res = run_checked(sc, stream_of([0, 0.5, 1.0], [100, 200, 50], [10, 3, 1]), router=rec)
    log = res.log
    for i in range(3):
        ev = [e for e in rec.events if e[1] == str(i)]
        assert [e[0] for e in ev] == ["dispatch", "first", "finish"]
        assert ev[0][3] == pytest.approx(log.arrival_s[i])
        assert ev[1][3] == pytest.approx(log.first_token_s[i])
        assert ev[2][3] == pytest.approx(log.finish_s[i]) and ev[2][4] == log.output_tokens[i]


def test_bookkeeping_is_empty_after_a_run_and_fresh_during_it():
    seen = []

    class Watch(RouterBase):
        name = "watch"

        def choose(self, req, fleet):
            seen.append(sum(v.inflight_requests for v in fleet.instances))
            return fleet.instances[0].id

    sc = make_scenario(**{"cluster.num_instances": 2})
    cl_res = run_checked(sc, stream_of([0.0] * 5, [100] * 5, [50] * 5), router=Watch())
    assert seen == [0, 1, 2, 3, 4]  # all within one scrape interval: only the books can see them
    assert cl_res.router_info["scrapes"] >= 1


def test_stale_gauges_herd_a_burst_while_the_books_spread_it():
    # r0 lands at t=0.01; the scrape at 0.1 shows it; the burst at 0.15 is between scrapes.
    arrivals = [0.01] + [0.15] * 10
    stream = stream_of(arrivals, [200] * 11, [400] * 11)
    base = {"cluster.num_instances": 2, "router.scrape_interval_s": 0.1}
    gauges = run_checked(make_scenario(**base, **{"router.name": "least-outstanding",
                                                  "router.params": {"signal": "gauges"}}), stream)
    books = run_checked(make_scenario(**base, **{"router.name": "least-outstanding"}), stream)
    g = sorted(i.num_dispatched for i in gauges.instances)
    b = sorted(i.num_dispatched for i in books.instances)
    assert g == [1, 10]  # every burst request went where the stale gauge said "empty"
    assert b == [5, 6]


@pytest.mark.parametrize("index", ["approximate", "precise"])
@pytest.mark.parametrize("scrape", [0.0, 0.05])
def test_fast_and_step_modes_agree_with_routers_reading_kv_and_prefix_state(index, scrape):
    stream = shared_prefix_stream(80)
    for router in (MostCached(), KvReader()):
        sc = make_scenario(**{"cluster.num_instances": 3, **kv_blocks(400),
                              "router.scrape_interval_s": scrape, "router.prefix_index": index,
                              "router.kv_event_delay_s": 0.0})
        fast = run_checked(sc.model_copy(update={"sim": sc.sim.model_copy(update={"mode": "fast"})}), stream,
                           router=type(router)())
        step = run_checked(sc.model_copy(update={"sim": sc.sim.model_copy(update={"mode": "step"})}), stream,
                           router=type(router)())
        assert_same(fast, step)


def test_prefix_aware_routing_beats_round_robin_on_hits():
    stream = shared_prefix_stream(240, groups=30)
    small = {"cluster.num_instances": 4, **kv_blocks(600)}
    rr = run_checked(make_scenario(**small, **{"router.name": "round-robin"}), stream)
    pa = run_checked(make_scenario(**small, **{"router.prefix_index": "approximate"}), stream, router=MostCached())
    hits = lambda res: sum(i.scheduler.stats.prefix_cache_hits for i in res.instances)  # noqa: E731
    assert hits(pa) > 1.5 * hits(rr)


def test_a_prefix_router_gets_the_index_it_asks_for():
    sc = make_scenario(**{"cluster.num_instances": 2})
    res = run_checked(sc, shared_prefix_stream(10), router=MostCached())
    assert res.router_info["prefix_index"] == "approximate"  # "any" resolves to approximate by default
    sc = make_scenario(**{"cluster.num_instances": 2, "router.prefix_index": "precise"})
    res = run_checked(sc, shared_prefix_stream(10), router=MostCached())
    assert res.router_info["prefix_index"] == "precise"
    res = run_checked(sc, shared_prefix_stream(10))  # least-outstanding reads no index: none is built
    assert res.router_info["prefix_index"] is None


def test_client_cap_truncates_and_judges_length_as_vllm():
    sc = make_scenario(**{"workload.max_tokens": 30, "cluster.engine.max_model_len": 150})
    res = run_checked(sc, stream_of([0, 0.1], [100, 130], [50, 10]))
    assert list(res.log.status) == [4, 5]  # 130 + cap 30 > 150: refused as vLLM would, though it needs 10
    assert res.log.output_tokens[0] == 30  # the cap stops it before its natural end


QUICK = "scenarios/quickstart.yaml"


def test_compare_runs_the_same_arrivals_and_writes_table_and_figures(tmp_path):
    out = tmp_path / "cmp"
    r = runner.invoke(app, ["compare", QUICK, "--routers", "round-robin,least-outstanding", "--router",
                            "{label: lor-stale, name: least-outstanding, params: {signal: gauges}, "
                            "scrape_interval_s: 0.5}", "--set", "workload.num_requests=150", "--seeds", "2",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    table = pd.read_csv(out / "comparison.csv")
    assert sorted(table.label.unique()) == ["least-outstanding", "lor-stale", "round-robin"]
    assert len(table) == 6 and set(table.seed) == {42, 43}
    assert (pd.read_csv(out / "comparison_mean.csv").label.tolist()
            == ["round-robin", "least-outstanding", "lor-stale"])
    for f in ("ttft_cdf.png", "latency_cdf.png", "timelines.png", "timeline.parquet", "requests.parquet"):
        assert (out / f).stat().st_size > 0, f
    req = pd.read_parquet(out / "requests.parquet")
    arr = {k: g.sort_values("request_id").arrival_s.to_numpy() for k, g in req.groupby("label")}
    first = arr["round-robin"]
    assert all(np.array_equal(first, a) for a in arr.values())
    assert table.loc[table.label == "lor-stale", "scrape_interval_s"].eq(0.5).all()


def test_compare_bad_contenders_are_one_line(tmp_path):
    for args, msg in ((["--routers", "nope"], "unknown router 'nope'"),
                      (["--router", "{name: random, colour: red}"], "unknown key(s) colour"),
                      (["--routers", "random,random"], "used twice"),
                      (["--router", "{label: x, name: random, params: {wrong: 1}}"], "it takes: seed")):
        r = runner.invoke(app, ["compare", QUICK, *args, "--out", str(tmp_path / "x")])
        assert r.exit_code == 2, (args, r.output)
        assert msg in r.output and "Traceback" not in r.output, r.output


def test_simulate_writes_a_timeline_and_plot_draws_it(tmp_path):
    out = tmp_path / "run"
    r = runner.invoke(app, ["simulate", QUICK, "--set", "workload.num_requests=100", "-q", "--out", str(out)])
    assert r.exit_code == 0, r.output
    tl = pd.read_parquet(out / "timeline.parquet")
    assert set(tl.columns) >= {"t_s", "instance", "running", "waiting", "kv_usage", "inflight", "state"}
    assert tl.instance.nunique() == 4 and (tl.kv_usage.between(0, 1)).all()
    s = json.loads((out / "summary.json").read_text())
    assert s["router"]["name"] == "least-outstanding" and s["router"]["scrape_interval_s"] == 0.05
    r = runner.invoke(app, ["plot", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "latency_cdf.png").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
    r = runner.invoke(app, ["plot", str(tmp_path)])
    assert r.exit_code == 2 and "no requests.parquet" in r.output


def test_plot_on_a_compare_folder_draws_one_curve_per_contender(tmp_path, monkeypatch):
    """`twin compare` writes requests.parquet and timeline.parquet with a `label` column beside its figures; `twin
    plot` read the folder as one run and overwrote compare's latency_cdf.png with a single curve over all of them."""
    import twin.analysis.report as report

    out = tmp_path / "cmp"
    r = runner.invoke(app, ["compare", QUICK, "--routers", "round-robin,least-outstanding", "--set",
                            "workload.num_requests=60", "-q", "--out", str(out)])
    assert r.exit_code == 0, r.output
    drawn: dict[str, dict[str, int]] = {}  # figure -> {curve: rows}
    real_cdfs, real_tl = report.latency_cdfs, report.timelines

    def cdfs(reqs, path, title=""):
        drawn[path.name] = {k: len(v) for k, v in reqs.items()}
        return real_cdfs(reqs, path, title)

    def tls(frames, path, title=""):
        drawn[path.name] = {k: len(v) for k, v in frames.items()}
        return real_tl(frames, path, title)

    monkeypatch.setattr(report, "latency_cdfs", cdfs)
    monkeypatch.setattr(report, "timelines", tls)
    r = runner.invoke(app, ["plot", str(out)])
    assert r.exit_code == 0, r.output
    assert drawn["latency_cdf.png"] == {"round-robin": 60, "least-outstanding": 60}
    assert sorted(drawn["timelines.png"]) == ["least-outstanding", "round-robin"]
    assert not (out / "timeline.png").exists()


def test_routers_command_lists_names_and_parameters():
    r = runner.invoke(app, ["routers"])
    assert r.exit_code == 0
    for name in ("round-robin", "random", "least-outstanding", "least-kv", "power-of-two"):
        assert name in r.output
    assert "signal='bookkeeping'" in r.output


def test_a_raising_router_fails_the_cli_run_with_its_traceback(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("from twin.policy import RouterBase\n"
                 "class Bad(RouterBase):\n"
                 "    def choose(self, req, fleet):\n"
                 "        raise ZeroDivisionError('oops in my router')\n")
    r = runner.invoke(app, ["simulate", QUICK, "--set", f"router.name={f}:Bad", "--set",
                            "workload.num_requests=5", "-q"])
    assert r.exit_code == 1
    assert "ZeroDivisionError: oops in my router" in r.output and "while routing request 0" in r.output
    assert "bad.py" in r.output  # the router's own traceback
    r = runner.invoke(app, ["simulate", QUICK, "--set", f"router.name={f}:Bad", "--set",
                            "workload.num_requests=5", "--set", "router.on_error=reject", "-q",
                            "--out", str(tmp_path / "o")])
    assert r.exit_code == 0
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["requests_rejected"] == 5


class GaugeRecorder(RouterBase):
    """Test router: records what every decision saw of every instance's gauges; spreads by arrival order."""

    name = "gauge-recorder"

    def __init__(self):
        self.seen = []
        self.n = 0

    def choose(self, req, fleet):
        for v in fleet.instances:
            g = v.gauges
            self.seen.append((fleet.now, v.id, g.as_of, g.num_running, g.num_waiting, g.kv_usage))
        self.n += 1
        return fleet.instances[self.n % len(fleet.instances)].id


@pytest.mark.parametrize("mode", ["fast", "step"])
@pytest.mark.parametrize("async_on", [True, False])
def test_gauges_read_at_a_decision_are_the_state_at_the_last_scrape_tick(mode, async_on):
    """No scrape process runs: a decision's gauges must still equal a /metrics poll at the last tick."""
    from twin.sim.cluster import Cluster

    dt = 0.05
    rng = np.random.default_rng(3)
    n = 150
    arrivals = np.cumsum(rng.exponential(0.03, n))
    stream = stream_of(arrivals, rng.integers(50, 900, n), rng.integers(5, 120, n))
    sc = make_scenario(**{"cluster.num_instances": 3, "router.scrape_interval_s": dt, "sim.mode": mode,
                          **kv_blocks(400),
                          "cluster.engine.async_scheduling": async_on})
    router = GaugeRecorder()
    cl = Cluster(sc, stream, router)
    polled = {}

    def poller():  # an eager poll just before each tick: the state after every event before it
        env = cl.env
        k = 1
        while True:
            yield env.timeout(max(k * dt - 1e-9 - env.now, 0.0))
            for inst in cl.instances:
                polled[(k, inst.id)] = (inst.num_running, inst.num_waiting, inst.kv_usage)
            k += 1

    cl.env.process(poller())
    cl.run()
    checked = 0
    for now, iid, as_of, running, waiting, kv in router.seen:
        k = int(round(as_of / dt))
        assert as_of <= now < as_of + dt + 1e-12  # as old as the last tick, never older
        if k == 0:
            continue
        assert (running, waiting) == polled[(k, iid)][:2], (now, iid, k)
        assert kv == pytest.approx(polled[(k, iid)][2], abs=1e-12), (now, iid, k)
        checked += 1
    assert checked > 200 and any(w > 0 for *_, w, _ in router.seen)


@pytest.mark.parametrize("predictor", [None, "oracle"])
def test_a_router_sees_the_view_the_dataclass_would_build(predictor):
    """The cluster builds views through the slots' setters (fast): each equals `RequestView(...)` of the same
    request, stays frozen, and carries the prediction when a predictor is set."""
    import dataclasses

    from twin.policy.views import RequestView

    seen = []

    class Keep(RouterBase):
        name = "keep"

        def choose(self, req, fleet):
            seen.append(req)
            return fleet.instances[0].id

    from twin.sim.cluster import Cluster

    stream = shared_prefix_stream(n=12)
    stream.session_id = np.arange(12) % 3
    over = {"predictor": {"name": predictor}} if predictor else {}
    sc = make_scenario(**over)
    cl = Cluster(sc, stream, Keep())
    cl.run()
    assert len(seen) == 12
    for i, v in enumerate(seen):
        keys = list(cl.make_request(i).block_keys)[: int(stream.prompt_tokens[i]) // 16]
        want = RequestView(str(i), float(stream.arrival_s[i]), int(stream.prompt_tokens[i]), None, keys, 16,
                           str(i % 3), predicted_output_tokens=float(stream.output_tokens[i]) if predictor else None)
        assert dataclasses.asdict(v) == dataclasses.asdict(want) and type(v) is RequestView and len(keys) > 10
        assert v == dataclasses.replace(v)
        with pytest.raises(dataclasses.FrozenInstanceError):
            v.num_prompt_tokens = 1
