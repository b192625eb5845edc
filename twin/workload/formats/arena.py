"""Prompt/answer JSONL pairs (Arena-Hard, MT-Bench): a prompts file joined by `question_id` to an answers file.

Prompts: `{question_id, turns: [{content}] or [str]}` per line; answers (one model's): `{question_id, choices:
[{turns: [{content, token_len}]}]}` per line (the first choice is used). Turn j of a question is one request
whose prompt is every earlier question turn and answer plus question turn j, as a chat client sends it.
The output length is the answer's `token_len` (the answering model's own count) unless a local tokenizer
is given, which then counts answers and prompts alike; without `token_len` or a tokenizer, answers are
counted by the estimate of `chars_per_token` characters per token (as the ShareGPT reader does).
The path is the folder holding the pair (also looked for in its `model_answer/` subfolder, Arena-Hard's
layout) or the prompts file with the answers file beside it; `answers` names the answers file outright.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twin.errors import TwinInputError
from twin.workload.formats.common import BadRows, stable_id
from twin.workload.stream import TraceStats

HASH_BLOCK = 16


def _first_record(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    return rec if isinstance(rec, dict) else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return None


def kind_of(path: Path) -> str | None:
    """"prompts", "answers" or None, from a JSONL file's first record."""
    rec = _first_record(path)
    if rec is None or "question_id" not in rec:
        return None
    if "choices" in rec:
        return "answers"
    if "turns" in rec:
        return "prompts"
    return None


def _jsonl_files(folder: Path) -> list[Path]:
    out = sorted(folder.glob("*.jsonl"))
    if (folder / "model_answer").is_dir():
        out += sorted((folder / "model_answer").glob("*.jsonl"))
    return out


def find_pair(path: Path, answers: str | Path | None = None) -> tuple[Path, Path]:
    """(prompts file, answers file) for a folder or a prompts file; one clear error when it is ambiguous."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    files = _jsonl_files(folder)
    if path.is_dir():
        prompts = [f for f in files if kind_of(f) == "prompts"]
        if len(prompts) != 1:
            raise TwinInputError(f"{path}: expected one prompts file (JSONL of {{question_id, turns}}) in the "
                                 f"folder, found {len(prompts)}" + (f": {', '.join(p.name for p in prompts)}"
                                                                    if prompts else ""))
        p = prompts[0]
    else:
        k = kind_of(path)
        if k == "answers":
            raise TwinInputError(f"{path}: this is an answers file ({{question_id, choices}}); give the prompts "
                                 "file or the folder holding both")
        if k != "prompts":
            raise TwinInputError(f"{path}: not a prompts file: its first line is not a JSON object with "
                                 "question_id and turns")
        p = path
    if answers is not None:
        a = Path(answers)
        if not a.exists():
            raise TwinInputError(f"answers file {a} does not exist")
        if kind_of(a) != "answers":
            raise TwinInputError(f"{a}: not an answers file: its first line is not a JSON object with "
                                 "question_id and choices")
        return p, a
    found = [f for f in files if kind_of(f) == "answers"]
    if len(found) != 1:
        raise TwinInputError(f"{folder}: expected one answers file (JSONL of {{question_id, choices}}) beside the "
                             f"prompts, found {len(found)}" + (f": {', '.join(f.name for f in found)}; name one "
                                                               "with answers" if found else ""))
    return p, found[0]


def _lines(path: Path, bad: BadRows) -> list[tuple[str, dict]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TwinInputError(f"{path}: cannot read: {e}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            bad.bad(f"line {n}", None, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(rec, dict):
            bad.bad(f"line {n}", None, f"expected a JSON object, got {type(rec).__name__}")
            continue
        if not isinstance(rec.get("question_id"), (str, int)):
            bad.bad(f"line {n}", "question_id", "missing" if rec.get("question_id") is None else "not a string")
            continue
        out.append((f"line {n}", rec))
    if not out:
        raise TwinInputError(f"{path}: no records (the file is empty or has no valid line)")
    return out


def _turn_text(t: object) -> str | None:
    if isinstance(t, str):
        return t
    if isinstance(t, dict) and isinstance(t.get("content"), str):
        return t["content"]
    return None


@dataclass
class ArenaRows:
    """One row per question turn: lengths, text, turn index, session (question) and prefix ids."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    session: np.ndarray
    turn: np.ndarray
    texts: list[str]
    hash_ids: list
    stats: TraceStats


def read_arena(path: Path, bad: BadRows, tokenizer: str | Path | None = None, chars_per_token: float = 4.0,
               answers: str | Path | None = None) -> ArenaRows:
    from twin.workload.formats.sharegpt import load_tokenizer

    if not 0.1 <= chars_per_token <= 1000:
        raise TwinInputError(f"chars_per_token must be 0.1 to 1000 characters (got {chars_per_token!r})")
    p_path, a_path = find_pair(Path(path), answers)
    bad_a = BadRows(a_path, bad.skip)
    bad_p = BadRows(p_path, bad.skip)
    answers_by_id: dict[str, list[tuple[str, int | None]]] = {}
    several = 0
    for where, rec in _lines(a_path, bad_a):
        ch = rec.get("choices")
        first = ch[0] if isinstance(ch, list) and ch else None
        if not isinstance(first, dict) or not isinstance(first.get("turns"), list):
            bad_a.bad(where, "choices", "expected a non-empty list of {turns: [...]}")
            continue
        several += len(ch) > 1
        turns = []
        for j, t in enumerate(ch[0]["turns"]):
            text = _turn_text(t)
            n = t.get("token_len") if isinstance(t, dict) else None
            if text is None:
                bad_a.bad(where, f"choices[0].turns[{j}].content", "missing or not a string")
                break
            if n is not None and (isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0 or n != int(n)):
                bad_a.bad(where, f"choices[0].turns[{j}].token_len", f"{n!r} is not a token count >= 0")
                break
            turns.append((text, None if n is None else int(n)))
        else:
            answers_by_id[str(rec["question_id"])] = turns
    encode = load_tokenizer(tokenizer) if tokenizer is not None else None
    count = (lambda texts: [len(x) for x in encode(texts)]) if encode is not None else \
        (lambda texts: [int(np.ceil(len(t) / chars_per_token)) for t in texts])
    prompt, output, session, turn_idx, texts, hashes = [], [], [], [], [], []
    unanswered = rows_read = short = no_len = 0
    block_chars = max(1, int(round(HASH_BLOCK * chars_per_token)))
    for s, (where, rec) in enumerate(_lines(p_path, bad_p)):
        q = rec.get("turns")
        qs = [_turn_text(t) for t in q] if isinstance(q, list) else None
        if not qs or any(x is None for x in qs):
            bad_p.bad(where, "turns", "expected a non-empty list of {content: str} (or of strings)")
            continue
        rows_read += len(qs)
        ans = answers_by_id.get(str(rec["question_id"]))
        if ans is None:
            unanswered += len(qs)
            continue
        context: list[str] = []
        chain: list[int] = []
        h = 0
        for j, qtext in enumerate(qs):
            if j >= len(ans):
                short += len(qs) - j
                break
            context.append(qtext)
            ptext = "\n".join(context)
            atext, alen = ans[j]
            if encode is not None or alen is None:
                no_len += alen is None
                alen = count([atext])[0]
            # prefix ids: 16-token runs (character runs without a tokenizer) of the conversation so far
            full = ptext + "\n" + atext
            while (len(chain) + 1) * block_chars <= len(full):
                b = len(chain)
                h = stable_id(h, full[b * block_chars:(b + 1) * block_chars])
                chain.append(h)
            n_p = max(count([ptext])[0], 1)
            prompt.append(n_p)
            output.append(max(int(alen), 1))
            session.append(s)
            turn_idx.append(j)
            texts.append(ptext)
            hashes.append(chain[: len(full) // block_chars] + ([-(len(prompt))] if len(full) % block_chars else []))
            context.append(atext)
    if not prompt:
        raise TwinInputError(f"{p_path}: no prompt joins an answer in {a_path} by question_id "
                             f"({len(answers_by_id)} answers read)")
    stats = TraceStats(source=f"arena {p_path} + {a_path.name}", notes=bad_p.note() + bad_a.note())
    stats.rows_read = rows_read + bad_p.skipped
    stats.rows_skipped = bad_p.skipped
    stats.rows_filtered = unanswered + short
    if unanswered:
        stats.notes.append(f"{unanswered} prompt turns have no answer in {a_path.name}: left out")
    if short:
        stats.notes.append(f"{short} later prompt turns have no answer turn: left out")
    if several:
        stats.notes.append(f"{several} answers have several choices: the first is used")
    if bad_a.skipped:
        stats.notes.append(f"{bad_a.skipped} bad answer lines skipped")
    stats.notes.append("token counts from tokenizer " + str(tokenizer) if encode is not None else
                       f"prompt token counts are an ESTIMATE: {chars_per_token:g} characters per token (no "
                       "--tokenizer); output lengths are the answers' token_len"
                       + (f" ({no_len} without token_len estimated)" if no_len else ""))
    stats.notes.append(f"{len(set(session))} questions -> {len(prompt)} requests (one per question turn)")
    return ArenaRows(np.asarray(prompt, np.int64), np.asarray(output, np.int64), np.asarray(session, np.int64),
                     np.asarray(turn_idx, np.int64), texts, hashes, stats)


def is_arena(folder: Path) -> bool:
    """A folder holding a prompts file (the answers are checked when it is read)."""
    return any(kind_of(f) == "prompts" for f in _jsonl_files(Path(folder)))
