"""Azure LLM inference traces (2023 Splitwise release; the 2024 week-long files share the columns).

CSV `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is a wall-clock datetime such as
`2023-11-16 18:17:03.9799600` (7 fractional digits, more than Python's strptime %f takes), so it is
parsed here field by field, exactly; an optional `Z` / `+hh:mm` suffix is honoured.
Arrival = seconds since the first row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from twin.workload.formats.common import BadRows, note_count, numbers, read_csv
from twin.workload.stream import RequestStream, TraceStats

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_STAMP = (r"^\s*(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?"
          r"(?:(Z)|([+-])(\d{2}):?(\d{2}))?\s*$")


def parse_timestamps(values: list[str]) -> np.ndarray:
    """Seconds since the earliest whole second in `values` (NaN where unparseable).

    Whole seconds are subtracted as integers before the fraction is added, so the 7 fractional
    digits survive float64 (an epoch-based float would round them to ~0.2 us).
    """
    s = pd.Series(values, dtype=object).astype(str)
    parts = s.str.extract(_STAMP)
    whole = pd.to_datetime(parts[0] + " " + parts[1], format="%Y-%m-%d %H:%M:%S", errors="coerce")
    sign = np.where(parts[4] == "-", -1, 1)
    offset = sign * (pd.to_numeric(parts[5], errors="coerce").fillna(0).to_numpy(dtype=np.int64) * 3600
                     + pd.to_numeric(parts[6], errors="coerce").fillna(0).to_numpy(dtype=np.int64) * 60)
    valid = whole.notna().to_numpy()
    secs = np.zeros(len(s), dtype=np.int64)
    secs[valid] = (whole[valid] - pd.Timestamp("1970-01-01")).dt.total_seconds().to_numpy().astype(np.int64)
    secs -= offset
    frac = parts[2].fillna("")
    frac_s = pd.to_numeric("0." + frac.where(frac != "", "0"), errors="coerce").to_numpy(dtype=np.float64)
    out = np.full(len(s), np.nan)
    if valid.any():
        out[valid] = (secs[valid] - secs[valid].min()).astype(np.float64) + frac_s[valid]
    return out


def read_azure(path: Path, bad: BadRows) -> RequestStream:
    """One row per request; arrival = seconds since the first row's TIMESTAMP."""
    rows = read_csv(path, bad, COLUMNS)
    n_read = len(rows) + bad.skipped
    t = parse_timestamps(rows.column("TIMESTAMP"))
    ok = ~np.isnan(t)
    raw = rows.column("TIMESTAMP")
    for i in np.flatnonzero(~ok):
        bad.flag(f"line {rows.lines[i]}", "TIMESTAMP", f"{raw[i]!r} is not a datetime like 2023-11-16 18:17:03.9799600")
    ctx, ok_c = numbers(rows, "ContextTokens", bad)
    gen, ok_g = numbers(rows, "GeneratedTokens", bad)
    ok &= ok_c & ok_g
    bad.drop(rows, ok)
    t, ctx, gen = t[ok], ctx[ok].astype(np.int64), gen[ok].astype(np.int64)
    stats = TraceStats(source=f"azure {path}", rows_read=n_read, rows_skipped=bad.skipped, notes=bad.note())
    keep = ctx > 0
    stats.rows_filtered = int((~keep).sum())
    note_count(stats.notes, stats.rows_filtered, "rows with ContextTokens 0 left out (a request needs a prompt)")
    note_count(stats.notes, int((gen[keep] == 0).sum()), "rows with GeneratedTokens 0 replayed with 1 output token")
    t0 = float(t.min()) if len(t) else 0.0
    stream = RequestStream(t[keep] - t0, ctx[keep], np.maximum(gen[keep], 1), stats=stats)
    stats.rows_used = len(stream)
    return stream
