"""Synthetic load: Poisson or Gamma arrivals, lengths fixed or drawn from a length trace, multi-turn sessions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from twin.errors import TwinInputError
from twin.workload.stream import RequestStream, TraceStats


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator, start: float = 0.0) -> np.ndarray:
    """Arrival times of a Poisson process at `rate` requests/s (exponential gaps)."""
    return start + np.cumsum(rng.exponential(1.0 / rate, size=n))


def gamma_arrivals(n: int, rate: float, cv: float, rng: np.random.Generator, start: float = 0.0) -> np.ndarray:
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation `cv` (cv=1 is Poisson)."""
    shape = 1.0 / (cv * cv)
    return start + np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n))


LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


def read_length_trace(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths from a Vidur-style CSV (`num_prefill_tokens`, `num_decode_tokens`)."""
    from twin.workload.formats.common import MAX_TOKENS, shown

    path = Path(path)
    if not path.exists():
        raise TwinInputError(f"length trace {path} does not exist")
    if path.is_dir():
        raise TwinInputError(f"length trace {path} is a folder, not a CSV file")
    try:
        df = pd.read_csv(path, encoding="utf-8-sig")
    except Exception as e:  # pandas raises many kinds; the user needs the file and the reason
        raise TwinInputError(f"{path}: cannot read as CSV: {' '.join(str(e).split())}") from None
    missing = [c for c in LENGTH_COLUMNS if c not in df.columns]
    if missing:
        have = ", ".join(shown(c) if not str(c).isprintable() else str(c) for c in df.columns)
        raise TwinInputError(f"{path}: missing column(s) {', '.join(missing)} (have: {have[:300]})")
    if not df.index.equals(pd.RangeIndex(len(df))):
        # pandas takes a first data row with one field more than the header as an index column: every row's
        # fields would shift by one, silently
        raise TwinInputError(f"{path}: line 2: expected {len(df.columns)} fields (the header's), found "
                             f"{len(df.columns) + 1}")
    out = []
    for col in LENGTH_COLUMNS:
        if pd.api.types.is_bool_dtype(df[col]):  # pandas reads a column of true/false as booleans: 1 and 0
            raise TwinInputError(f"{path}: line 2: field {col}: {shown(df[col].iloc[0].item())} is not a token "
                                 "count >= 0")
        v = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(v) | (v < 0) | (v > MAX_TOKENS) | (v != np.floor(v))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            cell = df[col].iloc[i]
            what = "an empty cell" if pd.isna(cell) else shown(cell.item() if hasattr(cell, "item") else cell)
            raise TwinInputError(f"{path}: line {i + 2}: field {col}: {what} is not a token count >= 0")
        out.append(v.astype(np.int64))
    return out[0], out[1]


def sample_lengths(prompt: np.ndarray, output: np.ndarray, n: int, rng: np.random.Generator,
                   max_total_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Draw n (prompt, output) pairs jointly, with replacement; rows over the cap are left out of the pool.

    Returns (prompt, output, rows left out by the cap). Zero-length outputs become 1 (vLLM emits >= 1 token).
    """
    keep = (prompt > 0)
    if max_total_tokens is not None:
        keep &= prompt + np.maximum(output, 1) <= max_total_tokens
    n_out = int((~keep).sum())
    p, o = prompt[keep], np.maximum(output[keep], 1)
    if len(p) == 0:  # say which: it read "fits max_total_tokens" for an empty file and without a cap
        if len(prompt) == 0:
            raise TwinInputError("the length trace has no rows, only a header")
        if not (prompt > 0).any():
            raise TwinInputError(f"every row of the length trace ({len(prompt)}) has a prompt of 0 tokens")
        raise TwinInputError(f"no length-trace row fits max_total_tokens {max_total_tokens}")
    idx = rng.integers(0, len(p), size=n)
    return p[idx], o[idx], n_out


def sessionize(arrival_s: np.ndarray, prompt: np.ndarray, output: np.ndarray, rng: np.random.Generator,
               turns_mean: float, think_time_s: float, hash_block_size: int = 16,
               closed_loop: bool = True) -> RequestStream:
    """Group requests into multi-turn sessions: turn k's prompt is all earlier turns plus a new message.

    Session starts keep the given arrival times. A later turn is sent an exponential think time after
    its predecessor's answer ends (closed loop, as a chat user does), or with `closed_loop=False` after
    its predecessor was sent. Turn counts are geometric with mean `turns_mean`. Each session's content
    gets its own block ids, so a later turn shares all earlier turns (prompts and answers) as a prefix.
    """
    n = len(arrival_s)
    p_stop = 1.0 / max(turns_mean, 1.0)
    arr, pr, out, sid, hashes, after, think = [], [], [], [], [], [], []
    i = 0
    s = 0
    while i < n:
        turns = int(rng.geometric(p_stop))
        t = float(arrival_s[i])
        context = 0
        prev = -1
        gap = 0.0
        for _ in range(turns):
            if i >= n:
                break
            new_msg = int(prompt[i])
            p_tok = context + new_msg
            o_tok = int(output[i])
            arr.append(t)
            pr.append(p_tok)
            out.append(o_tok)
            sid.append(s)
            after.append(prev)
            think.append(gap)
            nblocks = -(-(p_tok + o_tok) // hash_block_size)
            base = s << 24
            hashes.append(list(range(base, base + nblocks)))
            context = p_tok + o_tok
            gap = float(rng.exponential(think_time_s)) if think_time_s > 0 else 0.0
            t += gap  # the open-loop time; closed loop, it only orders the stream
            prev = i
            i += 1
        s += 1
    stream = RequestStream(np.array(arr), np.array(pr), np.array(out), hashes, hash_block_size,
                           hashes_cover_output=True, session_id=np.array(sid),
                           stats=TraceStats(source="synthetic sessions", rows_read=n, rows_used=n),
                           after=np.array(after) if closed_loop else None,
                           think_s=np.array(think) if closed_loop else None)
    return stream
