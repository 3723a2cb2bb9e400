"""Tandem client protocol, version 1: parsing (server side).
Pure functions, no sockets and no torch: the ROUTER loop hands the frames of
one client message to :func:`parse_client_message` and sends what the
``encode_*`` functions (``encode.py``) return.  The contract is ``docs/PROTOCOL.md``.

Every message, both directions, is two frames: :data:`VERSION_FRAME` then one
msgpack map with string keys.

Validation rules, in the order they are applied:

1. frame 0 must be ``b"TANDEM1"``             -> ``unsupported_version``
2. total size <= ``Limits.max_message_bytes``  -> ``too_long``
3. exactly two frames, frame 1 one msgpack map with string keys and a known
   string ``type``                             -> ``bad_request``
4. per type: no unknown fields, then every field's type (msgspec, against the
   message's wire type: ``GenerateFields``, ...), then what a type cannot say:
   required fields, the prompt form, lengths and ranges -> ``bad_request``; a
   prompt over ``Limits.max_prompt_chars`` / ``max_prompt_tokens`` -> ``too_long``.

The sampling fields of ``generate`` are ``SamplingParams``' fields, with the
same names and defaults (``shared.sampling.SAMPLING_FIELDS``): the wire type
declares their types, ``SamplingParams.validate`` checks their ranges. A type
error is worded as ``<field> must be <MUST_BE[field]>, got <msgpack type>``.

A field sent as nil is treated as absent (so clients whose encoders turn
``undefined``/``None`` into nil work); a required field sent as nil is missing.
Errors carry the request id whenever a valid id could be read from the
message, so the server can answer to it.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import msgpack
import msgspec

from shared.sampling import MAX_TOP_LOGPROBS, SAMPLING_FIELD_NAMES, SAMPLING_FIELDS, SamplingParams

from .encode import encode_error
from .wire import (
    CHAT_TEMPLATE_FIELDS,
    DEFAULT_LIMITS,
    ERROR_CODES,
    MAX_ID_CHARS,
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_STOP,
    MUST_BE,
    PART_TYPES,
    ROLES,
    SKILL_FIELDS,
    TEMPLATE_ARGUMENTS,
    TOKEN_ID_FIELDS,
    VERSION_FRAME,
    WIRE_FIELDS,
    WIRE_TYPES,
    CancelFields,
    CancelRequest,
    ChatMessage,
    ClientMessage,
    GenerateFields,
    GenerateRequest,
    InfoFields,
    InfoRequest,
    Limits,
    PingFields,
    PingRequest,
    TextPart,
    prompt_field,
)


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


def _valid_id(v: object) -> bool:
    return isinstance(v, str) and 1 <= len(v) <= MAX_ID_CHARS


def _bad(message: str) -> ProtocolError:
    """A bad request; the envelope adds the request's id once it is known."""
    return ProtocolError("bad_request", message)


def _too_long(message: str) -> ProtocolError:
    return ProtocolError("too_long", message)


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


def _check_keys(d: dict, where: str) -> None:
    for k in d:
        if not isinstance(k, str):
            raise _bad(f"{where} keys must be strings, got a {_tname(k)} key")


def _check_unknown(msg: dict, allowed: frozenset, what: str) -> None:
    extra = sorted(k for k in msg if k not in allowed)
    if extra:
        names = ", ".join(_short(k) for k in extra[:5])
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        s = "s" if len(extra) > 1 else ""
        raise _bad(f"unknown field{s} {names}{more} for {what}")


# --------------------------------------------------------------------------- wire types -> errors

_PATH_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+)\]")


def _convert(value: Any, wire_type: Any, name: str = "", kind: str = "") -> Any:
    """``value`` as ``wire_type`` (msgspec checks every type), or the protocol's ``bad_request`` for the
    first value of a wrong type (where ``value`` is one field: ``name`` the path's root, ``kind`` its
    key in MUST_BE when that is not its name)."""
    try:
        return msgspec.convert(value, wire_type, strict=True)
    except msgspec.ValidationError as e:
        raise _wire_error(str(e), value, name, kind or name) from None


def _wire_error(error: str, value: Any, name: str, kind: str) -> ProtocolError:
    """msgspec's ``"<what> - at `$.messages[0].role`"`` in the protocol's words, naming the value by
    its path (``messages[0].role``) and its msgpack type."""
    what, _, at = error.rpartition(" - at `")
    if not what:
        what, at = error, "$`"
    key_error = at.startswith("key` in `")
    steps = _PATH_STEP.findall(at.removeprefix("key` in `").removeprefix("$").rstrip("`"))
    where, pattern = name, kind
    for field_name, index in steps:
        if index:
            value = value[int(index)] if isinstance(value, list) else None
            where, pattern = f"{where}[{index}]", f"{pattern}[]"
        else:
            value = value.get(field_name) if isinstance(value, dict) else None
            where, pattern = (f"{s}.{field_name}" if s else field_name for s in (where, pattern))
    if key_error:
        key = next((k for k in value or () if not isinstance(k, str)), None)
        return _bad(f"{where} keys must be strings, got a {_tname(key)} key")
    if what.startswith("Object contains unknown field `"):
        return _bad(f"unknown field {_short(what.split('`')[1])} for {where}")
    if what.startswith("Object missing required field `"):  # a part's own field
        field_name = what.split("`")[1]
        value = None
        where, pattern = f"{where}.{field_name}", f"{pattern}.{field_name}"
    root, bracket, rest = pattern.partition("[")
    if root in TOKEN_ID_FIELDS:
        pattern = "token_ids" + bracket + rest
    if pattern == "messages[].content[].type":
        return _bad(f"{where} must be one of {', '.join(PART_TYPES)}, got {_short(value)}")
    if pattern not in MUST_BE:  # a wire type without its words: msgspec's own, never a crash
        return _bad(f"{where or 'payload'}: {what}")
    got = _short(value) if pattern == "truncate_prompt_tokens" else _tname(value)
    return _bad(f"{where} must be {MUST_BE[pattern]}, got {got}")


# --------------------------------------------------------------------------- the envelope


def parse_client_message(frames: Sequence[bytes], limits: Limits | None = None) -> ClientMessage:
    """Validate one client message (its frames, ROUTER identity already removed).

    Returns a request object or raises :class:`ProtocolError`; never raises
    anything else for any input frames.
    """
    limits = limits or DEFAULT_LIMITS
    payload = _payload_frame(frames, limits)
    msg = _decode_payload(payload)
    id_ = msg["id"] if _valid_id(msg.get("id")) else None
    try:
        kind = _message_type(msg)
        size = len(VERSION_FRAME) + len(payload)
        if size > limits.max_message_bytes and not (kind == "generate" and msg.get("images")):
            raise _too_long(f"message is {size} bytes, the limit is {limits.max_message_bytes}")
        wire_type = WIRE_TYPES[kind]
        _check_unknown(msg, WIRE_FIELDS[kind], kind)
        return _PARSERS[kind](msg, _convert(msg, wire_type), limits)
    except ProtocolError as e:
        e.id = e.id or id_  # errors carry the request id whenever a valid one could be read
        raise


def _payload_frame(frames: Sequence[bytes], limits: Limits) -> bytes:
    """Rules 1-3 on the frames: the version frame, the size, two frames. Returns the payload."""
    try:
        frames = [f if isinstance(f, bytes) else bytes(f) for f in frames]
    except Exception:
        raise _bad("frames must be bytes") from None
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
        raise _bad("missing payload frame: a message is the version frame then one msgpack map")
    if len(frames) > 2:
        raise ProtocolError("bad_request", f"message has {len(frames)} frames, expected 2 (further frames are "
                            "reserved)", peeked_id())
    return frames[1]


def _decode_payload(payload: bytes) -> dict:
    """The payload as a map with string keys."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except msgpack.ExtraData:
        raise _bad("payload has trailing bytes after the msgpack map") from None
    except UnicodeDecodeError:
        raise _bad("payload contains a string that is not valid UTF-8") from None
    except msgpack.StackError:
        raise _bad("payload is nested too deeply") from None
    except Exception as e:  # OutOfData, FormatError, unhashable keys, ...
        raise _bad(f"payload is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise _bad(f"payload must be a msgpack map, got {_tname(msg)}")
    _check_keys(msg, "payload")
    return msg


def _message_type(msg: dict) -> str:
    t = msg.get("type")
    if t is None:
        raise _bad("missing field 'type'")
    if not isinstance(t, str):
        raise _bad(f"type must be a string, got {_tname(t)}")
    if t not in WIRE_TYPES:
        raise _bad(f"unknown message type {_short(t)}; expected one of {', '.join(WIRE_TYPES)}")
    return t


# --------------------------------------------------------------------------- one parser per type
# Each gets the message as decoded (which fields it gave) and as its wire type (every type checked).


def _request_id(given: str | None) -> str:
    if given is None:
        raise _bad("missing field 'id'")
    if not 1 <= len(given) <= MAX_ID_CHARS:
        raise _bad(f"id must be 1 to {MAX_ID_CHARS} characters, got {len(given)}")
    return given


def _parse_generate(msg: dict, g: Any, limits: Limits) -> GenerateRequest:
    id_ = _request_id(g.id)
    prompt = _parse_prompt(msg, g, limits)
    stop = _parse_stop(g.stop)
    top_logprobs = g.top_logprobs or 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise _bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_short(top_logprobs)}")
    grammar = _parse_grammar(g.grammar)
    images = _parse_images(g.images, prompt)
    if g.adapter == "":  # whether the server has it is the server's check
        raise _bad("adapter must not be empty")
    options = _template_options(g, "messages" in prompt)
    truncate = g.truncate_prompt_tokens
    if truncate is not None:
        if truncate < 1:
            raise _bad(f"truncate_prompt_tokens must be an integer >= 1, got {_short(truncate)}")
        if images or "skill" in prompt:
            raise _bad("truncate_prompt_tokens cannot be combined with images or a skill (their tokens "
                       "would be cut)")
    sampling = _sampling_params(g, limits)  # ranges last, once every type is known good
    given = [f for f in SKILL_FIELDS if msg.get(f) is not None]  # nil means absent, as everywhere
    if "skill" in prompt:
        if grammar is not None or stop:
            raise _bad("grammar and stop cannot be combined with a skill (it has its own)")
        prompt["skill"] = {"skill": prompt["skill"], **{f: msg[f] for f in given}}
    elif given:
        raise _bad(f"{given[0]} is a skill field: send it with skill")
    return GenerateRequest(id=id_, **prompt, sampling=sampling, stop=stop, stream=_default(g.stream, True),
                           logprobs=bool(g.logprobs) or top_logprobs > 0, top_logprobs=top_logprobs,
                           grammar=grammar, images=images, adapter=g.adapter, template_options=options,
                           truncate_prompt_tokens=truncate,
                           explicit=frozenset(f for f in SAMPLING_FIELD_NAMES if getattr(g, f) is not None))


def _parse_cancel(msg: dict, c: CancelFields, limits: Limits) -> CancelRequest:
    return CancelRequest(_request_id(c.id))


def _parse_ping(msg: dict, p: PingFields, limits: Limits) -> PingRequest:
    try:  # it is echoed back, so it must survive re-encoding
        msgpack.packb(p.nonce, use_bin_type=True)
    except Exception:
        raise _bad("nonce cannot be echoed (nested too deeply)") from None
    return PingRequest(p.nonce)


def _parse_info(msg: dict, i: InfoFields, limits: Limits) -> InfoRequest:
    return InfoRequest()


_PARSERS = {"generate": _parse_generate, "cancel": _parse_cancel, "ping": _parse_ping, "info": _parse_info}


def _default(v: Any, default: Any) -> Any:
    return default if v is None else v


# --------------------------------------------------------------------------- generate's fields


def _parse_prompt(msg: dict, g: Any, limits: Limits) -> dict[str, Any]:
    """The one prompt form given, as ``{field: validated value}``."""
    try:
        name = prompt_field(msg)
    except ValueError as e:
        raise _bad(str(e)) from None
    check = {"prompt": _check_text, "messages": _check_messages, "prompt_token_ids": _check_prompt_token_ids,
             "skill": _check_skill}[name]
    return {name: check(getattr(g, name), limits)}


def parse_prompt(name: str, value: object, limits: Limits | None = None) -> Any:
    """One prompt form (``prompt``, ``messages`` or ``prompt_token_ids``) checked as a generate's is
    (``ProtocolError`` naming the field): for what renders prompts outside a generate (HTTP ``/tokenize``)."""
    check = {"prompt": _check_text, "messages": _check_messages, "prompt_token_ids": _check_prompt_token_ids}[name]
    g = _convert({name: value}, GenerateFields)
    return check(getattr(g, name), limits or DEFAULT_LIMITS)


def template_options(msg: Mapping[str, Any]) -> dict[str, Any]:
    """The chat template's options a map gives (``CHAT_TEMPLATE_FIELDS``), checked as a generate's
    (``ProtocolError`` naming the field): for HTTP ``/tokenize``."""
    return _template_options(_convert({f: msg.get(f) for f in CHAT_TEMPLATE_FIELDS}, GenerateFields), True)


def _template_options(g: Any, chat: bool) -> dict[str, Any]:
    """apply_chat_template's keyword arguments (vLLM's rules: continuing the final message opens no
    new one; the kwargs are template variables, not its own arguments)."""
    given = [f for f in CHAT_TEMPLATE_FIELDS if getattr(g, f) is not None]
    if not given:
        return {}
    if not chat:
        raise _bad(f"{given[0]} renders chat messages: send it with messages")
    add = _default(g.add_generation_prompt, True)
    continued = _default(g.continue_final_message, False)
    if add and continued:
        raise _bad("continue_final_message needs add_generation_prompt: false (the final message is "
                   "continued, no new one is opened)")
    variables = g.chat_template_kwargs or {}
    _check_keys(variables, "chat_template_kwargs")
    taken = sorted(set(variables) & TEMPLATE_ARGUMENTS)
    if taken:
        raise _bad(f"chat_template_kwargs.{taken[0]} is not a template variable (send it as a field of "
                   "its own, if it is one)")
    return {**variables, "add_generation_prompt": add, "continue_final_message": continued}


def parse_token_ids(value: object, name: str, limits: Limits | None = None) -> list[int]:
    """Token ids of the vocabulary (``ProtocolError`` naming ``name``); may be empty (HTTP ``/detokenize``)."""
    return _check_token_ids(_convert(value, list[int], name, "token_ids"), name, limits or DEFAULT_LIMITS)


def _check_token_ids(ids: list[int], name: str, limits: Limits) -> list[int]:
    if ids and min(ids) < 0:
        i = next(i for i, t in enumerate(ids) if t < 0)
        raise _bad(f"{name}[{i}] must be >= 0, got {ids[i]}")
    if ids and limits.vocab_size is not None and max(ids) >= limits.vocab_size:
        i = next(i for i, t in enumerate(ids) if t >= limits.vocab_size)
        raise _bad(f"{name}[{i}] must be < vocab size {limits.vocab_size}, got {ids[i]}")
    return ids


def _check_skill(v: str, limits: Limits) -> str:
    if not v:
        raise _bad(f"skill must be {MUST_BE['skill']}, got str")
    return v


def _check_text(v: str, limits: Limits) -> str:
    if not v:
        raise _bad("prompt must not be empty")
    if len(v) > limits.max_prompt_chars:
        raise _too_long(f"prompt is {len(v)} characters, the limit is {limits.max_prompt_chars}")
    return v


def _check_prompt_token_ids(v: list[int], limits: Limits) -> list[int]:
    if not v:
        raise _bad("prompt_token_ids must not be empty")
    if len(v) > limits.max_prompt_tokens:
        raise _too_long(f"prompt_token_ids has {len(v)} tokens, the limit is {limits.max_prompt_tokens}")
    return _check_token_ids(v, "prompt_token_ids", limits)


def _check_messages(v: list[ChatMessage], limits: Limits) -> list[dict[str, Any]]:
    if not v:
        raise _bad("messages must not be empty")
    if len(v) > limits.max_messages:
        raise _too_long(f"messages has {len(v)} entries, the limit is {limits.max_messages} "
                        "(each message takes at least one token of the context)")
    out = [_chat_message(m, f"messages[{i}]") for i, m in enumerate(v)]
    total = sum(len(_content_text(m["content"])) for m in out)
    if total > limits.max_prompt_chars:
        raise _too_long(f"messages hold {total} characters of content, the limit is {limits.max_prompt_chars}")
    return out


def _chat_message(m: ChatMessage, where: str) -> dict[str, Any]:
    if m.role is None:
        raise _bad(f"{where}.role is required")
    if m.role not in ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {_short(m.role)}")
    if m.content is None:
        raise _bad(f"{where}.content is required")
    if isinstance(m.content, str):
        return {"role": m.role, "content": m.content}
    parts = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in m.content]
    return {"role": m.role, "content": parts}


def _content_text(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _parse_images(v: list[bytes] | None, prompt: dict[str, Any]) -> tuple[bytes, ...]:
    """Only the envelope (count, sizes); decoding and placement are checked by the server."""
    messages = prompt.get("messages")
    image_parts = sum(1 for m in messages or () if isinstance(m["content"], list)
                      for p in m["content"] if p["type"] == "image")
    if v is None:
        if image_parts:
            raise _bad(f"messages hold {image_parts} image parts but no images were sent")
        return ()
    if "prompt_token_ids" in prompt:
        raise _bad("images cannot be combined with prompt_token_ids: send prompt or messages")
    if len(v) > MAX_IMAGES:
        raise _bad(f"images: too many images: {len(v)} (at most {MAX_IMAGES} per request)")
    for i, data in enumerate(v):
        if len(data) > MAX_IMAGE_BYTES:
            raise _bad(f"images[{i}]: image is {len(data)} bytes, more than the limit of {MAX_IMAGE_BYTES} "
                       "(20 MiB)")
    if "skill" in prompt:
        if len(v) > 1:
            raise _bad(f"images: a skill takes one image, got {len(v)}")
    elif "prompt" in prompt:
        marks = prompt["prompt"].count("<image>")
        if marks != len(v):
            raise _bad(f"images: the prompt has {marks} <image> placeholders but {len(v)} images were sent")
    elif image_parts and image_parts != len(v):
        raise _bad(f"images: messages hold {image_parts} image parts but {len(v)} images were sent")
    return tuple(v)


def _sampling_params(g: Any, limits: Limits) -> SamplingParams:
    """SamplingParams from the sampling fields given (absent or nil: its default). Range checks live in
    one place, shared with the worker: SamplingParams.validate() names the field."""
    values: dict[str, Any] = {}
    for f in SAMPLING_FIELDS:
        v = getattr(g, f.name)
        if v is None:
            continue
        if f.type is tuple:  # token ids
            v = tuple(_check_token_ids(v, f.name, limits))
        elif f.type is float:
            v = _as_float(v)
        values[f.name] = v
    try:
        return SamplingParams(**values)
    except ValueError as e:
        raise _bad(str(e)) from None


def _as_float(v: int | float) -> float:
    try:
        return float(v)
    except OverflowError:  # an int too large for a float: let the range check reject it
        return math.inf


def _parse_stop(v: list[str] | None) -> tuple[str, ...]:
    if v is None:
        return ()
    if len(v) > MAX_STOP:
        raise _bad(f"stop may hold at most {MAX_STOP} strings, got {len(v)}")
    if not all(v):
        raise _bad(f"stop[{v.index('')}] must not be empty")
    return tuple(v)


def _parse_grammar(v: dict | None) -> dict[str, Any] | None:
    """Only the shape: a map with a string ``kind`` (the grammar module checks the rest)."""
    if v is None:
        return None
    _check_keys(v, "grammar")
    kind = v.get("kind")
    if kind is None:
        raise _bad("grammar.kind is required")
    if not isinstance(kind, str):
        raise _bad(f"grammar.kind must be a string, got {_tname(kind)}")
    return v
