"""Vidur-style length CSVs (`num_prefill_tokens, num_decode_tokens`): lengths only, arrivals drawn by us."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from twin.workload.formats.common import BadRows, numbers, read_csv
from twin.workload.stream import TraceStats
from twin.workload.synthetic import LENGTH_COLUMNS, read_length_trace


def read_lengths(path: Path, bad: BadRows) -> tuple[np.ndarray, np.ndarray, TraceStats]:
    """(prompt, output, stats) per row, in file order; a bad row is an error unless skipping."""
    if not bad.skip:
        prompt, output = read_length_trace(path)
    else:
        rows = read_csv(path, bad, LENGTH_COLUMNS)
        p, ok = numbers(rows, LENGTH_COLUMNS[0], bad)
        o, ok_o = numbers(rows, LENGTH_COLUMNS[1], bad)
        ok &= ok_o
        bad.drop(rows, ok)
        prompt, output = p[ok].astype(np.int64), o[ok].astype(np.int64)
    stats = TraceStats(source=f"lengths {path}", rows_read=len(prompt) + bad.skipped, rows_skipped=bad.skipped,
                       notes=bad.note())
    return prompt, output, stats
