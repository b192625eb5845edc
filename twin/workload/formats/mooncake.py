"""Mooncake (Kimi, FAST'25) JSONL traces: real arrival times and 512-token prefix-block hashes.

Each line: `timestamp` (ms from trace start), `input_length`, `output_length` (tokens), `hash_ids`
(ids of the prompt's 512-token blocks; equal ids at equal positions are a reusable prefix).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twin.errors import TwinInputError
from twin.workload.formats.common import MAX_TIME_S, MAX_TOKENS, BadRows, note_count, shown
from twin.workload.stream import RequestStream, TraceStats

MOONCAKE_BLOCK = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _count(v: object) -> bool:
    """A token count: a whole JSON number >= 0 that fits a context (Python ints may be any size)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return 0 <= v <= MAX_TOKENS and float(v).is_integer()


def _time_ms(v: object) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return 0 <= v <= MAX_TIME_S * 1000 and math.isfinite(v)


def _hash_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and -(2**63) <= x < 2**63


def read_mooncake(path: Path, bad: BadRows) -> RequestStream:
    """Every line is one request; arrival = timestamp / 1000 s, shifted so the first request is at 0 s."""
    arr, inp, out, hashes = [], [], [], []
    rows = 0
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TwinInputError(f"{path}: cannot open: {e.strerror}") from None
    with f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                rows += 1
                bad.bad(f"line {line_no}", None, f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                        "a Mooncake trace is JSON Lines")
                continue
            if not line.strip():
                continue
            rows += 1
            where = f"line {line_no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                bad.bad(where, None, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            except (ValueError, RecursionError) as e:  # a number too long to convert, nesting too deep
                bad.bad(where, None, f"not valid JSON ({str(e).split(';')[0] or type(e).__name__})")
                continue
            if not isinstance(rec, dict):
                bad.bad(where, None, f"expected a JSON object, got {type(rec).__name__}")
                continue
            missing = [k for k in FIELDS if k not in rec]
            if missing:
                bad.bad(where, missing[0], "missing")
                continue
            ts = rec["timestamp"]
            if not _time_ms(ts):
                bad.bad(where, "timestamp", f"{shown(ts)} is not a time in ms from 0 to {MAX_TIME_S * 1000:.0e}")
                continue
            problem = next((k for k in ("input_length", "output_length") if not _count(rec[k])), None)
            if problem:
                bad.bad(where, problem, f"{shown(rec[problem])} is not a token count >= 0")
                continue
            h = rec["hash_ids"]
            if not isinstance(h, list) or not all(_hash_id(x) for x in h):
                bad.bad(where, "hash_ids", "not a list of 64-bit integers")
                continue
            arr.append(ts / 1000.0)
            inp.append(int(rec["input_length"]))
            out.append(int(rec["output_length"]))
            hashes.append(h)
    arr_a, inp_a, out_a = np.asarray(arr, float), np.asarray(inp, np.int64), np.asarray(out, np.int64)
    if len(arr_a):
        arr_a = arr_a - arr_a.min()  # the trace's clock starts at its first request (see replay.window)
    stats = TraceStats(source=f"mooncake {path}", rows_read=rows, rows_skipped=bad.skipped, notes=bad.note())
    keep = inp_a > 0
    stats.rows_filtered = int((~keep).sum())
    note_count(stats.notes, stats.rows_filtered, "rows with input_length 0 left out (a request needs a prompt)")
    zero_out = int((out_a[keep] == 0).sum())
    note_count(stats.notes, zero_out, "rows with output_length 0 replayed with 1 output token (vLLM emits >= 1)")
    idx = np.flatnonzero(keep)
    stream = RequestStream(arr_a[idx], inp_a[idx], np.maximum(out_a[idx], 1), [hashes[i] for i in idx],
                           hash_block_size=MOONCAKE_BLOCK, stats=stats)
    stats.rows_used = len(stream)
    return stream


@dataclass
class IdealReuse:
    """What an infinite prefix cache shared by all requests could hit: an upper bound for any real cache."""

    blocks_referenced: int
    blocks_unique: int
    block_hit_rate: float  # fraction of referenced blocks already seen earlier in the trace
    token_hit_rate: float  # prompt tokens in leading already-seen blocks / all prompt tokens (vLLM's measure)

    def line(self) -> str:
        return (f"trace ideal prefix reuse {self.block_hit_rate:.1%} of {self.blocks_referenced:,} "
                f"{MOONCAKE_BLOCK}-token blocks (token-weighted upper bound {self.token_hit_rate:.1%})")


def ideal_block_reuse(hash_ids: list, prompt_tokens=None, block_size: int = MOONCAKE_BLOCK) -> IdealReuse:
    """Ideal reuse of a trace's prefix blocks, in arrival order.

    `block_hit_rate` is the trace's own measure (Mooncake's README: 35.1% for the conversation head).
    `token_hit_rate` compares with a simulated prefix-cache hit rate (hit tokens / prompt tokens): per
    request, the leading run of already-seen block ids, in tokens, capped at the prompt length.
    """
    seen: set = set()
    referenced = hits = 0
    hit_tokens = total_tokens = 0
    for i, ids in enumerate(hash_ids):
        ids = ids or []
        p = len(ids) * block_size if prompt_tokens is None else int(prompt_tokens[i])
        lead = 0
        while lead < len(ids) and ids[lead] in seen:
            lead += 1
        hit_tokens += min(lead * block_size, p)
        total_tokens += p
        for h in ids:
            referenced += 1
            if h in seen:
                hits += 1
            else:
                seen.add(h)
    return IdealReuse(referenced, len(seen), hits / referenced if referenced else 0.0,
                      hit_tokens / total_tokens if total_tokens else 0.0)
