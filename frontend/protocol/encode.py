"""Tandem client protocol, version 1: encoding, both directions (``docs/PROTOCOL.md``).

Each ``encode_*`` returns a message's two frames (:data:`VERSION_FRAME`, one msgpack map);
a value msgpack cannot carry is named (:class:`Unencodable`) or made carriable (:func:`carriable`).
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import msgpack

from .wire import ERROR_CODES, FINISH_REASONS, PROTOCOL_VERSION, VERSION_FRAME


def _frames(obj: dict) -> list[bytes]:
    return [VERSION_FRAME, msgpack.packb(obj, use_bin_type=True)]


class Unencodable(ValueError):
    """A message field holds a value msgpack cannot carry (the message names the field)."""


_UNENCODABLE = {OverflowError: "an integer out of range (msgpack carries integers of at most 64 bits)",
                UnicodeEncodeError: "a string that is not valid Unicode (a lone surrogate such as \\ud800)"}


def encode_message(msg: Mapping[str, Any]) -> list[bytes]:
    """A client message's frames. Python (and JSON) allow values msgpack cannot carry: integers
    beyond 64 bits, strings with lone surrogates; they raise :class:`Unencodable` naming the field."""
    try:
        return _frames(dict(msg))
    except (OverflowError, UnicodeEncodeError):
        for name, value in msg.items():  # the error path only: find the field to name
            try:
                msgpack.packb(value, use_bin_type=True)
            except (OverflowError, UnicodeEncodeError) as e:
                raise Unencodable(f"{name} holds {_UNENCODABLE[type(e)]}") from None
        raise


def encode_chunk(id: str, seq: int, text: str, token_ids: Sequence[int],
                 logprobs: Sequence[float] | None = None, top_logprobs: Sequence | None = None) -> list[bytes]:
    """``logprobs`` / ``top_logprobs`` (one per token id) are omitted from the message when None."""
    msg = {"type": "chunk", "id": id, "seq": int(seq), "text": text, "token_ids": [int(t) for t in token_ids]}
    if logprobs is not None:
        msg["logprobs"] = [float(x) for x in logprobs]
    if top_logprobs is not None:
        msg["top_logprobs"] = top_logprobs
    return _frames(msg)


def encode_done(
    id: str,
    finish_reason: str,
    text: str,
    token_ids: Sequence[int],
    usage: Mapping[str, Any],
    metrics: Mapping[str, Any],
    output: Any = None,
    logprobs: Any = None,
    reasoning: Any = None,
    top_logprobs: Any = None,
) -> list[bytes]:
    """``output`` / ``logprobs`` / ``reasoning`` / ``top_logprobs`` are omitted from the message when None."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {finish_reason!r}")
    msg: dict[str, Any] = {
        "type": "done",
        "id": id,
        "finish_reason": finish_reason,
        "text": text,
        "token_ids": [int(t) for t in token_ids],
        "usage": dict(usage),
        "metrics": dict(metrics),
    }
    if output is not None:
        msg["output"] = output
    if logprobs is not None:
        msg["logprobs"] = logprobs
    if reasoning is not None:
        msg["reasoning"] = reasoning
    if top_logprobs is not None:
        msg["top_logprobs"] = top_logprobs
    try:
        return _frames(msg)
    except (OverflowError, UnicodeEncodeError):  # only a parsed output can hold such values
        msg["output"] = carriable(output)
        return _frames(msg)


_SURROGATE = re.compile("[\ud800-\udfff]")


def carriable(value: Any) -> Any:
    """A parsed JSON value as msgpack can carry it: an integer beyond 64 bits as a float (as
    JavaScript reads a JSON number), a lone surrogate (a ``"\\ud800"`` escape) as U+FFFD."""
    if isinstance(value, dict):
        return {carriable(k): carriable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [carriable(v) for v in value]
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < 1 << 64:
        try:
            return float(value)
        except OverflowError:  # beyond a float's range too
            return math.inf if value > 0 else -math.inf
    return value


def encode_error(id: str | None, code: str, message: str) -> list[bytes]:
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    return _frames({"type": "error", "id": id, "code": code, "message": message})


def encode_pong(nonce: Any = None) -> list[bytes]:
    return _frames({"type": "pong", "nonce": nonce})


def encode_info(
    model: str,
    max_batch: int,
    max_model_len: int,
    pipeline: bool,
    device: str,
    **extra: Any,
) -> list[bytes]:
    """``extra`` keys are added after the contract's fields (clients ignore unknown keys)."""
    msg: dict[str, Any] = {
        "type": "info",
        "protocol": PROTOCOL_VERSION,
        "model": model,
        "max_batch": int(max_batch),
        "max_model_len": int(max_model_len),
        "pipeline": bool(pipeline),
        "device": device,
    }
    for k, v in extra.items():
        msg.setdefault(k, v)
    return _frames(msg)
