"""ShareGPT conversations (`[{id, conversations: [{from, value}, ...]}]`): prompt text per turn.

Each human turn becomes one request whose prompt is every earlier turn of its conversation plus the
new message (a later turn carries the earlier ones as a shared prefix). Token counts come from a local
Hugging Face tokenizer folder, or, without one, an estimate of `chars_per_token` characters per token.
The output length is the next assistant turn's length when the conversation has one, else a draw from
a user-given length CSV or the default output-length model below.
Prefix identity: chained content hashes over 16-token blocks of the conversation (real token ids with a
tokenizer, character runs of 16 x chars_per_token without), so identical prefixes share blocks across
conversations too; a trailing partial block gets an id of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from twin.errors import TwinInputError
from twin.workload.formats.common import BadRows, shown, stable_id
from twin.workload.stream import TraceStats
from twin.workload.synthetic import read_length_trace

USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}
SYSTEM_ROLES = {"system"}
HASH_BLOCK = 16

# Default output-length model: quantiles (every 5%) of `num_decode_tokens` in the ShareGPT length trace
# sharegpt_8k_filtered_stats_llama2_tokenizer.csv (30,731 rows, Llama-2 tokenizer, mean 439; shared/traces/
# length_traces, from project-etalon/etalon, Apache-2.0), sampled by linear interpolation between quantiles.
DEFAULT_OUTPUT_QUANTILES = (
    2, 44, 84, 130, 181, 228, 271, 312, 346, 381, 415, 453, 493, 534, 581, 628, 683, 754, 834, 920, 1024)


@dataclass
class Rows:
    """Requests before they have arrival times: lengths, session grouping and prefix ids."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    session: np.ndarray
    hash_ids: list
    stats: TraceStats
    output_real: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


def load_tokenizer(folder: str | Path):
    """encode(list of texts) -> list of token-id lists, from a local tokenizer folder (optional deps)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TwinInputError(f"tokenizer folder {folder} does not exist (give a local Hugging Face tokenizer folder)")
    if (folder / "tokenizer.json").exists():
        try:
            from tokenizers import Tokenizer  # optional: pip install 'llmtwin[predict]'

            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            return lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        except ImportError:
            pass
    try:
        from transformers import AutoTokenizer  # optional: pip install 'llmtwin[predict]'
    except ImportError:
        raise TwinInputError("--tokenizer needs the optional package 'tokenizers' (for a folder with "
                             "tokenizer.json) or 'transformers': pip install 'llmtwin[predict]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many kinds; the user needs the folder and the reason
        raise TwinInputError(f"tokenizer folder {folder}: cannot load: {e}") from None
    return lambda texts: [tok.encode(t, add_special_tokens=False) for t in texts]


def default_output_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    q = np.asarray(DEFAULT_OUTPUT_QUANTILES, dtype=np.float64)
    u = rng.random(n) * (len(q) - 1)
    i = np.minimum(u.astype(int), len(q) - 2)
    return np.maximum(np.rint(q[i] + (u - i) * (q[i + 1] - q[i])), 1).astype(np.int64)


def _records(path: Path, bad: BadRows) -> list[tuple[str, object]]:
    """(where, record) pairs from a JSON array (where = record index) or JSON Lines (where = line)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise TwinInputError(f"{path}: cannot read: {e}") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TwinInputError(f"{path}: line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        except (ValueError, RecursionError) as e:  # a number too long to convert, nesting too deep
            raise TwinInputError(f"{path}: not valid JSON ({str(e).split(';')[0] or type(e).__name__})") from None
        if not isinstance(data, list):
            raise TwinInputError(f"{path}: expected a JSON array of conversations, got {type(data).__name__}")
        return [(f"record {i}", r) for i, r in enumerate(data)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"line {n}", json.loads(line)))
        except json.JSONDecodeError as e:
            bad.bad(f"line {n}", None, f"not valid JSON ({e.msg} at column {e.colno})")
        except (ValueError, RecursionError) as e:
            bad.bad(f"line {n}", None, f"not valid JSON ({str(e).split(';')[0] or type(e).__name__})")
    return out


def _turns(where: str, rec: object, bad: BadRows) -> list[tuple[str, str]] | None:
    """[(role, text)] of a record, roles normalised to user|assistant|system; None for a bad record."""
    if not isinstance(rec, dict):
        bad.bad(where, None, f"expected a JSON object, got {type(rec).__name__}")
        return None
    if isinstance(rec.get("id"), str):
        where = f"{where} (id {shown(rec['id'])})"
    conv = rec.get("conversations")
    if not isinstance(conv, list):
        bad.bad(where, "conversations", "missing" if conv is None else "not a list")
        return None
    turns = []
    for j, t in enumerate(conv):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            bad.bad(where, f"conversations[{j}]", "expected {\"from\": str, \"value\": str}")
            return None
        role = t["from"].strip().lower()
        if role in USER_ROLES:
            turns.append(("user", t["value"]))
        elif role in ASSISTANT_ROLES:
            turns.append(("assistant", t["value"]))
        elif role in SYSTEM_ROLES:
            turns.append(("system", t["value"]))
        else:
            bad.bad(where, f"conversations[{j}].from", f"unknown role {shown(t['from'])}")
            return None
    return turns


def read_sharegpt(path: Path, bad: BadRows, rng: np.random.Generator, tokenizer: str | Path | None = None,
                  output_lengths: str | Path | None = None, chars_per_token: float = 4.0) -> Rows:
    """Rows (one per human turn) with prompt/output tokens, session = conversation, prefix ids."""
    recs = [(w, t) for w, r in _records(path, bad) if (t := _turns(w, r, bad)) is not None]
    encode = load_tokenizer(tokenizer) if tokenizer is not None else None
    if encode is None:
        block = max(1, int(round(HASH_BLOCK * chars_per_token)))
        units = lambda texts: texts  # noqa: E731  (characters stand in for tokens)
        count = lambda n_units: int(np.ceil(n_units / chars_per_token))  # noqa: E731
    else:
        block = HASH_BLOCK
        units = encode
        count = lambda n_units: n_units  # noqa: E731
    stats = TraceStats(source=f"sharegpt {path}", notes=bad.note())
    prompt, out_len, out_real, session, hashes = [], [], [], [], []
    no_user = {"system": 0, "assistant": 0, "none": 0}
    empty = 0
    for s, (_, turns) in enumerate(recs):
        pieces = units([t for _, t in turns])
        if not any(r == "user" for r, _ in turns):
            no_user[turns[0][0] if turns else "none"] += 1
            continue
        content = "".join(pieces) if encode is None else [x for p in pieces for x in p]
        chain, h = [], 0
        for b in range(len(content) // block):
            h = stable_id(h, content[b * block:(b + 1) * block] if encode is None
                          else np.asarray(content[b * block:(b + 1) * block], np.int64).tobytes())
            chain.append(h)
        pos = 0  # units of the conversation before turn j
        for j, (role, text) in enumerate(turns):
            n = len(pieces[j])
            if role == "user":
                if count(n) == 0 or not text.strip():
                    empty += 1
                else:
                    p_units = pos + n  # every earlier turn (system, questions, answers) plus this message
                    real = j + 1 < len(turns) and turns[j + 1][0] == "assistant" and turns[j + 1][1].strip() != ""
                    a_units = len(pieces[j + 1]) if real else 0
                    end = p_units + a_units
                    ids = chain[: end // block]
                    if end % block:
                        ids = ids + [-(len(prompt) + 1)]  # partial block: unique to this request
                    prompt.append(count(p_units))
                    out_len.append(count(a_units) if real else 0)
                    out_real.append(real)
                    session.append(s)
                    hashes.append(ids)
            pos += n
    out_len_a = np.asarray(out_len, np.int64)
    real_a = np.asarray(out_real, bool)
    n_sampled = int((~real_a).sum())
    if n_sampled:
        if output_lengths is not None:
            _, pool = read_length_trace(output_lengths)
            pool = np.maximum(pool, 1)
            out_len_a[~real_a] = pool[rng.integers(0, len(pool), size=n_sampled)]
            src = f"drawn from num_decode_tokens of {output_lengths}"
        else:
            out_len_a[~real_a] = default_output_lengths(n_sampled, rng)
            src = ("drawn from the default output-length model (ShareGPT decode-length quantiles, "
                   "Llama-2 tokenizer; see twin.workload.formats.sharegpt)")
        stats.notes.append(f"{n_sampled} requests have no assistant answer in the trace: output length {src}")
    stats.notes.append("token counts from tokenizer " + str(tokenizer) if encode is not None else
                       f"token counts are an ESTIMATE: {chars_per_token:g} characters per token (no --tokenizer)")
    users = len(prompt) + empty
    filtered = empty + sum(no_user.values())
    stats.rows_read = users + sum(no_user.values()) + bad.skipped
    stats.rows_filtered = filtered
    stats.rows_skipped = bad.skipped
    for role, n in no_user.items():
        if n:
            what = {"system": "only a system turn", "assistant": "only assistant (gpt) turns",
                    "none": "no turns"}[role]
            stats.notes.append(f"{n} conversations with {what}, no human turn: left out (counted as one row each)")
    if empty:
        stats.notes.append(f"{empty} empty human turns left out")
    stats.notes.append(f"{len(recs)} conversations -> {len(prompt)} requests (one per human turn)")
    return Rows(np.asarray(prompt, np.int64), np.maximum(out_len_a, 1), np.asarray(session, np.int64), hashes,
                stats, real_a)
