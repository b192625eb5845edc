"""Public trace formats, each read into the one `RequestStream`: `load_trace(path, format="auto", **controls)`.

Formats: sharegpt (conversation JSON), burstgpt (CSV), azure (Azure LLM inference CSV), mooncake (JSONL
with prefix hashes), servegen (per-client window statistics), lengths (Vidur-style length CSV), arena
(prompt/answer JSONL pairs joined by question_id: Arena-Hard, MT-Bench).
Options are the `ReplayControls` fields plus the format's own (see `OPTIONS`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from twin.errors import TwinInputError
from twin.workload.formats.arena import is_arena
from twin.workload.formats.burstgpt import BurstGPTSynthetic, read_burstgpt
from twin.workload.formats.common import BadRows, check_file, shown
from twin.workload.formats.mooncake import MOONCAKE_BLOCK, IdealReuse, ideal_block_reuse, read_mooncake
from twin.workload.replay import (ArrivalProcess, ReplayControls, apply_controls, select_rows, session_arrivals,
                                  step_rng)
from twin.workload.stream import RequestStream

FORMATS = ("sharegpt", "burstgpt", "azure", "mooncake", "servegen", "lengths", "arena")
UNTIMED = {"sharegpt", "lengths", "arena"}
ARRIVAL = {"arrival", "rate", "cv", "shuffle"}
OPTIONS = {  # format-specific options, beyond ReplayControls
    "sharegpt": ARRIVAL | {"think_time_s", "tokenizer", "output_lengths", "chars_per_token"},
    "lengths": ARRIVAL,
    "burstgpt": {"models", "log_types", "keep_failed"},
    "servegen": {"clients", "lengths"},
    "azure": set(),
    "mooncake": set(),
    "arena": ARRIVAL | {"think_time_s", "tokenizer", "chars_per_token", "answers"},
}

__all__ = ["FORMATS", "load_trace", "detect_format", "ideal_block_reuse", "IdealReuse", "BurstGPTSynthetic",
           "ReplayControls", "MOONCAKE_BLOCK"]


def detect_format(path: str | Path) -> str:
    """Guess a trace's format from its first bytes (and name, for ServeGen)."""
    path = Path(path)
    if path.is_dir():
        if any(path.glob("chunk-*-trace.csv")):
            return "servegen"
        if is_arena(path):
            return "arena"
        raise TwinInputError(f"{path}: a folder is a trace only as a ServeGen model folder (chunk-<id>-trace.csv)")
    if path.name.startswith("chunk-") and path.name.endswith(("-trace.csv", "-dataset.json")):
        return "servegen"
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError as e:
        raise TwinInputError(f"{path}: cannot read: {e.strerror or e}") from None
    text = head.lstrip("\ufeff \t\r\n")
    if text.startswith("["):
        return "sharegpt"
    if text.startswith("{"):
        first = text.splitlines()[0]
        try:
            keys = set(json.loads(first))
        except (ValueError, RecursionError):
            keys = set()
        if {"hash_ids", "input_length"} & keys or '"hash_ids"' in first:
            return "mooncake"
        if "conversations" in keys or '"conversations"' in first:
            return "sharegpt"
        if {"question_id", "turns"} <= keys or {"question_id", "choices"} <= keys:
            return "arena"
    header = text.splitlines()[0] if text else ""
    cols = {c.strip() for c in header.split(",")}
    if {"TIMESTAMP", "ContextTokens"} <= cols:
        return "azure"
    if {"Request tokens", "Response tokens"} <= cols:
        return "burstgpt"
    if {"num_prefill_tokens", "num_decode_tokens"} <= cols:
        return "lengths"
    fields = header.split(",")
    if len(fields) == 6 and (fields[3] in ("Gamma", "Weibull", "")):
        return "servegen"
    raise TwinInputError(f"{path}: cannot tell the trace format from its first line {shown(header, 80)}; "
                         f"give --format ({'|'.join(FORMATS)})")


def load_trace(path: str | Path, format: str = "auto", **options) -> RequestStream:
    """Read a trace and apply the replay controls; the returned stream's stats account for every row.

    options: any `ReplayControls` field (start_s, duration_s, rate_scale, target_rate, sample, max_requests,
    max_prompt_tokens, max_total_tokens, seed, skip_bad_rows) and the format's own (`OPTIONS[format]`):
    arrival/rate/cv/shuffle for traces without timestamps; think_time_s, tokenizer, output_lengths,
    chars_per_token for sharegpt; models, log_types, keep_failed for burstgpt; clients, lengths for servegen.
    """
    path = check_file(Path(path), "trace")
    fmt = detect_format(path) if format == "auto" else format
    if fmt not in FORMATS:
        raise TwinInputError(f"unknown trace format {format!r} (known: auto, {', '.join(FORMATS)})")
    control_names = ReplayControls.names()
    unknown = [k for k in options if k not in control_names and k not in OPTIONS[fmt]]
    if unknown:
        hint = " (to change a timed trace's rate use rate_scale or target_rate)" if "rate" in unknown else ""
        raise TwinInputError(f"option(s) {', '.join(unknown)} do not apply to {fmt} traces{hint}")
    c = ReplayControls(**{k: v for k, v in options.items() if k in control_names}).check()
    opts = {k: v for k, v in options.items() if k not in control_names}
    bad = BadRows(path, c.skip_bad_rows)
    if fmt == "mooncake":
        return apply_controls(read_mooncake(path, bad), c)
    if fmt == "azure":
        from twin.workload.formats.azure import read_azure

        return apply_controls(read_azure(path, bad), c)
    if fmt == "burstgpt":
        return apply_controls(read_burstgpt(path, bad, opts.get("models") or (), opts.get("log_types") or (),
                                            bool(opts.get("keep_failed", False))), c)
    if fmt == "servegen":
        return _servegen(path, bad, c, opts)
    return _untimed(fmt, path, bad, c, opts)


def _servegen(path: Path, bad: BadRows, c: ReplayControls, opts: dict) -> RequestStream:
    from twin.workload.formats.servegen import generate_servegen
    from twin.workload.synthetic import read_length_trace

    pool = None
    if opts.get("lengths"):
        pool = read_length_trace(check_file(Path(opts["lengths"]), "length trace"))
    stream = generate_servegen(path, bad, step_rng(c.seed, "servegen"), opts.get("clients") or (), c.start_s,
                               c.duration_s, c.max_requests if c.sample is None else None, pool)
    if c.start_s == 0 and c.duration_s is None and len(stream):
        stream.arrival_s = stream.arrival_s - stream.arrival_s[0]
    return apply_controls(stream, replace(c, start_s=0.0, duration_s=None), per_request=False, windowed=True)


def _untimed(fmt: str, path: Path, bad: BadRows, c: ReplayControls, opts: dict) -> RequestStream:
    """ShareGPT, prompt/answer pairs and length CSVs: pick rows, then draw arrival times with the user's process."""
    texts = None
    if fmt == "sharegpt":
        from twin.workload.formats.sharegpt import read_sharegpt

        out_path = opts.get("output_lengths")
        rows = read_sharegpt(path, bad, step_rng(c.seed, "output"), opts.get("tokenizer"),
                             None if out_path is None else check_file(Path(out_path), "output-length trace"),
                             float(opts.get("chars_per_token", 4.0)))
        prompt, output, session, hashes, stats = rows.prompt_tokens, rows.output_tokens, rows.session, \
            rows.hash_ids, rows.stats
    elif fmt == "arena":
        from twin.workload.formats.arena import read_arena

        rows = read_arena(path, bad, opts.get("tokenizer"), float(opts.get("chars_per_token", 4.0)),
                          opts.get("answers"))
        prompt, output, session, hashes, stats, texts = rows.prompt_tokens, rows.output_tokens, rows.session, \
            rows.hash_ids, rows.stats, rows.texts
    else:
        from twin.workload.formats.lengths import read_lengths

        prompt, output, stats = read_lengths(path, bad)
        session, hashes = np.arange(len(prompt)), None
        keep = prompt > 0
        n0 = int((~keep).sum())
        if n0:
            stats.rows_filtered += n0
            stats.notes.append(f"{n0} rows with num_prefill_tokens 0 left out (a request needs a prompt)")
            prompt, output, session = prompt[keep], output[keep], session[keep]
        nz = int((output == 0).sum())
        if nz:
            stats.notes.append(f"{nz} rows with num_decode_tokens 0 replayed with 1 output token")
        output = np.maximum(output, 1)
    # length filters first (whole rows), then sample / shuffle / cap, then arrivals
    keep = np.ones(len(prompt), dtype=bool)
    if c.max_prompt_tokens is not None:
        keep &= prompt <= c.max_prompt_tokens
    if c.max_total_tokens is not None:
        keep &= prompt + output <= c.max_total_tokens
    if not keep.all():
        n = int((~keep).sum())
        stats.rows_filtered += n
        stats.notes.append(f"{n} requests left out: over max_prompt_tokens / max_total_tokens")
    idx = np.flatnonzero(keep)
    order = select_rows(len(idx), session[idx], c, stats, bool(opts.get("shuffle", True)))
    idx = idx[order]
    session_sel = session[idx]
    n_sessions = len(np.unique(session_sel))
    proc = ArrivalProcess(opts.get("arrival", "poisson"), opts.get("rate"), float(opts.get("cv", 1.0)))
    starts = proc.times(n_sessions, step_rng(c.seed, "arrivals"), fmt)
    think = float(opts.get("think_time_s", 10.0))
    if think < 0:
        raise TwinInputError(f"think_time_s must be >= 0 (got {think})")
    arrival = session_arrivals(session_sel, starts, think, step_rng(c.seed, "think"))
    if len(arrival):
        arrival = arrival - arrival.min()  # the clock starts at the first request, as for timed traces
    unit = "conversations/s (turn 1)" if fmt in ("sharegpt", "arena") else "req/s"
    stats.notes.append(f"arrivals: {proc.process} at {proc.rate:g} {unit}"
                       + (f", cv {proc.cv:g}" if proc.process == "gamma" else "")
                       + (f"; later turns after an exponential think time of mean {think:g} s"
                          if fmt != "lengths" and len(session_sel) > n_sessions else ""))
    stream = RequestStream(arrival, prompt[idx], output[idx],
                           None if hashes is None else [hashes[i] for i in idx],
                           16, hashes_cover_output=hashes is not None,
                           session_id=session_sel if fmt in ("sharegpt", "arena") else None, stats=stats,
                           texts=None if texts is None else [texts[i] for i in idx])
    stream = apply_controls(stream, replace(c, max_prompt_tokens=None, max_total_tokens=None), timed=False)
    return stream
