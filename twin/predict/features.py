"""Request features both trainable models read: lengths, session history, and simple text cues.

Every feature is known when the request arrives (the true output length never is); text features are NaN
when the request carries no text, history features NaN on a session's first turn.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

# keyword cues: a word at a word boundary, matched case-insensitively
CUES = {
    "kw_write": r"write|draft|compose|generate|create",
    "kw_explain": r"explain|describe|why|how",
    "kw_list": r"list|enumerate|steps|outline",
    "kw_code": r"code|function|script|program|implement|python|javascript|sql|c\+\+|class|regex|bash",
    "kw_short": r"brief|briefly|short|concise|one word|one sentence|yes or no|only answer|just answer",
    "kw_long": r"detailed|in detail|step by step|essay|comprehensive|thorough|in depth|article|story",
    "kw_summarize": r"summari[sz]e|summary|tl;?dr",
    "kw_translate": r"translate|translation",
    "kw_compare": r"compare|comparison|versus|vs\.?|difference",
    "kw_fix": r"fix|debug|error|bug|wrong",
}
_CUE_RE = {k: re.compile(r"(?<![a-z])(?:" + v + r")(?![a-z])") for k, v in CUES.items()}

LENGTH_FEATURES = ["log_prompt_tokens", "turn", "log_hist_mean", "log_hist_last"]
TEXT_FEATURES = ["log_chars", "log_words", "log_lines", "question_marks", "code_fences", "digit_share",
                 "upper_share", *CUES]
FEATURES = LENGTH_FEATURES + TEXT_FEATURES

# cues are looked for in the first and last part of a long prompt (the instruction is usually there)
_CUE_SPAN = 2000


def text_features(text: str | None) -> list[float]:
    if text is None:
        return [math.nan] * len(TEXT_FEATURES)
    n = len(text)
    low = text.lower()
    if n > 2 * _CUE_SPAN:
        low = low[:_CUE_SPAN] + "\n" + low[-_CUE_SPAN:]
    digits = sum(c.isdigit() for c in text)
    upper = sum(c.isupper() for c in text)
    base = [math.log1p(n), math.log1p(len(text.split())), math.log1p(text.count("\n") + 1),
            float(text.count("?")), float(text.count("```")), digits / max(n, 1), upper / max(n, 1)]
    return base + [float(bool(r.search(low))) for r in _CUE_RE.values()]


def feature_row(num_prompt_tokens: int, turn: int, history: Sequence[int], text: str | None) -> list[float]:
    """One request's features, in `FEATURES` order."""
    hm = math.log1p(sum(history) / len(history)) if history else math.nan
    hl = math.log1p(history[-1]) if history else math.nan
    return [math.log1p(max(num_prompt_tokens, 0)), float(turn), hm, hl, *text_features(text)]


def feature_matrix(prompt_tokens: Sequence[int], turns: Sequence[int], histories: Sequence[Sequence[int]],
                   texts: Sequence[str | None]) -> np.ndarray:
    rows = [feature_row(int(p), int(t), h, x) for p, t, h, x in zip(prompt_tokens, turns, histories, texts)]
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(FEATURES))
