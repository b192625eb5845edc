"""A worker's `/metrics` page as the gauges and launch config a router reads, tolerant of vLLM's renames.

vLLM 0.32 (`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`) publishes `vllm:kv_cache_usage_perc` and
`vllm:prefix_cache_{queries,hits}_total`; releases before the V1 rename published `vllm:gpu_cache_usage_perc`
and `vllm:gpu_prefix_cache_{queries,hits}_total`. Both spellings are read; the new one wins when a page has
both. Series of several engines (data parallel: label `engine`) are summed (usage: averaged).
Only the few series the controller needs are parsed (one regular expression over the page, about a
millisecond for a 50 KB page here). `series_sums` reads any named series (histogram `_sum`/`_count`, counters)
the same way, for the lab's before/after deltas (`twin.lab.observe`, `twin.lab.calibrate`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from twin.policy.views import Gauges, InstanceConfig

# canonical name -> accepted names, newest first
NAMES: dict[str, tuple[str, ...]] = {
    "num_running": ("vllm:num_requests_running",),
    "num_waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
}
CACHE_INFO = "vllm:cache_config_info"
_LOOKUP: dict[str, tuple[str, int]] = {n: (key, rank) for key, names in NAMES.items()
                                       for rank, n in enumerate(names)}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_MEAN = {"kv_usage"}


@dataclass
class MetricsPage:
    """What one scrape found. `values` has the canonical names above that the page carried."""

    values: dict[str, float] = field(default_factory=dict)
    cache_info: dict[str, str] = field(default_factory=dict)
    engines: int = 0
    process_start: float | None = None  # the API server's `process_start_time_seconds` (absent with several)

    def gauges(self, as_of: float) -> Gauges:
        v = self.values
        return Gauges(int(v.get("num_running", 0)), int(v.get("num_waiting", 0)),
                      float(v.get("kv_usage", 0.0)), as_of)

    def config(self, base: InstanceConfig | None = None) -> InstanceConfig:
        """Launch config from `vllm:cache_config_info`, keeping `base`'s fields the page does not carry."""
        base = base or InstanceConfig()
        info = self.cache_info

        def num(key: str, default: int) -> int:
            try:
                return int(info[key])
            except (KeyError, ValueError):
                return default

        return InstanceConfig(num_gpu_blocks=num("num_gpu_blocks", base.num_gpu_blocks),
                              block_size=num("block_size", base.block_size),
                              max_num_seqs=base.max_num_seqs, max_num_batched_tokens=base.max_num_batched_tokens,
                              max_model_len=base.max_model_len)

    @property
    def prefix_caching(self) -> bool | None:
        v = self.cache_info.get("enable_prefix_caching")
        return None if v is None else v == "True"


# a literal "\nvllm:" lead lets the regex engine jump between candidate lines (5x faster than ^ with re.M)
_SERIES = re.compile(r"\nvllm:(" + "|".join(re.escape(n[5:]) for n in _LOOKUP) + r")(?:\{([^}\n]*)\})?[ \t]+(\S+)")
_ENGINE = re.compile(r'engine="([^"]*)"')
# prometheus_client's process collector, on the API server's registry (vllm/v1/metrics/prometheus.py); not
# published in multiprocess mode (several API servers), where restarts go unseen here
_START = re.compile(r"(?:^|\n)process_start_time_seconds[ \t]+(\S+)")


def parse_metrics(text: str) -> MetricsPage:
    """Parse a Prometheus text page, keeping only the series in NAMES and `vllm:cache_config_info`.

    One regular expression over the page picks the wanted series (a page is ~600 lines, most of them
    histogram buckets this skips without splitting)."""
    page = MetricsPage()
    best: dict[str, int] = {}  # canonical -> rank of the name used
    acc: dict[str, float] = {}
    counts: dict[str, int] = {}
    engines: set[str] = set()
    for name, labels_s, raw in _SERIES.findall("\n" + text):
        key, rank = _LOOKUP["vllm:" + name]
        try:
            value = float(raw)
        except ValueError:
            continue
        prev = best.get(key)
        if prev is not None and rank > prev:
            continue  # an older spelling of a series the page also has under its new name
        if prev is None or rank < prev:
            best[key] = rank
            acc[key] = 0.0
            counts[key] = 0
        acc[key] += value
        counts[key] += 1
        if labels_s:
            e = _ENGINE.search(labels_s)
            if e:
                engines.add(e.group(1))
    i = text.find("\n" + CACHE_INFO + "{")
    if i != -1:
        j = text.find("}", i)
        page.cache_info = dict(_LABEL.findall(text[i + len(CACHE_INFO) + 2:j]))
    m = _START.search(text)
    if m is not None:
        try:
            page.process_start = float(m.group(1))
        except ValueError:
            pass
    for key, total in acc.items():
        page.values[key] = total / counts[key] if key in _MEAN and counts[key] else total
    page.engines = len(engines) or (1 if acc else 0)
    return page


# a label set, quoted values may hold braces ("{...}") and escaped quotes
_LABELS = r'\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\}'


def series_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each named series' value summed over its label sets (engines, models); a name the page lacks is left out.

    Exact names: `vllm:time_to_first_token_seconds_sum` is one series, its `_bucket` lines are others."""
    wanted = tuple(dict.fromkeys(names))
    if not wanted:
        return {}
    pat = re.compile(r"^(" + "|".join(re.escape(n) for n in wanted) + r")(?:" + _LABELS + r")?[ \t]+(\S+)", re.M)
    out: dict[str, float] = {}
    for name, raw in pat.findall(text):
        try:
            value = float(raw)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out
