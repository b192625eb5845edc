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
                                          "Time to build the request view and run the router", buckets=_FAST,
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
