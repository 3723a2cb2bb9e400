"""Moondream-compatible routes: ``POST /v1/caption``, ``/v1/query``, ``/v1/point``, ``/v1/detect``.

The request and answer shapes are those the ``moondream`` Python client
(``moondream.vl(endpoint="http://HOST:PORT/v1")``) sends and parses. Prompts,
sampling defaults and grammars come from ``frontend/skills.py``. Streaming
caption/query answers are server-sent events ``data: {"chunk": TEXT}``, then
``data: {"completed": true, "finish_reason", "usage"}``.

Caption, point and detect need an image; ``query`` works without one. A model
without a vision encoder answers every image with a 400
(``common.image_input``).
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse

from frontend import skills
from .bridge import Call
from .common import (Context, check_model, first_event, image_input, read_body, run_to_end, session_of,
                     sse, sse_response, terminal_or_raise)
from .errors import HttpError, bad_request


async def caption(ctx: Context, request: Request):
    body = await _body(ctx, request, "/v1/caption")
    images = _image(ctx, body, required=True)
    length = body.length or "normal"
    if ctx.native_skills:
        fields = _skill(skills.native, "caption", {"length": length}, body.settings)
    else:
        fields = _skill(skills.caption, length, body.settings)
    return await _text_answer(ctx, request, body, {**fields, **images}, "caption")


async def query(ctx: Context, request: Request):
    body = await _body(ctx, request, "/v1/query")
    images = _image(ctx, body, required=False)
    if ctx.native_skills:
        own = {"question": body.question, "reasoning": body.reasoning, "spatial_refs": body.spatial_refs}
        fields = _skill(skills.native, "query", own, body.settings)
    else:
        if body.reasoning:
            raise bad_request("reasoning is not supported by this model")
        fields = _skill(skills.query, body.question, body.settings)
    return await _text_answer(ctx, request, body, {**fields, **images}, "answer")


async def point(ctx: Context, request: Request):
    return await _located(ctx, request, "/v1/point", skills.point, "points")


async def detect(ctx: Context, request: Request):
    return await _located(ctx, request, "/v1/detect", skills.detect, "objects")


# --------------------------------------------------------------------------- shared


async def _body(ctx: Context, request: Request, route: str) -> Any:
    body = await read_body(request, route, ctx.max_body_bytes)
    check_model(ctx, body.model)
    return body


def _image(ctx: Context, body: Any, required: bool) -> dict[str, Any]:
    """The request's ``images`` field (the protocol places the image before the skill's text)."""
    url = body.image_url
    if url is None:
        if required:
            raise bad_request("image_url is required (a data: URL of the image)")
        return {}
    return {"images": [image_input(ctx, url)]}


def _skill(fn, *args) -> dict[str, Any]:
    try:
        return fn(*args)
    except skills.SkillError as e:
        raise bad_request(str(e)) from None


async def _located(ctx: Context, request: Request, route: str, fn, key: str):
    body = await _body(ctx, request, route)
    images = _image(ctx, body, required=True)
    if ctx.native_skills:
        fields = _skill(skills.native, "point" if key == "points" else "detect", {"object": body.object},
                        body.settings)
    else:
        fields = _skill(fn, body.object, body.settings)
    call = ctx.bridge.generate({**fields, **images, "stream": False}, session=session_of(request, body.user))
    done = await run_to_end(request, call)
    if "output" not in done and done["finish_reason"] == "length":  # the settings' doing, not the server's
        raise bad_request(f"the {key} did not fit in {done['usage']['completion_tokens']} tokens (finish_reason "
                          "length): raise settings.max_tokens or lower settings.max_objects")
    if "output" not in done:
        raise HttpError(500, f"the answer did not complete (finish_reason {done['finish_reason']})", "internal",
                        "server_error")
    return JSONResponse({key: done["output"][key], "request_id": done["id"]})


async def _text_answer(ctx: Context, request: Request, body: Any, fields: dict, key: str):
    stream = bool(body.stream)
    call = ctx.bridge.generate({**fields, "stream": stream}, session=session_of(request, body.user))
    if not stream:
        done = await run_to_end(request, call)
        reasoning = {"reasoning": done["reasoning"]} if "reasoning" in done else {}
        return JSONResponse({key: done["text"], **reasoning, "finish_reason": done["finish_reason"],
                             "usage": done["usage"], "request_id": done["id"]})
    events = call.events()
    first = await first_event(request, events)
    return sse_response(_stream(call, events, first))


async def _stream(call: Call, events: AsyncIterator[dict], first: dict) -> AsyncIterator[bytes]:
    msg = first
    try:
        while msg["type"] == "chunk":
            if msg["text"]:
                yield sse({"chunk": msg["text"]})
            msg = await events.__anext__()
        done = terminal_or_raise(msg)
        yield sse({"completed": True, "finish_reason": done["finish_reason"], "usage": done["usage"]})
    except HttpError as e:
        yield sse({**e.body(), "completed": True})
    finally:
        call.abandon()
