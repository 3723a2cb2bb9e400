"""What every HTTP route shares: the JSON body, the model name, images, running a
request to its end while watching the client, and server-sent events."""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import dataclasses
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from ..protocol.wire import DEFAULT_LIMITS, Limits
from .bridge import Bridge, Call
from .errors import HttpError, bad_request
from .openapi import decode_body

MAX_BODY_BYTES = 32 << 20  # images travel as data: URLs; the server's own limits apply after this


@dataclass
class Context:
    """What the routes need from the server (shared by every request on the HTTP loop)."""

    bridge: Bridge
    model: str  # the served model's name (--served-model-name, else --model), as /v1/models lists it
    tokenizer: Any = None  # logprobs' token strings, /tokenize and /detokenize (this loop's own copy)
    aliases: tuple[str, ...] = ()  # other names a request may give the served model (--model, when renamed)
    max_model_len: int = 0  # the context: prompt + generated tokens
    limits: Limits = DEFAULT_LIMITS  # the server's (prompt size, vocabulary): /tokenize checks what generate would
    adapters: tuple[str, ...] = ()  # the LoRA adapters served (--lora): OpenAI routes take them as models
    vision: bool = False  # the model takes images
    native_skills: bool = False  # the model renders its own skill prompts (Moondream: shared/families)
    sampling_defaults: dict = dataclasses.field(default_factory=dict)  # the model's (generation_config.json), applied by the server
    max_body_bytes: int = MAX_BODY_BYTES


class ClientGone(Exception):
    """The HTTP client disconnected; its request was cancelled."""


async def read_body(request: Request, route: str, limit: int) -> Any:
    """The request body as ``route``'s Struct (``openapi.body_types``): 400 if it is not a JSON
    object or a field's JSON type is not the documented one, 413 over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"the request body is {declared} bytes, the limit is {limit}", "too_long")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"the request body is over the limit of {limit} bytes", "too_long")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before the body arrived: nothing was started
        raise ClientGone() from None
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as e:  # not JSON, not UTF-8, or an integer of more than 4300 digits
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    return decode_body(route, body)  # each field's JSON type, as /openapi.json states it


def check_model(ctx: Context, model: str | None, adapters: bool = False) -> str:
    """The ``model`` the request names (absent, or one of its aliases: the served name); 404 for any
    other. With ``adapters``, the name of a served LoRA adapter is a model too (see :func:`adapter_field`)."""
    if model is None or model in ctx.aliases:
        return ctx.model
    if model != ctx.model and not (adapters and model in ctx.adapters):
        served = ", ".join(repr(m) for m in (ctx.model, *(ctx.adapters if adapters else ())))
        raise HttpError(404, f"the model {model!r} does not exist; this server serves {served}",
                        "model_not_found")
    return model


def adapter_field(ctx: Context, model: str) -> dict[str, str]:
    """The protocol's ``adapter`` field for a checked model name (none for the base model)."""
    return {"adapter": model} if model in ctx.adapters else {}


def session_of(request: Request, user: str | None) -> str | None:
    """The client's session: the ``X-Session-Id`` header, else OpenAI's ``user`` field (a cluster
    sends a session's requests to one replica, whose prefix cache holds its earlier turns)."""
    return request.headers.get("x-session-id") or user


async def server_info(ctx: Context) -> dict[str, Any] | None:
    """The server's ``info`` answer; None while the server loop is too busy to answer."""
    try:
        return await ctx.bridge.info()
    except TimeoutError:
        return None


def image_input(ctx: Context, url: Any, where: str = "image_url") -> bytes:
    """The encoded image file of an ``image_url`` (a ``data:`` URL, or OpenAI's ``{"url": ...}``):
    the one place images enter. The server decodes and checks the file like a ZeroMQ request's
    ``images``; a text-only model answers 400 naming the model."""
    if not ctx.vision:
        raise bad_request(f"this model ({ctx.model}) does not take images; send text only", "images_not_supported")
    if isinstance(url, dict):
        url, where = url.get("url"), f"{where}.url"
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise bad_request(f"{where} must be a data: URL (data:image/png;base64,...); "
                          "this server fetches nothing from the network")
    meta, payload = url[5:].split(",", 1)
    if not meta.endswith(";base64"):
        raise bad_request(f"{where} must be base64-encoded (data:<type>;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where} holds invalid base64") from None


async def unless_gone(request: Request, awaitable) -> Any:
    """Await a step of a request while watching the client: if it disconnects first, the
    step is cancelled (which leaves ``Call.events()``: the request is cancelled in the
    server) and ``ClientGone`` raised."""
    result = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
    if result.done() and not result.cancelled():
        return result.result()
    raise ClientGone()


async def run_to_end(request: Request, call: Call) -> dict[str, Any]:
    """The request's terminal message, as a result (``done``) or an ``HttpError``."""
    return terminal_or_raise(await unless_gone(request, call.result()))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def terminal_or_raise(msg: dict[str, Any]) -> dict[str, Any]:
    if msg["type"] == "error":
        raise HttpError.from_protocol(msg)
    return msg


async def first_event(request: Request, events: AsyncIterator[Any]) -> Any:
    """The first message (or batch, from ``Call.batches()``) of a streamed request, before the
    response starts: an error then is an HTTP error status, not a 200 stream that fails."""
    first = await unless_gone(request, events.__anext__())
    terminal_or_raise(first[-1] if isinstance(first, list) else first)
    return first


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_response(gen: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"
