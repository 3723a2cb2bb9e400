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
   For ``generate``: the prompt form, then every field's type, then the
   ranges of the sampling fields.

The sampling fields of ``generate`` are ``SamplingParams``' fields, with the
same names and defaults (``shared.sampling.SAMPLING_FIELDS``): this module
checks their wire types, ``SamplingParams.validate`` their ranges.

A field sent as nil is treated as absent (so clients whose encoders turn
``undefined``/``None`` into nil work); a required field sent as nil is missing.
Errors carry the request id whenever a valid id could be read from the
message, so the server can answer to it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import msgpack

from shared.sampling import MAX_TOP_LOGPROBS, SAMPLING_FIELD_NAMES, SAMPLING_FIELDS, SamplingParams

__all__ = [
    "VERSION_FRAME",
    "PROTOCOL_VERSION",
    "ERROR_CODES",
    "FINISH_REASONS",
    "ROLES",
    "MAX_ID_CHARS",
    "MAX_STOP",
    "PROMPT_FIELDS",
    "OUTPUT_FIELDS",
    "MODEL_FIELDS",
    "Limits",
    "DEFAULT_LIMITS",
    "ProtocolError",
    "GenerateRequest",
    "CancelRequest",
    "PingRequest",
    "InfoRequest",
    "ClientMessage",
    "parse_client_message",
    "prompt_field",
    "template_options",
    "CHAT_TEMPLATE_FIELDS",
    "MAX_CHOICES",
    "choice_request",
    "parse_prompt",
    "parse_token_ids",
    "encode_chunk",
    "encode_done",
    "encode_error",
    "encode_pong",
    "encode_info",
    "encode_message",
    "Unencodable",
]

VERSION_FRAME = b"TANDEM1"
PROTOCOL_VERSION = 1

ERROR_CODES = frozenset(
    {
        "bad_request",
        "unsupported_version",
        "duplicate_id",
        "too_long",
        "context_length_exceeded",
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
MAX_IMAGES = 8  # per request
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one encoded image file
MAX_IMAGE_SIDE = 8192  # width * height must not exceed MAX_IMAGE_SIDE ** 2

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids", "skill")  # exactly one per generate
# A skill's own fields (Moondream's skills; the server validates their values).
SKILL_FIELDS = ("length", "question", "reasoning", "spatial_refs", "object", "max_objects")
SKILLS = ("caption", "query", "point", "detect")
# Moondream's API defaults (its reference's caption/query sampling and max_objects), whichever model
# answers a skill: natively (frontend/moondream/) or as a prompted request (frontend/skills.py).
SKILL_SAMPLING = {"temperature": 0.5, "top_p": 0.3}
DEFAULT_MAX_OBJECTS = 50
MAX_GRAMMAR_OBJECTS = 100  # the most items a point/box grammar (frontend/grammars) takes
OUTPUT_FIELDS = ("stop", "stream", "logprobs", "top_logprobs", "grammar")  # optional, besides the sampling fields
# How the chat template renders messages (vLLM's names; only with messages).
CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# apply_chat_template's own arguments: not variables a request may set through chat_template_kwargs
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                 "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                 "truncation", "max_length", "return_tensors", "return_dict",
                                 "return_assistant_tokens_mask", "tokenizer_kwargs"})
MODEL_FIELDS = ("adapter",)  # optional: which weights answer (a LoRA adapter's name; nil = the base model)
_GENERATE_FIELDS = frozenset({"type", "id", "images", "truncate_prompt_tokens", *PROMPT_FIELDS, *SAMPLING_FIELD_NAMES,
                              *OUTPUT_FIELDS, *MODEL_FIELDS, *SKILL_FIELDS, *CHAT_TEMPLATE_FIELDS})
_PART_TYPES = ("text", "image")  # the parts of a message's content given as a list
_MESSAGE_FIELDS = frozenset({"role", "content"})


@dataclass(frozen=True)
class Limits:
    """Server-configurable limits (the id length and stop count are fixed by the contract)."""

    max_message_bytes: int = 1 << 20  # both frames together
    max_image_message_bytes: int = 64 << 20  # a generate carrying images
    max_prompt_chars: int = 1 << 18  # prompt, or the sum of all messages' content
    max_prompt_tokens: int = 1 << 17  # prompt_token_ids length
    # Every chat template spends at least one token on each message, so more messages than the
    # context holds tokens cannot fit: refused before any of them is parsed or rendered.
    max_messages: int = 1 << 17
    vocab_size: int | None = None  # when set, token ids must be < vocab_size


DEFAULT_LIMITS = Limits()


class SkillError(ValueError):
    """A skill's fields are wrong (a bad request, naming the field)."""


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
    The sampling fields are in ``sampling`` and also read as attributes
    (``req.max_tokens``). ``grammar`` is the raw map (only checked to have a
    string ``kind``).
    """

    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stream: bool = True
    logprobs: bool = False
    top_logprobs: int = 0  # each token's most likely alternatives too (implies logprobs)
    grammar: dict[str, Any] | None = None
    images: tuple[bytes, ...] = ()  # encoded image files, placed by <image> / image parts (not yet decoded)
    adapter: str | None = None  # a LoRA adapter the server was started with; None = the base model
    skill: dict[str, Any] | None = None  # {"skill": name, and its own fields as given}
    explicit: frozenset = frozenset()  # the sampling fields the message gave (a skill has its own defaults)
    # messages only: apply_chat_template's options (add_generation_prompt, continue_final_message, and the
    # chat_template_kwargs as template variables)
    template_options: dict[str, Any] = field(default_factory=dict)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (vLLM's left truncation)

    def __getattr__(self, name: str) -> Any:  # only called for names not found otherwise
        if name in SAMPLING_FIELD_NAMES:
            return getattr(self.sampling, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


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


MAX_CHOICES = 16  # choices of one request (OpenAI's n): each is a request of its own, its KV reserved


def choice_request(msg: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Choice ``i`` (0-based) of a request asked for several times (OpenAI's ``n``): one request per
    choice, the same fields but the id ``ID-i`` (choice 0 keeps ``ID``) and, with a seed, seed + i
    (modulo 2**64, within the seed's range), so that each choice is reproducible on its own."""
    out = dict(msg)
    if not 0 <= i < MAX_CHOICES:
        raise ValueError(f"n must be in [1, {MAX_CHOICES}]")
    if i and out.get("id") is not None:
        out["id"] = f"{out['id']}-{i}"
        if len(out["id"]) > MAX_ID_CHARS:
            raise ValueError(f"id: with n choices, an id takes at most {MAX_ID_CHARS - 3} characters")
    if i and out.get("seed") is not None:
        seed = out["seed"] + i
        out["seed"] = seed - (1 << 64) if seed >= 1 << 64 else seed
    return out


def prompt_field(msg: Mapping[str, Any]) -> str:
    """Which of ``prompt``, ``messages``, ``prompt_token_ids`` ``msg`` gives (None = not given).

    ``ValueError`` unless exactly one: the client checks its arguments with this too.
    """
    given = [f for f in PROMPT_FIELDS if msg.get(f) is not None]
    if len(given) != 1:
        got = " and ".join(given) or "none"
        raise ValueError(f"exactly one of {', '.join(PROMPT_FIELDS)} is required, got {got}")
    return given[0]


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


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


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


def _required_str(ctx: _Ctx, msg: dict, name: str) -> str:
    v = msg.get(name)
    if v is None:
        raise ctx.bad(f"missing field {name!r}")
    if not isinstance(v, str):
        raise ctx.bad(f"{name} must be a string, got {_tname(v)}")
    return v


def _check_id(ctx: _Ctx, msg: dict) -> str:
    v = _required_str(ctx, msg, "id")
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


def _opt_bool(ctx: _Ctx, msg: dict, name: str, default: bool) -> bool:
    """An optional bool field: ``default`` when absent or nil."""
    v = msg.get(name)
    if v is None:
        return default
    if not _is_bool(v):
        raise ctx.bad(f"{name} must be a bool, got {_tname(v)}")
    return v


def _opt_str(ctx: _Ctx, msg: dict, name: str) -> str | None:
    """An optional non-empty string field: None when absent or nil."""
    v = msg.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ctx.bad(f"{name} must be a string, got {_tname(v)}")
    if not v:
        raise ctx.bad(f"{name} must not be empty")
    return v


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


# --------------------------------------------------------------------------- the envelope


def parse_client_message(frames: Sequence[bytes], limits: Limits | None = None) -> ClientMessage:
    """Validate one client message (its frames, ROUTER identity already removed).

    Returns a request object or raises :class:`ProtocolError`; never raises
    anything else for any input frames.
    """
    limits = limits or DEFAULT_LIMITS
    ctx = _Ctx()
    payload = _payload_frame(ctx, frames, limits)
    msg = _decode_payload(ctx, payload)
    kind = _message_type(ctx, msg)
    size = len(VERSION_FRAME) + len(payload)
    if size > limits.max_message_bytes and not (kind == "generate" and msg.get("images")):
        raise ctx.too_long(f"message is {size} bytes, the limit is {limits.max_message_bytes}")
    return _PARSERS[kind](ctx, msg, limits)


def _payload_frame(ctx: _Ctx, frames: Sequence[bytes], limits: Limits) -> bytes:
    """Rules 1-3 on the frames: the version frame, the size, two frames. Returns the payload."""
    try:
        frames = [f if isinstance(f, bytes) else bytes(f) for f in frames]
    except Exception:
        raise ctx.bad("frames must be bytes") from None
    if not frames:
        raise ProtocolError("unsupported_version", "empty message: expected the version frame b'TANDEM1'")

    def peeked_id() -> str | None:  # the payload is not decoded yet: read the id from its first entries
        return _peek_id(frames[1]) if len(frames) > 1 else None

    if frames[0] != VERSION_FRAME:
        got = frames[0][:16]
        raise ProtocolError(
            "unsupported_version",
            f"unsupported protocol version frame {got!r}{'...' if len(frames[0]) > 16 else ''}; "
            f"this server speaks {VERSION_FRAME!r}",
            peeked_id(),
        )
    size = sum(len(f) for f in frames)
    cap = max(limits.max_message_bytes, limits.max_image_message_bytes)  # the tighter limit once decoded
    if size > cap:
        raise ProtocolError("too_long", f"message is {size} bytes, the limit is {cap}", peeked_id())
    if len(frames) < 2:
        raise ctx.bad("missing payload frame: a message is the version frame then one msgpack map")
    if len(frames) > 2:
        ctx.id = peeked_id()
        raise ctx.bad(f"message has {len(frames)} frames, expected 2 (further frames are reserved)")
    return frames[1]


def _decode_payload(ctx: _Ctx, payload: bytes) -> dict:
    """The payload as a map with string keys; remembers its id (if valid) for the errors after."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
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
    return msg


def _message_type(ctx: _Ctx, msg: dict) -> str:
    t = _required_str(ctx, msg, "type")
    if t not in _PARSERS:
        raise ctx.bad(f"unknown message type {_short(t)}; expected one of {', '.join(_PARSERS)}")
    return t


# --------------------------------------------------------------------------- one parser per type


def _parse_generate(ctx: _Ctx, msg: dict, limits: Limits) -> GenerateRequest:
    id_ = _check_id(ctx, msg)
    _check_unknown(ctx, msg, _GENERATE_FIELDS, "generate")
    prompt = _parse_prompt(ctx, msg, limits)
    sampling_values = _sampling_values(ctx, msg, limits)
    stop = _parse_stop(ctx, msg.get("stop"))
    stream = _opt_bool(ctx, msg, "stream", True)
    logprobs = _opt_bool(ctx, msg, "logprobs", False)
    top_logprobs = msg.get("top_logprobs")
    if top_logprobs is None:
        top_logprobs = 0
    elif not _is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        got = _short(top_logprobs) if _is_int(top_logprobs) else _tname(top_logprobs)
        raise ctx.bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {got}")
    grammar = _parse_grammar(ctx, msg.get("grammar"))
    images = _parse_images(ctx, msg.get("images"), prompt)
    adapter = _opt_str(ctx, msg, "adapter")  # whether the server has it is the server's check
    template_options = _template_options(ctx, msg, "messages" in prompt)
    truncate = msg.get("truncate_prompt_tokens")
    if truncate is not None:
        if not _is_int(truncate) or truncate < 1:
            raise ctx.bad(f"truncate_prompt_tokens must be an integer >= 1, got {_short(truncate)}")
        if images or "skill" in prompt:
            raise ctx.bad("truncate_prompt_tokens cannot be combined with images or a skill (their tokens "
                          "would be cut)")
    sampling = _sampling_params(ctx, sampling_values)  # ranges last, once every type is known good
    given = [f for f in SKILL_FIELDS if f in msg]
    if "skill" in prompt:
        if grammar is not None or stop:
            raise ctx.bad("grammar and stop cannot be combined with a skill (it has its own)")
        prompt["skill"] = {"skill": prompt["skill"], **{f: msg[f] for f in given}}
    elif given:
        raise ctx.bad(f"{given[0]} is a skill field: send it with skill")
    return GenerateRequest(id=id_, **prompt, sampling=sampling, stop=stop, stream=stream,
                           logprobs=logprobs or top_logprobs > 0, top_logprobs=top_logprobs,
                           grammar=grammar, images=images, adapter=adapter, template_options=template_options,
                           truncate_prompt_tokens=truncate,
                           explicit=frozenset(f for f in SAMPLING_FIELD_NAMES if msg.get(f) is not None))


def _parse_cancel(ctx: _Ctx, msg: dict, limits: Limits) -> CancelRequest:
    id_ = _check_id(ctx, msg)
    _check_unknown(ctx, msg, frozenset({"type", "id"}), "cancel")
    return CancelRequest(id_)


def _parse_ping(ctx: _Ctx, msg: dict, limits: Limits) -> PingRequest:
    _check_unknown(ctx, msg, frozenset({"type", "nonce"}), "ping")
    nonce = msg.get("nonce")
    try:  # it is echoed back, so it must survive re-encoding
        msgpack.packb(nonce, use_bin_type=True)
    except Exception:
        raise ctx.bad("nonce cannot be echoed (nested too deeply)") from None
    return PingRequest(nonce)


def _parse_info(ctx: _Ctx, msg: dict, limits: Limits) -> InfoRequest:
    _check_unknown(ctx, msg, frozenset({"type"}), "info")
    return InfoRequest()


_PARSERS = {"generate": _parse_generate, "cancel": _parse_cancel, "ping": _parse_ping, "info": _parse_info}


# --------------------------------------------------------------------------- generate's fields


def _parse_prompt(ctx: _Ctx, msg: dict, limits: Limits) -> dict[str, Any]:
    """The one prompt form given, as ``{field: validated value}``."""
    try:
        name = prompt_field(msg)
    except ValueError as e:
        raise ctx.bad(str(e)) from None
    parse = {"prompt": _parse_text, "messages": _parse_messages, "prompt_token_ids": _parse_token_ids,
             "skill": _parse_skill}[name]
    return {name: parse(ctx, msg[name], limits)}


def parse_prompt(name: str, value: object, limits: Limits | None = None) -> Any:
    """One prompt form (``prompt``, ``messages`` or ``prompt_token_ids``) checked as a generate's is
    (``ProtocolError`` naming the field): for what renders prompts outside a generate (HTTP ``/tokenize``)."""
    parse = {"prompt": _parse_text, "messages": _parse_messages, "prompt_token_ids": _parse_token_ids}[name]
    return parse(_Ctx(), value, limits or DEFAULT_LIMITS)


def template_options(msg: Mapping[str, Any]) -> dict[str, Any]:
    """The chat template's options a map gives (``CHAT_TEMPLATE_FIELDS``), checked as a generate's
    (``ProtocolError`` naming the field): for HTTP ``/tokenize``."""
    return _template_options(_Ctx(), msg, True)


def _template_options(ctx: _Ctx, msg: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """apply_chat_template's keyword arguments (vLLM's rules: continuing the final message opens no
    new one; the kwargs are template variables, not its own arguments)."""
    given = [f for f in CHAT_TEMPLATE_FIELDS if msg.get(f) is not None]
    if not given:
        return {}
    if not chat:
        raise ctx.bad(f"{given[0]} renders chat messages: send it with messages")
    add = _opt_bool(ctx, msg, "add_generation_prompt", True)
    continued = _opt_bool(ctx, msg, "continue_final_message", False)
    if add and continued:
        raise ctx.bad("continue_final_message needs add_generation_prompt: false (the final message is "
                      "continued, no new one is opened)")
    variables = msg.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise ctx.bad(f"chat_template_kwargs must be a map, got {_tname(variables)}")
    _check_keys(ctx, variables, "chat_template_kwargs")
    taken = sorted(set(variables) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise ctx.bad(f"chat_template_kwargs.{taken[0]} is not a template variable (send it as a field of "
                      "its own, if it is one)")
    return {**variables, "add_generation_prompt": add, "continue_final_message": continued}


def parse_token_ids(value: object, name: str, limits: Limits | None = None) -> list[int]:
    """Token ids of the vocabulary (``ProtocolError`` naming ``name``); may be empty (HTTP ``/detokenize``)."""
    return _int_list(_Ctx(), value, name, limits or DEFAULT_LIMITS)


def _parse_skill(ctx: _Ctx, v: object, limits: Limits) -> str:
    if not isinstance(v, str) or not v:
        raise ctx.bad(f"skill must be a skill's name (a string), got {_tname(v)}")
    return v


def _parse_text(ctx: _Ctx, v: object, limits: Limits) -> str:
    if not isinstance(v, str):
        raise ctx.bad(f"prompt must be a string, got {_tname(v)}")
    if not v:
        raise ctx.bad("prompt must not be empty")
    if len(v) > limits.max_prompt_chars:
        raise ctx.too_long(f"prompt is {len(v)} characters, the limit is {limits.max_prompt_chars}")
    return v


def _parse_token_ids(ctx: _Ctx, v: object, limits: Limits) -> list[int]:
    if isinstance(v, list):  # cheap checks first
        if not v:
            raise ctx.bad("prompt_token_ids must not be empty")
        if len(v) > limits.max_prompt_tokens:
            raise ctx.too_long(f"prompt_token_ids has {len(v)} tokens, the limit is {limits.max_prompt_tokens}")
    return _int_list(ctx, v, "prompt_token_ids", limits)


def _parse_messages(ctx: _Ctx, v: object, limits: Limits) -> list[dict[str, str]]:
    if not isinstance(v, list):
        raise ctx.bad(f"messages must be an array of {{role, content}} maps, got {_tname(v)}")
    if not v:
        raise ctx.bad("messages must not be empty")
    if len(v) > limits.max_messages:
        raise ctx.too_long(f"messages has {len(v)} entries, the limit is {limits.max_messages} "
                           "(each message takes at least one token of the context)")
    out = [_parse_chat_message(ctx, m, f"messages[{i}]") for i, m in enumerate(v)]
    total = sum(len(_content_text(m["content"])) for m in out)
    if total > limits.max_prompt_chars:
        raise ctx.too_long(
            f"messages hold {total} characters of content, the limit is {limits.max_prompt_chars}"
        )
    return out


def _parse_chat_message(ctx: _Ctx, m: object, where: str) -> dict[str, str]:
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
    if isinstance(content, list):
        return {"role": role, "content": _parse_parts(ctx, content, f"{where}.content")}
    if not isinstance(content, str):
        raise ctx.bad(f"{where}.content must be a string or an array of parts, got {_tname(content)}")
    return {"role": role, "content": content}


def _parse_parts(ctx: _Ctx, parts: list, where: str) -> list[dict[str, str]]:
    """``[{"type": "text", "text": str} | {"type": "image"}]``: text and the places of images."""
    out = []
    for i, part in enumerate(parts):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise ctx.bad(f"{at} must be a map, got {_tname(part)}")
        _check_keys(ctx, part, at)
        kind = part.get("type")
        if kind not in _PART_TYPES:
            raise ctx.bad(f"{at}.type must be one of {', '.join(_PART_TYPES)}, got {_short(kind)}")
        if kind == "text":
            _check_unknown(ctx, part, frozenset({"type", "text"}), at)
            if not isinstance(part.get("text"), str):
                raise ctx.bad(f"{at}.text must be a string, got {_tname(part.get('text'))}")
            out.append({"type": "text", "text": part["text"]})
        else:
            _check_unknown(ctx, part, frozenset({"type"}), at)
            out.append({"type": "image"})
    return out


def _content_text(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _parse_images(ctx: _Ctx, v: object, prompt: dict[str, Any]) -> tuple[bytes, ...]:
    """Only the envelope (count, types, sizes); decoding and placement are checked by the server."""
    messages = prompt.get("messages")
    image_parts = sum(1 for m in messages or () if isinstance(m["content"], list)
                      for p in m["content"] if p["type"] == "image")
    if v is None:
        if image_parts:
            raise ctx.bad(f"messages hold {image_parts} image parts but no images were sent")
        return ()
    if not isinstance(v, list):
        raise ctx.bad(f"images must be an array of bin (encoded image files), got {_tname(v)}")
    if "prompt_token_ids" in prompt:
        raise ctx.bad("images cannot be combined with prompt_token_ids: send prompt or messages")
    if len(v) > MAX_IMAGES:
        raise ctx.bad(f"images: too many images: {len(v)} (at most {MAX_IMAGES} per request)")
    for i, data in enumerate(v):
        if not isinstance(data, (bytes, bytearray)):
            raise ctx.bad(f"images[{i}] must be bin (an encoded image file), got {_tname(data)}")
        if len(data) > MAX_IMAGE_BYTES:
            raise ctx.bad(f"images[{i}]: image is {len(data)} bytes, more than the limit of {MAX_IMAGE_BYTES} "
                          "(20 MiB)")
    if "skill" in prompt:
        if len(v) > 1:
            raise ctx.bad(f"images: a skill takes one image, got {len(v)}")
    elif "prompt" in prompt:
        marks = prompt["prompt"].count("<image>")
        if marks != len(v):
            raise ctx.bad(f"images: the prompt has {marks} <image> placeholders but {len(v)} images were sent")
    elif image_parts and image_parts != len(v):
        raise ctx.bad(f"images: messages hold {image_parts} image parts but {len(v)} images were sent")
    return tuple(bytes(d) for d in v)


_WIRE_TYPE_OK = {int: _is_int, float: _is_num, bool: _is_bool}


def _sampling_values(ctx: _Ctx, msg: dict, limits: Limits) -> dict[str, Any]:
    """The sampling fields given (SamplingParams' fields, same names on the wire), type-checked.

    Absent or nil takes SamplingParams' default; ranges are left to SamplingParams.
    """
    values: dict[str, Any] = {}
    for f in SAMPLING_FIELDS:
        v = msg.get(f.name)
        if v is None:
            continue
        if f.type is tuple:  # token ids
            values[f.name] = tuple(_int_list(ctx, v, f.name, limits))
        elif f.type is dict:  # token id -> number (keys: integers, or decimal strings as JSON has them)
            if not isinstance(v, dict):
                raise ctx.bad(f"{f.name} must be {f.must_be}, got {_tname(v)}")
            values[f.name] = v
        elif not _WIRE_TYPE_OK[f.type](v):
            raise ctx.bad(f"{f.name} must be {f.must_be}, got {_tname(v)}")
        else:
            values[f.name] = _as_float(v) if f.type is float else v
    return values


def _as_float(v: int | float) -> float:
    try:
        return float(v)
    except OverflowError:  # an int too large for a float: let the range check reject it
        return math.inf


def _sampling_params(ctx: _Ctx, values: dict[str, Any]) -> SamplingParams:
    # Range checks live in one place, shared with the worker: SamplingParams.validate()
    # names the field. Types were checked before, so its messages only quote short numbers.
    try:
        return SamplingParams(**values)
    except ValueError as e:
        raise ctx.bad(str(e)) from None


def _parse_stop(ctx: _Ctx, v: object) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ctx.bad(f"stop must be an array of strings, got {_tname(v)}")
    if len(v) > MAX_STOP:
        raise ctx.bad(f"stop may hold at most {MAX_STOP} strings, got {len(v)}")
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise ctx.bad(f"stop[{i}] must be a string, got {_tname(s)}")
        if not s:
            raise ctx.bad(f"stop[{i}] must not be empty")
    return tuple(v)


def _parse_grammar(ctx: _Ctx, v: object) -> dict[str, Any] | None:
    """Only the shape: a map with a string ``kind`` (the grammar module checks the rest)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ctx.bad(f"grammar must be a map, got {_tname(v)}")
    _check_keys(ctx, v, "grammar")
    kind = v.get("kind")
    if kind is None:
        raise ctx.bad("grammar.kind is required")
    if not isinstance(kind, str):
        raise ctx.bad(f"grammar.kind must be a string, got {_tname(kind)}")
    return v


# --------------------------------------------------------------------------- encoding


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
        return _as_float(value) if value > 0 else -_as_float(-value)
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
