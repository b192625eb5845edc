"""A prompt's token ids, for the request view: from the worker's `/tokenize`, a local tokenizer, or an estimate.

The token count feeds the bookkeeping and the context check; the ids feed the prefix hashes. `worker` asks
a serving worker (exactly what vLLM will see, one extra round trip); `local` runs a Hugging Face tokenizer
in process (needs `transformers`; the same files the worker loads); `estimate` counts characters
(ASSUMPTION: `chars_per_token`, 4 by default) and yields no ids, so no prefix.
"""

from __future__ import annotations

import json
import logging
import re
import reprlib
from dataclasses import dataclass, replace

import aiohttp
from typing import Annotated, Any, Optional, Sequence, Union

from pydantic import Field, TypeAdapter, ValidationError

from twin.errors import TwinInputError


class BadPrompt(ValueError):
    """The body's prompt, messages or another field is not of a form vLLM's OpenAI server accepts (a 400)."""


log = logging.getLogger("llmtwin.live")


class BadAnswer(aiohttp.ClientError):
    """A worker's answer is not what vLLM answers: the worker failed, as when it drops the connection."""


# the types of vLLM's request models (vllm/entrypoints/openai/*/protocol.py), read as FastAPI reads a body there:
# pydantic's lax mode, where 10.0, "10" and true are the integers 10, 10 and 1, and "false" is false
FIELD_TYPES = {"model": TypeAdapter(Optional[str]), "int": TypeAdapter(Optional[int]),
               "bool": TypeAdapter(Optional[bool])}

_TOKEN_ID = Annotated[int, Field(ge=0)]
PROMPT_TYPE = TypeAdapter(Optional[Union[list[_TOKEN_ID], list[list[_TOKEN_ID]], str, list[str]]])


def body_field(body: dict, key: str, kind: str) -> Any:
    """`body[key]` as vLLM's request model reads it (`kind`: model, int or bool), or BadPrompt where it refuses."""
    v = body.get(key)
    if v is None:
        return None
    try:
        return FIELD_TYPES[kind].validate_python(v)
    except ValidationError as e:
        raise BadPrompt(f"'{key}': {e.errors()[0]['msg']} (got {reprlib.repr(v)})") from None


@dataclass(frozen=True, slots=True)
class PromptInfo:
    num_tokens: int
    token_ids: Sequence[int] | None  # of the first prompt; None when only estimated
    text: str | None
    max_model_len: int | None = None  # from /tokenize, when it says
    lengths: tuple[int, ...] = ()  # each prompt's tokens (a chat is one prompt): exact for the first `exact`
    exact: int = 0


def template_kwargs(body: dict) -> dict[str, Any]:
    """A chat body's `tools` and `chat_template_kwargs`, which vLLM hands to the chat template."""
    out: dict[str, Any] = {}
    kw = body.get("chat_template_kwargs")
    if isinstance(kw, dict):
        out.update((k, v) for k, v in kw.items() if isinstance(k, str) and k not in _OWN_KWARGS)
    if isinstance(body.get("tools"), list):
        out["tools"] = body["tools"]
    return out


_OWN_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
               "chat_template", "return_dict")


def token_options(body: dict, chat: bool) -> dict[str, bool]:
    """The body's fields that change its tokens, with vLLM's defaults (`ChatCompletionRequest`: a generation
    prompt, no special tokens; `CompletionRequest`: special tokens), read as vLLM reads them."""
    keys = {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False} if chat \
        else {"add_special_tokens": True}
    out = {}
    for k, default in keys.items():
        v = body_field(body, k, "bool")
        out[k] = default if v is None else bool(v)
    return out


def prompt_parts(body: dict, chat: bool) -> tuple[list[Any], str | None]:
    """The prompts of a completions body (strings or token-id lists) or the messages of a chat body."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadPrompt("'messages' must be a non-empty list")
        texts = []
        for m in msgs:
            if not isinstance(m, dict) or "role" not in m:
                raise BadPrompt("each message must be an object with 'role' and 'content'")
            texts.extend(_texts(m.get("content")))
        return [msgs], "\n".join(texts)
    try:  # vLLM's own reading: token ids [1, 2.0] and [1, "2"] are [1, 2] there
        p = PROMPT_TYPE.validate_python(body.get("prompt"))
    except ValidationError:
        p = None
    if isinstance(p, str):
        return [p], p
    if p and isinstance(p[0], int):
        return [p], None
    if p:
        return list(p), (p[0] if isinstance(p[0], str) else None)
    raise BadPrompt("'prompt' must be a string, a list of strings, or token ids (integers from 0)")


class PromptTokenizer:
    """Counts and ids of a request's prompt, by the configured mode."""

    def __init__(self, mode: str, path: str | None = None, chars_per_token: float = 4.0) -> None:
        if mode not in ("worker", "local", "estimate"):
            raise ValueError(mode)
        self.mode = mode
        self.chars_per_token = chars_per_token
        self._tok = None
        if mode == "local":
            if not path:
                raise TwinInputError("tokenizer.mode local needs tokenizer.path (a Hugging Face tokenizer folder)")
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise TwinInputError("tokenizer.mode local needs the transformers package") from None
            try:
                self._tok = AutoTokenizer.from_pretrained(path)
            except Exception as e:  # noqa: BLE001 - any load failure is bad config
                raise TwinInputError(f"tokenizer.path {path}: cannot load a tokenizer ({e})") from None

    def estimate(self, text: str) -> int:
        return max(1, int(len(text) / self.chars_per_token + 0.5))

    async def tokenize(self, body: dict, chat: bool, session: Any = None, worker_url: str | None = None,
                       model: str | None = None) -> PromptInfo:
        parts, text = prompt_parts(body, chat)
        opts = token_options(body, chat)
        first = parts[0]
        if not chat and isinstance(first, list):  # token ids given: nothing to tokenize
            lengths = tuple(len(p) for p in parts)
            return PromptInfo(sum(lengths), first, text, lengths=lengths, exact=len(lengths))
        if self.mode == "estimate" or (self.mode == "worker" and (session is None or worker_url is None)):
            return self._estimated(parts, chat, text)
        if self.mode == "local":
            try:
                kw = template_kwargs(body) if chat else {}
                ids = self._local_ids(first, chat, opts, kw)
                lengths = (len(ids), *(len(self._local_ids(p, chat, opts, kw)) for p in parts[1:]))
            except Exception as e:  # noqa: BLE001 - a chat template that raises on odd messages
                # vLLM judges the request (its template, its 400): here it is routed on an estimate, not a 500
                log.warning("local tokenizer failed (%s: %s); the prompt's length is estimated", type(e).__name__, e)
                return self._estimated(parts, chat, text)
            return PromptInfo(sum(lengths), ids, text, lengths=lengths, exact=len(lengths))
        if chat:  # as the body gives them: the worker's /tokenize takes the chat request's fields
            opts = {**opts, **{k: body[k] for k in ("tools", "chat_template_kwargs") if body.get(k) is not None}}
        ids, mml = await self._worker_ids(session, worker_url, model, first, chat, opts)
        lengths = (len(ids), *(self.estimate(p) if isinstance(p, str) else len(p) for p in parts[1:]))
        return PromptInfo(sum(lengths), ids, text, mml, lengths, 1)

    def estimated_messages(self, body: dict) -> PromptInfo:
        """An Anthropic Messages body's prompt, estimated: its `system` and its messages' text (a string, or the
        text blocks), 4 tokens a message for the template's frame as a chat's estimate."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise BadPrompt("'messages' must be a non-empty list of objects with 'role' and 'content'")
        contents = [body.get("system"), *(m.get("content") for m in msgs)]
        return self._estimated_texts([t for c in contents for t in _texts(c)], len(msgs))

    def estimated_input(self, body: dict) -> PromptInfo:
        """A Responses API body's prompt, estimated: its `instructions` and `input` (a string, or items whose
        content is a string or text parts), 4 tokens an item."""
        items = body.get("input")
        if isinstance(items, str):
            items = [{"content": items}]
        if not isinstance(items, list) or not items:
            raise BadPrompt("'input' must be a string or a non-empty list of items")
        contents = [body.get("instructions"), *(it.get("content", it.get("output")) for it in items
                                                if isinstance(it, dict))]
        return self._estimated_texts([t for c in contents for t in _texts(c)], len(items))

    def _estimated_texts(self, texts: list[str], frames: int) -> PromptInfo:
        """One prompt of these texts, estimated, with 4 tokens of the template's frame for each of `frames`."""
        text = "\n".join(texts)
        n = (self.estimate(text) if text else 0) + 4 * frames
        return PromptInfo(n, None, text, lengths=(n,))

    def _estimated(self, parts: list[Any], chat: bool, text: str | None) -> PromptInfo:
        if chat:
            msgs = parts[0]
            lengths: tuple[int, ...] = (sum(self.estimate(m.get("content") if isinstance(m.get("content"), str)
                                                          else str(m.get("content"))) for m in msgs) + 4 * len(msgs),)
        else:
            lengths = tuple(self.estimate(p) if isinstance(p, str) else len(p) for p in parts)
        return PromptInfo(sum(lengths), None, text, lengths=lengths)

    def _local_ids(self, prompt: Any, chat: bool, opts: dict[str, bool], kw: dict[str, Any]) -> list[int]:
        """As vLLM's server: a chat is rendered to text by the template (with the body's tools and template
        arguments), then tokenized (without special tokens unless the body asks for them); a completion's prompt
        with them unless it asks not to (`opts`)."""
        tok = self._tok
        if chat:
            msgs = template_messages(prompt, getattr(tok, "chat_template", None))
            text = tok.apply_chat_template(msgs, add_generation_prompt=opts["add_generation_prompt"],
                                           continue_final_message=opts["continue_final_message"], tokenize=False,
                                           **kw)
            return list(tok(text, add_special_tokens=opts["add_special_tokens"])["input_ids"])
        if isinstance(prompt, list):
            return prompt
        return list(tok(prompt, add_special_tokens=opts["add_special_tokens"])["input_ids"])


    async def _worker_ids(self, session: Any, url: str, model: str | None, prompt: Any, chat: bool,
                          opts: dict[str, Any]) -> tuple[list[int], int | None]:
        """vLLM's `/tokenize` (`vllm/entrypoints/serve/tokenize`): {"tokens": [...], "max_model_len": N}."""
        body: dict[str, Any] = {"messages": prompt, **opts} if chat else {"prompt": prompt, **opts}
        if model:
            body["model"] = model
        async with session.post(url + "/tokenize", json=body) as resp:
            try:
                data = await resp.json(content_type=None)
            except ValueError:  # not JSON: not vLLM's answer (a page from something in between, a wrong URL)
                data = None
            if 400 <= resp.status < 500 and data is not None:  # vLLM refused the prompt; a 5xx is the worker's
                msg = data.get("error", data) if isinstance(data, dict) else data
                if isinstance(msg, dict):
                    msg = msg.get("message", msg)
                raise BadPrompt(f"the worker could not tokenize the prompt: {msg}")
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if resp.status != 200 or not isinstance(tokens, list):  # a worker failure (502, marked down)
            raise BadAnswer(f"/tokenize answered {resp.status} without token ids: {reprlib.repr(data)}")
        mml = data.get("max_model_len")
        return tokens, mml if isinstance(mml, int) and not isinstance(mml, bool) else None


def fit_context(info: PromptInfo, max_tokens: int | None, mml: int | None, truncate: int | None,
                side: str | None, least: int, param: str) -> tuple[PromptInfo, int | None]:
    """The prompt as vLLM 0.32 serves it within a `mml`-token context, and the output tokens it will allow; or
    BadPrompt with vLLM's message. vLLM (`vllm/renderers/params.py` `TokenizeParams`) refuses max_tokens above the
    context and a truncation above it, keeps the last `truncate_prompt_tokens` tokens of each prompt (the first
    with `truncation_side: right`; -1: the context less one), refuses a prompt longer than the context, and then
    *cuts* max_tokens to what the context leaves (`serve/utils/api_utils.py` `get_max_tokens`), per prompt: a
    prompt plus max_tokens over the context is served, not refused. Estimated lengths are never refused."""
    if mml and max_tokens is not None and max_tokens > mml:
        raise BadPrompt(f"{param}={max_tokens} cannot be greater than max_model_len={mml}. Please request fewer "
                        "output tokens.")
    if mml and truncate is not None and truncate > mml:
        raise BadPrompt(f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {mml}. Please "
                        "request a smaller truncation size.")
    keep = (mml - 1 if mml else None) if truncate == -1 else truncate
    if keep is not None and info.lengths and max(info.lengths) > keep:
        ids = info.token_ids
        if ids is not None and len(ids) > keep:
            ids = ids[:keep] if side == "right" else ids[len(ids) - keep:]
        lengths = tuple(min(n, keep) for n in info.lengths)
        info = replace(info, num_tokens=sum(lengths), token_ids=ids, lengths=lengths)
    if not mml or not info.exact:
        return info, max_tokens
    longest = max(info.lengths[:info.exact])
    if longest > mml:
        qualifier = "at least " if longest == mml + 1 else ""
        raise BadPrompt(f"This model's maximum context length is {mml} tokens. However, your prompt contains "
                        f"{qualifier}{longest} input tokens, which exceeds this limit even without any output "
                        "tokens. Please reduce the length of the input prompt.")
    allowed = mml - longest
    if max_tokens is None:
        return info, None  # vLLM's chat default: what the context leaves, not an expected length
    fits = min(max_tokens, allowed)
    if fits < least:
        raise BadPrompt(f"max_tokens must be at least {least}, got {fits}.")
    return info, fits


# a template that loops over a message's content takes OpenAI's list of parts; others get one string
# (vLLM: `vllm/renderers/hf.py` `_detect_content_format`, which walks the template's AST for such a loop)
_CONTENT_LOOP = re.compile(r"\bfor\s+\w+\s+in\s+[\w.]+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


def _texts(content: Any) -> list[str]:
    """The text of a content: a string, or the `text` of its blocks (Anthropic's and OpenAI's parts alike)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str)]
    return []


def _joined(content: Any) -> Any:
    """A list of parts as one string: their texts joined by newlines (`vllm/renderers/chat_utils.py`)."""
    if not isinstance(content, list):
        return content
    texts = [p if isinstance(p, str) else p.get("text") for p in content if isinstance(p, (str, dict))]
    return "\n".join(t for t in texts if isinstance(t, str))


def _tool_calls(calls: Any) -> Any:
    """An assistant's tool calls as templates take them: `arguments` a JSON object, not its text (vLLM's
    `_postprocess_messages`: text that is not a JSON object becomes {})."""
    if not isinstance(calls, list):
        return calls
    out = []
    for item in calls:
        fn = item.get("function") if isinstance(item, dict) else None
        if isinstance(fn, dict):
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                try:
                    args = json.loads(args)
                except ValueError:
                    args = None
            item = {**item, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}}
        out.append(item)
    return out


def _message(m: dict, openai: bool) -> dict:
    """One message rebuilt as vLLM's `_parse_chat_message_content` rebuilds it: the content as parts (a template
    that loops over them) or one string; tool calls, a tool's call id, a name and reasoning kept, the rest not."""
    role, c = m.get("role"), m.get("content")
    parts = [] if c is None else ([{"type": "text", "text": c}] if isinstance(c, str) else c)
    content: Any = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts] if openai else \
        _joined(parts)
    msg: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"])
            if msg["tool_calls"] == []:
                del msg["tool_calls"]  # an empty list keeps the template on its plain assistant path
        if m.get("reasoning") is not None:
            msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
    elif role == "tool":
        if "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            msg["content"] = "\n".join(str(p.get("text", "")) for p in content)
    if isinstance(m.get("name"), str):
        msg["name"] = m["name"]
    if role == "developer":
        msg["tools"] = m.get("tools")
    return msg


def template_messages(messages: list[dict], template: Any) -> list[dict]:
    """The messages as vLLM hands them to a chat template (`vllm/renderers/chat_utils.py` `parse_chat_messages`,
    `vllm/renderers/hf.py` `safe_apply_chat_template`): rebuilt one by one (`_message`); for a template that does
    not name the `developer` role, developer messages become system ones, merged into one first system message.
    Not mirrored: multimodal parts, Claude Code's billing header in system prompts."""
    text = template if isinstance(template, str) else ""
    openai = _CONTENT_LOOP.search(text) is not None
    out = [_message(m, openai) for m in messages]
    if '"developer"' in text or "'developer'" in text or not any(m.get("role") == "developer" for m in out):
        return out
    out = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m.get("role") == "developer" else m
           for m in out]
    if not any(m.get("role") == "system" for m in out[1:]):
        return out  # one system message, first: as it is (`_consolidate_system_messages`)
    system = [c for m in out if m.get("role") == "system" and (c := _joined(m.get("content") or ""))]
    return [{"role": "system", "content": "\n\n".join(system)}] + [m for m in out if m.get("role") != "system"]
