"""The controller's own Prometheus metrics (prometheus-client), served at the proxy's `/metrics`.

Each controller has its own `CollectorRegistry`, so several can live in one process (tests) and the page
carries only `llmtwin_*` series, never the workers' `vllm:*` ones.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_FAST = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class ControllerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("llmtwin_requests", "Client requests by worker and HTTP status",
                                ["worker", "status"], registry=r)
        self.decision_latency = Histogram("llmtwin_decision_latency_seconds",
                                          "Time to build the request view (tokenising the prompt) and run the router, "
                                          "with a look-ahead router's wait for the decision before it", buckets=_FAST,
                                          registry=r)
        self.upstream_errors = Counter("llmtwin_upstream_errors", "Failed upstream requests by worker and kind",
                                       ["worker", "kind"], registry=r)
        self.retries = Counter("llmtwin_retries", "Requests retried on another worker before their first byte",
                               registry=r)
        self.inflight = Gauge("llmtwin_inflight_requests", "Requests in flight per worker (router bookkeeping)",
                              ["worker"], registry=r)
        self.workers = Gauge("llmtwin_workers", "Workers by state", ["state"], registry=r)
        self.scale_events = Counter("llmtwin_scale_events", "Actuator actions by kind", ["action"], registry=r)
        self.scrape_age = Gauge("llmtwin_scrape_age_seconds", "Age of the worker's last good /metrics scrape",
                                ["worker"], registry=r)
        self.scrape_duration = Histogram("llmtwin_scrape_duration_seconds", "One /metrics scrape, fetch and parse",
                                         buckets=_FAST + (0.25, 0.5, 1.0), registry=r)
        self.scrape_errors = Counter("llmtwin_scrape_errors", "Failed scrapes", ["worker"], registry=r)
        self.kv_event_lag = Gauge("llmtwin_kv_event_lag_seconds",
                                  "Receive time minus the publish timestamp of the worker's last KV-event batch",
                                  ["worker"], registry=r)
        self.kv_events = Counter("llmtwin_kv_events", "KV events applied to the precise index",
                                 ["worker", "type"], registry=r)
        self.kv_events_unmapped = Counter("llmtwin_kv_events_unmapped_blocks",
                                          "Stored blocks whose parent hash the controller never saw", ["worker"],
                                          registry=r)
        self.kv_event_gaps = Counter("llmtwin_kv_event_sequence_gaps", "Missed KV-event batches (sequence gaps)",
                                     ["worker"], registry=r)
        self.kv_events_arriving = Gauge("llmtwin_kv_events_arriving",
                                        "1 once a worker's first KV-event batch arrived, 0 until then",
                                        ["worker"], registry=r)
        self.rejected = Counter("llmtwin_rejected", "Requests answered by the controller itself, by reason",
                                ["reason"], registry=r)

        self.shadow: ShadowMetrics | None = None
        self.chunk_plan: ChunkPlanMetrics | None = None

    def enable_shadow(self) -> "ShadowMetrics":
        """Register shadow mode's series (live.shadow) on this controller's page; only when it is on."""
        if self.shadow is None:
            self.shadow = ShadowMetrics(self.registry)
        return self.shadow

    def enable_chunk_plan(self) -> "ChunkPlanMetrics":
        """Register the online chunk planner's series (live.chunk_plan); only when it is on."""
        if self.chunk_plan is None:
            self.chunk_plan = ChunkPlanMetrics(self.registry)
        return self.chunk_plan

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ShadowMetrics:
    """The shadow twin's forecasts per variant, its cost, and its own error against what happened."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.forecast = Gauge("llmtwin_shadow_forecast_seconds",
                              "Shadow twin forecast for the next window, by metric (ttft_p50, ...) and variant",
                              ["metric", "variant"], registry=r)
        self.goodput = Gauge("llmtwin_shadow_forecast_goodput_requests_per_second",
                             "Shadow twin forecast: requests meeting shadow.slo per second", ["variant"], registry=r)
        self.attainment = Gauge("llmtwin_shadow_forecast_slo_attainment",
                                "Shadow twin forecast: share of the window's requests meeting shadow.slo",
                                ["variant"], registry=r)
        self.error = Gauge("llmtwin_shadow_forecast_error_ratio",
                           "|forecast - realised| / realised of the last scored window (variant current)",
                           ["metric"], registry=r)
        self.runs = Counter("llmtwin_shadow_runs", "Shadow twin runs (all variants of one window)", registry=r)
        self.run_seconds = Histogram("llmtwin_shadow_run_seconds", "Wall time of one shadow run, all variants",
                                     buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.last_run_seconds = Gauge("llmtwin_shadow_last_run_seconds", "Wall time of the last shadow run",
                                      registry=r)
        self.window_requests = Gauge("llmtwin_shadow_window_requests", "Requests simulated in the last shadow run",
                                     registry=r)
        self.scored = Counter("llmtwin_shadow_windows_scored", "Forecast windows compared with what happened",
                              registry=r)
        self.skipped = Counter("llmtwin_shadow_skipped", "Shadow runs or variants not simulated, by reason",
                               ["reason"], registry=r)
        self.truncated = Counter("llmtwin_shadow_truncated_windows",
                                 "Windows cut to shadow.max_requests most recent requests", registry=r)

    def clear_forecasts(self) -> None:
        for g in (self.forecast, self.goodput, self.attainment):
            g.clear()


class ChunkPlanMetrics:
    """The online chunk planner: the engine arguments the next launched worker gets, plans and changes."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.engine_arg = Gauge("llmtwin_chunk_plan_engine_arg",
                                "Engine argument the chunk planner gives workers launched from now on", ["arg"],
                                registry=r)
        self.plans = Counter("llmtwin_chunk_plans", "Chunk planner runs over its candidates", registry=r)
        self.changes = Counter("llmtwin_chunk_plan_changes", "Picks that changed the launch arguments", registry=r)
        self.plan_seconds = Gauge("llmtwin_chunk_plan_last_seconds", "Wall time of the last chunk plan", registry=r)

    def set_current(self, knobs) -> None:
        self.engine_arg.clear()
        for k, v in knobs.as_engine_args().items():
            self.engine_arg.labels(k).set(v)
