"""Tandem client protocol, version 1: what the server and its clients agree on (``docs/PROTOCOL.md``).

Every message, both directions, is two frames: :data:`VERSION_FRAME` then one
msgpack map with string keys. This module holds the contract's constants and
limits, the validated requests the server acts on (``GenerateRequest``, ...),
and each client message's wire type (``GenerateFields``, ...: msgspec Structs,
every field optional, nil = absent) with :data:`MUST_BE`, the words of a type
error. Parsing is ``parse.py``, encoding ``encode.py``; no sockets, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import msgspec

from shared.moondream_config import MOONDREAM2_RULES
from shared.sampling import MAX_TOP_LOGPROBS, SAMPLING_FIELD_NAMES, SAMPLING_FIELDS, SamplingParams

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
# answers a skill: natively (frontend/moondream/) or as a prompted request (frontend/skills.py). A
# Moondream model's own default max_objects is its SkillRules' (Moondream 2's is this one).
SKILL_SAMPLING = {"temperature": 0.5, "top_p": 0.3}
DEFAULT_MAX_OBJECTS = MOONDREAM2_RULES.default_max_objects
MAX_GRAMMAR_OBJECTS = 100  # the most items a point/box grammar (frontend/grammars) takes
OUTPUT_FIELDS = ("stop", "stream", "logprobs", "top_logprobs", "grammar")  # optional, besides the sampling fields
# How the chat template renders messages (vLLM's names; only with messages).
CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# apply_chat_template's own arguments: not variables a request may set through chat_template_kwargs
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                 "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                 "truncation", "max_length", "return_tensors", "return_dict",
                                 "return_assistant_tokens_mask", "tokenizer_kwargs"})
MODEL_FIELDS = ("adapter",)  # optional: which weights answer (a LoRA adapter's name; nil = the base model)
PART_TYPES = ("text", "image")  # the parts of a message's content given as a list


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


def skill_text(name: str, value: Any) -> str:
    """A skill's text field (``question``, ``object``): a non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise SkillError(f"{name} must be a non-empty string")
    return value


def skill_max_objects(value: Any, limit: int, name: str = "max_objects") -> int:
    """A point/detect skill's ``max_objects``: an integer in [1, limit]."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        raise SkillError(f"{name} must be an integer in [1, {limit}]")
    return value


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


# --------------------------------------------------------------------------- wire types
# What each client message may hold, as msgspec Structs: the types are declared here once and
# checked by msgspec (in C); what a type cannot say (ranges, lengths, one prompt form, the limits)
# is the parser's post-check. Every field is optional and nil means absent, so a message decodes
# whatever it leaves out; what is required is the post-check's to say, in the protocol's words.


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image", forbid_unknown_fields=True):
    pass


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str | None = None
    content: str | list[TextPart | ImagePart] | None = None


_SAMPLING_WIRE_TYPES = {int: int, float: float, bool: bool, tuple: list[int], dict: dict}

GenerateFields = msgspec.defstruct("GenerateFields", [
    ("type", str, "generate"), ("id", str | None, None),
    ("prompt", str | None, None), ("messages", list[ChatMessage] | None, None),
    ("prompt_token_ids", list[int] | None, None), ("skill", str | None, None),
    *((f.name, _SAMPLING_WIRE_TYPES[f.type] | None, None) for f in SAMPLING_FIELDS),
    ("stop", list[str] | None, None), ("stream", bool | None, None), ("logprobs", bool | None, None),
    ("top_logprobs", int | None, None), ("grammar", dict | None, None), ("images", list[bytes] | None, None),
    ("adapter", str | None, None), ("truncate_prompt_tokens", int | None, None),
    ("add_generation_prompt", bool | None, None), ("continue_final_message", bool | None, None),
    ("chat_template_kwargs", dict | None, None),
    *((name, Any, None) for name in SKILL_FIELDS),  # their values are the skill's to check
])


class CancelFields(msgspec.Struct):
    type: str
    id: str | None = None


class PingFields(msgspec.Struct):
    type: str
    nonce: Any = None


class InfoFields(msgspec.Struct):
    type: str


WIRE_TYPES = {"generate": GenerateFields, "cancel": CancelFields, "ping": PingFields, "info": InfoFields}
WIRE_FIELDS = {kind: frozenset(t.__struct_fields__) for kind, t in WIRE_TYPES.items()}

# A wire type's error in the protocol's words: "<field> must be <MUST_BE[field]>, got <type>" (indexes
# written []); a field's element by name[], a nested map's field by a dot.
MUST_BE: dict[str, str] = {
    "id": "a string", "prompt": "a string", "skill": "a skill's name (a string)", "adapter": "a string",
    "messages": "an array of {role, content} maps", "messages[]": "a map with role and content",
    "messages[].role": "a string", "messages[].content": "a string or an array of parts",
    "messages[].content[]": "a map", "messages[].content[].text": "a string",
    "token_ids": "an array of integers", "token_ids[]": "an integer",
    **{f.name: f.must_be for f in SAMPLING_FIELDS},
    "stop": "an array of strings", "stop[]": "a string", "stream": "a bool", "logprobs": "a bool",
    "top_logprobs": f"an integer in [0, {MAX_TOP_LOGPROBS}]", "grammar": "a map",
    "images": "an array of bin (encoded image files)", "images[]": "bin (an encoded image file)",
    "truncate_prompt_tokens": "an integer >= 1", "add_generation_prompt": "a bool",
    "continue_final_message": "a bool", "chat_template_kwargs": "a map",
}
TOKEN_ID_FIELDS = ("prompt_token_ids", *(f.name for f in SAMPLING_FIELDS if f.type is tuple))  # MUST_BE's token_ids


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
