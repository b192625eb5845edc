"""Length predictors (pure policy objects), the prompt/answer trace format, and bad training data.

Nothing here needs the `[predict]` extras; the trainable models are in test_predictors_models.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from twin.cli import app
from twin.errors import TwinInputError
from twin.policy.predictors import (PREDICTORS, BucketQuantile, MissingTruth, Noisy, SessionTracker,
                                    evaluate, has_quantiles, lognormal_sigma, make_predictor)
from twin.policy.views import RequestView
from twin.workload.formats import detect_format, load_trace
from twin.workload.stream import RequestStream

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
SHARED_ARENA = ROOT.parent / "shared" / "traces" / "arena_hard"
runner = CliRunner()


def rv(i, prompt=100, session=None, max_tokens=None, text=None) -> RequestView:
    return RequestView(str(i), 0.0, prompt, max_tokens, (), 16, session, text=text)


# ---- simple predictors ----

def test_registry_names_and_bad_names_or_params():
    assert set(PREDICTORS) == {"oracle", "constant", "mean", "bucket-quantile", "noisy", "model"}
    with pytest.raises(TwinInputError, match="unknown length predictor 'median'.*bucket-quantile"):
        make_predictor("median")
    with pytest.raises(TwinInputError, match="takes: value"):
        make_predictor("constant", valu=3)
    with pytest.raises(TwinInputError, match="value must be a number >= 1"):
        make_predictor("constant", value=0)


def test_oracle_refuses_without_a_revealed_truth_and_says_it_is_the_oracle():
    o = make_predictor("oracle")
    assert o.is_oracle and o.needs_truth and not make_predictor("mean").is_oracle
    with pytest.raises(MissingTruth, match="request '7' was not revealed"):
        o.predict(rv(7))
    o.reveal("7", 123)
    assert o.predict(rv(7)) == 123.0 and o.quantiles(rv(7), [0.1, 0.9]) == [123.0, 123.0]
    o.observe(rv(7), 123)  # finished: the truth is forgotten
    with pytest.raises(MissingTruth):
        o.predict(rv(7))


def test_constant_and_mean_and_the_cap():
    c = make_predictor("constant", value=300)
    assert c.predict(rv(0)) == 300 and c.predict(rv(0, max_tokens=50)) == 50
    m = make_predictor("mean", prior=99)
    assert m.predict(rv(0)) == 99
    for i, n in enumerate((10, 20, 60)):
        m.observe(rv(i), n)
    assert m.predict(rv(9)) == pytest.approx(30.0)
    assert not has_quantiles(m) and has_quantiles(c)


def test_session_tracker_turns_and_history():
    s = SessionTracker()
    assert s.turn(rv("a", session="x")) == 0
    assert s.turn(rv("b", session="x")) == 1
    assert s.turn(rv("a", session="x")) == 0  # fixed at first sight
    assert s.turn(rv("c")) == 0  # no session: always a first turn
    s.observe(rv("a", session="x"), 40)
    assert s.history(rv("d", session="x")) == [40] and s.turn(rv("d", session="x")) == 2


def test_bucket_quantile_converges_on_a_bimodal_workload():
    """Short prompts get short answers, long prompts long ones: per-bucket medians find both modes, where
    the global median would sit between them."""
    rng = np.random.default_rng(0)
    p = BucketQuantile(min_count=20)
    assert p.predict(rv("first", prompt=30)) == p.prior  # nothing observed yet
    for i in range(1000):
        long = i % 2 == 1
        r = rv(i, prompt=int(rng.integers(2048, 4096)) if long else int(rng.integers(16, 32)))
        p.observe(r, int(rng.normal(800, 40)) if long else int(rng.normal(50, 5)))
    assert p.predict(rv("s", prompt=20)) == pytest.approx(50, abs=3)
    assert p.predict(rv("l", prompt=3000)) == pytest.approx(800, abs=15)
    q = p.quantiles(rv("l2", prompt=3000), [0.1, 0.5, 0.9])
    assert q[0] < q[1] < q[2] and q[2] - q[0] == pytest.approx(2 * 1.2816 * 40, rel=0.2)
    # a prompt length never seen: the global distribution (its median lies between the modes, 50 or 800 mixed)
    g = p.predict(rv("m", prompt=300))
    assert 50 <= g <= 800
    assert p.predict(rv("m2", prompt=300, max_tokens=10)) == 10


def test_bucket_quantile_separates_turns_and_falls_back_while_thin():
    p = BucketQuantile(min_count=10)
    for s in range(40):  # first turns answer 100, second turns 500, all with 100-token prompts
        a, b = rv(f"{s}a", session=str(s)), rv(f"{s}b", session=str(s))
        p.predict(a), p.predict(b)
        p.observe(a, 100)
        p.observe(b, 500)
    assert p.predict(rv("n1", session="new")) == pytest.approx(100)
    assert p.predict(rv("n2", session="new")) == pytest.approx(500)
    # turn 3 has no bucket of its own yet: the prompt-length bucket over all turns (100 and 500, median 300)
    assert p.predict(rv("n3", session="new")) == pytest.approx(300)
    assert p.counts()[(6, 0)] == 40 and p.counts()[(6, 1)] == 40


@pytest.mark.parametrize("dist,rate", [("uniform", 0.25), ("uniform", 0.5), ("lognormal", 0.25), ("lognormal", 1.0)])
def test_noisy_has_the_error_rate_it_says(dist, rate):
    truth = np.random.default_rng(1).integers(50, 2000, size=20000)
    n = make_predictor("noisy", inner="oracle", error_rate=rate, seed=3, dist=dist)
    assert n.needs_truth and not n.is_oracle and "noisy oracle" in n.describe()
    pred = []
    for i, t in enumerate(truth.tolist()):
        n.reveal(str(i), t)
        pred.append(n.predict(rv(i)))
    got = evaluate(pred, truth)["error_rate"]
    assert got == pytest.approx(rate, rel=0.05)
    if dist == "uniform":  # unbiased
        assert np.mean(np.asarray(pred) / truth) == pytest.approx(1.0, abs=0.01)


def test_noisy_factor_is_a_function_of_seed_and_request():
    a = Noisy("constant", 0.25, seed=5, inner_params={"value": 400})
    b = Noisy("constant", 0.25, seed=5, inner_params={"value": 400})
    other = Noisy("constant", 0.25, seed=6, inner_params={"value": 400})
    assert a.predict(rv("x")) == a.predict(rv("x")) == b.predict(rv("x"))
    assert a.predict(rv("x")) != other.predict(rv("x"))
    assert Noisy("constant", 0.0, inner_params={"value": 400}).predict(rv("x")) == 400
    with pytest.raises(TwinInputError, match="needs error_rate <= 0.5"):
        Noisy("oracle", 0.6)
    with pytest.raises(TwinInputError, match="inner must be another kind"):
        Noisy("noisy")
    z = np.random.default_rng(0).standard_normal(400_000)
    assert np.abs(np.exp(lognormal_sigma(0.25) * z) - 1).mean() == pytest.approx(0.25, rel=0.01)


def test_model_predictor_needs_a_model_folder(tmp_path):
    with pytest.raises(TwinInputError, match="not a length model"):
        make_predictor("model", path=str(tmp_path))


def test_evaluate_computes_blocks_metrics():
    m = evaluate([100, 150, 400, 10], [100, 100, 200, 20])
    assert m["mae"] == pytest.approx((0 + 50 + 200 + 10) / 4)
    assert m["error_rate"] == pytest.approx((0 + 0.5 + 1.0 + 0.5) / 4)
    assert m["acc50"] == 0.75 and m["acc100"] == 0.75


# ---- the prompt/answer (Arena-Hard) format ----

def write_pair(folder: Path, questions: list[list[str]], answers: dict[int, list[tuple[str, int | None]]],
               prompts_name: str = "question.jsonl", answers_name: str = "model_a.jsonl", string_turns=False):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / prompts_name, "w") as f:
        for i, q in enumerate(questions):
            turns = q if string_turns else [{"content": t} for t in q]
            f.write(json.dumps({"question_id": f"q{i}", "category": "x", "turns": turns}) + "\n")
    with open(folder / answers_name, "w") as f:
        for i, a in answers.items():
            turns = [{"content": c, **({"token_len": n} if n is not None else {})} for c, n in a]
            f.write(json.dumps({"question_id": f"q{i}", "answer_id": "a", "model_id": "m",
                                "choices": [{"index": 0, "turns": turns}]}) + "\n")
    return folder


def test_arena_pair_detected_and_joined(tmp_path):
    qs = [["Write a poem about the sea."], ["Name one prime.", "And another?"], ["Unanswered question"]]
    ans = {1: [("2", 1), ("3", 1)], 0: [("The sea " * 40, 90)]}
    d = write_pair(tmp_path / "pair", qs, ans, string_turns=True)  # MT-Bench style: turns are strings
    assert detect_format(d) == "arena" and detect_format(d / "question.jsonl") == "arena"
    s = load_trace(d, rate=10.0, shuffle=False)
    assert len(s) == 3 and s.stats.rows_read == 4 and s.stats.rows_filtered == 1
    assert s.output_tokens.tolist() == [90, 1, 1]  # the answers' token_len
    assert s.texts[0] == "Write a poem about the sea."
    assert s.texts[2] == "Name one prime.\n2\nAnd another?"  # the second turn carries the first
    assert s.prompt_tokens[2] == int(np.ceil(len(s.texts[2]) / 4))
    assert s.session_id[1] == s.session_id[2] != s.session_id[0]
    assert any("no answer" in n for n in s.stats.notes)
    # the second turn's prefix starts with the first turn's blocks (the conversation so far)
    first, second = s.hash_ids[1], s.hash_ids[2]
    full = [h for h in first if h >= 0]
    assert second[:len(full)] == full


def test_arena_bad_pairs_are_one_clear_line(tmp_path):
    d = write_pair(tmp_path / "a", [["hi"]], {5: [("x", 3)]})
    with pytest.raises(TwinInputError, match="no prompt joins an answer"):
        load_trace(d, rate=1.0)
    with pytest.raises(TwinInputError, match="this is an answers file"):
        load_trace(d / "model_a.jsonl", rate=1.0)
    write_pair(tmp_path / "a", [["hi"]], {0: [("x", 3)]}, answers_name="model_b.jsonl")
    with pytest.raises(TwinInputError, match="found 2: model_a.jsonl, model_b.jsonl"):
        load_trace(d, rate=1.0)
    s = load_trace(d, rate=1.0, answers=str(d / "model_b.jsonl"))
    assert len(s) == 1
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "q.jsonl").write_text(json.dumps({"question_id": "1", "turns": [{"content": "hi"}]}) + "\n")
    with pytest.raises(TwinInputError, match="expected one answers file .* found 0"):
        load_trace(lone, rate=1.0)
    bad = write_pair(tmp_path / "b", [["hi"]], {0: [("x", 3)]})
    (bad / "model_a.jsonl").write_text(json.dumps({"question_id": "q0", "choices": [{"turns": [
        {"content": "x", "token_len": "many"}]}]}) + "\n")
    with pytest.raises(TwinInputError, match=r"model_a.jsonl: line 1: field choices\[0\].turns\[0\].token_len"):
        load_trace(bad, rate=1.0)


def test_stream_texts_follow_sorting_head_and_subset():
    from twin.workload.replay import subset

    s = RequestStream([2.0, 0.0, 1.0], [1, 2, 3], [1, 1, 1], texts=["c", "a", "b"])
    assert s.texts == ["a", "b", "c"] and s.prompt_tokens.tolist() == [2, 3, 1]
    assert s.head(2).texts == ["a", "b"]
    assert subset(s, np.array([True, False, True])).texts == ["a", "c"]
    with pytest.raises(ValueError, match="texts"):
        RequestStream([0.0], [1], [1], texts=["a", "b"])


def test_replay_takes_the_arena_folder_or_prompts_file(tmp_path):
    qs = [[f"Question number {i}: explain {'x' * (i * 7)}"] for i in range(30)]
    d = write_pair(tmp_path / "pair", qs, {i: [("answer " * i, 10 + 5 * i)] for i in range(30)})
    for target in (d, d / "question.jsonl"):
        out = tmp_path / f"run-{target.name}"
        r = runner.invoke(app, ["replay", str(target), "--scenario", str(QUICKSTART), "--rate", "5",
                                "--out", str(out), "-q"])
        assert r.exit_code == 0, r.output
        s = json.loads((out / "summary.json").read_text())
        assert s["requests_total"] == 30 and s["requests_finished"] == 30
        assert s["workload"]["rows_read"] == 30
    r = runner.invoke(app, ["replay", str(d), "--scenario", str(QUICKSTART), "--format", "arena", "--rate", "5",
                            "--max-requests", "7", "--out", str(tmp_path / "r3"), "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "r3" / "summary.json").read_text())["requests_total"] == 7


@pytest.mark.skipif(not SHARED_ARENA.is_dir(), reason="../shared/traces/arena_hard not present")
def test_the_shared_arena_hard_sample_reads_whole():
    s = load_trace(SHARED_ARENA, rate=4.0)
    assert len(s) == 400 and len(s.texts) == 400 and s.stats.rows_read == 400
    assert int(s.output_tokens.sum()) == 141820  # the sum of the answers' token_len


# ---- bad training data: one clear line from the CLI ----

def train(*args):
    return runner.invoke(app, ["predictor", "train", *map(str, args)])


@pytest.mark.parametrize("name,content,message", [
    ("empty.csv", "", "the file is empty"),
    ("cols.csv", "text,tokens\nhello,3\n", "missing column(s) prompt, output_tokens"),
    ("nan.csv", "prompt,output_tokens\nhello,12\n\"two, words\",lots\n", "line 3: field output_tokens: 'lots'"),
    ("frac.csv", "prompt,output_tokens\nhello,1.5\n", "field output_tokens: '1.5' is not a whole number"),
    ("zero.jsonl", '{"prompt": "hi", "output_tokens": 0}\n',
     "line 1: field output_tokens: 0 is not a whole number >= 1"),
    ("noprompt.jsonl", '{"prompt": "hi", "output_tokens": 3}\n{"output_tokens": 4}\n', "line 2: field prompt: missing"),
    ("badjson.jsonl", '{"prompt": "hi", "output_tokens": 3}\n{"prompt": \n', "line 2: not valid JSON"),
    ("keys.jsonl", '{"question": "hi", "answer": 3}\n', "cannot tell the format"),
])
def test_bad_training_data_is_one_clear_line(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_text(content)
    r = train("--data", f, "--kind", "xgboost", "--out", tmp_path / "m")
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines[0].startswith("error:") and "Traceback" not in r.output
    assert message in " ".join(r.output.split()), r.output
    assert not (tmp_path / "m").exists()


def test_bad_training_pairs_and_kind(tmp_path):
    d = write_pair(tmp_path / "p", [["hi"], ["ho"]], {7: [("x", 3)]})
    r = train("--data", d, "--kind", "xgboost", "--out", tmp_path / "m")
    assert r.exit_code == 2 and "no prompt joins an answer" in " ".join(r.output.split())
    r = train("--data", tmp_path / "missing.csv", "--kind", "xgboost", "--out", tmp_path / "m")
    assert r.exit_code == 2 and "does not exist" in r.output
    f = tmp_path / "ok.csv"
    f.write_text("prompt,output_tokens\nhello,3\n")
    r = train("--data", f, "--kind", "forest", "--out", tmp_path / "m")
    assert r.exit_code == 2 and "unknown model kind 'forest'" in r.output
    r = runner.invoke(app, ["predictor", "eval", str(tmp_path), "--data", str(f)])
    assert r.exit_code == 2 and "not a length model" in r.output


def test_sharegpt_training_examples_carry_turns_and_history(tmp_path):
    from twin.predict.data import load_examples

    conv = [{"id": "c1", "conversations": [
        {"from": "human", "value": "Tell me a joke."}, {"from": "gpt", "value": "x" * 80},
        {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "y" * 40},
        {"from": "human", "value": "Thanks"}]}]
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(conv))
    ex = load_examples(f)
    assert len(ex) == 2 and ex.turns.tolist() == [0, 1]
    assert ex.output_tokens.tolist() == [20, 10] and ex.histories == [[], [20]]
    assert ex.texts[1] == "Tell me a joke.\n" + "x" * 80 + "\nAnother?"
    assert ex.prompt_tokens[1] == int(np.ceil(len("Tell me a joke.") / 4)) + 20 + int(np.ceil(len("Another?") / 4))
    assert any("1 human turns without an answer" in n for n in ex.notes)
    f.write_text(json.dumps([{"id": "c", "conversations": [{"from": "human", "value": "hi"}]}]))
    with pytest.raises(TwinInputError, match="no usable examples.*1 human turns without an answer"):
        load_examples(f)
