"""ServeGen (Alibaba Bailian, Xiang et al., arXiv:2505.09999) per-client window statistics -> requests.

A client `chunk-<id>` has `chunk-<id>-trace.csv` (no header; one row per 600 s window:
`window_start_s, rate, cv, pattern, shape, scale`, pattern Gamma|Weibull parameterising the
inter-arrival time as scipy's gamma(a=shape, scale=scale) / weibull_min(c=shape, scale=scale);
idle windows read `...,0,0,,0,0`) and optionally `chunk-<id>-dataset.json` (per 6-hour window,
length distributions as python-dict-literal strings `{value: probability}`).

Generation, per client and window: gaps drawn from the window's fitted distribution, rescaled so
their mean is 1/rate (the fits' own means are off the measured rate by up to 100x in places, while
`rate` is the window's exact request count / 600 s; the rescale keeps the fitted shape, i.e. the
burstiness). Input and output lengths are drawn independently from the window's distributions (the
files hold marginals only); a window without one uses the nearest window of the same client that has
one, else the user's length CSV (joint pairs).
Accounting: the source's rows are window statistics, so TraceStats counts window rows (used = rows that
overlap the time window, filtered = the others); generated requests are reported in the notes.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from twin.errors import TwinInputError
from twin.workload.formats.common import MAX_TOKENS, BadRows, note_count, numbers, read_csv, seconds
from twin.workload.stream import RequestStream, TraceStats

TRACE_COLUMNS = ["window_start_s", "rate", "cv", "pattern", "shape", "scale"]
DATASET_WINDOW_S = 21600
INPUT_PARTS = ("text_tokens", "image_tokens", "audio_tokens", "video_tokens")  # multimodal: summed
MAX_GENERATED = 5_000_000
_CHUNK = re.compile(r"chunk-(\d+)-(trace\.csv|dataset\.json)$")


@dataclass
class Client:
    """One ServeGen client: its window rows and, when present, its length distributions."""

    id: int
    trace: Path
    dataset: Path | None
    start: np.ndarray = field(default_factory=lambda: np.zeros(0))
    rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    pattern: list = field(default_factory=list)
    shape: np.ndarray = field(default_factory=lambda: np.zeros(0))
    scale: np.ndarray = field(default_factory=lambda: np.zeros(0))
    _raw: dict | None = None
    _dist: dict = field(default_factory=dict)

    def lengths(self, window: int) -> tuple | None:
        """(input (values, p), output (values, p)) for the 6-h window holding `window`, or nearest; None if none."""
        if self.dataset is None:
            return None
        if self._raw is None:
            try:
                raw = json.loads(self.dataset.read_text(encoding="utf-8-sig"))
                self._raw = {int(k): v for k, v in raw.items()}
            except (OSError, ValueError, AttributeError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
                why = " ".join(str(e).split(";")[0].split())[:200] or type(e).__name__
                raise TwinInputError(f"{self.dataset}: not a ServeGen dataset JSON (an object of window start "
                                     f"-> distributions): {why}") from None
        key = window // DATASET_WINDOW_S * DATASET_WINDOW_S
        for k in sorted(self._raw, key=lambda k: (abs(k - key), k)):
            d = self._parsed(k)
            if d is not None:
                return d + (k,)
        return None

    def _parsed(self, k: int):
        if k not in self._dist:
            entry = self._raw[k]
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise TwinInputError(f"{self.dataset}: window {k}: expected an object of distributions, each a "
                                     "string like \"{100: 0.5, 200: 0.5}\"")
            try:
                dists = {f: ast.literal_eval(s) for f, s in entry.items()}
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
                raise TwinInputError(f"{self.dataset}: window {k}: a distribution is not a python dict literal "
                                     f"({' '.join(str(e).split())[:200] or type(e).__name__})") from None
            if not all(isinstance(d, dict) for d in dists.values()):
                raise TwinInputError(f"{self.dataset}: window {k}: a distribution is not a dict {{value: "
                                     "probability}}")
            out = dists.get("output_tokens") or {}
            if "input_tokens" in dists:
                inp = [dists["input_tokens"]]
            else:
                inp = [dists[p] for p in INPUT_PARTS if dists.get(p)]
            self._dist[k] = None if not out or not inp or not all(inp) else (
                [_dist(d, self.dataset, k) for d in inp], _dist(out, self.dataset, k))
        return self._dist[k]


def _dist(d: dict, path: Path, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(token counts, probabilities) of one {count: probability} literal, checked."""
    try:
        v = np.array(list(d.keys()), dtype=np.float64)
        p = np.array(list(d.values()), dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        raise TwinInputError(f"{path}: window {k}: a length distribution is not {{number: number}}") from None
    with np.errstate(invalid="ignore", over="ignore"):
        ok = (np.all(np.isfinite(v)) and np.all(np.isfinite(p)) and np.all(v >= 0) and np.all(v <= MAX_TOKENS)
              and np.all(p >= 0) and np.isfinite(p.sum()) and p.sum() > 0)
    if not ok:
        raise TwinInputError(f"{path}: window {k}: a length distribution has negative, non-finite or too large "
                             "values, or no mass")
    return v, p / p.sum()


def find_clients(path: Path, clients: list[int]) -> list[Client]:
    """Clients from a model folder (all, or those named) or from one chunk file."""
    if path.is_dir():
        found = {}
        for f in path.glob("chunk-*-trace.csv"):
            m = _CHUNK.search(f.name)
            if m:
                found[int(m.group(1))] = f
        if not found:
            raise TwinInputError(f"{path}: no ServeGen chunk-<id>-trace.csv files in this folder")
        ids = sorted(found) if not clients else list(clients)
        missing = [c for c in ids if c not in found]
        if missing:
            raise TwinInputError(f"{path}: no trace file for client(s) {missing} "
                                 f"(have {len(found)} clients, e.g. {sorted(found)[:8]})")
        files = [(c, found[c]) for c in ids]
    else:
        m = _CHUNK.search(path.name)
        if not m:
            raise TwinInputError(f"{path}: a ServeGen path is a model folder or a chunk-<id>-trace.csv file")
        cid = int(m.group(1))
        if clients and list(clients) != [cid]:
            raise TwinInputError(f"{path}: this file is client {cid}; to pick clients {list(clients)}, "
                                 "give the folder instead")
        files = [(cid, path.with_name(f"chunk-{cid}-trace.csv"))]
    out = []
    for cid, trace in files:
        ds = trace.with_name(f"chunk-{cid}-dataset.json")
        out.append(Client(cid, trace, ds if ds.exists() else None))
    return out


def read_windows(c: Client, bad: BadRows) -> int:
    """Parse a client's window rows into `c`; returns the rows read."""
    if not c.trace.exists():
        raise TwinInputError(f"ServeGen trace {c.trace} does not exist")
    rows = read_csv(c.trace, bad, header=TRACE_COLUMNS)
    n = len(rows) + bad.skipped
    start, ok = numbers(rows, "window_start_s", bad, integer=False, what="a time in seconds >= 0")
    rate, ok_r = numbers(rows, "rate", bad, integer=False, what="a rate >= 0")
    ok &= ok_r
    pattern = [p.strip() for p in rows.column("pattern")]
    shape, scale = np.zeros(len(rows)), np.zeros(len(rows))
    for col, arr in (("shape", shape), ("scale", scale)):
        for i, cell in enumerate(rows.column(col)):
            try:
                arr[i] = float(cell)
            except ValueError:
                arr[i] = np.nan
    for i in np.flatnonzero(ok & (rate > 0)):
        where = f"line {rows.lines[i]}"
        if pattern[i] not in ("Gamma", "Weibull"):
            bad.flag(where, "pattern", f"{pattern[i]!r} is not Gamma or Weibull")
            ok[i] = False
        elif not (shape[i] > 0 and np.isfinite(shape[i])):
            bad.flag(where, "shape", f"{rows.column('shape')[i]!r} is not a number > 0")
            ok[i] = False
        elif not (scale[i] > 0 and np.isfinite(scale[i])):
            bad.flag(where, "scale", f"{rows.column('scale')[i]!r} is not a number > 0")
            ok[i] = False
    # windows in time order, each once: a repeated or earlier start made the windows' length (their median step)
    # 0 s, and every request vanished with "their active windows span 0 s"
    last = -math.inf
    for i in np.flatnonzero(ok):
        if start[i] <= last:
            bad.flag(f"line {rows.lines[i]}", "window_start_s",
                     f"{start[i]:g} does not follow the window before ({last:g}): windows are in time order, each once")
            ok[i] = False
        else:
            last = start[i]
    bad.drop(rows, ok)
    c.start, c.rate, c.shape, c.scale = start[ok], rate[ok], shape[ok], scale[ok]
    c.pattern = [p for p, k in zip(pattern, ok) if k]
    return n


def _gaps(pattern: str, shape: float, scale: float, rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    if pattern == "Gamma":
        g = rng.gamma(shape, scale, size=n)
        mean = shape * scale
    else:
        g = rng.weibull(shape, size=n) * scale
        lg = math.lgamma(1.0 + 1.0 / shape)
        mean = scale * math.exp(lg) if lg < 700 else float(np.mean(g)) or scale
    if not (math.isfinite(mean) and mean > 0):
        raise DegenerateGaps
    return g * ((1.0 / rate) / mean)


class DegenerateGaps(Exception):
    """The window's fitted shape/scale give gaps with no usable mean (e.g. shape 1e-300): no arrivals follow."""


def _window_arrivals(pattern, shape, scale, rate, length, rng) -> np.ndarray:
    """Arrival offsets in [0, length) of a renewal process with the window's gap distribution."""
    expect = rate * length
    n = int(expect + 5 * math.sqrt(expect) + 10)
    t = np.cumsum(_gaps(pattern, shape, scale, rate, n, rng))
    while t[-1] < length:
        if len(t) > 4 * n + MAX_GENERATED:  # gaps that (almost) never add up: a degenerate fit
            raise DegenerateGaps
        t = np.concatenate([t, t[-1] + np.cumsum(_gaps(pattern, shape, scale, rate, n, rng))])
    return t[t < length]


def generate_servegen(path: Path, bad: BadRows, rng: np.random.Generator, clients=(), start_s: float = 0.0,
                      duration_s: float | None = None, max_requests: int | None = None,
                      length_pool: tuple[np.ndarray, np.ndarray] | None = None) -> RequestStream:
    """Requests of the chosen clients inside [start_s, start_s + duration_s), times relative to start_s.

    start_s counts from the start of the chosen clients' first active window (rate > 0), where the trace's
    first request falls, as `--start` counts from the first request in every format."""
    cl = find_clients(path, list(clients))
    stats = TraceStats(source=f"servegen {path} clients {[c.id for c in cl]}")
    for c in cl:
        stats.rows_read += read_windows(c, bad)
    stats.rows_skipped = bad.skipped
    stats.notes += bad.note()
    steps = [np.diff(c.start) for c in cl if len(c.start) > 1]
    win = float(np.median(np.concatenate(steps))) if steps else 600.0
    active = np.concatenate([c.start[c.rate > 0] for c in cl]) if cl else np.zeros(0)
    if not len(active):
        raise TwinInputError(f"{path}: clients {[c.id for c in cl]} have no active window (every rate is 0): "
                             "no requests to generate")
    t0 = float(active.min())
    stats.span_s = float(active.max()) + win - t0
    if t0 > 0:
        stats.notes.append(f"times counted from the first active window (window_start_s {t0:g})")
    rel_start, rel_end = start_s, (math.inf if duration_s is None else start_s + duration_s)
    start_s = t0 + start_s  # from here on, the file's own clock
    end = math.inf if duration_s is None else start_s + duration_s
    jobs = []  # (window start, client, row)
    expected = 0.0
    for c in cl:
        over = (c.start + win > start_s) & (c.start < end)
        stats.rows_used += int(over.sum())
        stats.rows_filtered += int((~over).sum())
        for i in np.flatnonzero(over & (c.rate > 0)):
            lo, hi = max(c.start[i], start_s), min(c.start[i] + win, end)
            expected += c.rate[i] * (hi - lo)
            jobs.append((float(c.start[i]), c, int(i)))
    if expected > MAX_GENERATED and (max_requests is None or max_requests > MAX_GENERATED):
        raise TwinInputError(f"{path}: the chosen clients and window imply ~{expected:,.0f} requests; narrow it "
                             "(start_s/duration_s, clients) or cap it with max_requests")
    jobs.sort(key=lambda j: (j[0], j[1].id))
    arr, inp, out = [], [], []
    fallback: dict[int, set] = {}
    pooled = 0
    total = 0
    last_start = None
    for ws, c, i in jobs:
        if max_requests is not None and total >= max_requests and ws != last_start:
            stats.notes.append(f"generation stopped at window {ws:g} s: max_requests {max_requests} reached")
            break
        last_start = ws
        lo, hi = max(ws, start_s), min(ws + win, end)
        if c.rate[i] * win > MAX_GENERATED:
            raise TwinInputError(f"{c.trace}: window {ws:g} s: rate {c.rate[i]:g} req/s implies more than "
                                 f"{MAX_GENERATED:,} requests in one {win:g} s window")
        try:
            t = ws + _window_arrivals(c.pattern[i], c.shape[i], c.scale[i], c.rate[i], win, rng)
        except DegenerateGaps:
            raise TwinInputError(f"{c.trace}: window {ws:g} s: the fitted {c.pattern[i]} (shape {c.shape[i]:g}, "
                                 f"scale {c.scale[i]:g}) gives no usable inter-arrival gaps") from None
        t = t[(t >= lo) & (t < hi)]
        if len(t) == 0:
            continue
        d = c.lengths(int(ws))
        if d is not None:
            (ins, outs, k) = d
            p_tok = sum(rng.choice(v, size=len(t), p=p) for v, p in ins)
            o_tok = rng.choice(outs[0], size=len(t), p=outs[1])
            if k != int(ws) // DATASET_WINDOW_S * DATASET_WINDOW_S:
                fallback.setdefault(c.id, set()).add(int(ws))
        elif length_pool is not None:
            j = rng.integers(0, len(length_pool[0]), size=len(t))
            p_tok, o_tok = length_pool[0][j], length_pool[1][j]
            pooled += len(t)
        else:
            raise TwinInputError(f"ServeGen client {c.id}: no length distribution for window {ws:g} s "
                                 f"({'no dataset JSON' if c.dataset is None else 'all windows empty'}); "
                                 "give a length CSV (--lengths) to draw lengths from")
        arr.append(t - start_s)
        inp.append(np.asarray(p_tok))
        out.append(np.asarray(o_tok))
        total += len(t)
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    a, p, o = cat(arr, np.float64), cat(inp, np.int64), cat(out, np.int64)
    note_count(stats.notes, int((p < 1).sum()), "generated prompts of 0 tokens set to 1")
    note_count(stats.notes, int((o < 1).sum()), "generated outputs of 0 tokens set to 1")
    stats.notes.append(f"{len(a)} requests generated from {len(jobs)} active client-windows of {win:g} s; gaps "
                       "from each window's fitted Gamma/Weibull rescaled to its measured rate; input and output "
                       "lengths drawn independently from the per-6h distributions")
    for cid, ws in sorted(fallback.items()):
        stats.notes.append(f"client {cid}: {len(ws)} windows had no length distribution of their own; "
                           "used the nearest 6-h window that has one")
    note_count(stats.notes, pooled, "requests took lengths from the length CSV (no distribution in the dataset)")
    if not len(a):
        win = f"starting {seconds(rel_start)}" if math.isinf(rel_end) else f"{seconds(rel_start)} to {seconds(rel_end)}"
        raise TwinInputError(f"{path}: no requests left: the chosen clients are idle in the window {win} after "
                             f"the first request; their active windows span {seconds(stats.span_s)} from it")
    return RequestStream(a, np.maximum(p, 1), np.maximum(o, 1), stats=stats)
