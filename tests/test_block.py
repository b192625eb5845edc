"""Block-style routing: the look-ahead sends a request away from an instance whose batch will be busy longer."""

import numpy as np
import pytest

from twin.sim.cluster import Cluster
from twin.policy import make_router
from twin.policy.block import Block

from conftest import kv_blocks, make_scenario, run_checked, stream_of
from policy_fakes import fleet_of, req


def test_block_avoids_the_instance_with_a_long_prefill_backlog():
    # instance-0 gets three 6000-token prompts (a long prefill backlog under a 512-token budget),
    # instance-1 five short requests: least-outstanding (3 < 5) picks instance-0, the look-ahead does not
    arrivals = [0.0, 0.0, 0.0, 0.001, 0.001, 0.001, 0.001, 0.001, 0.01]
    prompts = [6000, 6000, 6000, 50, 50, 50, 50, 50, 100]
    outs = [20] * 9

    class Scripted(Block):
        def choose(self, r, fleet):
            if int(r.id) < 3:
                return "instance-0"
            if int(r.id) < 8:
                return "instance-1"
            choice = super().choose(r, fleet)
            self.final = (choice, dict(self.last_scores))
            return choice

    sc = make_scenario(**{"cluster.num_instances": 2, "cluster.engine.max_num_batched_tokens": 512,
                          "workload.max_tokens": 20, "router.scrape_interval_s": 0.0})
    router = Scripted(objective="ttft")
    res = run_checked(sc, stream_of(arrivals, prompts, outs), router=router)
    choice, scores = router.final
    assert choice == "instance-1"
    assert scores["instance-0"] > 5 * scores["instance-1"]
    assert res.log.instance[8] == 1
    lor = make_router("least-outstanding")
    fleet = fleet_of({"id": "instance-0", "inflight": 3}, {"id": "instance-1", "inflight": 5})
    assert lor.choose(req(), fleet) == "instance-0"


@pytest.mark.parametrize("objective", ["ttft", "e2e"])
def test_the_forecast_is_exact_when_lengths_are_known_and_nothing_else_arrives(objective):
    # every request's length is its cap (known), the last request arrives alone: its forecast is its fate
    rng = np.random.default_rng(4)
    n = 25
    arr = np.sort(rng.uniform(0, 1.0, n))
    arr[-1] = 1.3
    sc = make_scenario(**{"cluster.num_instances": 3, "workload.max_tokens": 40,
                          **kv_blocks(300), "router.scrape_interval_s": 0.0})
    router = Block(objective=objective, horizon_s=100.0)
    res = run_checked(sc, stream_of(arr, rng.integers(100, 1500, n), [40] * n), router=router)
    last = n - 1
    chosen = f"instance-{res.log.instance[last]}"
    want = res.log.first_token_s[last] if objective == "ttft" else res.log.finish_s[last]
    assert router.last_scores[chosen] == pytest.approx(want - res.log.arrival_s[last], rel=1e-9, abs=1e-12)
    assert router.last_scores[chosen] == min(router.last_scores.values())


def test_block_runs_with_a_bounded_candidate_set_and_accounts_for_everything():
    rng = np.random.default_rng(0)
    n = 200
    sc = make_scenario(**{"cluster.num_instances": 4, "router.name": "block",
                          "router.params": {"max_candidates": 2, "horizon_s": 5.0}})
    res = run_checked(sc, stream_of(np.cumsum(rng.exponential(0.02, n)), rng.integers(50, 800, n),
                                    rng.integers(5, 100, n)))
    assert (res.log.status == 4).all()
    assert res.router_info["name"] == "block"


def test_block_without_a_forecaster_is_a_loud_error_and_bad_params_are_refused():
    with pytest.raises(RuntimeError, match="needs a forecaster"):
        Block().choose(req(), fleet_of({"id": "a"}))
    with pytest.raises(ValueError):
        Block(objective="fastest")


def test_a_configured_predictor_fills_the_view_and_learns_from_finishes():
    seen = {}

    class Spy:
        name = "spy"

        def choose(self, r, fleet):
            seen[r.id] = r.predicted_output_tokens
            return fleet.instances[0].id

    outs = [10, 20, 30, 40]
    stream = stream_of([0, 0.1, 0.2, 0.3], [100] * 4, outs)
    res = run_checked(make_scenario(predictor={"name": "oracle"}), stream, router=Spy())
    assert [seen[str(i)] for i in range(4)] == outs  # the oracle was handed the truth
    from twin.sim.metrics import summarize

    assert summarize(res)["router"]["predictor"]["oracle"] is True
    seen.clear()
    run_checked(make_scenario(predictor={"name": "constant", "params": {"value": 7}}), stream, router=Spy())
    assert set(seen.values()) == {7}
    cl = Cluster(make_scenario(predictor={"name": "mean", "params": {"prior": 1000}}), stream, router=Spy())
    cl.run()
    assert seen["0"] == 1000 and seen["3"] < 1000  # it learned from the first finishes


def test_block_with_an_oracle_predictor_beats_round_robin_on_ttft_under_load():
    rng = np.random.default_rng(1)
    n = 300
    arr = np.cumsum(rng.exponential(1 / 25, n))
    prompts = rng.integers(50, 3000, n)
    outs = rng.integers(10, 400, n)
    stream = stream_of(arr, prompts, outs)
    base = {"cluster.num_instances": 3, "cluster.engine.max_num_batched_tokens": 1024}
    rr = run_checked(make_scenario(**base, **{"router.name": "round-robin"}), stream)
    blk = run_checked(make_scenario(**base, **{"router.name": "block", "router.params": {"objective": "ttft"}},
                                    predictor={"name": "oracle"}), stream)
    from twin.sim.metrics import summarize

    assert summarize(blk)["ttft_s"]["mean"] < summarize(rr)["ttft_s"]["mean"]


def test_a_drained_fork_reports_when_its_last_request_ended_not_the_horizon():
    """Block's `makespan` reads drain_s: the fork's clock idles on to the horizon, the drain time must not."""
    from conftest import make_scenario, stream_of
    from twin.sim.forecaster import SimForecaster
    from twin.policy.views import RequestView

    cl = Cluster(make_scenario(), stream_of([0.0], [200], [20]))
    fc = SimForecaster(cl)
    extra = RequestView("x", 0.0, 100, 10)
    got = fc.forecast(cl.instances[0].id, extra, horizon_s=60.0, until="drain")
    assert got.drain_s is not None and 0.0 < got.drain_s < 5.0
    assert got.e2e_s is not None and got.drain_s >= got.e2e_s - 1e-9


def test_a_forecast_length_ends_at_the_context_as_vllm_ends_a_request():
    """A request's forecast length (the recent mean output) past max_model_len: a cache sized for max_model_len could
    not hold it, and Block's fork raised "scheduler made no progress" (found by a live fuzzing pass: 5 blocks of 128
    at max_model_len 512). vLLM ends a request at the context, so the forecast does too; every request is served."""
    sc = make_scenario(**{"cluster.num_instances": 2, "cluster.engine.block_size": 128, **kv_blocks(5, 128),
                          "router.name": "block", "router.scrape_interval_s": 0.0})
    n_long = 6  # short prompts with long answers first: the recent mean output (400) is what later forecasts expect
    arrivals = [0.01 * i for i in range(n_long)] + [20.0 + 0.05 * i for i in range(6)]
    prompts = [50] * n_long + [490] * 6
    outs = [400] * n_long + [10] * 6
    res = run_checked(sc, stream_of(arrivals, prompts, outs))
    assert (res.log.status == 4).all()
