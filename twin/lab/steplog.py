"""The engine's own step log (live/vllm_plugins/llmtwin_steplog.py) read back as frames: steps and requests.

`twin observe` keeps its load's lines as `steps.parquet` and `engine_requests.parquet`; twin.lab.steps
replays them. Here only the parsing, so the observer needs nothing of the replay.

A recorded step's duration, as the twin replays it, is its period in vLLM's loop: from the end of the step
before it (while the engine still had unfinished requests) to its own end, so the loop's time between steps
(draining the input queue, putting outputs out: ~0.1 ms, up to ~3 ms after a prefill step here) is in the
step that follows it, where vLLM spends it; a step an idle engine began starts when the request that woke it
entered the scheduler. The twin's step boundaries then fall where the server's steps ended, its tokens
appear when the server's did, and every request enters the twin's engine where the period of the step
that took it in began (twin.lab.steps.engine_entry).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from twin.errors import TwinInputError
from twin.perf.base import StepBatch

STEP_COLS = ("num_prefill_tokens", "prefill_attn_tokens", "prefill_kv_read_tokens", "num_prefill_sampled",
             "num_decode_tokens", "decode_context_tokens", "num_prefill_reqs")


def request_tag(nonce: str, i: int) -> str:
    """The `request_id` the client sends for load request i (vLLM makes it `cmpl-<tag>-0-<8 hex>`)."""
    return f"lt{nonce}-{i}"


def _index(rid: str, nonce: str) -> int | None:
    m = re.search(rf"lt{re.escape(nonce)}-(\d+)(?:-|$)", rid)
    return int(m.group(1)) if m else None


def batch_of(reqs: Sequence[Sequence]) -> StepBatch:
    """The twin's batch sums (twin.engine.scheduler.SchedulerOutput.batch) for one logged step's requests:
    [request_id, scheduled, computed before, prompt tokens, tokens]; a decode is one token at the end of a
    request past its prompt, anything else a prefill chunk (a resumed request recomputes its outputs too)."""
    b = StepBatch()
    for _, n, c, p, t in reqs:
        if n == 1 and c == t - 1 and c >= p:
            b.num_decode_tokens += 1
            b.decode_context_tokens += c + 1
        else:
            b.num_prefill_reqs += 1
            b.num_prefill_tokens += n
            b.prefill_attn_tokens += n * c + n * (n + 1) / 2
            b.prefill_kv_read_tokens += c + n
            if c + n == t:
                b.num_prefill_sampled += 1
    return b


def read_step_log(path: str | Path, start: int = 0) -> tuple[list[dict], int]:
    """The plugin's lines from byte offset `start` on (complete lines only), and the offset after them."""
    path = Path(path)
    if not path.is_file():
        return [], start
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                raise TwinInputError(f"{path}: a line that is not JSON (not written by llmtwin_steplog?)") from None
    return out, start + end


def engine_frames(lines: list[dict], t0_mono: float, nonce: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`steps` (one row per executed step, times in the client's frame: seconds from its load's start) and
    `engine_requests` (per load request: scheduler entry, first token and finish at the engine)."""
    adds = {ln["add"]: ln for ln in lines if "add" in ln}
    steps = [ln for ln in lines if "t0" in ln]
    ids = {rid: _index(rid, nonce) for rid in adds}
    ids = {k: v for k, v in ids.items() if v is not None}
    live: set[str] = set()
    add_times = sorted((a["t"], rid) for rid, a in adds.items())
    ai = 0
    rows, first, fin, ntok = [], {}, {}, {}
    busy, prev_end = False, None
    for k, s in enumerate(steps):
        if busy:
            start = prev_end  # the loop went on: this step's period began where the last one ended
        elif ai < len(add_times) and add_times[ai][0] <= s["t0"]:
            start = add_times[ai][0]  # an idle engine: its period began when the waking request entered
        else:
            start = s["t0"]
        while ai < len(add_times) and add_times[ai][0] <= s["t0"]:
            live.add(add_times[ai][1])
            ai += 1
        b = batch_of(s["r"])
        for rid, n_new, done in s["o"]:
            if n_new > 0:
                first.setdefault(rid, s["t1"])
                ntok[rid] = ntok.get(rid, 0) + n_new
            if done:
                fin[rid] = s["t1"]
                live.discard(rid)
        busy, prev_end = bool(live) and k + 1 < len(steps), s["t1"]
        rows.append({"step": k, "start_s": s["t0"] - t0_mono, "end_s": s["t1"] - t0_mono,
                     "replay_start_s": start - t0_mono, "duration_s": s["t1"] - start,
                     "busy_after": busy, "vllm_elapsed_ms": s.get("el"), "num_requests": len(s["r"]),
                     **{c: getattr(b, c) for c in STEP_COLS}})
    st = pd.DataFrame(rows, columns=["step", "start_s", "end_s", "replay_start_s", "duration_s",
                                     "busy_after", "vllm_elapsed_ms",
                                     "num_requests", *STEP_COLS])
    req = []
    for rid, i in sorted(ids.items(), key=lambda kv: kv[1]):
        a = adds[rid]
        req.append({"request_id": i, "queued_s": a["t"] - t0_mono, "prompt_tokens": a["p"],
                    "first_token_s": first.get(rid, np.nan) - t0_mono if rid in first else np.nan,
                    "finish_s": fin[rid] - t0_mono if rid in fin else np.nan, "output_tokens": ntok.get(rid, 0)})
    er = pd.DataFrame(req, columns=["request_id", "queued_s", "prompt_tokens", "first_token_s", "finish_s",
                                    "output_tokens"])
    return st, er
