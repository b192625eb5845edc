"""Training data for length models, as users have it: prompt/answer JSONL pairs (Arena-Hard), ShareGPT, or
their own logs (CSV or JSONL with columns `prompt` and `output_tokens`, optionally `prompt_tokens` and
`session_id`; rows of one session in turn order).

Token counts come from a local tokenizer folder when given, else the estimate of 4 characters per token
that the ShareGPT reader documents. Bad data is one TwinInputError naming the file, line and field.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from twin.errors import TwinInputError
from twin.workload.formats.common import BadRows

DATA_FORMATS = ("auto", "arena", "sharegpt", "pairs")


@dataclass
class Examples:
    """Requests with their true output lengths; `groups` keeps a session's turns together in splits."""

    texts: list
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    turns: np.ndarray
    histories: list
    groups: np.ndarray
    source: str = ""
    notes: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.output_tokens)

    def take(self, idx: np.ndarray) -> "Examples":
        idx = np.asarray(idx, dtype=np.int64)
        return Examples([self.texts[i] for i in idx], self.prompt_tokens[idx], self.output_tokens[idx],
                        self.turns[idx], [self.histories[i] for i in idx], self.groups[idx], self.source,
                        list(self.notes))

    def has_text(self) -> bool:
        return all(t is not None for t in self.texts)


def split(ex: Examples, holdout: float, seed: int) -> tuple[Examples, Examples]:
    """(train, holdout): a seeded random `holdout` share of the groups (sessions stay whole)."""
    if not 0 <= holdout < 1:
        raise TwinInputError(f"holdout must be in [0, 1) (got {holdout:g})")
    uniq = np.unique(ex.groups)
    rng = np.random.default_rng(seed)
    n_out = int(round(holdout * len(uniq)))
    if holdout > 0 and len(uniq) - n_out < 1:
        raise TwinInputError(f"{ex.source}: {len(uniq)} example group(s) are too few to hold {holdout:.0%} out")
    out = set(rng.permutation(uniq)[:n_out].tolist())
    mask = np.array([g in out for g in ex.groups.tolist()], dtype=bool)
    return ex.take(np.flatnonzero(~mask)), ex.take(np.flatnonzero(mask))


def _counter(tokenizer: str | Path | None, chars_per_token: float):
    """texts -> token counts, and a note saying how they were counted."""
    if tokenizer is not None:
        from twin.workload.formats.sharegpt import load_tokenizer

        encode = load_tokenizer(tokenizer)
        return (lambda texts: [len(x) for x in encode(list(texts))]), f"token counts from tokenizer {tokenizer}"
    return (lambda texts: [int(math.ceil(len(t) / chars_per_token)) for t in texts]), \
        f"token counts are an ESTIMATE: {chars_per_token:g} characters per token (no --tokenizer)"


def detect_data_format(path: Path) -> str:
    path = Path(path)
    if not path.exists():
        raise TwinInputError(f"training data {path} does not exist")
    if path.is_dir():
        from twin.workload.formats.arena import is_arena

        if is_arena(path):
            return "arena"
        raise TwinInputError(f"{path}: a folder is training data only as a prompt/answer pair "
                             "(a prompts JSONL and an answers JSONL joined by question_id)")
    try:
        with open(path, "rb") as f:
            head = f.read(65536).decode("utf-8", errors="replace")
    except OSError as e:
        raise TwinInputError(f"{path}: cannot read: {e}") from None
    text = head.lstrip("\ufeff \t\r\n")
    if not text:
        raise TwinInputError(f"{path}: the file is empty")
    if text.startswith("["):
        return "sharegpt"
    if text.startswith("{"):
        try:
            keys = set(json.loads(text.splitlines()[0]))
        except ValueError:
            raise TwinInputError(f"{path}: line 1: not valid JSON") from None
        if "question_id" in keys:
            return "arena"
        if "conversations" in keys:
            return "sharegpt"
        if {"prompt", "output_tokens"} & keys:
            return "pairs"
        raise TwinInputError(f"{path}: line 1: cannot tell the format from its keys ({', '.join(sorted(keys))}); "
                             "expected prompt and output_tokens (own logs), question_id (prompt/answer pairs) "
                             "or conversations (ShareGPT)")
    return "pairs"  # a CSV


def load_examples(path: str | Path, format: str = "auto", tokenizer: str | Path | None = None,
                  chars_per_token: float = 4.0, answers: str | Path | None = None) -> Examples:
    """Read training or evaluation examples; every example has a true output length >= 1."""
    path = Path(path)
    if format not in DATA_FORMATS:
        raise TwinInputError(f"unknown training-data format {format!r} (known: {', '.join(DATA_FORMATS)})")
    if not chars_per_token > 0:
        raise TwinInputError(f"chars_per_token must be > 0 (got {chars_per_token!r})")
    fmt = detect_data_format(path) if format == "auto" else format
    if not path.exists():
        raise TwinInputError(f"training data {path} does not exist")
    if fmt == "arena":
        ex = _arena(path, tokenizer, chars_per_token, answers)
    elif fmt == "sharegpt":
        ex = _sharegpt(path, tokenizer, chars_per_token)
    else:
        ex = _pairs(path, tokenizer, chars_per_token)
    if len(ex) == 0:
        raise TwinInputError(f"{path}: no usable examples (each needs a prompt and a true output length): "
                             + "; ".join(ex.notes))
    return ex


def _arena(path: Path, tokenizer, chars_per_token: float, answers) -> Examples:
    from twin.workload.formats.arena import read_arena

    rows = read_arena(path, BadRows(path), tokenizer, chars_per_token, answers)
    hist: list[list[int]] = []
    for i, t in enumerate(rows.turn.tolist()):
        hist.append([] if t == 0 else hist[i - 1] + [int(rows.output_tokens[i - 1])])
    return Examples(rows.texts, rows.prompt_tokens, rows.output_tokens, rows.turn, hist, rows.session,
                    rows.stats.source, rows.stats.notes)


def _sharegpt(path: Path, tokenizer, chars_per_token: float) -> Examples:
    """Human turns followed by a non-empty assistant answer; the prompt is the conversation so far."""
    from twin.workload.formats.sharegpt import _records, _turns

    bad = BadRows(path)
    count, how = _counter(tokenizer, chars_per_token)
    texts, prompt, output, turns, hist, groups = [], [], [], [], [], []
    unanswered = 0
    for g, (where, rec) in enumerate(_records(path, bad)):
        conv = _turns(where, rec, bad)
        if not conv:
            continue
        sizes = count([t for _, t in conv])
        so_far: list[str] = []
        earlier: list[int] = []
        k = 0
        for j, (role, text) in enumerate(conv):
            so_far.append(text)
            if role != "user" or not text.strip():
                continue
            if j + 1 < len(conv) and conv[j + 1][0] == "assistant" and conv[j + 1][1].strip():
                texts.append("\n".join(so_far))
                prompt.append(max(sum(sizes[: j + 1]), 1))
                output.append(max(sizes[j + 1], 1))
                turns.append(k)
                hist.append(list(earlier))
                groups.append(g)
                earlier.append(output[-1])
                k += 1
            else:
                unanswered += 1
    notes = [how, f"{len(set(groups))} conversations -> {len(output)} examples (human turns with an answer)"]
    if unanswered:
        notes.append(f"{unanswered} human turns without an answer left out (no true length)")
    return Examples(texts, np.asarray(prompt, np.int64), np.asarray(output, np.int64), np.asarray(turns, np.int64),
                    hist, np.asarray(groups, np.int64), f"sharegpt {path}", notes)


def _pair_rows(path: Path) -> list[tuple[int, dict]]:
    """(line, record) from a JSONL file or a CSV with a header line."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise TwinInputError(f"{path}: cannot read: {e}") from None
    if not text.strip():
        raise TwinInputError(f"{path}: the file is empty")
    out: list[tuple[int, dict]] = []
    if text.lstrip().startswith("{"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TwinInputError(f"{path}: line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise TwinInputError(f"{path}: line {n}: expected a JSON object, got {type(rec).__name__}")
            out.append((n, rec))
        return out
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        header = [h.strip() for h in (reader.fieldnames or [])]
        missing = [c for c in ("prompt", "output_tokens") if c not in header]
        if missing:
            raise TwinInputError(f"{path}: line 1: missing column(s) {', '.join(missing)} "
                                 f"(have: {', '.join(header) or 'none'})")
        reader.fieldnames = header
        for rec in reader:
            if None in rec:
                raise TwinInputError(f"{path}: line {reader.line_num}: more fields than the header has")
            out.append((reader.line_num, rec))
    except csv.Error as e:
        raise TwinInputError(f"{path}: line {reader.line_num}: not readable as CSV ({e})") from None
    return out


def _count_field(path: Path, line: int, name: str, raw: object, minimum: int) -> int:
    if isinstance(raw, bool):
        raw = None
    try:
        v = float(raw.strip()) if isinstance(raw, str) else float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or v != int(v) or v < minimum:
        raise TwinInputError(f"{path}: line {line}: field {name}: {raw!r} is not a whole number >= {minimum}")
    return int(v)


def _pairs(path: Path, tokenizer, chars_per_token: float) -> Examples:
    rows = _pair_rows(path)
    texts, given, output, sessions = [], [], [], []
    for line, rec in rows:
        p = rec.get("prompt")
        if p is None:
            raise TwinInputError(f"{path}: line {line}: field prompt: missing")
        if not isinstance(p, str):
            raise TwinInputError(f"{path}: line {line}: field prompt: expected text, got {type(p).__name__}")
        if not p.strip() and rec.get("prompt_tokens") in (None, ""):
            raise TwinInputError(f"{path}: line {line}: field prompt: empty (and no prompt_tokens given)")
        if "output_tokens" not in rec or rec["output_tokens"] in (None, ""):
            raise TwinInputError(f"{path}: line {line}: field output_tokens: missing")
        output.append(_count_field(path, line, "output_tokens", rec["output_tokens"], 1))
        pt = rec.get("prompt_tokens")
        given.append(None if pt in (None, "") else _count_field(path, line, "prompt_tokens", pt, 1))
        texts.append(p)
        s = rec.get("session_id")
        sessions.append(None if s in (None, "") else str(s))
    count, how = _counter(tokenizer, chars_per_token)
    need = [i for i, g in enumerate(given) if g is None]
    counted = dict(zip(need, count([texts[i] for i in need]))) if need else {}
    prompt = [max(g if g is not None else counted[i], 1) for i, g in enumerate(given)]
    turns, hist, groups = [], [], []
    seen: dict[str, list[int]] = {}
    ids: dict[str, int] = {}
    for i, s in enumerate(sessions):
        if s is None:
            turns.append(0)
            hist.append([])
            groups.append(-(i + 1))  # a group of its own
            continue
        h = seen.setdefault(s, [])
        turns.append(len(h))
        hist.append(list(h))
        groups.append(ids.setdefault(s, len(ids)))
        h.append(output[i])
    notes = [how if need else "prompt token counts from the prompt_tokens column",
             f"{len(output)} examples" + (f" in {len(ids)} sessions" if ids else "")]
    return Examples(texts, np.asarray(prompt, np.int64), np.asarray(output, np.int64), np.asarray(turns, np.int64),
                    hist, np.asarray(groups, np.int64), f"pairs {path}", notes)
