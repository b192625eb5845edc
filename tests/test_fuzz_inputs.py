"""Fuzz: no file, however mangled, makes the scenario loader or a trace reader end in anything but a result
or one TwinInputError. A corpus of hand-mangled files plus hypothesis mutations of small valid files.

LLMTWIN_HYPOTHESIS_EXAMPLES raises the example counts for a long stress run (default: a few seconds).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.errors import TwinInputError
from twin.scenario import Scenario, load_scenario
from twin.workload import RequestStream
from twin.workload.formats import load_trace

EXAMPLES = int(os.environ.get("LLMTWIN_HYPOTHESIS_EXAMPLES", 25))
# the default run is the same every time; a raised count explores new inputs on every run
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize="LLMTWIN_HYPOTHESIS_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

SCENARIO = """name: fuzz
seed: 3
cluster:
  num_instances: 2
  hardware: H100
  model: Llama-3-8B
  tensor_parallel: 1
  engine: {block_size: 16, max_num_batched_tokens: 2048, max_num_seqs: 64}
workload:
  num_requests: 20
  arrival: {process: gamma, rate: 5.0, cv: 2}
  lengths: {kind: fixed, prompt_tokens: 100, output_tokens: 20}
router: {name: round_robin}
slo: {ttft_s: 0.5}
"""

# one small valid file per format: (format, file name, text, options load_trace needs)
SEEDS = {
    "azure": ("az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
                        "2023-11-16 18:17:04.0319600,3180,8\n2023-11-16 18:17:05.1+01:00,200,0\n", {}),
    "burstgpt": ("b.csv", "Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                          "5,a,ChatGPT,472,18,490,Conversation log\n45,b,GPT-4,1087,0,1087,API log\n"
                          "46,a,ChatGPT,300,20,320,Conversation log\n", {"keep_failed": True}),
    "mooncake": ("m.jsonl", "".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 2000, "input_length": 10, "output_length": 0, "hash_ids": [9]}]), {}),
    "sharegpt": ("s.json", json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "hello there, how are you today?"},
                                      {"from": "gpt", "value": "fine, thanks for asking. And you?"},
                                      {"from": "human", "value": "good"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                      {"from": "human", "value": "what is 2+2"}]}]), {"rate": 2.0}),
    "lengths": ("l.csv", "num_prefill_tokens,num_decode_tokens\n41,950\n1045,742\n0,3\n", {"rate": 2.0}),
    "servegen": ("chunk-7-trace.csv", "0,0,0,,0,0\n600,0.05,1.2,Gamma,0.7,28.5\n1200,0.02,1.0,Weibull,1.1,52\n",
                 {"max_requests": 200}),
}
SERVEGEN_DATASET = json.dumps({"0": {"input_tokens": "{100: 0.5, 2000: 0.5}", "output_tokens": "{10: 1.0}"},
                               "21600": {"input_tokens": "{}", "output_tokens": "{}"}})


def corpus(text: str) -> dict[str, bytes]:
    """Hand-mangled versions of a valid file: the kinds of damage real files come with."""
    b = text.encode()
    rng = np.random.default_rng(7)
    first_num = next((i for i, c in enumerate(text) if c.isdigit()), 0)
    return {
        "empty": b"",
        "blank lines": b"\n\n  \n",
        "truncated half": b[: len(b) // 2],
        "truncated one byte": b[:-1],
        "truncated mid-first-line": b[: max(1, text.find("\n") // 2)],
        "binary": bytes(rng.integers(0, 256, 2000, dtype=np.uint8)),
        "binary with newlines": b"\n".join(bytes(rng.integers(0, 256, 60, dtype=np.uint8)) for _ in range(20)),
        "NUL bytes": b.replace(b",", b"\x00", 2) + b"\x00\x00",
        "BOM": b"\xef\xbb\xbf" + b,
        "UTF-16": text.encode("utf-16"),
        "latin-1": text.replace("a", "\u00e9", 3).encode("latin-1", errors="replace"),
        "huge numbers": text.replace("0", "99999999999999999999999999999999").encode(),
        "float overflow": (text[:first_num] + "1e400" + text[first_num + 1:]).encode(),
        "inf and nan": text.replace("1", "inf", 2).replace("2", "nan", 2).encode(),
        "negative": text.replace("1", "-1").encode(),
        "wrong types (quoted)": text.replace("5", '"five"').encode(),
        "wrong types (lists)": text.replace("4", "[4]").replace("1", "{}").encode(),
        "null": text.replace("2", "null").encode(),
        "booleans": text.replace("0", "true").encode(),
        "windows line ends": text.replace("\n", "\r\n").encode(),
        "old mac line ends": text.replace("\n", "\r").encode(),
        "unbalanced quote": (text[: len(text) // 3] + '"' + text[len(text) // 3:]).encode(),
        "duplicated header": (text.split("\n")[0] + "\n" + text).encode(),
        "only header": (text.split("\n")[0] + "\n").encode(),
        "very long line": b + b"1" * 20_000 + b"\n",
        "deep nesting": b"[" * 1100 + b"]" * 1100,  # past the JSON decoder's recursion limit
        "deep YAML nesting": b"a: " + b"[" * 600 + b"]" * 600,  # past PyYAML's (and quicker than the above)
    }


def check_stream(s) -> None:
    """What a result must be: a stream the simulator can run (finite ordered times, positive lengths)."""
    assert isinstance(s, RequestStream)
    if len(s):
        assert np.all(np.isfinite(s.arrival_s)) and np.all(np.diff(s.arrival_s) >= 0)
        assert s.arrival_s[0] >= 0
        assert np.all(s.prompt_tokens > 0) and np.all(s.output_tokens > 0)
    st_ = s.stats
    assert min(st_.rows_read, st_.rows_used, st_.rows_filtered, st_.rows_skipped) >= 0


def read(fmt: str, folder: Path, data: bytes, skip: bool, auto: bool = False, dataset: bytes | None = None):
    """load_trace on `data` written as the format's file: a stream, or one TwinInputError line."""
    name, _, opts = SEEDS[fmt]
    path = folder / name
    path.write_bytes(data)
    if fmt == "servegen":
        (folder / "chunk-7-dataset.json").write_bytes(SERVEGEN_DATASET.encode() if dataset is None else dataset)
    try:
        s = load_trace(path, "auto" if auto else fmt, skip_bad_rows=skip, **opts)
    except TwinInputError as e:
        assert "\n" not in str(e) and str(e).strip(), repr(str(e))
        return None
    check_stream(s)
    return s


def load(folder: Path, data: bytes):
    path = folder / "sc.yaml"
    path.write_bytes(data)
    try:
        sc = load_scenario(path)
    except TwinInputError as e:
        assert str(e).strip()
        return None
    assert isinstance(sc, Scenario)
    return sc


@pytest.mark.parametrize("fmt", list(SEEDS))
def test_seeds_are_valid(tmp_path, fmt):
    """The fuzz starts from files each reader accepts (else the mutations test little)."""
    assert len(read(fmt, tmp_path, SEEDS[fmt][1].encode(), skip=False)) > 0
    assert load(tmp_path, SCENARIO.encode()) is not None


@pytest.mark.parametrize("fmt", list(SEEDS))
def test_mangled_corpus_traces(tmp_path, fmt):
    for kind, data in corpus(SEEDS[fmt][1]).items():
        for skip in (False, True):
            try:
                read(fmt, tmp_path, data, skip)
                read(fmt, tmp_path, data, skip, auto=True)
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001  (the point: name the input that crashed)
                raise AssertionError(f"{fmt} reader crashed on {kind!r} (skip_bad_rows={skip}): "
                                     f"{type(e).__name__}: {e}") from e


def test_mangled_servegen_dataset(tmp_path):
    for kind, data in corpus(SERVEGEN_DATASET).items():
        try:
            read("servegen", tmp_path, SEEDS["servegen"][1].encode(), False, dataset=data)
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"servegen dataset {kind!r}: {type(e).__name__}: {e}") from e


def test_mangled_corpus_scenario(tmp_path):
    for kind, data in corpus(SCENARIO).items():
        if kind == "deep nesting":  # JSON-deep: seconds in PyYAML; "deep YAML nesting" covers its limit
            continue
        try:
            load(tmp_path, data)
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"scenario loader crashed on {kind!r}: {type(e).__name__}: {e}") from e


def mutated(seed: str):
    """A valid file with a few byte-level edits: replace, insert, delete, or cut."""
    b = seed.encode()
    edit = st.tuples(st.sampled_from(["replace", "insert", "delete", "cut"]), st.integers(0, len(b)),
                     st.binary(min_size=1, max_size=8) | st.sampled_from(
                         [b"-", b"1e999", b"nan", b'"', b"[", b"}", b",", b"\n", b"\xff", b"99999999999999999999"]))

    def apply(edits) -> bytes:
        out = bytearray(b)
        for op, at, piece in edits:
            at = min(at, len(out))
            if op == "replace":
                out[at:at + len(piece)] = piece
            elif op == "insert":
                out[at:at] = piece
            elif op == "delete":
                del out[at:at + len(piece)]
            else:
                del out[at:]
        return bytes(out)

    return st.lists(edit, min_size=1, max_size=4).map(apply)


@pytest.mark.parametrize("fmt", list(SEEDS))
def test_hypothesis_mutated_traces(tmp_path, fmt):
    @FUZZ
    @given(data=mutated(SEEDS[fmt][1]) | st.binary(max_size=300), skip=st.booleans())
    def run(data, skip):
        read(fmt, tmp_path, data, skip)

    run()


def test_hypothesis_mutated_scenario(tmp_path):
    @FUZZ
    @given(data=mutated(SCENARIO) | st.binary(max_size=300))
    def run(data):
        load(tmp_path, data)

    run()


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


def test_hypothesis_wrong_types_in_scenario_fields(tmp_path):
    """Any YAML value in any field: a scenario or a TwinInputError, never a crash inside a validator."""
    import yaml

    base = yaml.safe_load(SCENARIO)
    paths = [("seed",), ("cluster", "num_instances"), ("cluster", "model"), ("cluster", "hardware"),
             ("cluster", "tensor_parallel"), ("cluster", "engine"), ("cluster", "engine", "block_size"),
             ("cluster", "engine", "max_num_seqs"), ("workload",), ("workload", "arrival", "rate"),
             ("workload", "lengths"), ("workload", "trace"), ("router", "params"), ("router", "name"),
             ("slo", "ttft_s"), ("sim", "mode")]

    @FUZZ
    @given(path=st.sampled_from(paths), value=yaml_values)
    def run(path, value):
        import copy

        raw = copy.deepcopy(base)
        node = raw
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
        load(tmp_path, yaml.safe_dump(raw).encode())

    run()


@pytest.mark.parametrize("first_only", [False, True])
def test_a_lengths_row_with_a_field_too_many_is_never_read_shifted(tmp_path, first_only):
    """pandas takes a first data row with one field more than the header as an index column: the lengths shifted
    by one field, with no word. Refused naming the line; skipped and counted with --skip-bad-rows."""
    rows = ["1,10,20", "2,30,40"] if not first_only else ["10,20,30", "20,5"]
    path = tmp_path / "l.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + "\n".join(rows) + "\n")
    with pytest.raises(TwinInputError) as e:
        load_trace(path, "lengths", rate=2.0)
    assert "line 2: expected 2 fields" in str(e.value)
    if first_only:
        s = load_trace(path, "lengths", skip_bad_rows=True, rate=2.0)
        assert s.stats.rows_skipped == 1 and set(s.prompt_tokens) == {20} and set(s.output_tokens) == {5}


def test_an_empty_length_cell_is_named_as_such(tmp_path):
    path = tmp_path / "l.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,\n20,5\n")
    with pytest.raises(TwinInputError) as e:
        load_trace(path, "lengths", rate=2.0)
    assert str(e.value).endswith("line 2: field num_decode_tokens: an empty cell is not a token count >= 0")
