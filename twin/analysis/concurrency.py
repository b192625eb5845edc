"""Closed-loop runs at several concurrency levels, one row of latency and throughput figures per level.

What `vllm bench serve --max-concurrency` prints for each level (mean and P99 of TTFT, TPOT, ITL, E2E, and
output and request throughput), from the twin's simulation of that load (twin.workload.closed_loop).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterable

from twin.errors import TwinInputError
from twin.scenario import Scenario, parse_scenario

METRICS = ("ttft", "tpot", "itl", "e2e")
COLUMNS = ("concurrency", "requests", "finished", *(f"{m}_{s}_ms" for m in METRICS for s in ("mean", "p99")),
           "throughput_output_tok_s", "throughput_req_s", "sim_time_s")


def at_concurrency(sc: Scenario, concurrency: int, num_requests: int | None = None) -> Scenario:
    """The scenario with `concurrency` clients (and `num_requests` requests, when given)."""
    if sc.workload.closed_loop is None:
        raise TwinInputError(f"{sc.name}: workload.closed_loop is not set; concurrency levels need a closed-loop load")
    raw = sc.model_dump(exclude_unset=True)
    raw["workload"]["closed_loop"]["concurrency"] = int(concurrency)
    if num_requests is not None:
        raw["workload"]["num_requests"] = int(num_requests)
    return parse_scenario(raw, sc.name, sc.base_dir)


def level_row(concurrency: int, summary: dict) -> dict:
    """One level's figures from a run's summary (twin.sim.metrics.summarize), in milliseconds."""
    row = {"concurrency": concurrency, "requests": summary["requests_total"],
           "finished": summary["requests_finished"]}
    for m in METRICS:
        d = summary[f"{m}_s"]
        for s in ("mean", "p99"):
            row[f"{m}_{s}_ms"] = None if d[s] is None else 1e3 * d[s]
    row["throughput_output_tok_s"] = summary["throughput_output_tok_s"]
    row["throughput_req_s"] = summary["throughput_req_s"]
    row["sim_time_s"] = summary["sim_time_s"]
    return row


def run_levels(sc: Scenario, levels: Iterable[int], requests_per_client: int | None = None) -> list[dict]:
    """Simulate the closed-loop scenario at each concurrency level; `requests_per_client` sets the request
    count per level (as InferenceX sends 10 x concurrency prompts), else the scenario's num_requests."""
    from twin.sim.cluster import simulate
    from twin.sim.metrics import summarize
    from twin.workload import build_stream

    rows = []
    for c in levels:
        if int(c) < 1:
            raise TwinInputError(f"concurrency levels must be >= 1, got {c}")
        s = at_concurrency(sc, int(c), None if requests_per_client is None else int(c) * requests_per_client)
        rows.append(level_row(int(c), summarize(simulate(s, build_stream(s)))))
    return rows


def write_levels(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS))
        w.writeheader()
        w.writerows(rows)
    return path
