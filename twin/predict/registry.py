"""Length models by kind: train one, or load a saved one, without the kinds' modules importing each other."""

from __future__ import annotations

import json
from pathlib import Path

from twin.errors import TwinInputError
from twin.predict.data import Examples
from twin.predict.features import FEATURES
from twin.predict.model import KINDS, MANIFEST, VERSION, Progress, TrainedModel, XGBoostModel, train_xgboost


def train_model(kind: str, train: Examples, seed: int = 0, epochs: int | None = None,
                encoder: str | None = None, progress: Progress | None = None) -> TrainedModel:
    if kind == "xgboost":
        if encoder is not None or epochs is not None:
            raise TwinInputError("--encoder and --epochs apply to the text model (--kind text)")
        return train_xgboost(train, seed, progress=progress)
    if kind == "text":
        from twin.predict.text import DEFAULT_EPOCHS, train_text

        return train_text(train, seed, DEFAULT_EPOCHS if epochs is None else epochs, encoder, progress)
    raise TwinInputError(f"unknown model kind {kind!r} (known: {', '.join(KINDS)})")


def load_model(path: str | Path) -> TrainedModel:
    """A model folder saved by `twin predictor train` (one clear error when it is not one)."""
    folder = Path(path)
    man_path = folder / MANIFEST
    if not man_path.is_file():
        raise TwinInputError(f"{folder}: not a length model (no {MANIFEST}; make one with twin predictor train)")
    try:
        man = json.loads(man_path.read_text())
    except (OSError, ValueError) as e:
        raise TwinInputError(f"{man_path}: cannot read: {e}") from None
    if not isinstance(man, dict) or man.get("kind") not in KINDS:
        raise TwinInputError(f"{man_path}: unknown model kind {man.get('kind') if isinstance(man, dict) else man!r}")
    if int(man.get("version", 0)) > VERSION:
        raise TwinInputError(f"{man_path}: model format version {man['version']} is newer than this llmtwin "
                             f"reads ({VERSION})")
    if man.get("features") != list(FEATURES):
        raise TwinInputError(f"{man_path}: the model was trained on other features than this llmtwin computes")
    if man["kind"] == "xgboost":
        return XGBoostModel.load(folder, man)
    from twin.predict.text import TextModel

    return TextModel.load(folder, man)
