"""Bad trace input: one TwinInputError naming file, line and field; or, with skip_bad_rows, counted and skipped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from twin.errors import TwinInputError
from twin.workload.formats import load_trace

ROOT = Path(__file__).resolve().parents[1]

AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_OK = ["2023-11-16 18:17:03.9799600,4808,10", "2023-11-16 18:17:04.0319600,3180,8",
            "2023-11-16 18:17:05.1000000,200,30"]
MOON_OK = {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]}
BURST_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(path, **kw) -> str:
    with pytest.raises(TwinInputError) as e:
        load_trace(path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def assert_names(msg: str, path, line: int | None, field: str | None) -> None:
    assert str(path) in msg
    if line is not None:
        assert re.search(rf"\bline {line}\b", msg), msg
    if field is not None:
        assert f"field {field}" in msg or field in msg, msg


# --- missing column -------------------------------------------------------------------------------------

def test_missing_column_azure(tmp_path):
    p = write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,4808\n")
    msg = error_of(p, format="azure")
    assert_names(msg, p, 1, "GeneratedTokens")
    assert "missing column" in msg


def test_missing_column_burstgpt(tmp_path):
    p = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens\n5,ChatGPT,4,5,9\n")
    msg = error_of(p, format="burstgpt")
    assert_names(msg, p, 1, "Log Type")


def test_missing_column_lengths(tmp_path):
    p = write(tmp_path, "l.csv", "num_prefill_tokens\n10\n")
    msg = error_of(p, format="lengths", rate=1.0)
    assert_names(msg, p, None, "num_decode_tokens")
    msg = error_of(p, format="lengths", rate=1.0, skip_bad_rows=True)
    assert_names(msg, p, 1, "num_decode_tokens")


def test_missing_field_mooncake(tmp_path):
    rec = dict(MOON_OK)
    del rec["hash_ids"]
    p = write(tmp_path, "m.jsonl", json.dumps(MOON_OK) + "\n" + json.dumps(rec) + "\n")
    assert_names(error_of(p), p, 2, "hash_ids")


def test_missing_conversations_sharegpt(tmp_path):
    p = write(tmp_path, "s.json", json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]},
                                              {"id": "b", "turns": []}]))
    msg = error_of(p, rate=1.0)
    assert str(p) in msg and "record 1" in msg and "'b'" in msg and "field conversations" in msg


# --- malformed line -------------------------------------------------------------------------------------

def test_malformed_line_azure(tmp_path):
    p = write(tmp_path, "az.csv", AZURE_HEAD + AZURE_OK[0] + "\n" + AZURE_OK[1] + ",99\n")
    msg = error_of(p)
    assert_names(msg, p, 3, None)
    assert "expected 3 fields, found 4" in msg


def test_malformed_line_mooncake(tmp_path):
    p = write(tmp_path, "m.jsonl", json.dumps(MOON_OK) + "\n" + '{"timestamp": 5, "input_length": \n')
    msg = error_of(p, format="mooncake")
    assert_names(msg, p, 2, None)
    assert "not valid JSON" in msg


def test_malformed_json_sharegpt(tmp_path):
    p = write(tmp_path, "s.json", '[{"id": "a",\n "conversations": [}]')
    msg = error_of(p, format="sharegpt", rate=1.0)
    assert_names(msg, p, 2, None)


def test_malformed_line_servegen(tmp_path):
    p = write(tmp_path, "chunk-7-trace.csv", "0,1.5,1.0,Gamma,1.0,0.66\n600,2.0,1.0,Gamma\n")
    msg = error_of(p)
    assert_names(msg, p, 2, None)
    assert "expected 6 fields" in msg


@pytest.mark.parametrize("first,second", [(600, 600), (600, 0)])
def test_servegen_windows_out_of_order_or_repeated(tmp_path, first, second):
    """A repeated or earlier window start made the windows' length 0 s: no requests, and a message about idle
    clients whose windows 'span 0 s'."""
    p = write(tmp_path, "chunk-7-trace.csv", f"{first},1.5,1.0,Gamma,1.0,0.66\n{second},2.0,1.0,Gamma,1.0,0.5\n")
    msg = error_of(p)
    assert_names(msg, p, 2, "window_start_s")
    assert "time order" in msg


def test_bad_pattern_servegen(tmp_path):
    p = write(tmp_path, "chunk-7-trace.csv", "0,1.5,1.0,Gamma,1.0,0.66\n600,2.0,1.0,Pareto,1.0,0.5\n")
    assert_names(error_of(p), p, 2, "pattern")


# --- unparseable timestamp ------------------------------------------------------------------------------

def test_bad_timestamp_azure(tmp_path):
    p = write(tmp_path, "az.csv", AZURE_HEAD + AZURE_OK[0] + "\n16/11/2023 18:17,3180,8\n")
    msg = error_of(p)
    assert_names(msg, p, 3, "TIMESTAMP")
    assert "16/11/2023 18:17" in msg


def test_bad_timestamp_burstgpt(tmp_path):
    p = write(tmp_path, "b.csv", BURST_HEAD + "5,ChatGPT,4,5,9,API log\nsoon,ChatGPT,4,5,9,API log\n")
    assert_names(error_of(p), p, 3, "Timestamp")


def test_bad_timestamp_mooncake(tmp_path):
    p = write(tmp_path, "m.jsonl", json.dumps({**MOON_OK, "timestamp": "noon"}) + "\n")
    assert_names(error_of(p, format="mooncake"), p, 1, "timestamp")


# --- negative length ------------------------------------------------------------------------------------

def test_negative_length_azure(tmp_path):
    p = write(tmp_path, "az.csv", AZURE_HEAD + AZURE_OK[0] + "\n" + "2023-11-16 18:17:04.0319600,-5,8\n")
    msg = error_of(p)
    assert_names(msg, p, 3, "ContextTokens")
    assert "'-5'" in msg


def test_negative_length_mooncake(tmp_path):
    p = write(tmp_path, "m.jsonl", json.dumps(MOON_OK) + "\n\n" + json.dumps({**MOON_OK, "output_length": -1}) + "\n")
    assert_names(error_of(p), p, 3, "output_length")


def test_negative_length_burstgpt(tmp_path):
    p = write(tmp_path, "b.csv", BURST_HEAD + "5,ChatGPT,-4,5,1,API log\n")
    assert_names(error_of(p), p, 2, "Request tokens")


def test_negative_length_lengths_csv(tmp_path):
    p = write(tmp_path, "l.csv", "num_prefill_tokens,num_decode_tokens\n10,5\n12,-1\n")
    assert_names(error_of(p, rate=1.0), p, 3, "num_decode_tokens")


# --- skip bad rows: counted, never silently dropped -----------------------------------------------------

def test_skip_bad_rows_azure_counts_rows_once(tmp_path):
    bad = ["garbage,1,2", "2023-11-16 18:17:04.5,-1,-2", "2023-11-16 18:17:04.6,1,2,3"]
    p = write(tmp_path, "az.csv", AZURE_HEAD + "\n".join(AZURE_OK[:2] + bad + AZURE_OK[2:]) + "\n")
    s = load_trace(p, skip_bad_rows=True)
    st = s.stats
    assert (st.rows_read, st.rows_used, st.rows_skipped, st.rows_filtered) == (6, 3, 3, 0)
    assert any("skipped 3 bad row(s)" in n and str(p) in n for n in st.notes)


def test_skip_bad_rows_mooncake_and_lengths(tmp_path):
    lines = [json.dumps(MOON_OK), "{oops", json.dumps({**MOON_OK, "input_length": -3}), json.dumps(MOON_OK)]
    p = write(tmp_path, "m.jsonl", "\n".join(lines) + "\n")
    s = load_trace(p, skip_bad_rows=True)
    assert (s.stats.rows_read, len(s), s.stats.rows_skipped) == (4, 2, 2)
    q = write(tmp_path, "l.csv", "num_prefill_tokens,num_decode_tokens\n10,5\nx,1\n12,-1\n7,7\n")
    s = load_trace(q, rate=1.0, skip_bad_rows=True)
    assert (s.stats.rows_read, len(s), s.stats.rows_skipped) == (4, 2, 2)


def test_skip_bad_rows_sharegpt_and_servegen(tmp_path):
    recs = [{"id": "a", "conversations": [{"from": "human", "value": "hello there"}]},
            {"id": "b", "conversations": [{"from": "robot", "value": "beep"}]},
            {"id": "c"}]
    p = write(tmp_path, "s.json", json.dumps(recs))
    s = load_trace(p, rate=1.0, skip_bad_rows=True)
    assert (s.stats.rows_read, len(s), s.stats.rows_skipped) == (3, 1, 2)
    q = write(tmp_path, "chunk-3-trace.csv", "0,1.0,1.0,Gamma,1.0,1.0\n600,x,1,Gamma,1,1\n1200,0,0,,0,0\n")
    s = load_trace(q, skip_bad_rows=True, lengths=ROOT / "traces" / "sharegpt_lengths.sample.csv")
    assert (s.stats.rows_read, s.stats.rows_skipped) == (3, 1)
    assert "took lengths from the length CSV" in " ".join(s.stats.notes)
    assert s.stats.rows_read == s.stats.rows_used + s.stats.rows_filtered + s.stats.rows_skipped


def test_options_that_do_not_apply(tmp_path):
    p = write(tmp_path, "m.jsonl", json.dumps(MOON_OK) + "\n")
    assert "rate_scale or target_rate" in error_of(p, rate=3.0)
    assert "tokenizer" in error_of(p, tokenizer="x")
    assert "format" in error_of(p, format="parquet")
    assert "does not exist" in error_of(tmp_path / "nope.jsonl")
    assert "sample" in error_of(p, sample=1.5)
    q = write(tmp_path, "s.json", json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}]))
    assert "give an arrival rate" in error_of(q)
