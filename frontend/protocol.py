"""Tandem client protocol, version 1: parsing and encoding (server side).

Pure functions, no sockets and no torch: the ROUTER loop hands the frames of
one client message to :func:`parse_client_message` and sends what the
``encode_*`` functions return.  The contract is ``docs/PROTOCOL.md``.

Every message, both directions, is two frames: :data:`VERSION_FRAME` then one
msgpack map with string keys.

Validation rules, in the order they are applied:

1. frame 0 must be ``b"TANDEM1"``             -> ``unsupported_version``
2. total size <= ``Limits.max_message_bytes``  -> ``too_long``
3. exactly two frames, frame 1 one msgpack map with string keys and a known
   string ``type``                             -> ``bad_request``
4. per type: required fields present, no unknown fields, every field of the
   right type and in range                     -> ``bad_request``; a prompt
   over ``Limits.max_prompt_chars`` / ``max_prompt_tokens`` -> ``too_long``.

A field sent as nil is treated as absent (so clients whose encoders turn
``undefined``/``None`` into nil work); a required field sent as nil is missing.
Errors carry the request id whenever a valid id could be read from the
message, so the server can answer to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import msgpack

from shared.sampling import SamplingParams

__all__ = [
    "VERSION_FRAME",
    "PROTOCOL_VERSION",
    "ERROR_CODES",
    "FINISH_REASONS",
    "ROLES",
    "MAX_ID_CHARS",
    "MAX_STOP",
    "Limits",
    "DEFAULT_LIMITS",
    "ProtocolError",
    "GenerateRequest",
    "CancelRequest",
    "PingRequest",
    "InfoRequest",
    "ClientMessage",
    "parse_client_message",
    "encode_chunk",
    "encode_done",
    "encode_error",
    "encode_pong",
    "encode_info",
]

VERSION_FRAME = b"TANDEM1"
PROTOCOL_VERSION = 1

ERROR_CODES = frozenset(
    {
        "bad_request",
        "unsupported_version",
        "duplicate_id",
        "too_long",
        "overloaded",
        "worker_failed",
        "internal",
    }
)
FINISH_REASONS = frozenset({"stop", "length", "cancelled"})
ROLES = ("system", "user", "assistant", "tool")

# Fixed by the contract (not configurable).
MAX_ID_CHARS = 128
MAX_STOP = 16

_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
_GENERATE_FIELDS = frozenset(
    {
        "type",
        "id",
        "prompt",
        "messages",
        "prompt_token_ids",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "stream",
        "logprobs",
        "grammar",
    }
)
_FIELDS = {
    "generate": _GENERATE_FIELDS,
    "cancel": frozenset({"type", "id"}),
    "ping": frozenset({"type", "nonce"}),
    "info": frozenset({"type"}),
}
_MESSAGE_FIELDS = frozenset({"role", "content"})


@dataclass(frozen=True)
class Limits:
    """Server-configurable limits (the id length and stop count are fixed by the contract)."""

    max_message_bytes: int = 1 << 20  # both frames together
    max_prompt_chars: int = 1 << 18  # prompt, or the sum of all messages' content
    max_prompt_tokens: int = 1 << 17  # prompt_token_ids length
    vocab_size: int | None = None  # when set, token ids must be < vocab_size


DEFAULT_LIMITS = Limits()


class ProtocolError(Exception):
    """A client message was rejected; answer it with :meth:`to_frames`."""

    def __init__(self, code: str, message: str, id: str | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id

    def to_frames(self) -> list[bytes]:
        return encode_error(self.id, self.code, self.message)

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.message!r}, id={self.id!r})"


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class GenerateRequest:
    """A validated ``generate``; every optional field resolved to its default.

    Exactly one of ``prompt``, ``messages``, ``prompt_token_ids`` is not None.
    ``grammar`` is the raw map (only checked to have a string ``kind``).
    """

    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = True
    logprobs: bool = False
    grammar: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )


@dataclass(frozen=True)
class CancelRequest:
    id: str


@dataclass(frozen=True)
class PingRequest:
    nonce: Any = None


@dataclass(frozen=True)
class InfoRequest:
    pass


ClientMessage = Union[GenerateRequest, CancelRequest, PingRequest, InfoRequest]


# --------------------------------------------------------------------------- helpers


def _tname(v: object) -> str:
    """The msgpack name of a decoded value's type, for error messages."""
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, (bytes, bytearray)):
        return "bin"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "map"
    return "ext"


def _short(v: object, limit: int = 40) -> str:
    """repr() of a value, truncated so error messages stay small."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        r = repr(v)
    else:
        r = _tname(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _valid_id(v: object) -> bool:
    return isinstance(v, str) and 1 <= len(v) <= MAX_ID_CHARS


def _peek_id(payload: bytes) -> str | None:
    """Best-effort: the ``id`` among the first entries of a msgpack map, else None.

    Used when the message as a whole is rejected before decoding (wrong version,
    oversize) so that the error can still be attributed.  Never raises.
    """
    try:
        up = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(payload) or 1)
        up.feed(payload)
        n = up.read_map_header()
        for _ in range(min(n, 8)):
            key = up.unpack()
            if key == "id":
                v = up.unpack()
                return v if _valid_id(v) else None
            up.skip()
    except Exception:
        pass
    return None


class _Ctx:
    """Carries the request id (once known) into the errors raised while validating."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id: str | None = None

    def bad(self, message: str) -> ProtocolError:
        return ProtocolError("bad_request", message, self.id)

    def too_long(self, message: str) -> ProtocolError:
        return ProtocolError("too_long", message, self.id)


def _check_keys(ctx: _Ctx, d: dict, where: str) -> None:
    for k in d:
        if not isinstance(k, str):
            raise ctx.bad(f"{where} keys must be strings, got a {_tname(k)} key")


def _check_id(ctx: _Ctx, msg: dict) -> str:
    v = msg.get("id")
    if v is None:
        raise ctx.bad("missing field 'id'")
    if not isinstance(v, str):
        raise ctx.bad(f"id must be a string, got {_tname(v)}")
    if not 1 <= len(v) <= MAX_ID_CHARS:
        raise ctx.bad(f"id must be 1 to {MAX_ID_CHARS} characters, got {len(v)}")
    ctx.id = v
    return v


def _check_unknown(ctx: _Ctx, msg: dict, allowed: frozenset, what: str) -> None:
    extra = sorted(k for k in msg if k not in allowed)
    if extra:
        names = ", ".join(_short(k) for k in extra[:5])
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        s = "s" if len(extra) > 1 else ""
        raise ctx.bad(f"unknown field{s} {names}{more} for {what}")


def _opt(ctx: _Ctx, msg: dict, name: str, default: Any, ok, what: str) -> Any:
    """An optional field: ``default`` when absent or nil, else a value that passes ``ok``."""
    v = msg.get(name)
    if v is None:
        return default
    if not ok(v):
        raise ctx.bad(f"{name} must be {what}, got {_tname(v)}")
    return v


def _opt_bool(ctx: _Ctx, msg: dict, name: str, default: bool) -> bool:
    return _opt(ctx, msg, name, default, lambda v: isinstance(v, bool), "a bool")


def _opt_int(ctx: _Ctx, msg: dict, name: str, default: Any, what: str) -> Any:
    return _opt(ctx, msg, name, default, _is_int, what)


def _opt_num(ctx: _Ctx, msg: dict, name: str, default: float, what: str) -> float:
    v = _opt(ctx, msg, name, None, _is_num, what)
    if v is None:
        return default
    try:
        return float(v)
    except OverflowError:  # an int too large for a float: let the range check reject it
        return math.inf


def _int_list(ctx: _Ctx, v: object, name: str, limits: Limits) -> list[int]:
    if not isinstance(v, list):
        raise ctx.bad(f"{name} must be an array of integers, got {_tname(v)}")
    for i, t in enumerate(v):
        if not _is_int(t):
            raise ctx.bad(f"{name}[{i}] must be an integer, got {_tname(t)}")
        if t < 0:
            raise ctx.bad(f"{name}[{i}] must be >= 0, got {t}")
        if limits.vocab_size is not None and t >= limits.vocab_size:
            raise ctx.bad(f"{name}[{i}] must be < vocab size {limits.vocab_size}, got {t}")
    return v


# --------------------------------------------------------------------------- parsing


def parse_client_message(frames: Sequence[bytes], limits: Limits | None = None) -> ClientMessage:
    """Validate one client message (its frames, ROUTER identity already removed).

    Returns a request object or raises :class:`ProtocolError`; never raises
    anything else for any input frames.
    """
    limits = limits or DEFAULT_LIMITS
    ctx = _Ctx()
    try:
        frames = [f if isinstance(f, bytes) else bytes(f) for f in frames]
    except Exception:
        raise ctx.bad("frames must be bytes") from None

    if not frames:
        raise ProtocolError("unsupported_version", "empty message: expected the version frame b'TANDEM1'")
    if frames[0] != VERSION_FRAME:
        pid = _peek_id(frames[1]) if len(frames) > 1 else None
        got = frames[0][:16]
        raise ProtocolError(
            "unsupported_version",
            f"unsupported protocol version frame {got!r}{'...' if len(frames[0]) > 16 else ''}; "
            f"this server speaks {VERSION_FRAME!r}",
            pid,
        )
    size = sum(len(f) for f in frames)
    if size > limits.max_message_bytes:
        pid = _peek_id(frames[1]) if len(frames) > 1 else None
        raise ProtocolError(
            "too_long", f"message is {size} bytes, the limit is {limits.max_message_bytes}", pid
        )
    if len(frames) < 2:
        raise ctx.bad("missing payload frame: a message is the version frame then one msgpack map")
    if len(frames) > 2:
        ctx.id = _peek_id(frames[1])
        raise ctx.bad(f"message has {len(frames)} frames, expected 2 (further frames are reserved)")

    try:
        msg = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except msgpack.ExtraData:
        raise ctx.bad("payload has trailing bytes after the msgpack map") from None
    except UnicodeDecodeError:
        raise ctx.bad("payload contains a string that is not valid UTF-8") from None
    except msgpack.StackError:
        raise ctx.bad("payload is nested too deeply") from None
    except Exception as e:  # OutOfData, FormatError, unhashable keys, ...
        raise ctx.bad(f"payload is not valid msgpack ({type(e).__name__})") from None

    if not isinstance(msg, dict):
        raise ctx.bad(f"payload must be a msgpack map, got {_tname(msg)}")
    _check_keys(ctx, msg, "payload")
    if _valid_id(msg.get("id")):
        ctx.id = msg["id"]

    t = msg.get("type")
    if t is None:
        raise ctx.bad("missing field 'type'")
    if not isinstance(t, str):
        raise ctx.bad(f"type must be a string, got {_tname(t)}")
    if t not in _FIELDS:
        raise ctx.bad(f"unknown message type {_short(t)}; expected one of generate, cancel, ping, info")

    if t == "generate":
        return _parse_generate(ctx, msg, limits)
    if t == "cancel":
        id_ = _check_id(ctx, msg)
        _check_unknown(ctx, msg, _FIELDS["cancel"], "cancel")
        return CancelRequest(id_)
    if t == "ping":
        _check_unknown(ctx, msg, _FIELDS["ping"], "ping")
        nonce = msg.get("nonce")
        try:  # it is echoed back, so it must survive re-encoding
            msgpack.packb(nonce, use_bin_type=True)
        except Exception:
            raise ctx.bad("nonce cannot be echoed (nested too deeply)") from None
        return PingRequest(nonce)
    _check_unknown(ctx, msg, _FIELDS["info"], "info")
    return InfoRequest()


def _parse_generate(ctx: _Ctx, msg: dict, limits: Limits) -> GenerateRequest:
    id_ = _check_id(ctx, msg)
    _check_unknown(ctx, msg, _GENERATE_FIELDS, "generate")

    given = [f for f in _PROMPT_FIELDS if msg.get(f) is not None]
    if len(given) != 1:
        got = "none" if not given else " and ".join(given)
        raise ctx.bad(f"exactly one of prompt, messages, prompt_token_ids is required, got {got}")

    prompt = messages = prompt_token_ids = None
    if given[0] == "prompt":
        prompt = msg["prompt"]
        if not isinstance(prompt, str):
            raise ctx.bad(f"prompt must be a string, got {_tname(prompt)}")
        if not prompt:
            raise ctx.bad("prompt must not be empty")
        if len(prompt) > limits.max_prompt_chars:
            raise ctx.too_long(
                f"prompt is {len(prompt)} characters, the limit is {limits.max_prompt_chars}"
            )
    elif given[0] == "messages":
        messages = _parse_messages(ctx, msg["messages"], limits)
    else:
        v = msg["prompt_token_ids"]
        if isinstance(v, list):  # cheap checks first
            if not v:
                raise ctx.bad("prompt_token_ids must not be empty")
            if len(v) > limits.max_prompt_tokens:
                raise ctx.too_long(
                    f"prompt_token_ids has {len(v)} tokens, the limit is {limits.max_prompt_tokens}"
                )
        prompt_token_ids = _int_list(ctx, v, "prompt_token_ids", limits)

    max_tokens = _opt_int(ctx, msg, "max_tokens", 256, "an integer >= 1")
    temperature = _opt_num(ctx, msg, "temperature", 0.0, "a finite number >= 0")
    top_p = _opt_num(ctx, msg, "top_p", 1.0, "a number in (0, 1]")
    top_k = _opt_int(ctx, msg, "top_k", 0, "an integer >= 0")
    seed = _opt_int(ctx, msg, "seed", None, "a 64-bit integer")

    stop_v = msg.get("stop")
    stop: tuple[str, ...] = ()
    if stop_v is not None:
        if not isinstance(stop_v, list):
            raise ctx.bad(f"stop must be an array of strings, got {_tname(stop_v)}")
        if len(stop_v) > MAX_STOP:
            raise ctx.bad(f"stop may hold at most {MAX_STOP} strings, got {len(stop_v)}")
        for i, s in enumerate(stop_v):
            if not isinstance(s, str):
                raise ctx.bad(f"stop[{i}] must be a string, got {_tname(s)}")
            if not s:
                raise ctx.bad(f"stop[{i}] must not be empty")
        stop = tuple(stop_v)

    sti_v = msg.get("stop_token_ids")
    stop_token_ids: tuple[int, ...] = ()
    if sti_v is not None:
        stop_token_ids = tuple(_int_list(ctx, sti_v, "stop_token_ids", limits))

    ignore_eos = _opt_bool(ctx, msg, "ignore_eos", False)
    stream = _opt_bool(ctx, msg, "stream", True)
    logprobs = _opt_bool(ctx, msg, "logprobs", False)

    grammar = msg.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, dict):
            raise ctx.bad(f"grammar must be a map, got {_tname(grammar)}")
        _check_keys(ctx, grammar, "grammar")
        kind = grammar.get("kind")
        if kind is None:
            raise ctx.bad("grammar.kind is required")
        if not isinstance(kind, str):
            raise ctx.bad(f"grammar.kind must be a string, got {_tname(kind)}")

    req = GenerateRequest(
        id=id_,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=prompt_token_ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        stream=stream,
        logprobs=logprobs,
        grammar=grammar,
    )
    # Range checks live in one place, shared with the worker: SamplingParams.validate().
    # Types were checked above, so its messages only ever quote short numbers.
    try:
        req.sampling_params().validate(limits.vocab_size)
    except ValueError as e:
        raise ctx.bad(str(e)) from None
    return req


def _parse_messages(ctx: _Ctx, v: object, limits: Limits) -> list[dict[str, str]]:
    if not isinstance(v, list):
        raise ctx.bad(f"messages must be an array of {{role, content}} maps, got {_tname(v)}")
    if not v:
        raise ctx.bad("messages must not be empty")
    total = 0
    out: list[dict[str, str]] = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ctx.bad(f"{where} must be a map with role and content, got {_tname(m)}")
        _check_keys(ctx, m, where)
        _check_unknown(ctx, m, _MESSAGE_FIELDS, where)
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise ctx.bad(f"{where}.role is required")
        if not isinstance(role, str):
            raise ctx.bad(f"{where}.role must be a string, got {_tname(role)}")
        if role not in ROLES:
            raise ctx.bad(f"{where}.role must be one of {', '.join(ROLES)}, got {_short(role)}")
        if content is None:
            raise ctx.bad(f"{where}.content is required")
        if not isinstance(content, str):
            raise ctx.bad(f"{where}.content must be a string, got {_tname(content)}")
        total += len(content)
        out.append({"role": role, "content": content})
    if total > limits.max_prompt_chars:
        raise ctx.too_long(
            f"messages hold {total} characters of content, the limit is {limits.max_prompt_chars}"
        )
    return out


# --------------------------------------------------------------------------- encoding


def _frames(obj: dict) -> list[bytes]:
    return [VERSION_FRAME, msgpack.packb(obj, use_bin_type=True)]


def encode_chunk(id: str, seq: int, text: str, token_ids: Sequence[int]) -> list[bytes]:
    return _frames(
        {"type": "chunk", "id": id, "seq": int(seq), "text": text, "token_ids": [int(t) for t in token_ids]}
    )


def encode_done(
    id: str,
    finish_reason: str,
    text: str,
    token_ids: Sequence[int],
    usage: Mapping[str, Any],
    metrics: Mapping[str, Any],
    output: Any = None,
    logprobs: Any = None,
) -> list[bytes]:
    """``output`` / ``logprobs`` are omitted from the message when None."""
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
    return _frames(msg)


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
