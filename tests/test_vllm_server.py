"""One way to start a vLLM server (live.vllm_server), used by the launcher, the lab and the heavy tests."""

from live.vllm_server import cpu_env, engine_flags, kv_events_config, server_command
from twin.lab.observe import EngineArgs


def test_engine_flags_by_vllms_names():
    assert engine_flags({"max_num_seqs": 8, "enforce_eager": True, "enable_prefix_caching": False,
                         "kv_events_config": {"a": 1}, "x": None, "l": [1, 2]}) == [
        "--max-num-seqs", "8", "--enforce-eager", "--no-enable-prefix-caching", "--kv-events-config", '{"a": 1}',
        "--l", "1", "2"]


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
