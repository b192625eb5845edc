"""`twin compare`: the same arrivals under several routers (or router settings), one table and figures."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd
import yaml

from twin.errors import TwinInputError

ROUTER_KEYS = ("name", "params", "scrape_interval_s", "prefix_index", "prefix_index_capacity_blocks",
               "kv_event_delay_s", "on_error")


@dataclass
class Variant:
    """One contender: a label, the router section fields it sets, and any other scenario overrides."""

    label: str
    router: dict
    overrides: list[str] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    """`NAME` or an inline YAML mapping `{label: .., name: .., params: {..}, scrape_interval_s: .., set: [..]}`."""
    text = text.strip()
    if not text.startswith("{"):
        if not text:
            raise TwinInputError("--routers: an empty router name")
        return Variant(text, {"name": text})
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TwinInputError(f"--router {text!r}: not a YAML mapping ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict) or "name" not in raw:
        raise TwinInputError(f"--router {text!r}: give at least name (and optionally label, params, set)")
    unknown = [k for k in raw if k not in ROUTER_KEYS + ("label", "set")]
    if unknown:
        raise TwinInputError(f"--router {text!r}: unknown key(s) {', '.join(unknown)} "
                             f"(known: label, set, {', '.join(ROUTER_KEYS)})")
    sets = raw.get("set") or []
    if isinstance(sets, str):
        sets = [sets]
    if not isinstance(sets, list) or not all(isinstance(x, str) for x in sets):
        raise TwinInputError(f"--router {text!r}: set must be a list of dotted.path=value overrides "
                             f"(e.g. set: [cluster.num_instances=8]), got {sets!r}")
    label = str(raw.get("label") or raw["name"])
    return Variant(label, {k: raw[k] for k in ROUTER_KEYS if k in raw}, list(sets))


def _variant_scenario(path: Path, overrides: list[str], v: Variant, seed: int):
    from twin.scenario import apply_overrides, parse_scenario, read_scenario_yaml

    raw = apply_overrides(read_scenario_yaml(path), list(overrides) + list(v.overrides))
    router = dict(raw.get("router") or {}) if isinstance(raw.get("router"), dict) else {}
    if v.router.get("name") != router.get("name"):
        router.pop("params", None)  # params belong to the router they were written for
    router.update(v.router)
    raw["router"] = router
    raw["seed"] = seed
    return parse_scenario(raw, f"{path} [{v.label}]", path.parent)


@dataclass
class Comparison:
    table: pd.DataFrame  # one row per (label, seed)
    mean: pd.DataFrame  # averaged over seeds, one row per label
    requests: dict = field(default_factory=dict)  # label -> requests frame (first seed)
    timelines: dict = field(default_factory=dict)  # label -> timeline frame (first seed)
    files: list = field(default_factory=list)


def compare(path: Path, variants: list[Variant], overrides: list[str] | None = None, seeds: int = 1,
            seed: int | None = None, progress: Callable[[str], None] | None = None) -> Comparison:
    """Run every variant on each seed's arrivals; nothing but the router section differs within a seed."""
    from twin.sim.cluster import Cluster, account
    from twin.sim.metrics import summarize
    from twin.analysis.report import load_imbalance, summary_row
    from twin.scenario import load_scenario
    from twin.workload import build_stream

    if not variants:
        raise TwinInputError("--routers: name at least one router")
    labels = [v.label for v in variants]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise TwinInputError(f"--routers: label(s) used twice: {', '.join(dup)} (give each a label)")
    overrides = list(overrides or [])
    base = load_scenario(path, overrides, seed)
    seed_list = [base.seed + k for k in range(seeds)]
    # validate every contender before running any
    scenarios = {(v.label, s): _variant_scenario(path, overrides, v, s) for s in seed_list for v in variants}
    from twin.sim.cluster import build_router

    for sc in scenarios.values():
        build_router(sc)
    rows = []
    cmp = Comparison(pd.DataFrame(), pd.DataFrame())
    for s in seed_list:
        shared = build_stream(load_scenario(path, overrides, s))
        for v in variants:
            sc = scenarios[(v.label, s)]
            stream = shared if not any(o.startswith("workload.") for o in v.overrides) else build_stream(sc)
            if progress is not None:
                progress(f"{v.label} (seed {s})")
            cl = Cluster(sc, stream)
            res = cl.run()
            summary = summarize(res)
            df = res.log.to_frame([i.id for i in res.instances])
            counts = account(res.log)
            assert sum(counts.values()) == len(stream)  # every request accounted for
            row = {"label": v.label, "router": sc.router.name, "seed": s,
                   "scrape_interval_s": sc.router.scrape_interval_s,
                   "prefix_index": summary.get("router", {}).get("prefix_index"),
                   **summary_row(summary), "load_imbalance": load_imbalance(df, len(res.instances))}
            rows.append(row)
            if s == seed_list[0]:
                cmp.requests[v.label] = df
                if cl.timeline is not None:
                    cmp.timelines[v.label] = cl.timeline.to_frame()
    cmp.table = pd.DataFrame(rows)
    num = cmp.table.drop(columns=["router", "seed", "prefix_index"]).groupby("label", sort=False).mean(
        numeric_only=True)
    cmp.mean = num.reset_index()
    return cmp


def write(cmp: Comparison, out: Path, title: str) -> list[Path]:
    """comparison.csv (per seed), comparison_mean.csv, requests per label, and the PNG figures."""
    from twin.analysis.report import latency_cdfs, timelines, ttft_cdf

    out.mkdir(parents=True, exist_ok=True)
    files = [out / "comparison.csv", out / "comparison_mean.csv"]
    cmp.table.to_csv(files[0], index=False)
    cmp.mean.to_csv(files[1], index=False)
    files.append(ttft_cdf(cmp.requests, out / "ttft_cdf.png", f"{title}: TTFT by router"))
    files.append(latency_cdfs(cmp.requests, out / "latency_cdf.png", title))
    if cmp.timelines:
        files.append(timelines(cmp.timelines, out / "timelines.png", f"{title}: per-instance load and KV use"))
        pd.concat([t.assign(label=k) for k, t in cmp.timelines.items()]).to_parquet(out / "timeline.parquet")
        files.append(out / "timeline.parquet")
    pd.concat([d.assign(label=k) for k, d in cmp.requests.items()]).to_parquet(out / "requests.parquet")
    files.append(out / "requests.parquet")
    (out / "comparison.json").write_text(json.dumps(cmp.table.to_dict(orient="records"), indent=1, default=float))
    cmp.files = files
    return files
