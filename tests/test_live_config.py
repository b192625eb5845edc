"""Live config: validated like scenarios, one clear line per problem, and the scenario's router block."""

import pytest

pytest.importorskip("aiohttp")

from live.cli import run  # noqa: E402
from live.config import LiveConfig, load_config, parse_config  # noqa: E402
from twin.errors import TwinInputError  # noqa: E402
from twin.scenario import RouterSpec  # noqa: E402

OK = {"workers": [{"url": "http://127.0.0.1:9"}]}


def test_router_block_is_the_scenarios():
    cfg = parse_config({**OK, "router": {"name": "p2c", "params": {"seed": 3}, "scrape_interval_s": 0.2}})
    assert isinstance(cfg.router, RouterSpec)
    assert cfg.router.name == "power-of-two"  # aliases resolve as in scenarios
    assert cfg.scrape_interval_s == 0.2
    assert LiveConfig.model_fields["router"].annotation is RouterSpec


def test_zero_scrape_interval_is_floored():
    cfg = parse_config({**OK, "router": {"scrape_interval_s": 0}})
    assert cfg.scrape_interval_s == cfg.min_scrape_interval_s > 0


@pytest.mark.parametrize("raw, needle", [
    ({}, "give workers"),
    ({**OK, "router": {"name": "nope"}}, "router.name: unknown router 'nope'"),
    ({**OK, "server": {"prot": 1}}, "server.prot: unknown key"),
    ({"workers": [{"url": "127.0.0.1:9"}]}, "workers.0.url: must start with http://"),
    ({**OK, "server": {"port": 70000}}, "server.port"),
    ({"workers": [{"id": "a", "url": "http://x"}, {"id": "a", "url": "http://y"}]}, "ids must be unique"),
    # an id-less worker is w<its place>: a clash with a given id was a traceback at start (a fuzzing pass)
    ({"workers": [{"id": "w1", "url": "http://x"}, {"url": "http://y"}]}, "'w1' twice"),
    ({"workers": [{"id": "local-0", "url": "http://x"}], "launcher": {"model": "m"}}, "launcher's name"),
    ({**OK, "tokenizer": {"mode": "magic"}}, "tokenizer.mode"),
    # a fleet the launcher could never start was found out only after its first workers came up (a fuzzing pass)
    ({"launcher": {"model": "m", "num_workers": 3, "max_workers": 2}}, "num_workers 3 is above max_workers 2"),
    ({"launcher": {"model": "m", "base_port": 65535, "max_workers": 2}}, "leaves no port for worker 2"),
    ({"launcher": {"model": "m", "base_port": 5600, "kv_events_base_port": 5601}}, "ports clash"),
    ({**OK, "health": {"backoff_initial_s": 60}}, "backoff_initial_s 60 is above backoff_max_s 30"),
    ([1, 2], "must be a YAML mapping"),
])
def test_bad_config_is_one_clear_line(raw, needle):
    with pytest.raises(TwinInputError) as e:
        parse_config(raw, "live.yaml")
    assert needle in str(e.value)
    assert "Traceback" not in str(e.value)


def test_cli_exit_2_on_bad_config(tmp_path, capsys):
    p = tmp_path / "live.yaml"
    p.write_text("workers: [{url: http://127.0.0.1:9}]\nrouter: {name: no-such-router}\n")
    assert run(p) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no-such-router" in err[0]
    assert run(tmp_path / "missing.yaml") == 2
    p.write_text("workers: [\n")
    assert run(p) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_bad_router_params_and_scaler_are_one_line(tmp_path, capsys):
    p = tmp_path / "live.yaml"
    p.write_text("workers: [{url: http://127.0.0.1:9}]\nrouter: {name: random, params: {sead: 1}}\n")
    assert run(p) == 2
    assert "router.params" in capsys.readouterr().err
    p.write_text("workers: [{url: http://127.0.0.1:9}]\nscaler: {name: nope}\n")
    assert run(p) == 2
    assert "scaler.name: unknown scaler" in capsys.readouterr().err


def test_overrides_and_api_key_env(tmp_path, monkeypatch):
    p = tmp_path / "live.yaml"
    p.write_text("workers: [{url: http://127.0.0.1:9}]\nserver: {api_key_env: LLMTWIN_TEST_KEY}\n")
    cfg = load_config(p, ["server.port=1234", "router.name=rr"])
    assert cfg.server.port == 1234 and cfg.router.name == "round-robin"
    monkeypatch.delenv("LLMTWIN_TEST_KEY", raising=False)
    with pytest.raises(TwinInputError, match="LLMTWIN_TEST_KEY is not set"):
        cfg.server.resolved_api_keys()
    monkeypatch.setenv("LLMTWIN_TEST_KEY", "s3cret")
    assert cfg.server.resolved_api_keys() == ("s3cret",)


def test_binds_loopback_by_default():
    assert parse_config(OK).server.host == "127.0.0.1"


def test_twin_live_command_bad_config_exit_2(tmp_path):
    from typer.testing import CliRunner

    from twin.cli import app

    p = tmp_path / "live.yaml"
    p.write_text("workers: []\n")
    r = CliRunner().invoke(app, ["live", str(p)])
    assert r.exit_code == 2
    assert "give workers" in r.output


@pytest.mark.parametrize("worker,says", [
    ({"url": "http://127.0.0.1:99999"}, "workers.0.url: not a URL"),
    ({"url": "http://"}, "workers.0.url: not a URL with a host"),
    ({"url": "http://exa mple.com:80"}, "workers.0.url: not a URL with a host"),
    ({"url": "http://127.0.0.1:8000", "kv_events_endpoint": "garbage"}, "workers.0.kv_events_endpoint: a ZMQ"),
    ({"url": "http://127.0.0.1:8000", "kv_events_endpoint": "tcp://*:70000"}, "workers.0.kv_events_endpoint"),
])
def test_a_worker_no_request_could_reach_is_refused_at_load(worker, says):
    """Each used to start: the worker was down at start and never came up, with a warning in the log."""
    with pytest.raises(TwinInputError) as e:
        parse_config({"workers": [worker]})
    assert says in str(e.value)


def test_two_workers_on_one_kv_event_endpoint_are_refused():
    ep = "tcp://127.0.0.1:5557"
    with pytest.raises(TwinInputError, match="kv_events_endpoint must be its own"):
        parse_config({"workers": [{"url": "http://a:1", "kv_events_endpoint": ep},
                                  {"url": "http://b:1", "kv_events_endpoint": ep}]})
    for ok in ("tcp://*:5557", "tcp://[::1]:5557", "ipc:///tmp/kv.sock"):
        parse_config({"workers": [{"url": "http://[::1]:8000", "kv_events_endpoint": ok}]})


def test_a_backoff_cap_below_the_default_first_backoff_takes_it_down():
    """Refused only when the first backoff is set above the cap: a cap alone below the default (1 s) loaded before
    the check, and still does, with the first backoff at the cap."""
    cfg = parse_config({"workers": [{"url": "http://127.0.0.1:1"}], "health": {"backoff_max_s": 0.5}})
    assert cfg.health.backoff_initial_s == cfg.health.backoff_max_s == 0.5


@pytest.mark.parametrize("section, key", [("health", "interval_s"), ("health", "backoff_initial_s"),
                                          ("shadow", "interval_s")])
def test_live_intervals_have_floors(section, key):
    """A health check or a shadow run every nanosecond was accepted (a fuzzing pass, 2026-12-07)."""
    with pytest.raises(TwinInputError, match=f"{section}.{key}"):
        parse_config({"workers": [{"url": "http://127.0.0.1:1"}], section: {key: 1e-9}})


def test_shadow_names_are_checked_even_with_shadow_mode_off():
    """The live batch defaults read `shadow.hardware` with shadow mode off: a typo is one line at load, where it
    left the workers described with placeholder limits."""
    from live.config import parse_config
    from twin.errors import TwinInputError

    base = {"workers": [{"url": "http://127.0.0.1:9"}]}
    for shadow, msg in (({"hardware": "H1000"}, "shadow.hardware: unknown GPU 'H1000'"),
                        ({"model": "nope"}, "shadow.model: unknown model 'nope'")):
        with pytest.raises(TwinInputError, match=msg):
            parse_config({**base, "shadow": shadow}, "t")
    assert parse_config({**base, "shadow": {"hardware": "h100", "model": "tiny-llama"}}, "t").shadow.hardware == "h100"


@pytest.mark.parametrize("keys", [[], ""])
def test_an_empty_api_key_is_refused_not_taken_as_none(keys):
    """Found in review: `api_key: []` turned the check off without a word (while ["a", ""] was refused)."""
    cfg = parse_config({"workers": [{"url": "http://127.0.0.1:9"}], "server": {"api_key": keys}}, "t")
    with pytest.raises(TwinInputError, match="empty key"):
        cfg.server.resolved_api_keys()
