"""BurstGPT (Azure OpenAI GPT-3.5/GPT-4 service, Wang et al. 2024, arXiv:2401.17644) CSV traces,
and a BurstGPT-style synthetic generator.

Columns: `Timestamp` (s from 0:00 of the first day), `Session ID`, `Elapsed time` (newer releases only),
`Model` (ChatGPT | GPT-4), `Request tokens`, `Response tokens`, `Total tokens`,
`Log Type` (Conversation log | API log). A failed request has `Response tokens` 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from twin.errors import TwinInputError
from twin.workload.formats.common import BadRows, note_count, numbers, read_csv
from twin.workload.stream import RequestStream, TraceStats

REQUIRED = ("Timestamp", "Model", "Request tokens", "Response tokens", "Log Type")
LOG_TYPES = {"conversation": "Conversation log", "api": "API log"}


def _log_type(name: str) -> str:
    key = name.strip().lower().removesuffix(" log")
    return LOG_TYPES.get(key, name)


def read_burstgpt(path: Path, bad: BadRows, models=(), log_types=(), keep_failed: bool = False) -> RequestStream:
    """One row per request, times from the first row; filters by `Model` and `Log Type`; failed rows dropped
    unless keep_failed."""
    rows = read_csv(path, bad, REQUIRED)
    n_read = len(rows) + bad.skipped
    ts, ok = numbers(rows, "Timestamp", bad, integer=False, what="a time in seconds >= 0")
    req, ok_r = numbers(rows, "Request tokens", bad)
    resp, ok_s = numbers(rows, "Response tokens", bad)
    ok &= ok_r & ok_s
    bad.drop(rows, ok)
    ts, req, resp = ts[ok], req[ok].astype(np.int64), resp[ok].astype(np.int64)
    t0 = float(ts.min()) if len(ts) else 0.0
    ts = ts - t0  # the trace's clock starts at its first request (see ReplayControls)
    model = np.array([m.strip() for m in rows.column("Model")], dtype=object)
    logt = np.array([t.strip() for t in rows.column("Log Type")], dtype=object)
    stats = TraceStats(source=f"burstgpt {path}", rows_read=n_read, rows_skipped=bad.skipped, notes=bad.note())
    if t0 > 0:
        stats.notes.append(f"times counted from the first request (Timestamp {t0:g} s)")
    keep = np.ones(len(ts), dtype=bool)

    def drop(mask: np.ndarray, why: str) -> None:
        n = int((keep & ~mask).sum())
        note_count(stats.notes, n, f"rows left out: {why}")
        stats.rows_filtered += n
        keep[:] &= mask

    if models:
        drop(np.isin(model, list(models)), f"Model not in {list(models)} (have {sorted(set(model))})")
    if log_types:
        wanted = [_log_type(x) for x in log_types]
        drop(np.isin(logt, wanted), f"Log Type not in {wanted}")
    failed = resp == 0
    if keep_failed:
        note_count(stats.notes, int((keep & failed).sum()),
                   "failed rows (Response tokens 0) kept, replayed with 1 output token")
    else:
        drop(~failed, "failed requests (Response tokens 0); keep them with --keep-failed")
    drop(req > 0, "Request tokens 0 (a request needs a prompt)")
    session = None
    if "Session ID" in rows.header:
        codes, _ = pd.factorize(pd.Series(rows.column("Session ID"), dtype=object).str.strip())
        session = codes[keep].astype(np.int64)
    else:
        stats.notes.append("older BurstGPT schema (no Session ID / Elapsed time)")
    stream = RequestStream(ts[keep], req[keep], np.maximum(resp[keep], 1), session_id=session, stats=stats)
    stats.rows_used = len(stream)
    return stream


@dataclass
class BurstGPTSynthetic:
    """Gamma inter-arrivals and Zipf token lengths, the model family the BurstGPT paper fits to its trace.

    The paper (Wang et al. 2024, arXiv:2401.17644, sections on request concurrency and request/response
    lengths) reports that inter-arrival times fit a Gamma distribution (with shape varying by model,
    service and time) and request token counts a Zipf distribution. We could not verify the exact
    fitted numbers, so every parameter here is an ASSUMPTION the user should set for their study:
    the defaults (Gamma shape 0.5, i.e. CV 1.41; Zipf exponent 1.1; lengths 1..4096 tokens) are the
    defaults of the BurstGPT-Perf example generator in the HPMLL/BurstGPT repository, not fitted values.
    """

    rate: float = 1.0  # mean requests per second (sets the Gamma scale)
    gamma_shape: float = 0.5  # ASSUMPTION: burstiness; CV of the gaps is 1/sqrt(shape)
    request_zipf: float = 1.1  # ASSUMPTION: exponent of P(k) ~ k^-s for request tokens
    response_zipf: float = 1.1  # ASSUMPTION: same for response tokens
    min_tokens: int = 1
    max_request_tokens: int = 4096
    max_response_tokens: int = 4096

    def generate(self, n: int, rng: np.random.Generator) -> RequestStream:
        if self.rate <= 0 or self.gamma_shape <= 0 or n <= 0:
            raise TwinInputError("BurstGPT synthetic: rate, gamma_shape and the count must be > 0")
        gaps = rng.gamma(self.gamma_shape, 1.0 / (self.rate * self.gamma_shape), size=n)
        req = bounded_zipf(n, self.request_zipf, self.min_tokens, self.max_request_tokens, rng)
        resp = bounded_zipf(n, self.response_zipf, self.min_tokens, self.max_response_tokens, rng)
        stats = TraceStats(source="burstgpt-style synthetic", rows_read=n, rows_used=n, notes=[
            f"BurstGPT-style synthetic: Gamma gaps (shape {self.gamma_shape:g}, rate {self.rate:g}/s), "
            f"Zipf lengths (s={self.request_zipf:g}/{self.response_zipf:g}); parameters are assumptions, "
            "not the paper's fitted values"])
        return RequestStream(np.cumsum(gaps), req, resp, stats=stats)


def bounded_zipf(n: int, s: float, lo: int, hi: int, rng: np.random.Generator) -> np.ndarray:
    """n draws of k in [lo, hi] with P(k) proportional to k^-s (exact inverse CDF on the finite support)."""
    if not (1 <= lo <= hi) or s <= 0:
        raise TwinInputError(f"Zipf lengths need 1 <= min <= max and exponent > 0 (got {lo}, {hi}, {s})")
    k = np.arange(lo, hi + 1, dtype=np.float64)
    cdf = np.cumsum(k ** -s)
    cdf /= cdf[-1]
    return (lo + np.searchsorted(cdf, rng.random(n), side="right")).astype(np.int64).clip(lo, hi)
