"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

An OpenAI request becomes one protocol ``generate``; the server validates it
(types, ranges, limits; ``bad_request`` names the field) like any ZeroMQ
request. What each field of OpenAI's and vLLM's is here (passed to the sampler,
read by the route, without effect, or refused with a 400 naming it: never dropped
in silence) is ``fields.FIELDS``. What this module checks is only the HTTP shape
the protocol does not have: message content parts, ``stop`` as a string, ``n``,
``tools``/``tool_choice``, the completions ``prompt`` forms, and the one way a
request asks for structured output (``response_format``, ``grammar``, vLLM's
``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``/``structured_outputs``: each
becomes the protocol's grammar map; its parsed result comes back as
``choices[i].output``). Unknown fields are ignored, as OpenAI does.

Defaults follow OpenAI, not the protocol: ``temperature`` 1.0, unless the model's
generation_config.json has one (then the server applies it, as it does its other
sampling defaults: ``Gate.sampling``). Without ``max_tokens``/``max_completion_tokens``
the model's default applies, else the protocol's (as vLLM: the rest of the context).
See docs/HTTP.md.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse

from shared.sampling import MAX_TOP_LOGPROBS

from ..protocol.wire import CHAT_TEMPLATE_FIELDS, MAX_CHOICES, choice_request
from .bridge import Call
from .common import (Context, adapter_field, check_model, first_event, image_input, read_body, run_to_end,
                     session_of, sse, sse_response, terminal_or_raise, unless_gone)
from .errors import HttpError, bad_request
from .fields import CHAT, COMPLETIONS, MAX_REQUEST_ID_CHARS, PASS_THROUGH, refuse_unsupported

OPENAI_TEMPERATURE = 1.0  # OpenAI's default where the model has none
ROLE_ALIASES = {"developer": "system"}
# The ways to ask for structured output, one per request: each gives the protocol's grammar map.
STRUCTURED = ("response_format", "grammar", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs")


def models(ctx: Context) -> JSONResponse:
    base = {"object": "model", "created": CREATED, "owned_by": "tandem", "max_model_len": ctx.max_model_len}
    adapters = [{"id": a, **base, "parent": ctx.model} for a in ctx.adapters]  # LoRA adapters, as vLLM lists them
    return JSONResponse({"object": "list", "data": [{"id": ctx.model, **base}, *adapters]})


async def chat_completions(ctx: Context, request: Request):
    body = await read_body(request, CHAT, ctx.max_body_bytes)
    model = check_model(ctx, body.model, adapters=True)
    refuse_unsupported(CHAT, body)
    images: list[bytes] = []
    template = {f: getattr(body, f) for f in CHAT_TEMPLATE_FIELDS if getattr(body, f) is not None}
    fields = {"messages": chat_messages(ctx, body.messages, images), **_sampling(ctx, body, chat=True),
              **adapter_field(ctx, model), **template}
    if images:
        fields["images"] = images
    return await _respond(ctx, request, body, model, fields, _ChatShape)


async def completions(ctx: Context, request: Request):
    body = await read_body(request, COMPLETIONS, ctx.max_body_bytes)
    model = check_model(ctx, body.model, adapters=True)
    refuse_unsupported(COMPLETIONS, body)
    fields = {**_prompt(body.prompt), **_sampling(ctx, body, chat=False), **adapter_field(ctx, model)}
    return await _respond(ctx, request, body, model, fields, _CompletionShape)


# --------------------------------------------------------------------------- request mapping


def _sampling(ctx: Context, body: Any, chat: bool) -> dict[str, Any]:
    """The protocol's sampling and output fields of a chat or completions body (its Struct)."""
    out: dict[str, Any] = {} if "temperature" in ctx.sampling_defaults else {"temperature": OPENAI_TEMPERATURE}
    out.update({k: getattr(body, k) for k in PASS_THROUGH if getattr(body, k) is not None})
    max_tokens = body.max_completion_tokens if chat else None
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    stop = body.stop
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else stop
    if chat:
        _refuse_tools(body)
    if chat:  # logprobs: true, and top_logprobs: the most likely alternatives of each token
        out["logprobs"] = bool(body.logprobs)
        top = body.top_logprobs
        if top is not None and not out["logprobs"]:
            raise bad_request("top_logprobs needs logprobs: true")
    else:  # completions: logprobs is the number of alternatives
        top = body.logprobs
        out["logprobs"] = top is not None
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    if top:
        out["top_logprobs"] = top  # the server checks its range
    given = [name for name in STRUCTURED if getattr(body, name) is not None]
    if len(given) > 1:
        raise bad_request(f"{given[1]}: one way to ask for structured output per request, got {' and '.join(given)}")
    grammar = _STRUCTURED_GRAMMAR[given[0]](getattr(body, given[0])) if given else None
    if grammar is not None:
        out["grammar"] = grammar
    if body.truncate_prompt_tokens is not None:
        out["truncate_prompt_tokens"] = body.truncate_prompt_tokens  # the server checks it
    so = body.stream_options
    if so is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream: true")
    if so is not None and not isinstance(so.get("include_usage", False), bool):
        raise bad_request("stream_options.include_usage must be a boolean")
    return out


def _refuse_tools(body: Any) -> None:
    """Tool calling is not served: a request that offers tools is a 400 naming the field, never
    answered as if they were not there (``tool_choice: "none"`` asks for no call: that is served)."""
    choice = body.tool_choice
    if choice == "none":
        return
    if body.tools:
        raise bad_request("tools: tool calling is not supported by this server (send tool_choice: \"none\" "
                          "or no tools)")
    if choice is not None:
        raise bad_request(f"tool_choice: tool calling is not supported by this server, got {json.dumps(choice)[:80]}")


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


def _json_schema(schema: Any, name: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"{name} must be a JSON schema (an object, or its JSON text): {e}") from None
    if not isinstance(schema, dict):
        raise bad_request(f"{name} must be a JSON schema (an object, or its JSON text)")
    return {"kind": "json_schema", "schema": schema}


def _ebnf(grammar: Any, name: str) -> dict[str, Any]:
    if not isinstance(grammar, str):
        raise bad_request(f"{name} must be a string (an EBNF grammar whose start rule is root)")
    return {"kind": "ebnf", "grammar": grammar}


def _regex(pattern: Any, name: str) -> dict[str, Any]:
    if not isinstance(pattern, str):
        raise bad_request(f"{name} must be a string (a regular expression)")
    return {"kind": "regex", "pattern": pattern}


_REGEX_SPECIAL = re.compile(r"[\\.^$|?*+()\[\]{}]")


def _choice(choices: Any, name: str) -> dict[str, Any]:
    """One of these strings exactly: a regex of the alternatives, each taken literally."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{name} must be a non-empty array of non-empty strings")
    return {"kind": "regex", "pattern": "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\g<0>", c) for c in choices) + ")"}


def _structured_outputs(so: dict) -> dict[str, Any]:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object; the rest refused."""
    kinds = {"json": _json_schema, "regex": _regex, "choice": _choice, "json_object": _json_object,
             "grammar": _ebnf}
    given = [k for k, v in so.items() if v is not None and v is not False]
    for k in given:
        if k not in kinds:
            raise bad_request(f"structured_outputs.{k} is not supported by this server (json, regex, choice, "
                              "grammar or json_object are)")
    if len(given) != 1:
        raise bad_request(f"structured_outputs must give one of json, regex, choice, grammar or json_object, got "
                          f"{', '.join(given) or 'none'}")
    return kinds[given[0]](so[given[0]], f"structured_outputs.{given[0]}")


def _json_object(value: Any, name: str) -> dict[str, Any]:
    if value is not True:
        raise bad_request(f"{name} must be true, got {json.dumps(value)[:40]}")
    return _response_format({"type": "json_object"})


_STRUCTURED_GRAMMAR = {
    "response_format": lambda rf: _response_format(rf),
    "grammar": lambda g: g,  # the protocol's map, checked by the server
    "guided_json": lambda v: _json_schema(v, "guided_json"),
    "guided_regex": lambda v: _regex(v, "guided_regex"),
    "guided_choice": lambda v: _choice(v, "guided_choice"),
    "guided_grammar": lambda v: _ebnf(v, "guided_grammar"),
    "structured_outputs": _structured_outputs,
}


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


def _content_parts(ctx: Context, parts: list, where: str, images: list[bytes]) -> list[dict[str, Any]]:
    """The protocol's text and image parts in order (the server renders them as for any client)."""
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
    return out


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise bad_request("prompt must be a string or an array of token ids (one prompt per request)")


# --------------------------------------------------------------------------- answers


async def _respond(ctx: Context, request: Request, body: Any, model: str, fields: dict, shape: type["_Shape"]):
    stream = bool(body.stream)
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {n}")
    as_ids = bool(body.return_tokens_as_token_ids)
    shapes = [shape(i, as_ids) for i in range(n)]
    meta = {"id": f"{shape.prefix}-{_request_id(body.request_id)}", "created": int(time.time()), "model": model}
    # The protocol's id: the answer's, unique however often a client sends its request_id (the
    # server's log line names it with a suffix of its own then, as vLLM does internally).
    rid = meta["id"] if body.request_id is None else f"{meta['id']}-{uuid.uuid4().hex[:8]}"
    session = session_of(request, body.user)
    # Each choice is one request of the protocol. The first streams (between the processes, whatever the
    # client asked) and the others start at its first token: its prompt's KV pages are in the prefix
    # cache by then, so they map them instead of computing them again.
    calls = [ctx.bridge.generate({**fields, "stream": stream or n > 1}, session=session, rid=rid)]
    try:
        if n == 1 and not stream:
            done = await run_to_end(request, calls[0])
            return JSONResponse({**meta, "object": shape.object, "choices": [shapes[0].choice(ctx, done)],
                                 "usage": _usage([done])})
        batches = [calls[0].batches()]
        first = await first_event(request, batches[0])
        for i in range(1, n):
            choice = choice_request({**fields, "id": rid, "stream": stream}, i)
            calls.append(ctx.bridge.generate(choice, session=session, rid=choice.pop("id")))
            batches.append(calls[i].batches())
        if stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            body_stream = _stream(ctx, calls, batches, first, meta, shapes, include_usage, fields["logprobs"])
            calls = []  # the stream owns them now
            return sse_response(body_stream)
        dones = await unless_gone(request, asyncio.gather(_terminal(batches[0], first),
                                                           *(_terminal(b, None) for b in batches[1:])))
        dones = [terminal_or_raise(d) for d in dones]
        return JSONResponse({**meta, "object": shape.object, "usage": _usage(dones),
                             "choices": [s.choice(ctx, d) for s, d in zip(shapes, dones)]})
    finally:
        for call in calls:
            call.abandon()  # an error or a client gone: the other choices stop too (no-op once ended)


def _request_id(rid: str | None) -> str:
    """vLLM's ``request_id`` (the answer's id, after the route's prefix), else a fresh one."""
    if rid is None:
        return uuid.uuid4().hex
    if not 1 <= len(rid) <= MAX_REQUEST_ID_CHARS:
        raise bad_request(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
    return rid


async def _terminal(batches: AsyncIterator[list], first: list | None) -> dict:
    """A call's terminal message, after ``first`` (a batch already taken from ``batches``)."""
    if first is not None and first[-1]["type"] != "chunk":
        return first[-1]
    async for batch in batches:
        if batch[-1]["type"] != "chunk":
            return batch[-1]
    raise AssertionError("unreachable: batches end with a terminal message")


_MARK = "\u0000text\u0000"


async def _stream(ctx: Context, calls: list[Call], batches: list[AsyncIterator[list]], first: list, meta: dict,
                  shapes: list["_Shape"], include_usage: bool, want_logprobs: bool) -> AsyncIterator[bytes]:
    """The SSE body, the choices interleaved as their messages arrive. Text chunks are the hot path:
    one pre-encoded template per choice with the text spliced in, and whatever arrived together goes
    out in one write. With logprobs, each chunk carries its tokens' (a token whose text is not out
    yet goes with the next chunk)."""
    head = {**meta, "object": shapes[0].chunk_object}
    extra = {"usage": None} if include_usage else {}
    templates = [sse({**head, "choices": [s.delta(_MARK)], **extra}).split(json.dumps(_MARK).encode())
                 for s in shapes]
    # per choice, not sent yet (their text is held back)
    held = [{"token_ids": [], "logprobs": [], "top_logprobs": []} for _ in shapes]

    def chunk(i: int, m: dict) -> bytes | None:
        if not want_logprobs:
            return templates[i][0] + json.dumps(m["text"]).encode() + templates[i][1] if m["text"] else None
        for key, values in held[i].items():
            values.extend(m.get(key) or ())
        if not m["text"]:
            return None
        lp = shapes[i].logprobs(ctx, **held[i])
        for values in held[i].values():
            values.clear()
        return sse({**head, "choices": [shapes[i].delta(m["text"], lp)], **extra})

    # The next batch of each choice still running: read only while this body is being read, so a
    # client gone (this generator left) leaves the requests unread, and their cancel goes out.
    waiting: dict[asyncio.Future, int] = {}
    ready: list[tuple[int, list]] = [(0, first)]
    for i in range(1, len(shapes)):
        waiting[asyncio.ensure_future(batches[i].__anext__())] = i
    dones: list[dict] = []
    try:
        openings = [s.opening() for s in shapes]
        if openings[0] is not None:
            yield b"".join(sse({**head, "choices": [o], **extra}) for o in openings)
        while len(dones) < len(shapes):
            if ready:
                i, batch = ready.pop(0)
            elif len(shapes) == 1:  # one choice: read it here, no task in between
                i, batch = 0, await batches[0].__anext__()
            else:
                arrived, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                ready.extend((waiting.pop(f), f.result()) for f in arrived)
                i, batch = ready.pop(0)
            if len(shapes) > 1 and batch[-1]["type"] == "chunk":
                waiting[asyncio.ensure_future(batches[i].__anext__())] = i
            out = [c for c in (chunk(i, m) for m in batch if m["type"] == "chunk") if c is not None]
            last = batch[-1]
            if last["type"] != "chunk":
                done = terminal_or_raise(last)
                dones.append(done)
                rest = shapes[i].logprobs(ctx, **held[i]) if want_logprobs and held[i]["token_ids"] else None
                out.append(sse({**head, "choices": [shapes[i].last(ctx, done, rest)], **extra}))
                if include_usage and len(dones) == len(shapes):
                    out.append(sse({**head, "choices": [], "usage": _usage(dones)}))
            if out:
                yield b"".join(out)
    except HttpError as e:  # after the 200 went out: the error as an event, as OpenAI does
        yield sse(e.body())
    finally:
        for f in waiting:
            f.cancel()
        for call in calls:
            call.abandon()  # the client went away mid-stream: cancel (no-op once ended)
    yield b"data: [DONE]\n\n"


def json_value(value: Any) -> Any:
    """A parsed JSON value as JSON can write it again: a number too large for a float (``1e999``, read as
    infinity) becomes null, as JavaScript's JSON.stringify writes it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_value(v) for v in value]
    return value


def _usage(dones: list[dict]) -> dict[str, int]:
    """One prompt, every choice's completion."""
    prompt = dones[0]["usage"]["prompt_tokens"]
    completion = sum(d["usage"]["completion_tokens"] for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_texts(ctx: Context, token_ids: list[int], as_ids: bool = False) -> list[str]:
    """Each token's text; ``as_ids``: ``token_id:ID`` (vLLM's return_tokens_as_token_ids)."""
    if as_ids:
        return [f"token_id:{t}" for t in token_ids]
    return ctx.tokenizer.batch_decode([[t] for t in token_ids]) if ctx.tokenizer is not None else \
        [str(t) for t in token_ids]


def _texts(ctx: Context, token_ids: list[int], top_logprobs: list | None,
           as_ids: bool = False) -> tuple[list[str], list[list]]:
    """The tokens' texts, and per token its alternatives as (text, logprob), best first (one decode call)."""
    tops = top_logprobs or [[] for _ in token_ids]
    texts = _token_texts(ctx, [*token_ids, *(t for top in tops for t, _ in top)], as_ids)
    at = len(token_ids)
    alternatives = []
    for top in tops:
        alternatives.append([(texts[at + j], lp) for j, (_, lp) in enumerate(top)])
        at += len(top)
    return texts[:len(token_ids)], alternatives


class _Shape:
    """One choice's pieces of the answer (``index``: its place among the request's ``n``)."""

    prefix = object = chunk_object = ""

    def __init__(self, index: int = 0, as_ids: bool = False) -> None:
        self.index = index
        self.as_ids = as_ids  # logprobs' tokens as "token_id:ID"

    def choice(self, ctx: Context, done: dict) -> dict: ...
    def opening(self) -> dict | None: ...
    def delta(self, text: str, logprobs: dict | None = None) -> dict: ...
    def last(self, ctx: Context, done: dict, logprobs: dict | None) -> dict: ...

    def _end_fields(self, done: dict, logprobs: dict | None) -> dict:
        out: dict[str, Any] = {"finish_reason": done["finish_reason"], "logprobs": logprobs}
        if "output" in done:
            out["output"] = json_value(done["output"])  # the grammar's parsed result (a Tandem extra)
        return out

    def all_logprobs(self, ctx: Context, done: dict) -> dict | None:
        """The whole completion's logprobs (a non-streamed answer), None if not asked."""
        if "logprobs" not in done:
            return None
        return self.logprobs(ctx, done["token_ids"], done["logprobs"], done.get("top_logprobs"))

    def logprobs(self, ctx: Context, token_ids: list[int], logprobs: list[float], top_logprobs: list | None) -> dict:
        """``top_logprobs``: per token, its alternatives' [token id, logprob] pairs (empty or None: none asked)."""


class _ChatShape(_Shape):
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, ctx, done):
        return {"index": self.index, "message": {"role": "assistant", "content": done["text"]},
                **self._end_fields(done, self.all_logprobs(ctx, done))}

    def opening(self):
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, text, logprobs=None):
        return {"index": self.index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}

    def last(self, ctx, done, logprobs):
        return {"index": self.index, "delta": {}, **self._end_fields(done, logprobs)}

    def logprobs(self, ctx, token_ids, logprobs, top_logprobs=None):
        tokens, tops = _texts(ctx, token_ids, top_logprobs, self.as_ids)
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top]}
                            for t, lp, top in zip(tokens, logprobs, tops)]}


class _CompletionShape(_Shape):
    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, index: int = 0, as_ids: bool = False) -> None:
        super().__init__(index, as_ids)
        self.offset = 0  # text_offset of the next token: its tokens' texts so far (streamed in parts)

    def choice(self, ctx, done):
        return {"index": self.index, "text": done["text"], **self._end_fields(done, self.all_logprobs(ctx, done))}

    def opening(self):
        return None

    def delta(self, text, logprobs=None):
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def last(self, ctx, done, logprobs):
        return {"index": self.index, "text": "", **self._end_fields(done, logprobs)}

    def logprobs(self, ctx, token_ids, logprobs, top_logprobs=None):
        tokens, tops = _texts(ctx, token_ids, top_logprobs, self.as_ids)
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "text_offset": offsets,
                "top_logprobs": [dict(top) for top in tops] if top_logprobs else None}


CREATED = int(time.time())  # when this server process started: the model's "created"
