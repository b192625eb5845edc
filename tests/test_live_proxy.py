"""The proxy against fake vLLM workers on loopback: routing by the twin's routers, bookkeeping at dispatch,
first chunk and finish, pass-through, retries, faults and bad input. Real workers: tests_vllm/test_live_*.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402
from multidict import CIMultiDict  # noqa: E402

from live.config import parse_config  # noqa: E402
from live.controller import Controller  # noqa: E402
from live.proxy import HEADER_LIMITS, serve  # noqa: E402
from twin.policy import RouterBase  # noqa: E402

METRICS = """# TYPE process_start_time_seconds gauge
process_start_time_seconds {started}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="fake"}} {running}
vllm:num_requests_waiting{{engine="0",model_name="fake"}} 0.0
vllm:kv_cache_usage_perc{{engine="0",model_name="fake"}} 0.5
vllm:prefix_cache_hits_total{{engine="0",model_name="fake"}} 0.0
vllm:cache_config_info{{block_size="4",enable_prefix_caching="True",engine="0",num_gpu_blocks="100"}} 1.0
"""


class FakeWorker:
    """Enough of vLLM's OpenAI server for the proxy: models, metrics, tokenize, completions (SSE or not)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"  # ok | error500 | request500 | busy503 | die_mid_stream | die_before_headers
        self.tokenize_status = 200
        self.tokenize_delay = 0.0
        self.received: list[dict] = []
        self.chunks = 5
        self.delay = 0.0
        self.wrote: list[float] = []  # loop time of each SSE event written
        self.gate: asyncio.Event | None = None  # when set: a stream's first event waits for it
        self.port = 0
        self.runner: web.AppRunner | None = None
        self.started = 1.796e9  # process_start_time_seconds
        self.model, self.max_model_len = "fake", 64
        self.models_answer: tuple[int, object] | None = None
        self.models_reads = 0
        self.abandoned = 0  # unary requests whose connection closed before the answer
        self.headers: list[CIMultiDict] = []
        self.stored: list[str] = []  # Responses API ids it made

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/version", self.version)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{rid}", self.get_response)
        self.runner = web.AppRunner(app, access_log=None, **HEADER_LIMITS)  # vLLM's uvicorn: no header limits
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def models(self, request):
        self.models_reads += 1
        if self.models_answer is not None:  # (status, JSON body): what a broken or foreign server answers
            return web.json_response(self.models_answer[1], status=self.models_answer[0])
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "vllm",
                                                              "root": f"/models/{self.model}", "parent": None,
                                                              "max_model_len": self.max_model_len}]})

    async def metrics(self, request):
        return web.Response(text=METRICS.format(running=len(self.received), started=self.started))

    async def version(self, request):
        return web.json_response({"version": "0.32.0", "worker": self.name})

    async def tokenize(self, request):
        body = await request.json()
        if self.mode == "die_on_tokenize":
            request.transport.close()
            await asyncio.sleep(1)
        await asyncio.sleep(self.tokenize_delay)
        if self.mode == "json500_on_tokenize":  # a dead engine's answer
            return web.json_response({"error": {"message": "EngineDeadError", "code": 500}}, status=500)
        if self.mode == "html_on_tokenize":  # something other than vLLM answering
            return web.Response(text="<html>bad gateway</html>", status=self.tokenize_status, content_type="text/html")
        if self.mode == "no_tokens_on_tokenize":
            return web.json_response({"count": 3})
        text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
        return web.json_response({"tokens": [ord(c) % 200 for c in text], "count": len(text), "max_model_len": 64})

    async def completions(self, request):
        body = await request.json()
        is_probe = body.get("prompt") == "hi" and body.get("max_tokens") == 1
        if not is_probe:
            self.received.append(body)
            self.headers.append(CIMultiDict(request.headers))
        echo = {"X-Request-Id": request.headers["X-Request-Id"]} if "X-Request-Id" in request.headers else {}
        if self.mode == "error500":  # vLLM's answer from a dead engine, before its server terminates
            return web.json_response({"error": {"message": "EngineCore encountered an issue. See stack trace (above) "
                                                           "for the root cause.", "type": "InternalServerError",
                                                "param": None, "code": 500}}, status=500)
        if self.mode in ("request500", "busy503") and not is_probe:  # vLLM's per-request errors
            code = 500 if self.mode == "request500" else 503
            return web.json_response({"error": {"message": f"{self.name} failed this request", "type": "Error",
                                                "param": None, "code": code}}, status=code)
        if self.mode == "die_before_headers" and not is_probe:
            request.transport.close()
            await asyncio.sleep(1)
        if str(body.get("stream")).lower() not in ("true", "1"):  # as vLLM reads it: "false" is false
            await asyncio.sleep(self.delay)
            if not is_probe and (request.transport is None or request.transport.is_closing()):  # vLLM aborts it
                self.abandoned += 1
            return web.json_response({"id": "cmpl-1", "worker": self.name, "choices": [{"text": "x" * 3}],
                                      "usage": {"completion_tokens": 3}}, headers=echo)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **echo})
        await resp.prepare(request)
        if self.mode == "vllm_sse":  # vLLM's events: a role chunk per choice (chat), tokens, the usage event
            await self.vllm_events(resp, body, request.path.endswith("chat/completions"))
            return resp
        if self.gate is not None:
            await self.gate.wait()
        for i in range(self.chunks):
            await resp.write(f"data: {json.dumps({'worker': self.name, 'i': i})}\n\n".encode())
            self.wrote.append(asyncio.get_running_loop().time())
            await asyncio.sleep(self.delay)
            if self.mode == "die_mid_stream" and i == 1:
                request.transport.close()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp


    async def messages(self, request):
        """vLLM's Anthropic Messages API: a message with usage, or its SSE events (`event:` lines)."""
        body = await request.json()
        self.received.append(body)
        if not body.get("stream"):
            return web.json_response({"id": "msg_1", "type": "message", "role": "assistant", "worker": self.name,
                                      "content": [{"type": "text", "text": "hi"}],
                                      "usage": {"input_tokens": 9, "output_tokens": 5}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [("message_start", {"type": "message_start", "message": {"id": "msg_1", "role": "assistant",
                                                                           "usage": {"input_tokens": 9,
                                                                                     "output_tokens": 0}}}),
                  ("content_block_start", {"type": "content_block_start", "index": 0})]
        events += [("content_block_delta", {"type": "content_block_delta", "delta": {"text": "t"}})] * 6
        events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                      "usage": {"input_tokens": 9, "output_tokens": 6}}),
                   ("message_stop", {"type": "message_stop"})]
        for name, ev in events:
            await resp.write(f"event: {name}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n".encode())
        return resp

    async def responses(self, request):
        """vLLM's Responses API with its store on: ids it made, a 404 for a previous id it does not hold."""
        body = await request.json()
        self.received.append(body)
        prev = body.get("previous_response_id")
        if prev and prev not in self.stored:
            return web.json_response({"error": {"message": f"Response with id '{prev}' not found.",
                                                "type": "invalid_request_error", "param": None, "code": 404}},
                                     status=404)
        rid = f"resp_{self.name}_{len(self.stored)}"
        self.stored.append(rid)
        done = {"id": rid, "object": "response", "status": "completed", "worker": self.name,
                "usage": {"input_tokens": 5, "output_tokens": 7, "total_tokens": 12}}
        if not body.get("stream"):
            return web.json_response(done)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for name, ev in [("response.created", {"type": "response.created", "response": {"id": rid}}),
                         ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "t"}),
                         ("response.completed", {"type": "response.completed", "response": done})]:
            await resp.write(f"event: {name}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n".encode())
            await asyncio.sleep(self.delay)  # vLLM writes response.created before the engine's first output
        return resp

    async def get_response(self, request):
        rid = request.match_info["rid"]
        if rid not in self.stored:
            return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
        return web.json_response({"id": rid, "worker": self.name})

    async def vllm_events(self, resp, body, chat):
        n, per = int(body.get("n", 1)), 4
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": self.model}
        events = []
        if chat:
            events += [{**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]}
                       for i in range(n)]
        for t in range(per):
            for i in range(n):
                delta = {"content": "tok"} if chat else None
                events.append({**base, "choices": [{"index": i, **({"delta": delta} if chat else {"text": "tok"})}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n * per,
                                                            "total_tokens": 3 + n * per}})
        for ev in events:  # one write each: the proxy sees them in any chunking
            await resp.write(f"data: {json.dumps(ev, separators=(',', ':'))}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")


class Recorder(RouterBase):
    """Round-robin that records what the hooks tell it (a twin router would read the same calls)."""

    name = "recorder"

    def __init__(self) -> None:
        self.n = 0
        self.calls: list[tuple] = []
        self.seen_prefix: list[dict] = []
        self.first_at: dict[str, float] = {}

    def choose(self, req, fleet):
        self.seen_prefix.append(fleet.cached_blocks(req))
        inst = fleet.instances[self.n % len(fleet.instances)]
        self.n += 1
        return inst.id

    def on_dispatch(self, req, instance_id, now):
        self.calls.append(("dispatch", req.id, instance_id, req.num_prompt_tokens, req.max_tokens))

    def on_first_token(self, req, instance_id, now):
        self.calls.append(("first", req.id, instance_id))
        self.first_at[req.id] = now

    def on_finish(self, req, instance_id, now, output_tokens):
        self.calls.append(("finish", req.id, instance_id, output_tokens))


@contextlib.asynccontextmanager
async def proxy(fake_workers, router_obj=None, **cfg_extra):
    raw = {"server": {"port": 0, "max_body_bytes": 4096, "request_timeout_s": 10},
           "workers": [{"id": w.name, "url": w.url} for w in fake_workers],
           "router": {"scrape_interval_s": 0.05}, "health": {"interval_s": 0.2, "backoff_initial_s": 0.1,
                                                             "backoff_max_s": 0.2}}
    for k, v in cfg_extra.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v  # (a list, e.g. workers, replaces)
    ctl = Controller(parse_config(raw), router=router_obj)
    stop = asyncio.Event()
    ready = asyncio.get_running_loop().create_future()
    task = asyncio.get_running_loop().create_task(serve(ctl, ready.set_result, stop))
    port = await asyncio.wait_for(ready, 10)
    ctl.test_stop = stop
    async with aiohttp.ClientSession() as client:
        try:
            yield ctl, f"http://127.0.0.1:{port}", client
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)


async def fakes(n=2):
    ws = [FakeWorker(f"w{i}") for i in range(n)]
    for w in ws:
        await w.start()
    return ws


def run(coro):
    return asyncio.run(coro)


def test_unary_and_stream_pass_through_with_bookkeeping_and_hooks():
    async def main():
        ws = await fakes()
        rec = Recorder()
        async with proxy(ws, rec) as (ctl, url, c):
            async with c.post(url + "/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": 7}) as r:
                assert r.status == 200
                a = await r.json()
            async with c.post(url + "/v1/completions",
                              json={"prompt": "hello", "max_tokens": 5, "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                text = (await r.read()).decode()
            assert ctl.bookkeeping.in_flight() == 0
            assert all(ld.requests == 0 and ld.prompt_tokens == 0 and ld.decode_tokens == 0
                       for ld in ctl.bookkeeping.loads.values())
            page = await (await c.get(url + "/metrics")).text()
        for w in ws:
            await w.stop()
        return a, text, rec, page

    a, text, rec, page = run(main())
    assert a["worker"] == "w0" and a["usage"]["completion_tokens"] == 3
    assert text.count("data: ") == 6 and '"worker": "w1"' in text and text.endswith("data: [DONE]\n\n")
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["dispatch", "first", "finish", "dispatch", "first", "finish"]
    assert rec.calls[0][2:] == ("w0", 1, 7)  # prompt tokens from the estimate (5 chars / 4), the client's cap
    assert rec.calls[2][3] == 3 and rec.calls[5][3] == 5  # output tokens: usage, then counted SSE events
    assert 'llmtwin_requests_total{status="200",worker="w0"} 1.0' in page
    assert "llmtwin_decision_latency_seconds_count 2.0" in page


def test_a_stream_is_passed_on_as_it_arrives_not_gathered():
    """The proxy forwards each upstream chunk when it comes (`iter_any`), so a client's token times are the
    worker's: it reads the first event before the worker has written the last, in about one read per event."""
    async def main():
        ws = await fakes(1)
        ws[0].chunks, ws[0].delay = 8, 0.05
        reads: list[tuple[float, int]] = []
        async with proxy(ws) as (ctl, url, c):
            async with c.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 8, "stream": True}) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    reads.append((asyncio.get_running_loop().time(), chunk.count(b"data: ")))
        await ws[0].stop()
        return reads, ws[0].wrote

    reads, wrote = run(main())
    assert sum(n for _, n in reads) == 9 and len(wrote) == 8
    seen, t_seven = 0, None
    for t, n in reads:
        seen += n
        if seen >= 7 and t_seven is None:
            t_seven = t
    assert t_seven is not None and t_seven < wrote[-1]  # 7 events read before the worker wrote the 8th
    assert len(reads) >= 5  # events 50 ms apart arrive apart (slack for a loaded guest)


def test_router_by_name_from_config_round_robin():
    async def main():
        ws = await fakes()
        async with proxy(ws, None, router={"name": "round-robin", "scrape_interval_s": 0.05}) as (ctl, url, c):
            for _ in range(6):
                async with c.post(url + "/v1/completions", json={"prompt": "p", "max_tokens": 1}) as r:
                    assert r.status == 200
            name = ctl.router_name
            completions = list(ctl.signals.completions)
        for w in ws:
            await w.stop()
        return ws, name, completions

    ws, name, completions = run(main())
    assert name == "round-robin"
    assert [len(w.received) for w in ws] == [3, 3]
    # a router without hooks: the unary answers still reach the scalers' signals, with their usage tokens
    assert [c.output_tokens for c in completions] == [3] * 6


def test_bad_input_is_4xx_with_a_message():
    async def main():
        ws = await fakes(1)
        out = {}
        async with proxy(ws, None, tokenizer={"mode": "worker"}) as (ctl, url, c):
            async def post(key, data=None, js=None, path="/v1/completions", ctype="application/json"):
                async with c.post(url + path, data=data, json=js, headers={"Content-Type": ctype}) as r:
                    out[key] = (r.status, await r.json())
            await post("json", data=b"{not json")
            await post("list", js=[1, 2])
            await post("model", js={"model": "gpt-9", "prompt": "x"})
            await post("big", data=json.dumps({"prompt": "x" * 10000}).encode())
            await post("context", js={"prompt": "x" * 70, "max_tokens": 1})
            await post("over", js={"prompt": "x", "max_tokens": 65})
            await post("maxtok", js={"prompt": "x", "max_tokens": -3})
            await post("noprompt", js={"max_tokens": 3})
            await post("chatmsgs", js={"messages": "hi"}, path="/v1/chat/completions")
            await post("model_list", js={"model": ["fake"], "prompt": "x"})
            await post("model_int", js={"model": 7, "prompt": "x"})
            await post("model_empty", js={"model": "", "prompt": "x", "max_tokens": 1})
            await post("ctype", js={"prompt": "x"}, ctype="text/plain")  # vLLM: 400, whatever the body
            await post("deep", data=b'{"prompt": "x", "a": ' + b"[" * 2000 + b"]" * 2000 + b"}")
        for w in ws:
            await w.stop()
        return out, ws[0].received

    out, received = run(main())
    assert out["json"][0] == 400 and "not valid JSON" in out["json"][1]["error"]["message"]
    assert out["list"][0] == 400
    assert out["model"][0] == 404 and "gpt-9" in out["model"][1]["error"]["message"]
    assert out["big"][0] == 413 and "4096 bytes" in out["big"][1]["error"]["message"]
    assert out["context"][0] == 400 and "maximum context length is 64" in out["context"][1]["error"]["message"]
    assert out["context"][1]["error"]["message"].count("70 input tokens") == 1
    assert out["over"][0] == 400 and "max_tokens=65 cannot be greater than max_model_len=64" in \
        out["over"][1]["error"]["message"]
    assert out["maxtok"][0] == 400
    assert out["noprompt"][0] == 400 and "prompt" in out["noprompt"][1]["error"]["message"]
    assert out["chatmsgs"][0] == 400
    assert out["model_list"][0] == 400 and "valid string" in out["model_list"][1]["error"]["message"]  # was a 500
    assert out["model_int"][0] == 400  # vLLM's 400 (a type error), not a 404
    assert out["model_empty"][0] == 200  # vLLM serves its model to an empty name
    assert out["ctype"][0] == 400 and "Only 'application/json'" in out["ctype"][1]["error"]["message"]
    assert out["deep"][0] == 400 and "nested too deeply" in out["deep"][1]["error"]["message"]  # was a 500
    assert len(received) == 1  # only the empty model name reached a worker


def test_fields_are_read_as_vllm_reads_them():
    """vLLM's request models read a body in pydantic's lax mode: max_tokens 7.0 or "2" is an integer there and
    stream "false" is false. The proxy refused the first (400) and streamed the second; its bookkeeping now gets
    vLLM's values. Chat's max_completion_tokens wins over max_tokens, as in vLLM."""
    async def main():
        ws = await fakes(1)
        rec = Recorder()
        out = {}
        async with proxy(ws, rec) as (ctl, url, c):
            async def post(key, js, path="/v1/completions"):
                async with c.post(url + path, json=js) as r:
                    out[key] = (r.status, r.headers["Content-Type"], await r.read())
            await post("float", {"prompt": "hello", "max_tokens": 7.0, "stream": "false"})
            await post("ids", {"prompt": [1, 2.0, "3"], "max_tokens": "2"})
            await post("echo", {"prompt": "hello", "max_tokens": 0, "echo": True})
            await post("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                "max_completion_tokens": 100}, "/v1/chat/completions")
        await ws[0].stop()
        return out, rec.calls

    out, calls = run(main())
    assert [out[k][0] for k in ("float", "ids", "echo")] == [200] * 3
    assert out["float"][1].startswith("application/json")  # answered, not streamed
    assert out["chat"][0] == 400 and b"max_completion_tokens=100 cannot be greater than" in out["chat"][2]
    dispatch = [c for c in calls if c[0] == "dispatch"]
    assert [c[3:] for c in dispatch] == [(1, 7), (3, 2), (1, 0)]  # prompt tokens, max_tokens
    assert [c[3] for c in calls if c[0] == "finish"] == [3, 3, 3]  # the answers' usage: not read as streams


def test_chat_parts_whose_text_is_no_string_go_to_vllm_to_refuse():
    """A content part's non-string text (5, null) was a 500 traceback (joining the texts); vLLM answers it 400,
    so the proxy passes it on: its own 400 comes back from /tokenize or the completion."""
    from live.tokens import prompt_parts

    for text in (5, None, ["a"]):
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                          {"type": "text", "text": "ok"}]}]}
        assert prompt_parts(body, chat=True) == ([body["messages"]], "ok")


def test_api_key_as_vllm_checks_it():
    """vLLM's AuthenticationMiddleware: one of several keys, the Bearer scheme in any case, /v1 only (vLLM's own
    /tokenize and /version are open), and a 401 of {"error": "Unauthorized"}. The proxy took one key, refused
    `bearer k` and guarded /tokenize and /version."""
    async def main():
        ws = await fakes(1)
        got = []
        async with proxy(ws, None, server={"api_key": ["k", "k2"]}) as (ctl, url, c):
            for method, path, auth in [("POST", "/v1/completions", None), ("POST", "/v1/completions", "Bearer k"),
                                       ("POST", "/v1/completions", "bearer k2"), ("POST", "/v1/completions", "Basic k"),
                                       ("POST", "/v1/completions", "Bearer k3"), ("GET", "/v1/models", None),
                                       ("POST", "/tokenize", None), ("GET", "/version", None),
                                       ("GET", "/workers", None), ("GET", "/workers", "Bearer k")]:
                headers = {"Authorization": auth} if auth else {}
                async with c.request(method, url + path, json={"prompt": "x"}, headers=headers) as r:
                    body = await r.json()
                    got.append((r.status, body if r.status == 401 else None))
        await ws[0].stop()
        return got

    got = run(main())
    assert [g[0] for g in got] == [401, 200, 200, 401, 401, 401, 200, 200, 401, 200]
    assert got[0][1] == {"error": "Unauthorized"}


def test_failure_before_first_byte_is_retried_once_elsewhere_and_marks_down():
    async def main():
        ws = await fakes()
        rec = Recorder()
        res = {}
        async with proxy(ws, rec, health={"interval_s": 30, "backoff_initial_s": 30, "backoff_max_s": 30}) as (
                ctl, url, c):
            ws[0].mode = "error500"
            async with c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                res["first"] = (r.status, await r.json())
            res["w0_state"] = ctl.registry.get("w0").view_state
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                res["second"] = (r.status, (await r.read()).decode())
            ws[1].mode = "die_before_headers"
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                res["all_down"] = (r.status, await r.json())
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                res["after"] = (r.status, await r.json())
            res["inflight"] = ctl.bookkeeping.in_flight()
            res["page"] = await (await c.get(url + "/metrics")).text()
        for w in ws:
            await w.stop()
        return res

    res = run(main())
    assert res["first"][0] == 200 and res["first"][1]["worker"] == "w1"
    assert res["w0_state"] == "stopped"
    assert res["second"][0] == 200 and '"worker": "w1"' in res["second"][1]
    assert res["all_down"][0] == 502 and "w1" in res["all_down"][1]["error"]["message"]
    assert res["after"][0] == 503 and "no worker is serving" in res["after"][1]["error"]["message"]
    assert "w0: down" in res["after"][1]["error"]["message"]
    assert res["inflight"] == 0
    assert "llmtwin_retries_total 1.0" in res["page"]


def test_worker_dying_mid_stream_gives_an_sse_error_and_later_requests_go_elsewhere():
    async def main():
        ws = await fakes()
        res = {}
        async with proxy(ws, None, router={"name": "round-robin"},
                         health={"interval_s": 30, "backoff_initial_s": 30, "backoff_max_s": 30}) as (ctl, url, c):
            ws[0].mode = "die_mid_stream"
            ws[0].delay = ws[1].delay = 0.01
            other = c.post(url + "/v1/completions", json={"prompt": "y", "stream": True})
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                res["dying"] = (r.status, (await r.read()).decode())
            async with other as r2:
                res["other"] = (r2.status, (await r2.read()).decode())
            res["state"] = ctl.registry.get("w0").view_state
            res["health"] = await (await c.get(url + "/health")).json()
            res["workers"] = {w["id"]: w["state"] for w in (await (await c.get(url + "/workers")).json())["workers"]}
            res["page"] = await (await c.get(url + "/metrics")).text()
            for i in range(3):
                async with c.post(url + "/v1/completions", json={"prompt": "z"}) as r:
                    res[f"later{i}"] = (await r.json())["worker"]
            res["inflight"] = ctl.bookkeeping.in_flight()
        for w in ws:
            await w.stop()
        return res

    res = run(main())
    status, body = res["dying"]
    assert status == 200
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])
    assert err["error"]["code"] == 502 and "mid-stream" in err["error"]["message"]
    assert res["other"][0] == 200 and res["other"][1].endswith("data: [DONE]\n\n")  # the other one is not lost
    assert res["other"][1].count('"worker": "w1"') == 5
    assert res["state"] == "stopped"  # to routers (the twin's InstanceState); to operators it is down
    assert res["health"]["workers"] == {"w0": "down", "w1": "serving"} and res["health"]["serving"] == 1
    assert res["workers"] == {"w0": "down", "w1": "serving"}
    assert 'llmtwin_workers{state="down"} 1.0' in res["page"] and 'llmtwin_workers{state="stopped"} 0.0' in res["page"]
    assert [res[f"later{i}"] for i in range(3)] == ["w1"] * 3
    assert res["inflight"] == 0


def test_a_client_gone_before_its_first_chunk_marks_no_worker_down_and_is_not_retried():
    """Found by a fuzzing pass: the write of the first chunk to a client that had left raised a connection error
    the proxy took for the worker's, so it marked the worker down and retried elsewhere, and again: one impatient
    client took the whole fleet down and its request was counted three times."""
    async def main():
        ws = await fakes()
        for w in ws:
            w.gate = asyncio.Event()
        async with proxy(ws, None, router={"name": "round-robin"},
                         health={"interval_s": 30, "backoff_initial_s": 30, "backoff_max_s": 30}) as (ctl, url, c):
            async with aiohttp.ClientSession() as leaving:
                task = asyncio.get_running_loop().create_task(
                    leaving.post(url + "/v1/completions", json={"prompt": "x", "stream": True}))
                while not (ws[0].received or ws[1].received):
                    await asyncio.sleep(0.01)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for w in ws:
                w.gate.set()
            while ctl.bookkeeping.in_flight():
                await asyncio.sleep(0.01)
            states = {w.id: w.status for w in ctl.registry}
            page = await (await c.get(url + "/metrics")).text()
        for w in ws:
            await w.stop()
        return ws, states, page

    ws, states, page = run(main())
    assert states == {"w0": "serving", "w1": "serving"}
    assert [len(w.received) for w in ws] == [1, 0]  # not retried on w1
    assert 'llmtwin_requests_total{status="499",worker="w0"} 1.0' in page
    assert "llmtwin_requests_total{" not in page.replace('llmtwin_requests_total{status="499",worker="w0"}', "")
    assert "llmtwin_retries_total 0.0" in page and "before_first_byte" not in page


def accounted(page: str) -> float:
    """Requests on the controller's page: answered by a worker or for one (by status), or by the controller."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(("llmtwin_requests_total{", "llmtwin_rejected_total{")))


def test_every_request_is_counted_once_whatever_its_end():
    """Found by a fuzzing pass: a router that raised (500), a retry that found no other worker (502), a stream
    that timed out before its first chunk (504) and a failed /tokenize (502) were on no request counter."""
    class RaisesOn13(Recorder):
        def choose(self, req, fleet):
            if req.max_tokens == 13:
                raise RuntimeError("13")
            return super().choose(req, fleet)

    async def main():
        ws = await fakes()
        statuses = []
        slow = {"interval_s": 30, "backoff_initial_s": 30, "backoff_max_s": 30}
        async with proxy(ws, RaisesOn13(), server={"request_timeout_s": 1}, health=slow) as (ctl, url, c):
            async def post(js):
                async with c.post(url + "/v1/completions", json=js) as r:
                    statuses.append(r.status)
                    await r.read()
            await post({"prompt": "x", "max_tokens": 13})  # the router raises: 500
            ws[0].gate = ws[1].gate = asyncio.Event()  # never set: no first chunk
            await post({"prompt": "x", "stream": True})  # 504
            ws[0].gate = ws[1].gate = None
            ws[0].mode = "error500"
            await post({"prompt": "x"})  # w0 fails, w1 answers: 200
            ws[1].mode = "die_before_headers"
            await post({"prompt": "x"})  # w1 fails, no other serving: 502
            await post({"prompt": "x"})  # none serving: 503
            page = await (await c.get(url + "/metrics")).text()
        ws[0].mode = "ok"
        async with proxy(ws[:1], None, tokenizer={"mode": "worker"}, health=slow) as (ctl, url, c):
            ws[0].mode = "die_on_tokenize"
            await post({"prompt": "x"})  # /tokenize fails: 502
            page2 = await (await c.get(url + "/metrics")).text()
        for w in ws:
            await w.stop()
        return statuses, page, page2

    statuses, page, page2 = run(main())
    assert statuses == [500, 504, 200, 502, 503, 502]
    assert accounted(page) == 5 and accounted(page2) == 1
    assert 'llmtwin_rejected_total{reason="router_error"} 1.0' in page


@pytest.mark.parametrize("mode,status", [("html_on_tokenize", 200), ("html_on_tokenize", 502),
                                         ("no_tokens_on_tokenize", 200), ("json500_on_tokenize", 500)])
def test_a_tokenize_answer_that_is_not_vllms_is_the_workers_failure(mode, status):
    """Found by a fuzzing pass: in `worker` tokenizer mode a /tokenize answer that is not JSON (a page from something
    in between), or JSON without token ids, raised out of the handler: a 500 and a traceback; a dead engine's JSON
    500 was sent to the client as a 400 and left the worker routable. Each is the worker's failure, as a dropped
    connection is: 502, the worker marked down, the request counted."""

    async def main():
        ws = await fakes(1)
        ws[0].mode, ws[0].tokenize_status = mode, status
        slow = {"interval_s": 30, "backoff_initial_s": 30, "backoff_max_s": 30}
        async with proxy(ws, None, tokenizer={"mode": "worker"}, health=slow) as (ctl, url, c):
            async with c.post(url + "/v1/completions", json={"prompt": "abc"}) as r:
                got = r.status, await r.json()
            page = await (await c.get(url + "/metrics")).text()
            state = ctl.registry.get("w0").routable
        await ws[0].stop()
        return got, page, state

    (code, body), page, state = run(main())
    assert code == 502 and "without token ids" in body["error"]["message"] and not state
    assert accounted(page) == 1


def test_requests_cut_when_the_shutdown_grace_runs_out_are_counted_cancelled():
    """Found by a fuzzing pass (left open there): a stream cut when `shutdown_timeout_s` ran out was counted 200, and
    a request cut before its answer was on no counter. Both are `cancelled` now: every request on a counter."""
    from prometheus_client import generate_latest

    async def main():
        ws = await fakes(2)
        ctx = proxy(ws, None, server={"shutdown_timeout_s": 0.5})
        ctl, url, c = await ctx.__aenter__()
        for w in ws:  # (set once ready: the readiness probe waits the delay too)
            w.delay, w.chunks = 2.0, 100  # a unary answer after the grace; a stream that outlives it

        async def stream():
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                async for _ in r.content.iter_any():
                    pass

        async def unary():
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                await r.read()

        jobs = [asyncio.create_task(stream())]
        jobs.append(asyncio.create_task(unary()))
        await asyncio.sleep(0.5)  # both in flight, the stream past its first chunk
        await ctx.__aexit__(None, None, None)  # stop: the grace (0.5 s) runs out on both
        await asyncio.gather(*jobs, return_exceptions=True)
        for w in ws:
            await w.stop()
        return generate_latest(ctl.metrics.registry).decode()

    page = run(main())
    cancelled = [line for line in page.splitlines() if line.startswith("llmtwin_requests_total{status=\"cancelled\"")]
    assert len(cancelled) == 2 and accounted(page) == 2, page


def test_requests_cut_before_dispatch_are_counted_too():
    """Found in review: a request cut by the shutdown while its prompt was tokenised (or routed), and one whose
    client left while its body was read, reached no counter. Both are counted under worker "-"."""
    from prometheus_client import generate_latest

    async def main():
        ws = await fakes(1)
        ctx = proxy(ws, None, tokenizer={"mode": "worker"}, server={"shutdown_timeout_s": 0.5})
        ctl, url, c = await ctx.__aenter__()
        port = int(url.rsplit(":", 1)[1])
        _, w = await asyncio.open_connection("127.0.0.1", port)  # a body promised, never sent in full
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{\"prompt\"")
        await w.drain()
        await asyncio.sleep(0.2)
        w.close()
        ws[0].tokenize_delay = 3.0

        async def unary():
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                await r.read()

        job = asyncio.create_task(unary())
        await asyncio.sleep(0.5)  # waiting on /tokenize
        await ctx.__aexit__(None, None, None)
        await asyncio.gather(job, return_exceptions=True)
        await ws[0].stop()
        return generate_latest(ctl.metrics.registry).decode()

    page = run(main())
    assert 'llmtwin_requests_total{status="499",worker="-"} 1.0' in page, page
    assert 'llmtwin_requests_total{status="cancelled",worker="-"} 1.0' in page, page
    assert accounted(page) == 2


def test_headers_as_long_as_vllm_takes_are_served():
    """aiohttp's defaults (8 KiB a header line, 128 headers) refused with a 400 and a logged traceback what vLLM's
    server (uvicorn with httptools, no such limits) serves: a 9,000-byte X-Session-Id, 300 headers."""

    async def main():
        ws = await fakes(1)
        got = []
        async with proxy(ws) as (ctl, url, c):
            for headers in ({"X-Session-Id": "s" * 9000}, {f"X-H{i}": "v" for i in range(300)}):
                async with c.post(url + "/v1/completions", json={"prompt": "x"}, headers=headers) as r:
                    got.append(r.status)
        await ws[0].stop()
        return got

    assert run(main()) == [200, 200]


def test_max_tokens_is_cut_to_the_context_as_vllm_does_and_only_what_vllm_refuses_is_refused():
    """vLLM 0.32 serves a prompt plus max_tokens over the context: it cuts max_tokens to what the context leaves
    (`get_max_tokens`), per prompt of a batch; it refuses only max_tokens above the context, a prompt longer than
    it, or one that leaves no token. The proxy refused every sum over the context (a batch's total too), so
    requests vLLM serves got a 400. A completion without max_tokens takes vLLM's 16 (`normalize_null_max_tokens`);
    chat has no such default. truncate_prompt_tokens keeps a prompt's last tokens before any of this."""

    async def main():
        ws = await fakes(1)
        rec = Recorder()
        got = []
        async with proxy(ws, rec, tokenizer={"mode": "worker"}) as (ctl, url, c):
            for path, js in (("/v1/completions", {"prompt": "x" * 10}),
                             ("/v1/completions", {"prompt": "x" * 10, "max_tokens": None}),
                             ("/v1/completions", {"prompt": "x" * 50}),  # 50 + 16 > the fake's 64: cut to 14
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 50}]}),
                             ("/v1/completions", {"prompt": [[1] * 40, [2] * 40, [3] * 40], "max_tokens": 30}),
                             ("/v1/completions", {"prompt": "x" * 64}),  # leaves no token: vLLM's 400
                             ("/v1/completions", {"prompt": "x" * 64, "echo": True, "max_tokens": 0}),
                             ("/v1/completions", {"prompt": "ab" * 50, "truncate_prompt_tokens": 6, "max_tokens": 2}),
                             ("/v1/completions", {"prompt": "x" * 90, "truncate_prompt_tokens": -1}),  # 63 kept
                             ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 65}),
                             ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 60}],
                                                       "max_completion_tokens": 65})):
                async with c.post(url + path, json=js) as r:
                    got.append((r.status, (await r.json()).get("error", {}).get("message", "")))
        await ws[0].stop()
        return got, [call for call in rec.calls if call[0] == "dispatch"]

    got, dispatched = run(main())
    assert [g[0] for g in got] == [200, 200, 200, 200, 200, 400, 200, 200, 200, 400, 400, 400], got
    assert "max_tokens must be at least 1, got 0" in got[5][1]
    assert "truncate_prompt_tokens=65 cannot be greater than max_model_len = 64" in got[9][1]
    assert "greater than or equal to -1" in got[10][1]
    assert "max_completion_tokens=65 cannot be greater than max_model_len=64" in got[11][1]
    # (prompt tokens, the output cap the books and routers read)
    assert [(d[3], d[4]) for d in dispatched] == [(10, 16), (10, 16), (50, 14), (50, None), (120, 24), (64, 0),
                                                  (6, 2), (63, 1)]


def test_health_checks_bring_a_worker_back():
    async def main():
        ws = await fakes(1)
        async with proxy(ws) as (ctl, url, c):
            ws[0].mode = "error500"
            r = await c.post(url + "/v1/completions", json={"prompt": "x"})
            down = (r.status, ctl.registry.get("w0").healthy)
            ws[0].mode = "ok"
            for _ in range(100):
                if ctl.registry.get("w0").healthy:
                    break
                await asyncio.sleep(0.05)
            r = await c.post(url + "/v1/completions", json={"prompt": "x"})
            up = (r.status, ctl.registry.get("w0").healthy)
        await ws[0].stop()
        return down, up

    down, up = run(main())
    assert down[0] in (502, 503) and down[1] is False  # the request or the health probe found it first
    assert up == (200, True)


def test_gauges_and_config_come_from_scrapes():
    async def main():
        ws = await fakes(1)
        async with proxy(ws) as (ctl, url, c):
            ws[0].received.extend([{}] * 3)
            await asyncio.sleep(0.3)
            v = ctl.registry.fleet.instances[0]
            got = (v.num_running, v.kv_usage, v.block_size, v.num_gpu_blocks, v.config.max_model_len)
        await ws[0].stop()
        return got

    assert run(main()) == (3, 0.5, 4, 100, 64)


def test_prefix_hashes_reach_the_router_via_the_approximate_index():
    class PrefixRR(Recorder):
        prefix_index = "approximate"

    async def main():
        ws = await fakes()
        rec = PrefixRR()
        async with proxy(ws, rec) as (ctl, url, c):
            assert ctl.tokenizer.mode == "worker" and ctl.index_kind == "approximate"
            for _ in range(2):
                async with c.post(url + "/v1/completions", json={"prompt": "abcdefghij", "max_tokens": 1}) as r:
                    assert r.status == 200
        for w in ws:
            await w.stop()
        return rec

    rec = run(main())
    assert rec.seen_prefix == [{}, {"w0": 2}]  # 10 tokens = 2 full blocks of 4, placed on w0 by the first


def test_stop_finishes_in_flight_requests_and_refuses_new_ones():
    """What SIGTERM does: serve()'s signal handler sets the same event (the real signal: tests_vllm)."""
    async def main():
        ws = await fakes(1)
        ws[0].delay = 0.1
        async with proxy(ws) as (ctl, url, c):
            loop = asyncio.get_running_loop()
            task = loop.create_task(c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}))
            await asyncio.sleep(0.15)
            ctl.test_stop.set()
            r = await task
            body = (await r.read()).decode()
            try:
                async with aiohttp.ClientSession() as c2:
                    r2 = await c2.post(url + "/v1/completions", json={"prompt": "x"})
                    late = r2.status
            except aiohttp.ClientConnectionError:
                late = "refused"
        await ws[0].stop()
        return r.status, body, late

    status, body, late = run(main())
    assert status == 200 and body.endswith("data: [DONE]\n\n") and body.count('"i"') == 5
    assert late in ("refused", 503)


def test_a_local_chat_template_that_raises_routes_on_an_estimate():
    """`tokenizer.mode: local`: a real chat template raises on messages it does not take (Llama 3's: roles that do
    not alternate). That was a 500 and a traceback; vLLM judges such a request itself (its template, its 400), so
    the proxy routes it on an estimated length instead."""
    from live.tokens import PromptTokenizer

    class StrictTemplate:
        def apply_chat_template(self, messages, **kw):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

        def __call__(self, text, **kw):
            return {"input_ids": list(range(len(text.split())))}

    tok = PromptTokenizer("estimate", chars_per_token=4.0)
    tok.mode, tok._tok = "local", StrictTemplate()
    msgs = [{"role": "user", "content": "a" * 40}, {"role": "user", "content": "b" * 40}]
    info = asyncio.run(tok.tokenize({"messages": msgs}, chat=True))
    assert info.token_ids is None and info.num_tokens == 10 + 10 + 2 * 4  # as the estimate mode counts it
    plain = asyncio.run(tok.tokenize({"prompt": "three words here"}, chat=False))
    assert plain.token_ids == [0, 1, 2] and plain.num_tokens == 3


def test_a_local_tokenizer_counts_a_chat_as_vllm_renders_it(tmp_path):
    """`tokenizer.mode: local` with a real Hugging Face tokenizer: a chat is rendered by its template to text and
    tokenized without special tokens (transformers 5 returns a BatchEncoding from a tokenizing
    `apply_chat_template`, which was counted as its 2 keys); a list of parts is one string for a template that
    reads the content as one (tests_vllm checks the counts against a real worker's usage)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from live.tokens import PromptTokenizer, template_messages

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(["which worker serves the prefix cache blocks"],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "<|user|>", "<|assistant|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(tmp_path)
    tok = PromptTokenizer("local", str(tmp_path))
    msgs = [{"role": "user", "content": "which worker serves the prefix"}]
    info = asyncio.run(tok.tokenize({"messages": msgs}, chat=True))
    rendered = fast.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert info.num_tokens == len(fast(rendered, add_special_tokens=False)["input_ids"]) == 7
    # the body's own add_generation_prompt (read as vLLM reads a bool): no "<|assistant|>" at the end
    assert asyncio.run(tok.tokenize({"messages": msgs, "add_generation_prompt": "false"}, chat=True)).num_tokens == 6
    parts = [{"role": "user", "content": [{"type": "text", "text": "which worker"},
                                          {"type": "text", "text": "serves"}]}]
    joined = [{"role": "user", "content": "which worker\nserves"}]
    assert asyncio.run(tok.tokenize({"messages": parts}, chat=True)).num_tokens == 5
    assert template_messages(parts, fast.chat_template) == joined
    looping = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
    assert template_messages(parts, looping) == parts  # OpenAI's parts for a template that loops over them
    # a template that does not name the developer role: system messages, merged first, as vLLM hands them over
    dev = [{"role": "user", "content": "hi"}, {"role": "developer", "content": "Be brief."},
           {"role": "system", "content": [{"type": "text", "text": "Route"}, {"type": "text", "text": "well."}]}]
    assert template_messages(dev, fast.chat_template) == [{"role": "system", "content": "Be brief.\n\nRoute\nwell."},
                                                          {"role": "user", "content": "hi"}]
    first = [{"role": "developer", "content": "Be brief.", "tools": []}, {"role": "user", "content": "hi"}]
    assert template_messages(first, fast.chat_template) == [{"role": "system", "content": "Be brief."}, first[1]]
    assert template_messages(dev, fast.chat_template + "{# 'developer' #}")[1]["role"] == "developer"
    # rebuilt as vLLM rebuilds them: tool-call arguments as objects (not JSON text; not an object: {}), a tool's
    # text parts as one string, a string as one part for a template that loops over parts, other keys dropped
    tools = [{"role": "user", "content": "weather?", "x-trace": 1},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
                 {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "[1]"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sun"}]},
             {"role": "assistant", "content": "ok", "tool_calls": []}]
    assert template_messages(tools, looping) == [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": [], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": {}}}]},
        {"role": "tool", "content": "sun", "tool_call_id": "c1"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    # the body's tools reach the template (a template that renders them counts them)
    fast.chat_template = ("{% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
                          "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    fast.save_pretrained(tmp_path)
    tok = PromptTokenizer("local", str(tmp_path))
    n = [asyncio.run(tok.tokenize({"messages": msgs, **extra}, chat=True)) for extra in (
        {"tools": []}, {"tools": [{"type": "function", "function": {"name": "serves"}}] * 3})]
    assert n[1].token_ids is not None and n[1].num_tokens == n[0].num_tokens + 3  # "serves serves serves "


def test_unset_batch_limits_are_vllms_defaults_on_the_named_hardware():
    """A static worker's max_num_seqs / max_num_batched_tokens left out of the config are what `vllm serve`
    picks on `shadow.hardware` (2048 / 128 on a CPU host), clamped by the context read at first contact;
    the shadow twin takes them. Without a hardware name, InstanceConfig's placeholders stand in."""
    from live.shadow import base_engine

    async def main():
        ws = await fakes(4)
        workers = [{"id": "w0", "url": ws[0].url}, {"id": "w1", "url": ws[1].url, "max_num_seqs": 1},
                   {"id": "w2", "url": ws[2].url, "max_num_batched_tokens": 96, "max_num_seqs": 4},
                   {"id": "w3", "url": ws[3].url, "performance_mode": "throughput"}]
        got = {}
        for hw in ("CPU-2core-AVX512", "H100-SXM-80GB", None):
            async with proxy(ws, workers=workers, shadow={"hardware": hw, "model": "tiny-llama"}) as (ctl, url, c):
                got[hw] = {w.id: (w.config.max_num_batched_tokens, w.config.max_num_seqs) for w in ctl.registry}
                eng = base_engine(ctl.cfg, ctl.registry.get("w0").config)
                got[hw, "twin"] = (eng["max_num_batched_tokens"], eng["max_num_seqs"])
                # before first contact the context is the model's (tiny-llama's), not yet the worker's 64
                got[hw, "launch"] = ctl.launch_config({"max_num_seqs": 1})
                got[hw, "throughput"] = ctl.launch_config({"performance_mode": "throughput"}).max_num_seqs
        for w in ws:
            await w.stop()
        return got

    got = run(main())
    # one sequence of at most 64 tokens (the fake's max_model_len): vLLM caps the token default at 64
    assert got["CPU-2core-AVX512"] == {"w0": (2048, 128), "w1": (64, 1), "w2": (96, 4), "w3": (4096, 256)}
    assert got["CPU-2core-AVX512", "twin"] == (2048, 128)
    assert got["H100-SXM-80GB"] == {"w0": (8192, 1024), "w1": (64, 1), "w2": (96, 4), "w3": (16384, 2048)}
    assert got[None] == {"w0": (8192, 256), "w1": (8192, 1), "w2": (96, 4), "w3": (8192, 256)}  # placeholders
    launch = got["CPU-2core-AVX512", "launch"]
    assert (launch.max_num_batched_tokens, launch.max_num_seqs, launch.max_model_len) == (2048, 1, 0)
    assert got["CPU-2core-AVX512", "throughput"] == 256 and got["H100-SXM-80GB", "throughput"] == 2048


def test_a_worker_restarted_between_scrapes_is_read_again():
    """A worker restarted with another model and context (its process start time changed at a scrape):
    /v1/models is read again, the context and vLLM's clamps follow, and its prefix cache is forgotten."""
    async def main():
        ws = await fakes(1)
        router = {"name": "lmetric", "scrape_interval_s": 60, "prefix_index": "approximate"}
        async with proxy(ws, shadow={"hardware": "CPU-2core-AVX512"}, router=router) as (ctl, url, c):
            w = ctl.registry.get("w0")
            before = (w.models, w.config.max_model_len, w.config.max_num_batched_tokens)
            ctl.index.on_dispatch([1, 2, 3], "w0", 0.0)
            held = ctl.index.blocks_held("w0")
            await ctl.scrape(w)  # the same process: nothing read again
            same = (w.models, ctl.index.blocks_held("w0"))
            ws[0].started, ws[0].model, ws[0].max_model_len = ws[0].started + 30, "fake-2", 8
            await ctl.scrape(w)
            after = (w.models, w.config.max_model_len, w.config.max_num_batched_tokens, ctl.index.blocks_held("w0"))
        await ws[0].stop()
        return before, held, same, after

    before, held, same, after = run(main())
    assert before == (("fake",), 64, 2048) and held == 3 and same == (("fake",), 3)
    assert after == (("fake-2",), 8, 1024, 0)  # 128 sequences x 8 tokens caps the token default


def test_after_a_restart_the_new_model_is_served_and_a_failed_read_is_tried_again():
    """The routers' views and the proxy's served models follow the re-read (they kept the old ones: a request
    for the new model was a 404); an answer that is not vLLM's, or a 503, is tried again at the next scrape (a
    list stopped the scrape loop for good, a 503 left the old model forever); overlapping scrapes read once."""
    async def main():
        ws = await fakes(1)
        router = {"scrape_interval_s": 60}
        async with proxy(ws, shadow={"hardware": "CPU-2core-AVX512"}, router=router) as (ctl, url, c):
            w, f = ctl.registry.get("w0"), ws[0]
            f.started, f.model, f.max_model_len = f.started + 30, "fake-2", 8
            f.models_answer = (200, ["not", "an", "object"])
            ok = await ctl.scrape(w)
            broken = (ok, w.models, w.models_stale)
            f.models_answer = (503, {"error": "starting"})
            await ctl.scrape(w)
            unavailable = (w.models, w.models_stale)
            f.models_answer, reads = None, f.models_reads
            await asyncio.gather(ctl.scrape(w), ctl.scrape(w))  # the health loop's scrape beside the loop's
            read_once = f.models_reads - reads
            view = ctl.registry.fleet.instances[0].config.max_model_len
            async with c.post(url + "/v1/completions", json={"model": "fake-2", "prompt": "hi", "max_tokens": 2}) as r:
                served = r.status
        await f.stop()
        return broken, unavailable, read_once, view, served, w

    broken, unavailable, read_once, view, served, w = run(main())
    assert broken == (True, ("fake",), True) and unavailable == (("fake",), True)
    assert read_once == 1 and not w.models_stale and w.models == ("fake-2",)
    assert view == 8 and served == 200


def test_launch_arguments_are_read_as_vllms_command_line_reads_them():
    from live.controller import launch_int

    assert [launch_int(v) for v in (8192, 8192.0, "8192", "8k", "8K", "25.6k", " 2M ")] == [
        8192, 8192, 8192, 8000, 8192, 25600, 2 * 2**20]
    # unset, vLLM's "fit to memory" for max_model_len, or what vLLM would judge at start: not a count
    assert [launch_int(v) for v in (None, -1, "-1", "auto", 0, True, "2.5K", "lots", [8])] == [None] * 9


def test_vllms_tokenize_detokenize_and_version_pass_through_to_a_serving_worker():
    """Tools ask the server for token counts (/tokenize) and its version: the least busy serving worker
    answers, as it is (its 404 for a path it lacks too); an unreachable worker is marked down, with a 502."""
    async def main():
        ws = await fakes(2)
        async with proxy(ws) as (ctl, url, c):
            async with c.post(url + "/tokenize", json={"model": "fake", "prompt": "abc"}) as r:
                tok = (r.status, await r.json())
            async with c.get(url + "/version") as r:
                ver = (r.status, await r.json())
            async with c.post(url + "/detokenize", json={"tokens": [1, 2]}) as r:
                detok = r.status  # the fake lacks it: its own 404
            ctl.bookkeeping.load("w0").requests += 1  # w0 busier: w1 answers
            async with c.get(url + "/version") as r:
                other = (await r.json())["worker"]
            ctl.bookkeeping.load("w0").requests -= 1
            await ws[0].stop()
            async with c.get(url + "/version") as r:
                down = (r.status, (await r.json())["error"]["message"], ctl.registry.get("w0").healthy)
            page = await (await c.get(url + "/metrics")).text()
        await ws[1].stop()
        return tok, ver, detok, other, down, page

    tok, ver, detok, other, down, page = run(main())
    assert tok == (200, {"tokens": [97, 98, 99], "count": 3, "max_model_len": 64})
    assert ver == (200, {"version": "0.32.0", "worker": "w0"}) and detok == 404 and other == "w1"
    assert down[0] == 502 and "w0" in down[1] and down[2] is False
    assert "llmtwin_requests_total{" not in page  # not generation: on no request counter


def test_a_path_or_method_no_route_serves_answers_in_json_as_vllm_does():
    """vLLM's FastAPI app answers an unknown path {"detail": "Not Found"} and a wrong method {"detail": "Method
    Not Allowed"}, both JSON: a client that parses every error body as JSON got aiohttp's plain text here."""
    async def main():
        ws = await fakes(1)
        out = {}
        async with proxy(ws) as (ctl, url, c):
            for name, method, path in [("path", "GET", "/v1/nope"), ("method", "POST", "/health"),
                                       ("get_chat", "GET", "/v1/chat/completions")]:
                async with c.request(method, url + path) as r:
                    out[name] = (r.status, r.content_type, await r.json(), r.headers.get("Allow"))
            async with c.post(url + "/v1/chat/completions", json={"model": "gpt-9", "messages": []}) as r:
                out["handler"] = (r.status, await r.json())
        await ws[0].stop()
        return out

    out = run(main())
    assert out["path"] == (404, "application/json", {"detail": "Not Found"}, None)
    assert out["method"][:3] == (405, "application/json", {"detail": "Method Not Allowed"})
    assert "GET" in out["method"][3] and "POST" not in out["method"][3]
    assert out["get_chat"][:3] == (405, "application/json", {"detail": "Method Not Allowed"})
    assert out["handler"][0] == 404 and "gpt-9" in out["handler"][1]["error"]["message"]  # a handler's own 404


def test_a_fleet_of_several_models_routes_each_request_to_a_worker_that_serves_its_model():
    """Workers that serve different models (or a model and its LoRA adapters on some): a request goes only to a
    worker whose /v1/models lists its model. Routing ignored the model, so round-robin sent every other request to
    a worker that answered 404. /v1/models passes vLLM's own cards (root, parent, permission)."""
    async def main():
        ws = await fakes(3)
        ws[0].model = ws[1].model = "model-a"
        ws[2].model = "model-b"
        out = {}
        async with proxy(ws, None, router={"name": "round-robin"}) as (ctl, url, c):
            for model in ["model-a"] * 4 + ["model-b"] * 2 + [""] * 3:
                async with c.post(url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}) as r:
                    out.setdefault(model, []).append((r.status, (await r.json()).get("worker")))
            async with c.get(url + "/v1/models") as r:
                out["cards"] = (await r.json())["data"]
            async with c.post(url + "/tokenize", json={"model": "model-b", "prompt": "abc"}) as r:
                out["tokenize"] = r.status
            ctl.registry.set_state(ctl.registry.get("w2"), "draining")
            async with c.post(url + "/v1/completions", json={"model": "model-b", "prompt": "x"}) as r:
                out["b_gone"] = (r.status, (await r.json())["error"]["message"])
        for w in ws:
            await w.stop()
        return out

    out = run(main())
    assert out["model-a"] == [(200, "w0"), (200, "w1"), (200, "w0"), (200, "w1")]
    assert out["model-b"] == [(200, "w2")] * 2
    assert {w for _, w in out[""]} == {"w0", "w1", "w2"}  # an empty name: each worker serves its own model
    assert [(c["id"], c["root"]) for c in out["cards"]] == [("model-a", "/models/model-a"),
                                                            ("model-b", "/models/model-b")]
    assert out["tokenize"] == 200
    assert out["b_gone"][0] == 503 and "model model-b" in out["b_gone"][1] and "w0" not in out["b_gone"][1]


def test_vllms_own_per_request_5xx_reaches_the_client_and_keeps_the_worker():
    """vLLM answers 500 for a request's unclassified error, 501 for an unsupported feature, 503 for a retryable one,
    with its error body, and goes on serving. The proxy took each for a dead worker: marked down, retried, and the
    client got the proxy's 502; two such answers emptied the fleet. Now a 500 passes as it is, a 503 is tried once
    elsewhere (the worker kept), and only a dead engine's answer or a body that is not vLLM's marks it down."""
    async def main():
        ws = await fakes(2)
        out = {}
        async with proxy(ws, None, router={"name": "round-robin"},
                         health={"interval_s": 30, "backoff_initial_s": 30, "backoff_max_s": 30}) as (ctl, url, c):
            async def post(key, **extra):
                async with c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra}) as r:
                    if r.content_type == "text/event-stream":
                        out.setdefault(key, []).append((r.status, "stream"))
                        await r.read()
                        return
                    body = await r.json()
                    out.setdefault(key, []).append((r.status, body.get("worker") or body["error"]["message"]))
            ws[0].mode = "request500"
            await post("500")  # round-robin: w0
            await post("stream500", stream=True)  # w1
            await post("stream500", stream=True)  # w0: its 500, not a stream
            ws[0].mode, ws[1].mode = "busy503", "ok"
            await post("503")  # w1
            await post("503")  # w0's 503: tried on w1
            ws[1].mode = "busy503"
            await post("both503")  # both answer 503: the last one's answer
            out["healthy"] = [w.healthy for w in ctl.registry]
            ws[0].mode = ws[1].mode = "ok"
            ws[0].mode = "error500"  # a dead engine: down, and tried elsewhere
            await post("dead")
            await post("dead")
            out["dead_healthy"] = [w.healthy for w in ctl.registry]
            page = await (await c.get(url + "/metrics")).text()
        for w in ws:
            await w.stop()
        return out, page

    out, page = run(main())
    assert out["500"] == [(500, "w0 failed this request")]
    assert out["stream500"] == [(200, "stream"), (500, "w0 failed this request")]
    assert out["503"] == [(200, "w1"), (200, "w1")]
    assert len(out["both503"]) == 1 and out["both503"][0][0] == 503 and "failed this request" in out["both503"][0][1]
    assert out["healthy"] == [True, True]
    assert out["dead"] == [(200, "w1"), (200, "w1")] and out["dead_healthy"] == [False, True]
    assert 'llmtwin_requests_total{status="500",worker="w0"} 2.0' in page


def test_a_unary_request_whose_client_leaves_is_aborted_on_the_worker():
    """vLLM aborts a request whose client disconnects (`with_cancellation`). Through the proxy an abandoned unary
    request ran to its end on the worker, holding its batch slot and KV blocks: aiohttp does not cancel a handler
    by default. It is counted 499, not with the worker's status."""
    async def main():
        ws = await fakes(1)
        ws[0].delay = 0.6
        async with proxy(ws) as (ctl, url, c):
            try:
                async with c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                  timeout=aiohttp.ClientTimeout(total=0.2)) as r:
                    await r.read()
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(0.8)
            page = await (await c.get(url + "/metrics")).text()
            inflight = ctl.bookkeeping.in_flight()
        await ws[0].stop()
        return ws[0].abandoned, page, inflight

    abandoned, page, inflight = run(main())
    assert abandoned == 1
    assert 'llmtwin_requests_total{status="499",worker="w0"} 1.0' in page and 'status="200"' not in page
    assert inflight == 0


def test_the_clients_headers_reach_the_worker_and_the_workers_come_back():
    """vLLM takes its request id from X-Request-Id (the answer's id, its logs), and reads traceparent, X-Session-Id
    and others; with --enable-request-id-headers it echoes X-Request-Id. The proxy sent only its own id
    (live-N, repeated across restarts and replicas) and returned only Content-Type. Hop-by-hop headers and the
    proxy's own API key stay behind."""
    async def main():
        ws = await fakes(1)
        got = []
        async with proxy(ws, server={"api_key": "k"}) as (ctl, url, c):
            hdrs = {"X-Request-Id": "client-abc", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716"
                    "9203331-01", "Authorization": "Bearer k", "Connection": "keep-alive"}
            for stream in (False, True):
                async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": stream}, headers=hdrs) as r:
                    await r.read()
                    got.append((r.status, r.headers.get("X-Request-Id"), r.headers.get("Content-Type")))
        await ws[0].stop()
        return got, ws[0].headers

    got, seen = run(main())
    assert got == [(200, "client-abc", "application/json; charset=utf-8"), (200, "client-abc", "text/event-stream")]
    for h in seen:
        assert h["X-Request-Id"] == "client-abc" and h["traceparent"].startswith("00-0af7")
        assert "Authorization" not in h and h["Content-Type"] == "application/json"


def test_a_streams_output_tokens_are_vllms_usage_or_its_token_events():
    """The on_finish hooks, the shadow twin and the chunk planner read a stream's output tokens. The proxy counted
    the usage event as a token and one role chunk for chat whatever `n`: 9 for 8 tokens with include_usage, 27
    for 24 in a chat with n=3. The usage event's count is now taken as it is, and else each choice's role chunk
    is left out."""
    async def main():
        ws = await fakes(1)
        ws[0].mode = "vllm_sse"
        rec = Recorder()
        async with proxy(ws, rec) as (ctl, url, c):
            usage = {"stream_options": {"include_usage": True}}
            msgs = {"messages": [{"role": "user", "content": "x"}]}
            for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/completions", {"prompt": "x", **usage}),
                                ("/v1/completions", {"prompt": "x", "n": 3, **usage}),
                                ("/v1/chat/completions", {**msgs, "n": 3}),
                                ("/v1/chat/completions", {**msgs, "n": 3, **usage})):
                async with c.post(url + path, json={"stream": True, **extra}) as r:
                    await r.read()
        await ws[0].stop()
        return [call[3] for call in rec.calls if call[0] == "finish"]

    assert run(main()) == [4, 4, 12, 12, 12]


def test_a_stream_that_goes_on_producing_is_not_cut_by_the_request_timeout():
    """`server.request_timeout_s` bounded a whole stream, so a long answer still streaming (reasoning) was cut
    with a 504 event after 600 s, where vLLM sets no bound. A stream is now bounded by its silences."""
    async def main():
        ws = await fakes(1)
        ws[0].chunks, ws[0].delay = 8, 0.15  # 1.2 s in all, never silent for 0.5 s
        async with proxy(ws, server={"request_timeout_s": 0.5}) as (ctl, url, c):
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                body = (await r.read()).decode()
        await ws[0].stop()
        return body

    body = run(main())
    assert body.count('"worker": "w0"') == 8 and body.rstrip().endswith("data: [DONE]") and "error" not in body


def test_ping_and_load_answer_as_vllms_do():
    """vLLM serves /ping (GET and POST: its /health, for SageMaker) and /load ({"server_load": requests in
    flight}); the proxy answered 404, so a SageMaker or load-aware front end could not use it."""
    async def main():
        ws = await fakes(1)
        ws[0].delay = 0.3
        async with proxy(ws) as (ctl, url, c):
            pings = [(await c.get(url + "/ping")).status, (await c.post(url + "/ping")).status]
            pending = asyncio.ensure_future(c.post(url + "/v1/completions", json={"prompt": "x"}))
            await asyncio.sleep(0.1)
            busy = await (await c.get(url + "/load")).json()
            (await pending).release()
            idle = await (await c.get(url + "/load")).json()
        await ws[0].stop()
        return pings, busy, idle

    pings, busy, idle = run(main())
    assert pings == [200, 200] and busy == {"server_load": 1} and idle == {"server_load": 0}


def test_the_anthropic_messages_api_is_routed_as_vllm_serves_it():
    """vLLM serves Anthropic's Messages API (/v1/messages: Claude Code and Anthropic SDKs talk to it); the proxy
    answered 404. It is routed as a chat on an estimate of its system and text blocks, and the finish carries
    the answer's usage.output_tokens, or a stream's message_delta usage."""
    async def main():
        ws = await fakes(2)
        rec = Recorder()
        got = []
        body = {"model": "fake", "max_tokens": 64, "system": "s" * 40,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 80}]}]}
        async with proxy(ws, rec) as (ctl, url, c):
            for stream in (False, True):
                async with c.post(url + "/v1/messages", json={**body, "stream": stream}) as r:
                    got.append((r.status, r.content_type, (await r.read()).decode()))
            async with c.post(url + "/v1/messages", json={"model": "fake", "max_tokens": 4, "messages": []}) as r:
                got.append((r.status, r.content_type, (await r.json())["error"]["message"]))
        for w in ws:
            await w.stop()
        return got, rec.calls

    got, calls = run(main())
    assert got[0][0] == 200 and '"output_tokens": 5' in got[0][2]
    assert got[1][:2] == (200, "text/event-stream") and got[1][2].count("event: content_block_delta") == 6
    assert got[2][0] == 400 and "messages" in got[2][2]
    dispatched = [cl for cl in calls if cl[0] == "dispatch"]
    assert [(d[2], d[3], d[4]) for d in dispatched] == [("w0", 34, 64), ("w1", 34, 64)]  # (40 + 80) / 4 + 4
    assert [cl[3] for cl in calls if cl[0] == "finish"] == [5, 6]


def test_the_responses_api_is_routed_and_a_continuation_goes_to_the_worker_that_holds_its_response():
    """vLLM serves the Responses API (/v1/responses); the proxy answered 404. With its store on, a worker holds the
    responses it made: a request with `previous_response_id`, and GET /v1/responses/{id}, must reach that worker,
    which round-robin would not. The finish carries usage.output_tokens, of the answer or response.completed."""
    async def main():
        ws = await fakes(2)
        rec = Recorder()
        got = []
        async with proxy(ws, rec) as (ctl, url, c):
            body = {"model": "fake", "input": "x" * 40, "instructions": "y" * 40, "max_output_tokens": 20}
            async with c.post(url + "/v1/responses", json=body) as r:
                first = await r.json()
            for stream in (False, True, False):
                async with c.post(url + "/v1/responses", json={**body, "stream": stream,
                                                               "previous_response_id": first["id"]}) as r:
                    got.append((r.status, (await r.read()).decode()))
            async with c.get(url + f"/v1/responses/{first['id']}") as r:
                got.append((r.status, (await r.json())["worker"]))
        for w in ws:
            await w.stop()
        return first, got, rec.calls

    first, got, calls = run(main())
    assert first["worker"] == "w0"
    assert [g[0] for g in got] == [200] * 4 and '"worker": "w0"' in got[0][1] and "resp_w0_" in got[1][1]
    assert got[3] == (200, "w0")
    dispatched = [cl for cl in calls if cl[0] == "dispatch"]
    assert {d[2] for d in dispatched} == {"w0"} and dispatched[0][3:] == (24, 20)  # 81 chars / 4 + 4 an item
    assert [cl[3] for cl in calls if cl[0] == "finish"] == [7, 7, 7, 7]


async def raw_post(url: str, head: bytes, path: bytes = b"/v1/completions") -> str:
    """A request written byte by byte (a header no client library sends as it is)."""
    body = b'{"prompt": "x", "max_tokens": 2}'
    port = int(url.rsplit(":", 1)[1])
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + head + b"Connection: close\r\n\r\n" + body)
    await w.drain()
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    return data.decode(errors="replace")


def test_a_key_with_a_byte_that_is_not_utf8_is_refused_not_a_500():
    """Found in review: aiohttp keeps a non-UTF-8 header byte as a surrogate, and hashing the token raised, a 500
    with a traceback and no `auth` rejection; vLLM (Starlette reads headers as latin-1) answers 401."""
    async def main():
        ws = await fakes(1)
        async with proxy(ws, server={"api_key": "caf\u00e9"}) as (ctl, url, c):
            latin1 = await raw_post(url, b"Authorization: Bearer caf\xe9\r\n")
            utf8 = await raw_post(url, "Authorization: Bearer caf\u00e9\r\n".encode())
            junk = await raw_post(url, b"Authorization: Bearer \xff\xfe\r\n")
            page = await (await c.get(url + "/metrics")).text()
        await ws[0].stop()
        return latin1, utf8, junk, page

    latin1, utf8, junk, page = run(main())
    # as vLLM: Starlette decodes the header as latin-1 and vLLM hashes it as UTF-8, so the key's latin-1 bytes match
    assert latin1.startswith("HTTP/1.1 200") and utf8.startswith("HTTP/1.1 401") and junk.startswith("HTTP/1.1 401")
    assert 'status="500"' not in page and 'llmtwin_rejected_total{reason="auth"} 2.0' in page


def test_a_compressed_body_is_passed_on_plain_with_no_encoding_claimed():
    """Found in review: aiohttp decompresses a gzip request body, but Content-Encoding: gzip went on with the plain
    bytes, which a server that honours it refused (a 500 that marked workers down). Upstream answers are asked
    uncompressed, so that the usage and SSE events are read and relayed as they are."""
    import gzip

    async def main():
        ws = await fakes(1)
        async with proxy(ws) as (ctl, url, c):
            data = gzip.compress(json.dumps({"prompt": "x", "max_tokens": 2}).encode())
            async with c.post(url + "/v1/completions", data=data, headers={"Content-Type": "application/json",
                                                                           "Content-Encoding": "gzip"}) as r:
                status = r.status
        await ws[0].stop()
        return status, ws[0].headers

    status, seen = run(main())
    assert status == 200 and "Content-Encoding" not in seen[0] and seen[0]["Accept-Encoding"] == "identity"


def test_tokenize_for_a_model_no_worker_serves_is_vllms_404_and_not_remembered():
    """Found in review: /tokenize naming an unknown model answered 503 "no worker is registered" (vLLM: 404), and
    every name a client sent stayed in the registry's per-model cache."""
    async def main():
        ws = await fakes(1)
        async with proxy(ws) as (ctl, url, c):
            for i in range(3):
                async with c.post(url + "/tokenize", json={"model": f"nope{i}", "prompt": "x"}) as r:
                    got = (r.status, (await r.json())["error"]["message"])
            async with c.post(url + "/tokenize", json={"model": "fake", "prompt": "x"}) as r:
                ok = r.status
            cached = set(ctl.registry._off)
        await ws[0].stop()
        return got, ok, cached

    got, ok, cached = run(main())
    assert got == (404, "The model `nope2` does not exist.") and ok == 200 and cached <= {"fake"}


def test_a_stream_waiting_for_a_pooled_connection_is_bounded_by_the_request_timeout():
    """Found in review: a stream's timeout bounds its silences, and so had no bound on the wait for a free
    upstream connection; it waited past request_timeout_s where a unary request answered 504."""
    async def main():
        ws = await fakes(1)
        ws[0].chunks, ws[0].delay = 6, 0.4  # 2.4 s on the one connection
        async with proxy(ws, server={"request_timeout_s": 1, "max_connections_per_worker": 1},
                         health={"interval_s": 30}) as (ctl, url, c):
            first = asyncio.ensure_future(c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}))
            await asyncio.sleep(0.2)
            t0 = asyncio.get_running_loop().time()
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                second = (r.status, asyncio.get_running_loop().time() - t0)
            (await first).release()
            healthy = ctl.registry.get("w0").healthy
        await ws[0].stop()
        return second, healthy

    (status, waited), healthy = run(main())
    assert status == 504 and healthy  # a wait, not the worker's failure
    assert waited < 2.0  # the bound, not the first stream's 2.4 s (a behaviour check, with a wide margin)


def test_a_responses_streams_first_token_is_its_first_output_event_not_response_created():
    """vLLM's Responses API writes response.created and response.in_progress before the engine's first output:
    the proxy booked its first token there, so TTFT signals and the books read it before prefill had run."""
    async def main():
        ws = await fakes(1)
        ws[0].delay = 0.3
        rec = Recorder()
        async with proxy(ws, rec) as (ctl, url, c):
            t0 = time.monotonic()
            async with c.post(url + "/v1/responses", json={"input": "x", "stream": True}) as r:
                await r.read()
        await ws[0].stop()
        return list(rec.first_at.values()), t0

    (first,), t0 = run(main())
    assert first - t0 >= 0.3  # at response.output_text.delta, written 0.3 s after response.created
