"""Fit the shipped `h100-vllm` step-time profile (twin/perf/profiles/h100-vllm.yaml) on the InferenceX H100 table.

Fits on the TP 2 and TP 8 points of both models (twin.analysis.profile_fit: the steady-state picture, then `refine` on
the simulated points, about 10 minutes on 2 cores), then scores the held-out TP 4 points by simulating each under its
closed-loop load (10 requests per client, as InferenceMAX sends), against the roofline with its defaults on the same
points, and writes the figures into the profile's `fit` section. Deterministic.

Usage: PYTHONPATH=. python scripts/fit_h100_profile.py [--out runs/h100-profile] [--iterations 2] [--no-refine]
       [--cross-model | --fit-set-check | --series-cv]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from twin.analysis.gpu_fidelity import METRICS, aggregate, plot, read_points, score, write_csv  # noqa: E402
from twin.perf.fitted import PROFILES  # noqa: E402
from twin.analysis.profile_fit import HOST_TERMS, PINNED, fit, profile_document, refine, split  # noqa: E402

DATA = ROOT / "tests" / "data" / "inferencex-h100-vllm.csv"
NAME = "h100-vllm"
# the GPUs whose scenarios take this profile by default (perf.kind auto): the SXM Hoppers, whose NVLink the fitted
# all-reduce terms saw; H200 through its own datasheet numbers in the basis (checked, never fitted, on
# tests/data/inferencex-h200-vllm.csv)
DEFAULT_FOR = ("H100-SXM-80GB", "H200-SXM-141GB")
HOST = HOST_TERMS  # the roofline's host terms (hidden under async scheduling)


def train(p) -> bool:
    return p.tp != 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "h100-profile")
    ap.add_argument("--requests-per-client", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=2, help="refine's Gauss-Newton iterations")
    ap.add_argument("--workers", type=int, default=2, help="processes simulating the points while refining")
    ap.add_argument("--no-refine", action="store_true", help="ship the steady-state picture's fit as it is")
    ap.add_argument("--cross-model", action="store_true",
                    help="instead: fit on Llama alone, score gpt-oss (written under --out, the shipped profile untouched)")
    ap.add_argument("--fit-set-check", action="store_true",
                    help="instead: the check candidates are judged by, on the fit set alone: fit TP 2 and score TP 8, "
                         "then the reverse (written under --out, the shipped profile untouched)")
    ap.add_argument("--series-cv", action="store_true",
                    help="instead: leave one (model, lengths, TP) series of the fit set out at a time, fit the picture "
                         "on the rest (no refine), simulate the series left out; with `compute` pinned and unpinned "
                         "(written under --out, the shipped profile untouched)")
    args = ap.parse_args()
    points = read_points(DATA)
    if args.cross_model:
        return cross_model(points, args.out, args)
    if args.fit_set_check:
        return fit_set_check(points, args.out, args)
    if args.series_cv:
        return series_cv(points, args.out, args)
    fit_on, held_out = split(points, train)
    coef, n, refined = fitted(fit_on, args)
    doc = profile_document(coef, "TP 2 and TP 8, both models (Llama-3.1-70B FP8, gpt-oss-120b "
                           f"MXFP4): {n} points whose load fits the KV cache",
                           f"TP 4, both models: {len(held_out)} points", "tests/data/inferencex-h100-vllm.csv "
                           "(SemiAnalysis InferenceX, real vLLM on H100 SXM)", HOST, DEFAULT_FOR, refined)
    path = PROFILES / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    rpc = args.requests_per_client
    held = {}
    for label, overrides in (("profile", ["cluster.perf.kind=fitted", f"cluster.perf.profile={NAME}"]),
                             ("roofline", ["cluster.perf.kind=roofline"])):
        rows = score(held_out, rpc, overrides)
        write_csv(rows, args.out / f"held_out_{label}.csv")
        plot(rows, args.out / f"held_out_{label}.png", f"{label} on the held-out TP 4 points ({rpc} requests/client)")
        held[label] = figures(rows)
        print(label, held[label])
    doc["fit"]["held_out_error_pct"] = {"requests_per_client": rpc, **held}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    print(f"wrote {path}")


def fitted(fit_on, args) -> tuple[dict, int, dict | None]:
    """The picture's fit, refined on the simulated points unless --no-refine: (coefficients, points fitted, what
    refine reported or None)."""
    result = fit(fit_on)
    n = result["points_fitted"]
    if args.no_refine:
        return result["coefficients"], n, None
    ref = refine(result["points"], result["coefficients"], args.requests_per_client, args.iterations, args.workers,
                 progress=print)
    return ref["coefficients"], n, {**ref, "iterations": args.iterations, "requests_per_client": args.requests_per_client}


def figures(rows) -> dict:
    """MAPE and signed error per metric over the rows that are not bad runs, to one decimal."""
    agg = aggregate([r for r in rows if not r["bad_run"]])[0]
    return {m: {"mape": round(agg[f"{m}_mape"], 1), "signed": round(agg[f"{m}_signed"], 1)} for m in METRICS}


def fit_and_score(fit_on, held_out, fitted_on: str, held_out_label: str, name: str, csv_name: str, out: Path,
                  args) -> dict:
    """Fit (and refine) on `fit_on`, write the profile to out/NAME.yaml, simulate `held_out` on it into
    out/CSV_NAME.csv; the held-out figures. The shipped profile is untouched."""
    coef, n, refined = fitted(fit_on, args)
    doc = profile_document(coef, f"{fitted_on}: {n} points", held_out_label, str(DATA.relative_to(ROOT)), HOST,
                           refined=refined)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    rows = score(held_out, args.requests_per_client, ["cluster.perf.kind=fitted", f"cluster.perf.fit_path={path}"])
    write_csv(rows, out / f"{csv_name}.csv")
    return figures(rows)


def cross_model(points, out: Path, args) -> None:
    """Fit on the dense model alone and score the MoE one: how far the basis transfers to a model never fitted on."""
    fit_on, held_out = split(points, lambda p: "llama" in p.model.lower())
    print("fit on Llama, scored on gpt-oss:",
          fit_and_score(fit_on, held_out, "Llama alone", f"gpt-oss: {len(held_out)} points", "llama-only",
                        "cross_model", out, args))


def fit_set_check(points, out: Path, args) -> None:
    """Fit on TP 2 and score TP 8, then the reverse: how a change to the fit is judged without the held-out TP 4."""
    for fit_tp, score_tp in ((2, 8), (8, 2)):
        got = fit_and_score([p for p in points if p.tp == fit_tp], [p for p in points if p.tp == score_tp],
                            f"TP {fit_tp}", f"TP {score_tp}", f"fit-tp{fit_tp}", f"fit-tp{fit_tp}-score-tp{score_tp}",
                            out, args)
        print(f"fitted on TP {fit_tp}, scored on TP {score_tp}:", got)


def series_of(p) -> tuple:
    """A measured series: one model at one TP and one pair of lengths, over its concurrencies."""
    return (p.model, p.label or f"{p.isl}/{p.osl}", p.tp)


def _series_job(job: tuple) -> list[dict]:
    """Fit the picture on the fit set less one series (pinned as shipped, or nothing pinned), simulate that series."""
    fit_set, left, variant, rpc, out = job
    pinned = tuple(PINNED) if variant == "pinned" else ()
    coef = fit(fit_set, fixed={k: PINNED[k] for k in pinned})["coefficients"]
    label = "-".join(str(x) for x in series_of(left[0])).replace("/", "_")
    doc = profile_document(coef, f"the fit set less {label}", label, str(DATA.relative_to(ROOT)), HOST, pinned=pinned)
    path = out / f"{variant}-{label}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return [{**r, "variant": variant} for r in score(left, rpc, ["cluster.perf.kind=fitted",
                                                                 f"cluster.perf.fit_path={path}"])]


def series_cv(points, out: Path, args) -> None:
    """Leave-one-series-out on the fit set (TP 2 and 8), at the picture's fit: whether a change to the basis or to
    what is pinned transfers to a series the fit did not see, without the held-out TP 4 or refine's minutes."""
    from multiprocessing import Pool

    fit_set = [p for p in points if train(p)]
    series = sorted({series_of(p) for p in fit_set})
    d = out / "series-cv"
    d.mkdir(parents=True, exist_ok=True)
    jobs = [([p for p in fit_set if series_of(p) != s], [p for p in fit_set if series_of(p) == s], variant,
             args.requests_per_client, d) for variant in ("pinned", "unpinned") for s in series]
    with Pool(args.workers) as pool:
        done = pool.map(_series_job, jobs)
    for variant in ("pinned", "unpinned"):
        rows = [r for job, rs in zip(jobs, done) if job[2] == variant for r in rs]
        write_csv(rows, d / f"{variant}.csv")
        print(f"leave one of {len(series)} series out, {variant}:", figures(rows))


if __name__ == "__main__":
    main()
