"""The simulator's side of the chunk planner: an evaluator that runs the twin, and the table and figure behind a plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from twin.policy.chunk import SLO, Candidate, EngineKnobs, WorkloadWindow
from twin.scenario import Scenario, parse_scenario
from twin.workload import RequestStream


def slo_of(sc: Scenario) -> SLO:
    return SLO(sc.slo.ttft_s, sc.slo.tpot_s, sc.slo.e2e_s)


def window_of(stream: RequestStream) -> WorkloadWindow:
    """A whole stream as a planner's window (the stream rides along, so the twin replays it exactly)."""
    return WorkloadWindow(stream.arrival_s, stream.prompt_tokens, stream.output_tokens, source=stream)


def with_knobs(sc: Scenario, knobs: EngineKnobs, slo: SLO | None = None) -> Scenario:
    """The scenario with `knobs` in cluster.engine (and `slo`), validated as a scenario file would be."""
    raw = sc.model_dump(mode="json")
    raw["cluster"]["engine"].update(knobs.as_engine_args())
    if slo is not None:
        raw["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s}
    return parse_scenario(raw, f"candidate {knobs.label()}", sc.base_dir)


class TwinEvaluator:
    """`(window, knobs, slo) -> summary`: the twin run on the window's requests with candidate engine knobs.

    A window that carries its RequestStream is replayed as is (prefix hashes, closed-loop turns); a bare window
    (arrival times and lengths, as the online planner keeps) becomes an open-loop stream starting at 0 with no
    shared prefixes.
    """

    def __init__(self, sc: Scenario) -> None:
        self.scenario = sc
        self.runs = 0

    def stream_of(self, window: WorkloadWindow) -> RequestStream:
        if isinstance(window.source, RequestStream):
            return window.source
        a = window.arrival_s - (window.arrival_s[0] if len(window) else 0.0)
        return RequestStream(a, window.prompt_tokens, window.output_tokens)

    def __call__(self, window: WorkloadWindow, knobs: EngineKnobs, slo: SLO) -> dict[str, Any]:
        from twin.cluster import Cluster
        from twin.metrics import summarize

        sc = with_knobs(self.scenario, knobs, slo)
        self.runs += 1
        return summarize(Cluster(sc, self.stream_of(window)).run())


def plan_frame(rows: Sequence[Candidate]) -> pd.DataFrame:
    return pd.DataFrame([c.row() for c in rows])


def plot_plan(rows: Sequence[Candidate], slo: SLO, path: Path, title: str) -> Path:
    """Goodput, and TTFT/TPOT/ITL p99, against the chunk size; the chosen setting marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = plan_frame(rows)
    ok = df[df.error.isna()] if "error" in df else df
    others = [c for c in ("max_num_seqs", "long_prefill_token_threshold") if c in ok.columns]
    groups = ok.groupby(others, dropna=False) if others else [((), ok)]
    fig, (top, bot) = plt.subplots(2, 1, figsize=(7.5, 7), sharex=True)
    for key, g in groups:
        g = g.sort_values("max_num_batched_tokens")
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{c}={v:g}" for c, v in zip(others, key) if v == v) or None
        top.plot(g.max_num_batched_tokens, g.goodput_req_s, "o-", label=label)
        for col, style, name in (("ttft_p99_s", "o-", "TTFT p99"), ("tpot_p99_s", "s--", "TPOT p99"),
                                 ("itl_p99_s", "^:", "ITL p99")):
            y = pd.to_numeric(g[col], errors="coerce")
            bot.plot(g.max_num_batched_tokens, y, style, label=name + (f" ({label})" if label else ""))
    chosen = ok[ok.chosen.astype(bool)]
    if len(chosen):
        top.scatter(chosen.max_num_batched_tokens, chosen.goodput_req_s, s=220, facecolors="none",
                    edgecolors="red", linewidths=2, zorder=5, label="chosen")
    for bound, name, color in ((slo.ttft_s, "TTFT SLO", "C0"), (slo.tpot_s, "TPOT SLO", "C1")):
        if bound is not None:
            bot.axhline(bound, color=color, lw=0.8, ls="-.", label=name)
    top.set_ylabel("goodput (req/s within SLO)")
    top.set_title(title)
    top.legend(fontsize=8)
    bot.set_ylabel("p99 latency (s)")
    bot.set_yscale("log")
    bot.set_xscale("log", base=2)
    ticks = sorted(ok.max_num_batched_tokens.unique())
    bot.set_xticks(ticks, [str(int(t)) for t in ticks], rotation=45 if len(ticks) > 8 else 0)
    bot.minorticks_off()
    bot.set_xlabel("max_num_batched_tokens (prefill chunk)")
    bot.legend(fontsize=7, ncol=2)
    for ax in (top, bot):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def candidate_values(text: str | None, what: str) -> list[int] | None:
    """A comma list of positive integers from the CLI, or None when not given."""
    from twin.errors import TwinInputError

    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = int(part)
        except ValueError:
            raise TwinInputError(f"{what}: {part!r} is not an integer (give e.g. 512,2048,8192)") from None
        if v < 0 or (v == 0 and what == "--candidates"):
            raise TwinInputError(f"{what}: {v} must be {'> 0' if what == '--candidates' else '>= 0'}")
        out.append(v)
    if not out:
        raise TwinInputError(f"{what}: no values")
    return out


__all__ = ["TwinEvaluator", "candidate_values", "plan_frame", "plot_plan", "slo_of", "window_of",
           "with_knobs"]
