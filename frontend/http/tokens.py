"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): a prompt's token ids as a generate
would see them, and the text of token ids.

A prompt is rendered as a generate's is (``frontend/tokenization.py``: the chat template, or
``--chat-template``, for ``messages``; the plain text without special tokens for ``prompt``)
and checked by the protocol's own rules (``protocol.parse_prompt``: roles, sizes, the
vocabulary), so ``count`` is the ``prompt_tokens`` a generate of the same prompt reports. The
work runs on the HTTP loop with its own tokenizer copy; the prompt-size limit bounds it.
"""
from __future__ import annotations

from contextlib import contextmanager

from starlette.requests import Request
from starlette.responses import JSONResponse

from frontend.server.tokenization import chat_prompt_ids, decode_ids, text_prompt_ids

from ..protocol.wire import CHAT_TEMPLATE_FIELDS
from ..protocol.parse import ProtocolError, parse_prompt, parse_token_ids, template_options
from .common import Context, check_model, read_body
from .errors import HttpError, bad_request
from .openai import chat_messages


async def tokenize(ctx: Context, request: Request):
    body = await read_body(request, "/tokenize", ctx.max_body_bytes)
    check_model(ctx, body.model)
    given = [name for name in ("prompt", "messages") if getattr(body, name) is not None]
    template = {f: getattr(body, f) for f in CHAT_TEMPLATE_FIELDS}
    if given == ["prompt"] and any(v is not None for v in template.values()):
        raise bad_request("add_generation_prompt, continue_final_message and chat_template_kwargs render "
                          "messages: send messages")
    if len(given) != 1:
        raise bad_request(f"exactly one of prompt and messages is required, got {' and '.join(given) or 'none'}")
    with _as_http_errors():
        if given == ["prompt"]:
            ids = text_prompt_ids(ctx.tokenizer, parse_prompt("prompt", body.prompt, ctx.limits))
        else:
            images: list[bytes] = []
            messages = chat_messages(ctx, body.messages, images)
            if images:
                raise bad_request("messages: /tokenize takes text only (an image's tokens depend on its tiling)")
            ids = chat_prompt_ids(ctx.tokenizer, parse_prompt("messages", messages, ctx.limits),
                                  **template_options(template))
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})


async def detokenize(ctx: Context, request: Request):
    body = await read_body(request, "/detokenize", ctx.max_body_bytes)
    check_model(ctx, body.model)
    with _as_http_errors():
        ids = parse_token_ids(body.tokens, "tokens", ctx.limits)
    return JSONResponse({"prompt": decode_ids(ctx.tokenizer, ids)})


@contextmanager
def _as_http_errors():
    """The protocol's errors (``bad_request``, ``too_long``) and a template's refusal as HTTP errors."""
    try:
        yield
    except ProtocolError as e:
        raise HttpError.from_protocol({"code": e.code, "message": e.message}) from None
    except ValueError as e:
        raise bad_request(str(e)) from None
