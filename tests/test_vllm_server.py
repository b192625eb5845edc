"""One way to start a vLLM server (live.vllm_server), used by the launcher, the lab and the heavy tests."""

import json

import pytest

from live.vllm_server import (VLLM_FLAGS, FlagKinds, cpu_env, engine_flags, kv_events_config, needs_flag_kinds,
                              parse_flag_kinds, server_command)
from twin.lab.observe import EngineArgs


def test_engine_flags_by_vllms_names():
    assert engine_flags({"max_num_seqs": 8, "enforce_eager": True, "enable_prefix_caching": False,
                         "kv_events_config": {"a": 1}, "x": None, "l": [1, 2]}) == [
        "--max-num-seqs", "8", "--enforce-eager", "--no-enable-prefix-caching", "--kv-events-config", '{"a": 1}',
        "--l", "1", "2"]


def test_a_false_for_a_flag_vllm_has_only_on_is_left_out_and_json_options_get_json():
    """vLLM's store_true flags (--disable-log-stats, --aggregate-engine-logging) have no --no- form: a false became
    --no-disable-log-stats, which vLLM refused ("unrecognized arguments"). Its config fields' flags keep --no-X;
    --allowed-origins and its kind take one JSON value (vLLM 0.32's parser, as recorded in VLLM_FLAGS)."""
    assert engine_flags({"disable_log_stats": False, "aggregate_engine_logging": False, "headless": False}) == []
    assert engine_flags({"disable_log_stats": True}) == ["--disable-log-stats"]
    assert engine_flags({"enable_prefix_caching": False, "enforce_eager": False}) == [
        "--no-enable-prefix-caching", "--no-enforce-eager"]
    assert engine_flags({"allowed_origins": ["http://a"], "allowed_headers": ("x",), "api_key": ["k1", "k2"]}) == [
        "--allowed-origins", '["http://a"]', "--allowed-headers", '["x"]', "--api-key", "k1", "k2"]


def test_the_workers_own_parser_decides_and_a_false_vllm_cannot_say_is_one_line():
    kinds = parse_flag_kinds("some vLLM log line\nLLMTWIN_FLAG_KINDS " + json.dumps(
        {"switches": ["new_switch"], "switches_on": ["on_switch"], "json_values": ["new_json"]}), "test")
    assert kinds == FlagKinds(frozenset({"new_switch"}), frozenset({"new_json"}), frozenset({"on_switch"}), "test")
    assert engine_flags({"new_switch": False, "disable_log_stats": False, "new_json": [1]}, kinds) == [
        "--no-disable-log-stats", "--new-json", "[1]"]  # that parser's word, not the recorded one
    with pytest.raises(ValueError, match="on_switch: vLLM's --on-switch is on by default and has no --no- form"):
        engine_flags({"on_switch": False}, kinds)
    assert parse_flag_kinds("Traceback ...\nImportError: no vllm", "test") is None
    assert parse_flag_kinds("LLMTWIN_FLAG_KINDS {not json", "test") is None
    assert needs_flag_kinds({"a": False}) and needs_flag_kinds({"a": [1]})
    assert not needs_flag_kinds({"a": True, "b": 0, "c": None, "d": {"x": False}})
    assert VLLM_FLAGS.source.startswith("vLLM 0.32")


def test_the_command_line_of_every_launcher():
    cmd = server_command("py", "/m", "127.0.0.1", 8100, {"max_num_seqs": 4}, served="tiny")
    assert cmd == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.0.0.1",
                   "--port", "8100", "--served-model-name", "tiny", "--max-num-seqs", "4"]
    assert "--served-model-name" not in server_command("py", "/m", "h", 1, {})
    assert kv_events_config("tcp://127.0.0.1:5") == {"enable_kv_cache_events": True, "publisher": "zmq",
                                                    "endpoint": "tcp://127.0.0.1:5", "topic": "kv"}


def test_the_lab_recipe_keeps_its_flags():
    assert EngineArgs().flags() == ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16",
                                    "--max-num-batched-tokens", "2048", "--kv-cache-memory-bytes",
                                    str(64 * 1024 * 1024), "--dtype", "float32"]
    assert EngineArgs(enable_prefix_caching=False).flags()[-1] == "--no-enable-prefix-caching"


def test_the_cpu_environment_is_offline_and_pinned():
    env = cpu_env("/tmp/c", "1", base={"VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/bin"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["PATH"] == "/bin"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CACHE_ROOT"] == "/tmp/c"
