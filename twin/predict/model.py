"""Trained length models, saved as one folder: `manifest.json` (kind, features, version, metrics) + weights.

Both kinds work on log1p(output tokens) and give quantiles at `QUANTILES`; a quantile of log1p(tokens)
mapped back with expm1 is the same quantile of tokens, and the median (0.5) is the point prediction (it
minimises the mean absolute error). The text model's head is trained with the pinball (quantile) loss;
the XGBoost model regresses the log length (squared error) and adds held-out residual quantiles (XGBoost's
own quantile objective stalled on exact-valued targets in our tests). Quantiles are sorted per request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from twin.errors import TwinInputError
from twin.predict.data import Examples
from twin.predict.features import FEATURES, feature_matrix, feature_row

MANIFEST = "manifest.json"
VERSION = 1
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
KINDS = ("xgboost", "text")
TARGET = "log1p(output_tokens), quantile regression (pinball loss) at levels " + ", ".join(map(str, QUANTILES))


Progress = Callable[[str, int, int], None]  # (stage, done, total)


def _need(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TwinInputError(f"{what} needs the optional package {module!r}: pip install torch==2.13.0 "
                             "'llmtwin[predict]'") from None


def to_tokens(log_q: np.ndarray) -> np.ndarray:
    """Quantiles in log1p space -> sorted token quantiles >= 1."""
    return np.maximum(np.expm1(np.sort(np.asarray(log_q, np.float64), axis=1)), 1.0)


class TrainedModel:
    """Common surface: quantiles for examples or for one request, and the manifest."""

    kind = "?"
    quantile_levels: list[float] = list(QUANTILES)

    def __init__(self, manifest: dict) -> None:
        self.manifest = manifest
        self.quantile_levels = list(manifest.get("quantiles", QUANTILES))

    def predict_quantiles(self, ex: Examples, progress: Progress | None = None) -> np.ndarray:
        raise NotImplementedError  # pragma: no cover

    def predict(self, ex: Examples, progress: Progress | None = None) -> np.ndarray:
        """Median predictions, tokens."""
        q = self.predict_quantiles(ex, progress)
        return q[:, self.quantile_levels.index(0.5)]

    def predict_request(self, num_prompt_tokens: int, turn: int, history: Sequence[int],
                        text: str | None) -> list[float]:
        ex = Examples([text], np.array([num_prompt_tokens]), np.array([1]), np.array([turn]), [list(history)],
                      np.array([0]))
        return self.predict_quantiles(ex)[0].tolist()

    def save(self, folder: str | Path) -> Path:
        raise NotImplementedError  # pragma: no cover

    def _write_manifest(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(json.dumps(self.manifest, indent=2) + "\n")


def base_manifest(kind: str, train: Examples, seed: int, **extra) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("llmtwin")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        ours = "0"
    return {"kind": kind, "version": VERSION, "llmtwin": ours,
            "features": list(FEATURES), "target": TARGET, "quantiles": list(QUANTILES), "seed": seed,
            "trained_on": train.source, "n_train": len(train), "metrics": {}, **extra}


class XGBoostModel(TrainedModel):
    """Gradient-boosted trees on `FEATURES` (NaN = missing, which XGBoost routes natively).

    The trees regress log1p(tokens) with squared error; a request's quantiles are its prediction plus the
    quantiles of held-out residuals in log space (`residual_quantiles`: one spread for every request).
    """

    kind = "xgboost"
    WEIGHTS = "model.json"

    def __init__(self, manifest: dict, booster) -> None:
        super().__init__(manifest)
        self.booster = booster
        self.residuals = np.asarray(manifest["residual_quantiles"], np.float64)

    def _quantiles(self, x: np.ndarray) -> np.ndarray:
        mean = np.asarray(self.booster.inplace_predict(x), np.float64).reshape(len(x), 1)
        return to_tokens(mean + self.residuals[None, :])

    def predict_quantiles(self, ex: Examples, progress: Progress | None = None) -> np.ndarray:
        return self._quantiles(feature_matrix(ex.prompt_tokens, ex.turns, ex.histories, ex.texts))

    def predict_request(self, num_prompt_tokens, turn, history, text):
        x = np.asarray([feature_row(int(num_prompt_tokens), int(turn), history, text)], np.float64)
        return self._quantiles(x)[0].tolist()

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.booster.save_model(str(folder / self.WEIGHTS))
        self._write_manifest(folder)
        return folder

    @classmethod
    def load(cls, folder: Path, manifest: dict) -> "XGBoostModel":
        xgb = _need("xgboost", "an xgboost length model")
        if "residual_quantiles" not in manifest:
            raise TwinInputError(f"{folder / MANIFEST}: missing field residual_quantiles")
        booster = xgb.Booster(params={"nthread": XGB_THREADS})
        try:
            booster.load_model(str(folder / cls.WEIGHTS))
        except xgb.core.XGBoostError as e:
            raise TwinInputError(f"{folder / cls.WEIGHTS}: cannot load: {str(e).splitlines()[0]}") from None
        return cls(manifest, booster)


# ASSUMPTION: tree settings for a few hundred to a few hundred thousand examples; the number of rounds is
# chosen by early stopping on a seeded 15 % of the training groups, then the trees are refit on all of them
XGB_PARAMS = {"max_depth": 3, "eta": 0.05, "subsample": 0.8, "colsample_bytree": 0.8, "min_child_weight": 5,
              "lambda": 1.0, "tree_method": "hist"}
XGB_MAX_ROUNDS = 1000
# one thread: on a shared 2-core machine OpenMP's spinning threads made training 30x slower with two
XGB_THREADS = 1
XGB_PATIENCE = 50
XGB_TARGET = ("log1p(output_tokens), squared error; quantiles = prediction + quantiles of held-out log "
              "residuals at levels " + ", ".join(map(str, QUANTILES)))


def train_xgboost(train: Examples, seed: int = 0, rounds: int | None = None, params: dict | None = None,
                  progress: Progress | None = None) -> XGBoostModel:
    """Fit the trees; `rounds` None: early stopping picks it (needs >= 20 groups, else 200 rounds).
    The residual spread comes from the early-stopping split (held out), else from the training fit."""
    xgb = _need("xgboost", "an xgboost length model")
    from twin.predict.data import split

    p = {**XGB_PARAMS, **(params or {}), "objective": "reg:squarederror", "seed": seed, "nthread": XGB_THREADS}

    def matrix(ex: Examples):
        x = feature_matrix(ex.prompt_tokens, ex.turns, ex.histories, ex.texts)
        return xgb.DMatrix(x, label=np.log1p(ex.output_tokens.astype(np.float64)), feature_names=list(FEATURES),
                           nthread=XGB_THREADS)

    def residuals(b, ex: Examples) -> np.ndarray:
        d = matrix(ex)
        return np.quantile(d.get_label() - b.predict(d), QUANTILES)

    chosen, spread = "given", "the training fit (no held-out split)"
    res = None
    if rounds is None:
        if len(np.unique(train.groups)) >= 20:
            fit, val = split(train, 0.15, seed)
            if progress is not None:
                progress("choosing rounds", 0, 1)
            b = xgb.train(p, matrix(fit), num_boost_round=XGB_MAX_ROUNDS, evals=[(matrix(val), "val")],
                          early_stopping_rounds=XGB_PATIENCE, verbose_eval=False)
            rounds = int(b.best_iteration) + 1
            res = residuals(b[:rounds], val)
            chosen = f"early stopping on {len(val)} of the {len(train)} training examples"
            spread = f"{len(val)} held-out training examples"
        else:
            rounds, chosen = 200, "default (too few examples to early-stop)"
    cb = []
    if progress is not None:
        total = rounds

        class _Tick(xgb.callback.TrainingCallback):
            def after_iteration(self, model, epoch, evals_log):
                progress("boosting", epoch + 1, total)
                return False
        cb.append(_Tick())
    booster = xgb.train(p, matrix(train), num_boost_round=rounds, callbacks=cb)
    if res is None:
        res = residuals(booster, train)
    booster.feature_names = None  # served from plain arrays
    man = base_manifest("xgboost", train, seed, rounds=rounds, rounds_chosen_by=chosen, params=p,
                        residual_quantiles=[float(r) for r in res], residuals_from=spread)
    man["target"] = XGB_TARGET
    return XGBoostModel(man, booster)
