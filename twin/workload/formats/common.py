"""Plumbing every trace reader shares: the bad-row policy, CSV columns with their line numbers, stable hashes."""

from __future__ import annotations

import csv
import gc
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from twin.errors import TwinInputError


@dataclass
class BadRows:
    """A bad row is an error naming file, line and field, unless the user asked to skip (and count) bad rows."""

    path: Path
    skip: bool = False
    skipped: int = 0
    first: str = ""

    def flag(self, where: str, field: str | None, problem: str) -> None:
        """Raise, or (skipping) remember the first problem; the caller counts the rows it drops."""
        msg = f"{self.path}: {where}: " + (f"field {field}: " if field else "") + problem
        if not self.skip:
            raise TwinInputError(msg)
        self.first = self.first or msg

    def bad(self, where: str, field: str | None, problem: str) -> None:
        """One bad row: raise, or count it as skipped."""
        self.flag(where, field, problem)
        self.skipped += 1

    def drop(self, rows: "CsvRows", ok: np.ndarray) -> None:
        """Skip the rows some column check flagged (each row counted once)."""
        self.skipped += int((~ok).sum())
        rows.keep(ok)

    def note(self) -> list[str]:
        return [f"skipped {self.skipped} bad row(s) (--skip-bad-rows); the first: {self.first}"] if self.skipped else []


def check_file(path: Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise TwinInputError(f"{what} {path} does not exist")
    return path


@dataclass
class CsvRows:
    """Raw CSV cells by column (object arrays of str), plus the source line of each row (for messages)."""

    path: Path
    header: list[str]
    columns: list[np.ndarray]
    lines: np.ndarray

    def __len__(self) -> int:
        return len(self.lines)

    def column(self, name: str) -> np.ndarray:
        return self.columns[self.header.index(name)]

    def keep(self, mask: np.ndarray) -> None:
        self.columns = [c[mask] for c in self.columns]
        self.lines = self.lines[mask]


def _split_rows(path: Path) -> tuple[list[list[str]], np.ndarray]:
    """All rows with their line numbers; plain splitting when the file has no quotes (fast), else csv."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise TwinInputError(f"{path}: cannot read: {e}") from None
    if '"' not in text:
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        rows = [line.split(",") if line else [] for line in text.split("\n")]
        return rows, np.arange(1, len(rows) + 1, dtype=np.int64)
    reader = csv.reader(io.StringIO(text, newline=""))
    rows, lines = [], []
    try:
        for row in reader:
            rows.append(row)
            lines.append(reader.line_num)
    except csv.Error as e:
        raise TwinInputError(f"{path}: line {reader.line_num + 1}: not readable as CSV ({e})") from None
    return rows, np.asarray(lines, dtype=np.int64)


def read_csv(path: Path, bad: BadRows, required: tuple[str, ...] = (), header: list[str] | None = None) -> CsvRows:
    """Rows of a CSV file with the expected field count; a row with the wrong count is a bad row.

    With `header` given the file has no header line and these are its column names. Blank lines are not rows.
    """
    enabled = gc.isenabled()
    gc.disable()  # millions of small lists: the cycle collector would rescan them again and again
    try:
        return _read_csv(path, bad, required, header)
    finally:
        if enabled:
            gc.enable()


def _read_csv(path: Path, bad: BadRows, required: tuple[str, ...], header: list[str] | None) -> CsvRows:
    rows, lines = _split_rows(path)
    if header is None:
        if not rows or not any(c.strip() for c in rows[0]):
            raise TwinInputError(f"{path}: line 1: the file is empty (expected a header line)")
        header = [h.strip() for h in rows[0]]
        rows, lines = rows[1:], lines[1:]
        missing = [c for c in required if c not in header]
        if missing:
            have = ", ".join(h if h.isprintable() else shown(h) for h in header)
            raise TwinInputError(f"{path}: line 1: missing column(s) {', '.join(missing)} (have: {have[:300]})")
    n = len(header)
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    ok = lens == n
    if not ok.all():
        for i in np.flatnonzero(~ok):
            if lens[i] == 0 or (lens[i] == 1 and not rows[i][0].strip()):  # a blank line is not a row
                continue
            bad.bad(f"line {lines[i]}", None, f"expected {n} fields, found {lens[i]}")
        rows = [r for r, k in zip(rows, ok) if k]
        lines = lines[ok]
    columns = [np.array(c, dtype=object) for c in zip(*rows)] if rows else [np.array([], object) for _ in header]
    return CsvRows(Path(path), header, columns, lines)


MAX_TOKENS = 2**31 - 1  # a token count above this fits no model's context (vLLM keeps positions in int32)
MAX_TIME_S = 1e12  # ~31,700 years: a time beyond this is a broken cell, not a trace


def numbers(rows: CsvRows, column: str, bad: BadRows, *, integer: bool = True, minimum: float = 0.0,
            what: str = "a token count >= 0") -> tuple[np.ndarray, np.ndarray]:
    """A numeric column, checked; returns (values, ok): ok is False on bad rows (drop them with BadRows.drop).

    Infinite, NaN and absurdly large values are bad rows too (token counts above MAX_TOKENS, other values
    above MAX_TIME_S), so every value that passes is safe as int64 and as a float time."""
    raw = rows.column(column)
    try:
        v = raw.astype(np.float64)
    except (ValueError, OverflowError):  # some cell is not a number: find which, one by one
        v = pd.to_numeric(pd.Series(raw, dtype=object).str.strip(), errors="coerce").to_numpy(
            dtype=np.float64, copy=True)
    with np.errstate(invalid="ignore"):
        badm = ~np.isfinite(v) | (v < minimum) | (v > (MAX_TOKENS if integer else MAX_TIME_S))
        if integer:
            badm |= np.where(np.isfinite(v), v != np.floor(v), True)
    for i in np.flatnonzero(badm):
        big = np.isfinite(v[i]) and v[i] > (MAX_TOKENS if integer else MAX_TIME_S)
        bad.flag(f"line {rows.lines[i]}", column, f"{shown(raw[i])} is not {what}" + (" (too large)" if big else ""))
    v[badm] = 0
    return v, ~badm


def shown(value: object, limit: int = 60) -> str:
    """A cell as a message shows it: repr (so control characters stay visible), cut to `limit` characters."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def stable_id(*parts: object) -> int:
    """A 63-bit id from content that is the same in every process (Python's str hash is salted per run)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little") >> 1


def note_count(notes: list[str], n: int, text: str) -> None:
    """Add `n <text>` to the notes when n > 0."""
    if n:
        notes.append(f"{n} {text}")


def seconds(x: float) -> str:
    """1,000,000 s, 521.589 s: times in messages, without exponents up to a trillion seconds (1e+300 s past it,
    not 300 digits)."""
    if not abs(x) < 1e12:
        return f"{x:.3g} s"
    return f"{x:,.3f}".rstrip("0").rstrip(".") + " s"
