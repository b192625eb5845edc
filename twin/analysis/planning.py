"""The chunk planner's table and figure, and the evaluator `twin plan-chunk` runs (`twin.sim.evaluate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pandas as pd

from twin.policy.chunk import SLO, Candidate
from twin.scenario import Scenario
from twin.sim.evaluate import TwinEvaluator, slo_of, window_of, with_knobs


def twin_evaluator(sc: Scenario) -> TwinEvaluator:
    """The evaluator `twin plan-chunk` uses: each candidate a full twin run of the window."""
    from twin.sim.cluster import simulate

    return TwinEvaluator(sc, simulate)


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


__all__ = ["TwinEvaluator", "candidate_values", "plan_frame", "plot_plan", "slo_of", "twin_evaluator", "window_of",
           "with_knobs"]
