"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

An OpenAI request becomes one protocol ``generate``; the server validates it
(types, ranges, limits; ``bad_request`` names the field) like any ZeroMQ
request. What this module checks is only the HTTP shape the protocol does not
have: message content parts, ``stop`` as a string, ``response_format``,
``n``, the completions ``prompt`` forms. Unknown fields are ignored, as
OpenAI does.

Defaults follow OpenAI, not the protocol: ``temperature`` 1.0. Without
``max_tokens``/``max_completion_tokens`` the protocol's default (256) applies.
Extras beyond OpenAI's fields: ``top_k``, ``ignore_eos``, ``stop_token_ids``
(as vLLM takes them) and ``grammar`` (the protocol's grammar map:
``{"kind": "point"|"box", "max_objects": n}``, ``{"kind": "regex", "pattern": s}``,
``{"kind": "json_schema", "schema": {...}}``), whose parsed result comes back
as ``choices[0].output``. See docs/HTTP.md.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse

from .bridge import Call
from .common import (Context, adapter_field, check_model, field, first_event, image_input, read_json, run_to_end,
                     session_of, sse, sse_response, terminal_or_raise)
from .errors import HttpError, bad_request

PASS_THROUGH = ("temperature", "top_p", "seed", "top_k", "ignore_eos", "stop_token_ids")
ROLE_ALIASES = {"developer": "system"}


def models(ctx: Context) -> JSONResponse:
    base = {"object": "model", "created": CREATED, "owned_by": "tandem", "max_model_len": ctx.max_model_len}
    adapters = [{"id": a, **base, "parent": ctx.model} for a in ctx.adapters]  # LoRA adapters, as vLLM lists them
    return JSONResponse({"object": "list", "data": [{"id": ctx.model, **base}, *adapters]})


async def chat_completions(ctx: Context, request: Request):
    body = await read_json(request, ctx.max_body_bytes)
    model = check_model(ctx, body, adapters=True)
    images: list[bytes] = []
    fields = {"messages": chat_messages(ctx, body.get("messages"), images), **_sampling(body, chat=True),
              **adapter_field(ctx, model)}
    if images:
        fields["images"] = images
    return await _respond(ctx, request, body, model, fields, _ChatShape())


async def completions(ctx: Context, request: Request):
    body = await read_json(request, ctx.max_body_bytes)
    model = check_model(ctx, body, adapters=True)
    if body.get("echo"):
        raise bad_request("echo is not supported")
    if body.get("suffix"):
        raise bad_request("suffix is not supported")
    if field(body, "best_of", int, "an integer") not in (None, 1):
        raise bad_request("best_of must be 1")
    fields = {**_prompt(body.get("prompt")), **_sampling(body, chat=False), **adapter_field(ctx, model)}
    return await _respond(ctx, request, body, model, fields, _CompletionShape())


# --------------------------------------------------------------------------- request mapping


def _sampling(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": 1.0}
    out.update({k: body[k] for k in PASS_THROUGH if body.get(k) is not None})
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else stop
    if field(body, "n", int, "an integer") not in (None, 1):
        raise bad_request("n must be 1 (one choice per request)")
    lp = body.get("logprobs")
    if chat:
        out["logprobs"] = bool(field(body, "logprobs", bool, "a boolean"))
    else:  # completions: the number of top alternatives; only the chosen token's logprob is given
        out["logprobs"] = field(body, "logprobs", int, "an integer") is not None
    if lp is not None and field(body, "top_logprobs", int, "an integer"):
        raise bad_request("top_logprobs is not supported (only the chosen token's logprob)")
    grammar = _response_format(body.get("response_format"))
    if body.get("grammar") is not None:
        if grammar is not None:
            raise bad_request("use either response_format or grammar, not both")
        grammar = body["grammar"]
    if grammar is not None:
        out["grammar"] = grammar
    so = field(body, "stream_options", dict, "an object")
    if so is not None and not body.get("stream"):
        raise bad_request("stream_options is only allowed with stream: true")
    if so is not None and not isinstance(so.get("include_usage", False), bool):
        raise bad_request("stream_options.include_usage must be a boolean")
    return out


def _response_format(rf: Any) -> dict[str, Any] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_schema", "schema": {"type": "object"}}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise bad_request("response_format.json_schema.schema must be an object (a JSON schema)")
        return {"kind": "json_schema", "schema": js["schema"]}
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def chat_messages(ctx: Context, messages: Any, images: list[bytes]) -> list[dict[str, Any]]:
    """The protocol's messages; the files of ``image_url`` parts are appended to ``images``."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object")
        role = m.get("role")
        content = m.get("content")
        if isinstance(content, list):
            content = _content_parts(ctx, content, f"messages[{i}].content", images)
        elif content is None:
            content = ""  # e.g. an assistant turn that only called tools
        if isinstance(role, str):
            role = ROLE_ALIASES.get(role, role)
        out.append({"role": role, "content": content})  # the server checks both
    return out


def _content_parts(ctx: Context, parts: list, where: str, images: list[bytes]) -> str | list[dict[str, Any]]:
    """Text parts joined into one string; with images, the protocol's text and image parts in order."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{j}].text must be a string")
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            images.append(image_input(ctx, part.get("image_url"), f"{where}[{j}].image_url"))
            out.append({"type": "image"})
        else:
            raise bad_request(f"{where}[{j}] must be a text or image_url part, got type {kind!r}")
    if any(p["type"] == "image" for p in out):
        return out
    return "\n".join(p["text"] for p in out)


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise bad_request("prompt must be a string or an array of token ids (one prompt per request)")


# --------------------------------------------------------------------------- answers


async def _respond(ctx: Context, request: Request, body: dict, model: str, fields: dict, shape: "_Shape"):
    stream = field(body, "stream", bool, "a boolean")
    meta = {"id": f"{shape.prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    call = ctx.bridge.generate({**fields, "stream": bool(stream)}, session=session_of(request, body), rid=meta["id"])
    if not stream:
        done = await run_to_end(request, call)
        return JSONResponse({**meta, "object": shape.object, "choices": [shape.choice(ctx, done)],
                             "usage": _usage(done)})
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    batches = call.batches()
    first = await first_event(request, batches)
    return sse_response(_stream(ctx, call, batches, first, meta, shape, include_usage))


_MARK = "\u0000text\u0000"


async def _stream(ctx: Context, call: Call, batches: AsyncIterator[list], first: list, meta: dict, shape: "_Shape",
                  include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body. Text chunks are the hot path: one pre-encoded template per stream with the
    text spliced in, and whatever arrived together goes out in one write."""
    head = {**meta, "object": shape.chunk_object}
    extra = {"usage": None} if include_usage else {}
    before, after = sse({**head, "choices": [shape.delta(_MARK)], **extra}).split(json.dumps(_MARK).encode())
    try:
        opening = shape.opening()
        if opening is not None:
            yield sse({**head, "choices": [opening], **extra})
        batch = first
        while True:
            out = [before + json.dumps(m["text"]).encode() + after for m in batch if m["type"] == "chunk" and m["text"]]
            last = batch[-1]
            if last["type"] != "chunk":
                done = terminal_or_raise(last)
                out.append(sse({**head, "choices": [shape.last(ctx, done)], **extra}))
                if include_usage:
                    out.append(sse({**head, "choices": [], "usage": _usage(done)}))
                yield b"".join(out)
                break
            if out:
                yield b"".join(out)
            batch = await batches.__anext__()
    except HttpError as e:  # after the 200 went out: the error as an event, as OpenAI does
        yield sse(e.body())
    finally:
        call.abandon()  # the client went away mid-stream: cancel (no-op once ended)
    yield b"data: [DONE]\n\n"


def _usage(done: dict) -> dict[str, int]:
    u = done["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _token_texts(ctx: Context, token_ids: list[int]) -> list[str]:
    return ctx.tokenizer.batch_decode([[t] for t in token_ids]) if ctx.tokenizer is not None else \
        [str(t) for t in token_ids]


class _Shape:
    prefix = object = chunk_object = ""

    def choice(self, ctx: Context, done: dict) -> dict: ...
    def opening(self) -> dict | None: ...
    def delta(self, text: str) -> dict: ...
    def last(self, ctx: Context, done: dict) -> dict: ...

    def _end_fields(self, ctx: Context, done: dict) -> dict:
        out: dict[str, Any] = {"finish_reason": done["finish_reason"], "logprobs": self.logprobs(ctx, done)}
        if "output" in done:
            out["output"] = done["output"]  # the grammar's parsed result (a Tandem extra)
        return out

    def logprobs(self, ctx: Context, done: dict) -> Any: ...


class _ChatShape(_Shape):
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, ctx, done):
        return {"index": 0, "message": {"role": "assistant", "content": done["text"]}, **self._end_fields(ctx, done)}

    def opening(self):
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, text):
        return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}

    def last(self, ctx, done):
        return {"index": 0, "delta": {}, **self._end_fields(ctx, done)}

    def logprobs(self, ctx, done):
        if "logprobs" not in done:
            return None
        tokens = _token_texts(ctx, done["token_ids"])
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(tokens, done["logprobs"])]}


class _CompletionShape(_Shape):
    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def choice(self, ctx, done):
        return {"index": 0, "text": done["text"], **self._end_fields(ctx, done)}

    def opening(self):
        return None

    def delta(self, text):
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}

    def last(self, ctx, done):
        return {"index": 0, "text": "", **self._end_fields(ctx, done)}

    def logprobs(self, ctx, done):
        if "logprobs" not in done:
            return None
        tokens = _token_texts(ctx, done["token_ids"])
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": list(done["logprobs"]), "top_logprobs": None,
                "text_offset": offsets}


CREATED = int(time.time())  # when this server process started: the model's "created"
