"""The OpenAI-compatible proxy (aiohttp server and pooled aiohttp client) in front of the workers.

Per request: parse and check the body, build the `RequestView` (token count and prefix hashes from the
tokenizer, the client's `max_tokens`), ask the router, update the bookkeeping at dispatch, first chunk
and finish, and pass the worker's answer through (streamed chunks as they come). A failure before the
client got a byte is retried once on another worker; a failure mid-stream ends the stream with an SSE error
event (vLLM's own form: `data: {"error": ...}` then `data: [DONE]`). The failing worker is marked down.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import re
import reprlib
import secrets
import signal
import time
import traceback
from collections import OrderedDict
from dataclasses import replace
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from twin.policy.host import RouterError, router_cause
from twin.policy.views import Reject, RequestView
from twin.workload.text_prefix import text_block_ids

from live.controller import Controller
from live.hashing import chain_hashes
from live.tokens import BadPrompt, body_field, fit_context

log = logging.getLogger("llmtwin.live")
CTL: web.AppKey[Controller] = web.AppKey("controller", Controller)
PROXY: web.AppKey["Proxy"] = web.AppKey("proxy")
_UPSTREAM_FAILURES = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionResetError)
_CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError)
_READ_TIMEOUT = aiohttp.SocketTimeoutError  # a stream's silence over `sock_read`: a timeout (504), not a failure


def error(status: int, message: str, kind: str | None = None) -> web.Response:
    """OpenAI's error body: {"error": {"message", "type", "code"}}."""
    kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                    413: "RequestTooLargeError", 500: "InternalServerError", 502: "BadGatewayError",
                    503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}.get(status, "Error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})
    return web.Response(status=status, text=body, content_type="application/json")


def unauthorized() -> web.Response:
    """vLLM's 401, as its AuthenticationMiddleware writes it (it guards /v1 only; so does the proxy, and its own
    /workers and /shadow)."""
    return web.json_response({"error": "Unauthorized"}, status=401)


def sse_error(message: str, code: int = 502) -> bytes:
    return (b"data: " + json.dumps({"error": {"message": message, "type": "BadGatewayError", "param": None,
                                              "code": code}}).encode() + b"\n\ndata: [DONE]\n\n")


# header limits far above aiohttp's defaults (8 KiB a line, 128 headers), which refused with a 400 and a logged
# traceback what vLLM serves (a 9,000-byte X-Session-Id, 300 headers): vLLM's uvicorn parses with httptools, which
# has no such limits; these bounds are the controller's own
HEADER_LIMITS = {"max_line_size": 4 * 1024 * 1024, "max_field_size": 4 * 1024 * 1024, "max_headers": 32768}
# headers a proxy does not pass on (hop-by-hop, or its own to set); the rest reach the worker as the client sent
# them, as they would reach vLLM directly: X-Request-Id (vLLM's request id), traceparent, X-Session-Id and the like
# (the body is sent as aiohttp read it, decompressed: its content-encoding and digests no longer hold)
_NOT_FORWARDED = frozenset(("host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer",
                            "upgrade", "proxy-authorization", "proxy-authenticate", "accept-encoding",
                            "content-encoding", "content-md5", "digest"))
_NOT_RETURNED = frozenset(("content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding",
                           "date", "server"))
_COUNTED: contextvars.ContextVar[bool] = contextvars.ContextVar("llmtwin_counted", default=False)  # per handler
COMPLETIONS_MAX_TOKENS = 16  # vllm/entrypoints/openai/completion/protocol.py, CompletionRequest.max_tokens
MESSAGES = "/v1/messages"  # vLLM's Anthropic Messages API
RESPONSES = "/v1/responses"  # vLLM's OpenAI Responses API
_RESPONSE_ID = re.compile(rb'"id":"(resp_[^"]+)"')
_OUTPUT_EVENT = b'"type":"response.output'  # the Responses API's output events (items, text deltas)
CANCELLED = "cancelled"  # `llmtwin_requests_total`'s status for a request cut when the shutdown's grace ran out


class Fields(NamedTuple):
    model: str | None
    stream: bool
    max_tokens: int | None
    priority: int
    echo: bool
    truncate: int | None  # truncate_prompt_tokens
    side: str | None  # truncation_side


def read_fields(body: dict, chat: bool) -> Fields:
    """The fields the proxy acts on, read as vLLM reads them (`body_field`): else the proxy would refuse what vLLM
    serves (max_tokens 10.0) or misread it (stream "false"). Chat's max_completion_tokens wins over max_tokens."""
    max_tokens = body_field(body, "max_tokens", "int")
    if chat:
        mct = body_field(body, "max_completion_tokens", "int")
        max_tokens = mct if mct is not None else max_tokens
    elif max_tokens is None:  # vLLM's completions default, for a missing or null max_tokens (normalize_null_max_tokens)
        max_tokens = COMPLETIONS_MAX_TOKENS
    truncate = body_field(body, "truncate_prompt_tokens", "int")
    if truncate is not None and truncate < -1:  # vLLM's Field(ge=-1)
        raise BadPrompt(f"'truncate_prompt_tokens': Input should be greater than or equal to -1 (got {truncate})")
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise BadPrompt(f"'truncation_side': Input should be 'left' or 'right' (got {reprlib.repr(side)})")
    return Fields(body_field(body, "model", "model"), bool(body_field(body, "stream", "bool")), max_tokens,
                  body_field(body, "priority", "int") or 0, bool(body_field(body, "echo", "bool")), truncate, side)


class _Retryable(Exception):
    """The attempt failed before the client received anything: another worker may take it. `answer`: the
    worker's own answer (status, body, content type), which the client gets if no other worker does better;
    then the worker is not at fault."""

    def __init__(self, message: str, answer: tuple[int, bytes, str] | None = None) -> None:
        super().__init__(message)
        self.answer = answer


# vLLM's message for a dead engine (vllm/v1/engine/exceptions.py, EngineDeadError); its server then terminates
ENGINE_DEAD = "EngineCore encountered an issue"


def upstream_5xx(w: Any, status: int, data: bytes, ctype: str) -> tuple[int, bytes, str] | None:
    """A worker's 5xx: None passes vLLM's own per-request error to the client as it is (vLLM answers 500 for an
    unclassified error, 501 for an unsupported feature: `create_error_response`); else `_Retryable`. A 503 (vLLM's
    RetryableRequestError) is tried once elsewhere, the worker kept; anything that is not vLLM's error body (a
    page from something in between), or a dead engine, marks the worker down and is tried elsewhere."""
    text = data[:200].decode(errors="replace")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        body = None
    vllms = isinstance(body, dict) and (isinstance(body.get("error"), dict) or body.get("object") == "error")
    if not vllms or ENGINE_DEAD in text:
        raise _Retryable(f"{w.id} answered {status}: {text}")
    if status == 503:
        raise _Retryable(f"{w.id} answered {status}: {text}", (status, data, ctype))
    return None


class Proxy:
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        s = ctl.cfg.server
        self.timeout = aiohttp.ClientTimeout(total=s.request_timeout_s, sock_connect=s.connect_timeout_s)
        keys = ctl.api_key  # hashed as vLLM hashes its --api-key values
        self._key_hashes = None if keys is None else [hashlib.sha256(k.encode()).digest() for k in keys]
        # a stream is bounded by its silences, not its length: vLLM sets no bound, and a long answer (reasoning)
        # streams past any total
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout_s,
                                                    sock_read=s.request_timeout_s)
        # per-request work kept off the hot path (benchmarks/bench_proxy.py): parsed upstream URLs, the
        # served-model set (rebuilt when the registry changes), and the request counter's label children
        self._urls: dict[tuple[str, str], URL] = {}
        self.owners: OrderedDict[str, str] = OrderedDict()  # Responses API: response id -> its worker
        self._served: tuple[int, set[str]] = (-1, set())
        self._counters: dict[tuple[str, str], Any] = {}

    def upstream(self, w: Any, path: str) -> URL:
        key = (w.url, path)
        u = self._urls.get(key)
        if u is None:
            u = self._urls[key] = URL(w.url + path)
        return u

    def unserved(self, model: str | None) -> bool:
        """A model no worker serves (an empty name is any worker's own, as vLLM serves its model to it)."""
        served = self.served_models()
        return bool(model and served and model not in served)

    def served_models(self) -> set[str]:
        version = self.ctl.registry.version
        if self._served[0] != version:
            self._served = (version, self.ctl.served_models())
        return self._served[1]

    def count(self, worker_id: str, status: str) -> None:
        """`llmtwin_requests_total{worker, status}` += 1, without prometheus-client's label lookup each time."""
        c = self._counters.get((worker_id, status))
        if c is None:
            c = self._counters[(worker_id, status)] = self.ctl.metrics.requests.labels(worker_id, status)
        c.inc()
        _COUNTED.set(True)

    def forwarded(self, request: web.Request) -> CIMultiDict:
        """The client's headers for the worker: all but hop-by-hop ones, and its Authorization when it was the
        proxy's own key (without one, the proxy is transparent and a worker's --api-key sees the client's)."""
        drop = _NOT_FORWARDED if self.ctl.api_key is None else _NOT_FORWARDED | {"authorization"}
        out = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in drop)
        out["Accept-Encoding"] = "identity"  # the answer is relayed as it comes, and its usage read
        return out

    def to_worker(self, fwd: CIMultiDict, w: Any) -> CIMultiDict:
        """`fwd` for worker `w`: where the proxy checks keys itself (`server.api_key`), the client's key was the
        proxy's, and the worker gets its own (`api_key`: the launch's --api-key or VLLM_API_KEY, a static worker's
        config), as vLLM asks it on /v1; without a proxy key the client's header passes as it came."""
        if self.ctl.api_key is None or not w.api_key:
            return fwd
        out = fwd.copy()
        out["Authorization"] = f"Bearer {w.api_key}"
        return out

    def _timed_out(self, w: Any, out: web.StreamResponse | None = None) -> web.StreamResponse:
        """A worker that did not answer within `request_timeout_s` (a stream: sent nothing before its first chunk;
        once the stream is relayed, `out` is what the client has): a 504."""
        if out is not None:
            return out
        self.ctl.metrics.upstream_errors.labels(w.id, "timeout").inc()
        self.count(w.id, "504")
        return error(504, f"worker {w.id} did not answer within {self.ctl.cfg.server.request_timeout_s:g} s")

    def own(self, response_id: str, worker_id: str) -> None:
        """Which worker made a response (the latest 65,536): it alone holds it for previous_response_id, GET and
        cancel."""
        self.owners[response_id] = worker_id
        self.owners.move_to_end(response_id)
        if len(self.owners) > 65536:
            self.owners.popitem(last=False)

    def cut_status(self) -> str:
        """Why a handler was cancelled: its client left ("499"; aiohttp cancels the handler, `handler_cancellation`,
        which closes the upstream request so that vLLM aborts it, as its own server does), or the shutdown's grace
        ran out ("cancelled")."""
        return "499" if self.ctl.accepting else CANCELLED

    def reject(self, reason: str) -> None:
        """`llmtwin_rejected_total{reason}` += 1: the controller answered the request itself."""
        self.ctl.metrics.rejected.labels(reason).inc()
        _COUNTED.set(True)

    # -- routes --------------------------------------------------------------------------------------
    def authorized(self, request: web.Request) -> bool:
        """vLLM's check (`vllm/entrypoints/serve/middleware/authenticate.py`): a Bearer token (the scheme in any
        case) equal to one of the keys, compared in constant time."""
        if self._key_hashes is None:
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        # as Starlette reads a header (latin-1) and vLLM hashes it (utf-8); aiohttp keeps a non-UTF-8 byte as a
        # surrogate, which a plain encode() refused with a 500
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape").decode("latin-1").encode()).digest()
        ok = False
        for h in self._key_hashes:
            ok |= secrets.compare_digest(digest, h)
        return ok

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """vLLM's OpenAI Responses API, routed as a chat; a response that continues another
        (`previous_response_id`) goes to the worker that made it, which holds it (VLLM_ENABLE_RESPONSES_API_STORE)."""
        return await self._generate(request, chat=True, path=RESPONSES)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """vLLM's Anthropic Messages API (`vllm/entrypoints/anthropic/`), routed as a chat."""
        return await self._generate(request, chat=True, path=MESSAGES)

    async def models(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return unauthorized()
        ctl = self.ctl
        cards: dict[str, dict] = {}
        for w in ctl.registry:
            if not w.routable:
                continue
            for card in w.cards:  # vLLM's own (root: the model's path, parent, permission, created)
                cards.setdefault(card["id"], card)
            for m in w.models:
                cards.setdefault(m, {"id": m, "object": "model", "owned_by": "vllm", "root": m,
                                     "max_model_len": w.config.max_model_len or None})
        if not cards:
            return error(503, self._none_serving())
        return web.json_response({"object": "list", "data": list(cards.values())})

    async def passthrough(self, request: web.Request) -> web.Response:
        """vLLM's endpoints beside generation (`/tokenize`, `/detokenize`, `/version`), answered by the least
        busy serving worker: a tool that asks the server for token counts gets the served model's. Not
        generation, so on no request counter. The worker's answer passes as it is (a 5xx too: the body is the
        client's, and the health probe judges the worker); a worker that cannot be reached is marked down. No API
        key is asked outside /v1, as vLLM asks none there. A stored response (GET, cancel) goes to its worker."""
        ctl = self.ctl
        if request.path.startswith("/v1") and not self.authorized(request):
            return unauthorized()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error(413, f"request body over the limit of {ctl.cfg.server.max_body_bytes} bytes")
        try:  # /tokenize names a model: a worker that serves it answers
            model = json.loads(raw).get("model") if raw else None
        except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
            model = None  # the worker answers what it makes of the body
        if not isinstance(model, str):
            model = None
        if self.unserved(model):  # vLLM's answer for a model it does not serve
            return error(404, f"The model `{model}` does not exist.")
        routable = ctl.registry.routable(model)
        if not routable:
            return error(503, self._none_serving(model))
        owner = ctl.registry.get(self.owners.get(request.match_info.get("response_id", ""), ""))
        w = owner if owner is not None and owner.routable else min(
            routable, key=lambda w: ctl.bookkeeping.load(w.id).requests)
        try:
            async with ctl.session.request(request.method, self.upstream(w, request.path), data=raw or None,
                                           headers=self.to_worker(self.forwarded(request), w),
                                           timeout=self.timeout) as r:
                data = await r.read()
                return web.Response(body=data, status=r.status, headers=returned(r.headers))
        except asyncio.TimeoutError:
            return error(504, f"worker {w.id} did not answer {request.path} within "
                              f"{ctl.cfg.server.request_timeout_s:g} s")
        except (aiohttp.ClientError, OSError) as e:
            ctl.fail(w, f"{request.path}: {type(e).__name__}: {e}")
            return error(502, f"worker {w.id} failed on {request.path}: {type(e).__name__}: {e}")

    async def health(self, request: web.Request) -> web.Response:
        ctl = self.ctl
        n = len(ctl.registry.routable())
        status = 200 if n and ctl.accepting else 503
        return web.json_response({"status": "ok" if status == 200 else "unavailable", "serving": n,
                                  "workers": {w.id: w.status for w in ctl.registry}}, status=status)

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's `/load` ({"server_load": the requests in flight}): here the fleet's, through this proxy."""
        return web.json_response({"server_load": self.active})

    async def metrics(self, request: web.Request) -> web.Response:
        ctl = self.ctl
        m = ctl.metrics
        now = time.monotonic()
        states: dict[str, int] = {"starting": 0, "serving": 0, "down": 0, "draining": 0, "stopped": 0}
        for w in ctl.registry:
            states[w.status] = states.get(w.status, 0) + 1
            m.inflight.labels(w.id).set(ctl.bookkeeping.load(w.id).requests)
            if w.last_scrape:
                m.scrape_age.labels(w.id).set(now - w.last_scrape)
        for s, n in states.items():
            m.workers.labels(s).set(n)
        return web.Response(body=m.render(), headers={"Content-Type": m.content_type})

    async def workers(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return unauthorized()
        return web.json_response(self.ctl.status())

    async def shadow(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return unauthorized()
        return web.json_response(self.ctl.shadow.status())

    # -- generation ----------------------------------------------------------------------------------
    def _none_serving(self, model: str | None = None) -> str:
        off = self.ctl.registry.not_serving(model)
        ws = [w for w in self.ctl.registry if w.id not in off]
        if not ws:
            return "no worker is registered"
        why = "; ".join(f"{w.id}: {w.status}" + (f" ({w.last_error})" if w.last_error else "") for w in ws)
        return f"no worker is serving{f' model {model}' if off else ''} ({why})"

    async def _generate(self, request: web.Request, chat: bool, path: str | None = None) -> web.StreamResponse:
        """A request, on exactly one counter however it ends: one that leaves without being counted (cut by the
        shutdown while it was tokenised or routed, its client gone while its body was read, a bug) is counted
        here under worker "-"."""
        self.active += 1
        self.idle.clear()
        _COUNTED.set(False)
        try:
            resp = await self._generate_inner(request, chat, path)
        except asyncio.CancelledError:
            if not _COUNTED.get():
                self.count("-", self.cut_status())
            raise
        except _CLIENT_GONE + (aiohttp.ClientPayloadError, asyncio.IncompleteReadError):
            if not _COUNTED.get():
                self.count("-", "499")
            raise
        except Exception:
            if not _COUNTED.get():
                self.count("-", "500")  # aiohttp answers 500 and logs the traceback
            raise
        finally:
            self.active -= 1
            if self.active == 0:
                self.idle.set()
        return resp

    async def _generate_inner(self, request: web.Request, chat: bool, path: str | None) -> web.StreamResponse:
        ctl = self.ctl
        m = ctl.metrics
        if not self.authorized(request):
            self.reject("auth")
            return unauthorized()
        if not ctl.accepting:
            self.reject("shutting_down")
            return error(503, "the controller is shutting down")
        media = request.headers.get("Content-Type", "").lower().split(";", 1)[0]
        if media != "application/json":  # vLLM's check (validate_json_request), else it served what vLLM refuses
            self.reject("bad_request")
            return error(400, f"Unsupported Media Type: Only 'application/json' is allowed (got {media!r})")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.reject("too_large")
            return error(413, f"request body over the limit of {ctl.cfg.server.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            self.reject("bad_json")
            return error(400, f"request body is not valid JSON: {e}")
        except RecursionError:  # vLLM: 400, "There was an error parsing the body"
            self.reject("bad_json")
            return error(400, "request body is not valid JSON: nested too deeply")
        if not isinstance(body, dict):
            self.reject("bad_json")
            return error(400, "request body must be a JSON object")
        try:  # a list or object as 'model' was a 500 (unhashable), 'stream': "false" streamed
            f = read_fields(body, chat)
        except BadPrompt as e:
            self.reject("bad_request")
            return error(400, str(e))
        if path == RESPONSES:  # the Responses API names its cap max_output_tokens
            try:
                f = f._replace(max_tokens=body_field(body, "max_output_tokens", "int"))
            except BadPrompt as e:
                self.reject("bad_request")
                return error(400, str(e))
        model, max_tokens = f.model, f.max_tokens
        if self.unserved(model):
            self.reject("unknown_model")
            return error(404, f"The model `{model}` does not exist (served: "
                              f"{', '.join(sorted(self.served_models()))}).")
        if max_tokens is not None and max_tokens < (0 if f.echo and not chat else 1):  # echo: the prompt alone
            self.reject("bad_request")
            return error(400, f"max_tokens must be at least 1, got {max_tokens}.")
        t0 = time.perf_counter()
        routable = ctl.registry.routable(model)
        if not routable:
            self.reject("none_serving")
            return error(503, self._none_serving(model))
        try:
            if path == MESSAGES:  # Anthropic's blocks and `system`: estimated, not the chat template's tokens
                info = ctl.tokenizer.estimated_messages(body)
            elif path == RESPONSES:
                info = ctl.tokenizer.estimated_input(body)
            else:
                info = await ctl.tokenizer.tokenize(body, chat, ctl.session, routable[0].url, model)
        except BadPrompt as e:
            self.reject("bad_request")
            return error(400, str(e))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ctl.fail(routable[0], f"/tokenize: {e}")
            m.upstream_errors.labels(routable[0].id, "tokenize").inc()
            self.count(routable[0].id, "502")
            return error(502, f"worker {routable[0].id} failed to tokenize the prompt: {e}")
        mml = info.max_model_len or min((w.config.max_model_len for w in routable if w.config.max_model_len),
                                        default=0)
        param = "max_output_tokens" if path == RESPONSES else \
            "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        try:
            info, max_tokens = fit_context(info, max_tokens, mml, f.truncate, f.side,
                                           0 if f.echo and not chat else 1, param)
        except BadPrompt as e:
            self.reject("too_long")
            return error(400, str(e))
        bs = ctl.registry.block_size()
        # token ids where known; else the text's chained character blocks, as the simulator derives them from a
        # trace's texts (twin.workload.text_prefix), so text-matching routers (cache-aware) work in estimate mode
        prefix = (chain_hashes(info.token_ids, bs) if info.token_ids is not None
                  else text_block_ids(info.text, bs, ctl.tokenizer.chars_per_token))
        now = time.monotonic()
        session = request.headers.get("X-Session-Id") or (body.get("user") if isinstance(body.get("user"), str)
                                                          else None)
        req = RequestView(ctl.next_id(), now, info.num_tokens, max_tokens, prefix, bs, session, f.priority, None,
                          info.text)
        if ctl.host.predictor is not None:  # the configured length predictor, as the simulator asks it
            req = replace(req, predicted_output_tokens=ctl.host.predict(req))
        stream = f.stream
        path = path or ("/v1/chat/completions" if chat else "/v1/completions")
        tried: list[str] = []
        last_error = ""
        answer: tuple[int, bytes, str] | None = None
        fwd = self.forwarded(request)
        prev = body.get("previous_response_id") if path == RESPONSES else None
        pin = self.owners.get(prev) if isinstance(prev, str) else None
        for attempt in (0, 1):
            # a look-ahead router decides on its own thread: the decision and its dispatch one at a time
            async with ctl.routing():
                w = await self._decide(req, model, tried, attempt, t0, last_error, pin)
                if isinstance(w, web.Response):
                    return w
                ctl.dispatched(req, w.id, time.monotonic())
                ctl.streamed(req, stream)
            try:
                if stream:
                    return await self._stream(request, req, w, path, raw, self.to_worker(fwd, w))
                return await self._unary(req, w, path, raw, self.to_worker(fwd, w))
            except _Retryable as e:
                last_error, answer = str(e), e.answer
                if answer is None:
                    ctl.fail(w, last_error)
                m.upstream_errors.labels(w.id, "before_first_byte").inc()
                tried.append(w.id)
                if not ctl.cfg.server.retry_before_first_byte or (
                        answer is not None and not ctl.registry.fleet_view(time.monotonic(), tried, model).instances):
                    break
                if attempt == 0:
                    log.warning("request %s: worker %s failed before the first byte (%s); retrying elsewhere",
                                req.id, w.id, last_error)
        if answer is not None:  # the last worker's own answer (vLLM's 503), not the proxy's 502
            self.count(tried[-1], str(answer[0]))
            return web.Response(body=answer[1], status=answer[0], headers={"Content-Type": answer[2]})
        self.count(tried[-1] if tried else "-", "502")
        return error(502, f"upstream failed before the first byte on {', '.join(tried)}: {last_error}")

    async def _decide(self, req: RequestView, model: str | None, tried: list[str], attempt: int, t0: float,
                      last_error: str, pin: str | None = None) -> Any:
        """The serving worker the router chose for `req` among those serving `model` (not one of `tried`), or the
        error response to send.

        Off the loop (`Controller.choose`), a worker the router was offered can stop serving while it decides (a
        drain, a failed health check): the router decides again on the fleet as it is then, up to twice more."""
        ctl = self.ctl
        m = ctl.metrics
        if pin is not None and pin not in tried:  # the worker that holds the previous response
            w = ctl.registry.get(pin)
            if w is not None and w.routable:
                return w
        for redo in range(3):
            fleet = ctl.registry.fleet_view(time.monotonic(), tried, model)
            if not fleet.instances:
                if attempt:
                    self.count(tried[-1], "502")
                    return error(502, f"worker {tried[0]} failed ({last_error}) and no other worker is serving")
                self.reject("none_serving")
                return error(503, self._none_serving(model))
            if attempt and not redo:
                m.retries.inc()
            offered = {v.id for v in fleet.instances} if ctl.decides_off_loop else ()
            try:  # the host's error rule (twin.policy.host): raise -> answered 500, reject -> answered 503
                target = await ctl.choose(req, fleet)
            except RouterError as e:
                cause = router_cause(e)
                log.error("router %s raised on request %s:\n%s", ctl.router_name, req.id,
                          "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)))
                self.reject("router_error")
                return error(500, f"router {ctl.router_name!r} raised {type(cause).__name__}: {cause}")
            if isinstance(target, Reject) and target.router_error:  # on_error: reject turned a raise into this
                self.reject("router_error")
                return error(503, target.reason)
            if attempt == 0 and not redo:
                m.decision_latency.observe(time.perf_counter() - t0)
            if isinstance(target, Reject):
                self.reject("router_reject")
                return error(503, f"rejected by router {ctl.router_name!r}: {target.reason}")
            w = ctl.registry.get(target) if isinstance(target, str) else None
            if w is not None and w.routable and target not in tried and target not in ctl.registry.not_serving(model):
                return w
            if not isinstance(target, str) or target not in offered:
                self.reject("router_error")
                return error(500, f"router {ctl.router_name!r} chose {target!r}, which is not a serving worker"
                                  f"{f' of model {model}' if model else ''}")
            log.info("request %s: worker %s stopped serving while router %s decided; deciding again", req.id,
                     target, ctl.router_name)
        self.reject("none_serving")
        return error(503, f"the workers router {ctl.router_name!r} chose stopped serving while it decided")

    async def _unary(self, req: RequestView, w: Any, path: str, raw: bytes, fwd: CIMultiDict) -> web.Response:
        ctl = self.ctl
        out_tokens = 0
        status = 502
        try:
            async with ctl.session.post(self.upstream(w, path), data=raw, timeout=self.timeout,
                                        headers=fwd) as r:
                data = await r.read()
                status = r.status
                if status >= 500:
                    upstream_5xx(w, status, data, r.headers.get("Content-Type", "application/json"))
                ctl.first_token(req, w.id, time.monotonic())
                if status == 200:  # its output tokens (a few microseconds): the scalers' recent-window signals
                    try:  # count a completion only with its tokens; on_finish hooks and the shadow twin take them
                        answer = json.loads(data)
                        usage = answer.get("usage") or {}  # OpenAI's, or Anthropic's and Responses' output_tokens
                        out_tokens = int(usage.get("completion_tokens", usage.get("output_tokens", 0)))
                        if path == RESPONSES and isinstance(answer.get("id"), str):
                            self.own(answer["id"], w.id)
                    except (ValueError, AttributeError, TypeError):
                        pass
                self.count(w.id, str(status))
                return web.Response(body=data, status=status, headers=returned(r.headers))
        except _UPSTREAM_FAILURES as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        except asyncio.TimeoutError:
            return self._timed_out(w)
        except asyncio.CancelledError:  # the client left (vLLM aborts it), or the shutdown's grace ran out
            self.count(w.id, self.cut_status())
            raise
        finally:
            ctl.finished(req, w.id, time.monotonic(), out_tokens)

    async def _stream(self, request: web.Request, req: RequestView, w: Any, path: str, raw: bytes,
                      fwd: CIMultiDict) -> web.StreamResponse:
        ctl = self.ctl
        m = ctl.metrics
        events = roles = 0
        tail = b""  # the stream's last bytes: the usage event, when the client asked for it
        out: web.StreamResponse | None = None
        status = "200"
        try:
            # the answer's headers within request_timeout_s, the wait for a pooled connection included (the
            # stream's own timeout bounds only its silences)
            async with await asyncio.wait_for(ctl.session.post(self.upstream(w, path), data=raw, headers=fwd,
                                                               timeout=self.stream_timeout),
                                              ctl.cfg.server.request_timeout_s) as r:
                if r.status != 200:
                    data = await r.read()
                    if r.status >= 500:
                        upstream_5xx(w, r.status, data, r.headers.get("Content-Type", "application/json"))
                    self.count(w.id, str(r.status))
                    return web.Response(body=data, status=r.status, headers=returned(r.headers))
                try:
                    first = await r.content.readany()
                except _READ_TIMEOUT:
                    raise
                except _UPSTREAM_FAILURES as e:
                    raise _Retryable(f"{type(e).__name__}: {e}") from None
                if not first:
                    raise _Retryable(f"{w.id} closed the stream before its first chunk")
                # the Responses API writes response.created and .in_progress before the engine's first output:
                # its first token is its first output event
                booked = path != RESPONSES or _OUTPUT_EVENT in first
                if booked:
                    ctl.first_token(req, w.id, time.monotonic())
                if path == RESPONSES and (rid := _RESPONSE_ID.search(first)):  # response.created names it
                    self.own(rid.group(1).decode(), w.id)
                headers = returned(r.headers)
                headers["Cache-Control"] = "no-cache"
                out = web.StreamResponse(status=200, headers=headers)
                try:  # a client gone before its first chunk is no worker's fault: not retried, the worker kept
                    await out.prepare(request)
                    events += first.count(b"data: ")
                    roles += first.count(b'"role"')
                    tail = first[-_TAIL:]
                    await out.write(first)
                except _CLIENT_GONE:
                    status = "499"
                    return out
                try:
                    async for chunk in r.content.iter_any():
                        if not booked and _OUTPUT_EVENT in chunk:
                            ctl.first_token(req, w.id, time.monotonic())
                            booked = True
                        events += chunk.count(b"data: ")
                        roles += chunk.count(b'"role"')
                        tail = (tail + chunk)[-_TAIL:]
                        await out.write(chunk)
                except _CLIENT_GONE:
                    status = "499"  # the client went away; leaving the block closes the upstream (vLLM aborts)
                    return out
                except asyncio.TimeoutError:  # before the failures: a read timeout is both
                    status = "504"
                    m.upstream_errors.labels(w.id, "timeout").inc()
                    try:
                        await out.write(sse_error(f"worker {w.id} sent nothing for "
                                                  f"{ctl.cfg.server.request_timeout_s:g} s mid-stream", 504))
                    except _CLIENT_GONE:
                        pass
                except _UPSTREAM_FAILURES as e:
                    status = "502"
                    msg = f"worker {w.id} failed mid-stream: {type(e).__name__}: {e}"
                    ctl.fail(w, msg)
                    m.upstream_errors.labels(w.id, "mid_stream").inc()
                    try:
                        await out.write(sse_error(msg))
                    except _CLIENT_GONE:
                        pass
                try:
                    await out.write_eof()
                except _CLIENT_GONE:
                    status = "499"
                return out
        except _READ_TIMEOUT:  # before the failures, which it is one of
            return self._timed_out(w, out)
        except _UPSTREAM_FAILURES as e:  # a connection that failed or timed out: tried elsewhere
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        except asyncio.TimeoutError:
            return self._timed_out(w, out)
        except asyncio.CancelledError:  # the client left, or the shutdown's grace ran out: not a 200
            status = self.cut_status()
            if out is None:
                self.count(w.id, status)
            raise
        finally:
            if out is not None:
                self.count(w.id, status)
            ctl.finished(req, w.id, time.monotonic(), streamed_tokens(events, roles, tail))


_TAIL = 4096
# the Messages API's message_delta and the Responses API's response.completed carry their usage's output_tokens
_OUTPUT_TOKENS = re.compile(rb'"output_tokens":(\d+)')
_USAGE = re.compile(rb'data: (\{"[^\n]*"choices":\[\][^\n]*\})\n')


def streamed_tokens(events: int, roles: int, tail: bytes) -> int:
    """A stream's output tokens for on_finish (the scalers' signals, the shadow twin, the chunk planner): the
    usage event's completion_tokens when the client asked for it (`stream_options.include_usage`: vLLM's last
    event before [DONE], with no choices), all choices together; the Messages API's message_delta or the
    Responses API's response.completed output_tokens; else the events less [DONE] and chat's role chunks (one per
    choice, the only events with a role: vLLM writes deltas with exclude_unset), a lower bound, as vLLM merges
    tokens into one event when the client reads slower than it decodes."""
    found = _USAGE.findall(tail)
    if found:
        try:
            usage = json.loads(found[-1]).get("usage")
            return int(usage["completion_tokens"])
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
    output = _OUTPUT_TOKENS.findall(tail)  # the last: message_start's 0 comes first
    if output:
        return int(output[-1])
    usage_events = tail.count(b'"choices":[]')
    return max(0, events - 1 - roles - usage_events)


@web.middleware
async def route_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A path or method no route serves answers as vLLM's FastAPI app does, in JSON: {"detail": "Not Found"}
    (404) or {"detail": "Method Not Allowed"} (405, with Allow), not aiohttp's plain text that a client's JSON
    parser fails on. Only the router's own refusals are rewritten; the handlers answer with `error`."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if request.match_info.http_exception is not e or e.status not in (404, 405):
            raise
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return web.json_response({"detail": e.reason}, status=e.status, headers=headers)


def build_app(ctl: Controller) -> web.Application:
    app = web.Application(client_max_size=ctl.cfg.server.max_body_bytes, middlewares=[route_errors])
    proxy = Proxy(ctl)
    app[CTL] = ctl
    app[PROXY] = proxy
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_post(RESPONSES, proxy.responses)
    app.router.add_get(RESPONSES + "/{response_id}", proxy.passthrough)
    app.router.add_post(RESPONSES + "/{response_id}/cancel", proxy.passthrough)
    app.router.add_post(MESSAGES, proxy.messages)
    app.router.add_post(MESSAGES + "/count_tokens", proxy.passthrough)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ping", proxy.health)  # vLLM's SageMaker ping: its /health
    app.router.add_post("/ping", proxy.health)
    app.router.add_get("/load", proxy.load)
    app.router.add_post("/tokenize", proxy.passthrough)
    app.router.add_post("/detokenize", proxy.passthrough)
    app.router.add_get("/version", proxy.passthrough)
    app.router.add_get("/metrics", proxy.metrics)
    app.router.add_get("/workers", proxy.workers)
    if ctl.shadow is not None:
        app.router.add_get("/shadow", proxy.shadow)
    return app


async def serve(ctl: Controller, on_ready: Any = None, stop: asyncio.Event | None = None) -> None:
    """Start the controller, listen, and on SIGTERM/SIGINT (or `stop`): stop accepting, let in-flight
    requests finish (up to `server.shutdown_timeout_s`), stop launched workers, return."""
    cfg = ctl.cfg
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    app = build_app(ctl)
    # handler_cancellation: a client that leaves cancels its handler, which closes the upstream request, so that
    # the worker aborts it (vLLM's own routes do so, `with_cancellation`); without it an abandoned unary request
    # ran to its end on the worker
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=cfg.server.shutdown_timeout_s, **HEADER_LIMITS)
    await runner.setup()
    cleaned = False
    try:
        await ctl.start()
        site = web.TCPSite(runner, cfg.server.host, cfg.server.port, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else cfg.server.port
        ctl.port = port
        log.info("llmtwin live: listening on http://%s:%d, router %s, %d workers", cfg.server.host, port,
                 ctl.router_name, len(ctl.registry))
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
        log.info("shutting down: %d requests in flight", app[PROXY].active)
        ctl.accepting = False
        await runner.cleanup()  # closes the listener, waits for running handlers, then closes connections
        cleaned = True
    finally:
        if not cleaned:
            await runner.cleanup()
        await ctl.stop()


def returned(headers: Any) -> CIMultiDict:
    """A worker's response headers for the client (X-Request-Id with vLLM's --enable-request-id-headers, its
    endpoint-load-metrics...), all but hop-by-hop ones and those the proxy's server sets itself."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _NOT_RETURNED)
