"""Typed control messages between the frontend and a GPU worker (never pickle).

Every message is a frozen msgspec Struct in one tagged union, encoded as a
msgpack map whose ``"type"`` field names the struct. ``decode`` is the only
way in: it accepts exactly the union's shapes and types (unknown fields,
wrong types, out-of-range ids, truncated or random bytes all raise
``MessageError``; nothing else escapes). Semantic checks of sampling values
live in ``to_sampling_params``, which raises ``ValueError`` naming the field,
so the worker can answer a bad request with ``RequestFailed`` instead of dying.

Ids are bounded to what the shared-memory rings carry: sequence ids are
uint32, token ids are non-negative int32.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Optional, Union

import msgspec
import msgspec.structs

from shared.sampling import MAX_TOP_LOGPROBS, SAMPLING_FIELDS, SamplingField, SamplingParams

__all__ = [
    "MessageError", "Sampling", "Submit", "Cancel", "Shutdown", "StatsRequest", "Stats",
    "Progress", "Ready", "Released", "RequestFailed", "SubmitImage", "ImagesCopied", "Message", "encode", "decode", "to_sampling_params",
    "MAX_MESSAGE_BYTES",
]

MAX_MESSAGE_BYTES = 64 << 20  # a 1M-token prompt is ~5 MB of msgpack

SeqId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=0x7FFFFFFF)]
Scalar = Union[bool, int, float, str, None]


class MessageError(ValueError):
    """A control message could not be encoded or decoded."""


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    pass


def _wire_field(f: SamplingField) -> tuple[str, Any, Any]:
    # Token ids travel as a list (what msgpack arrays decode to, so a decoded
    # message equals the one encoded), logit biases as a map; unset-able fields (seed) may be nil.
    kind = {tuple: list[int], dict: dict[int, float]}.get(f.type, f.type)
    default = list(f.default) if f.type is tuple else f.default
    if f.type is dict:
        return f.name, kind, msgspec.field(default_factory=dict)
    return f.name, (Optional[kind] if f.default is None else kind), default


def _from_params(cls: type, p: SamplingParams) -> "Sampling":
    return cls(**{name: list(v) if isinstance(v, tuple) else v for name, v in dataclasses.asdict(p).items()})


# The wire form of SamplingParams: generated from its fields (same names, types
# and defaults), so a field added there crosses the process boundary with no
# change here. Types only; ranges are checked by to_sampling_params.
Sampling = msgspec.defstruct(
    "Sampling", [_wire_field(f) for f in SAMPLING_FIELDS], module=__name__,
    frozen=True, forbid_unknown_fields=True,
    namespace={"__doc__": "The wire form of ``shared.sampling.SamplingParams`` (generated from it).",
               "from_params": classmethod(_from_params)},
)


class SubmitImage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One image of a Submit: its tiles are in these tile blocks of the arena (never in the message)."""
    hash: str  # the encoder-cache key
    num_tiles: Annotated[int, msgspec.Meta(ge=1)]
    blocks: list[Annotated[int, msgspec.Meta(ge=0)]]
    tiling: Optional[list[int]] = None  # Moondream: the crops' (rows, columns); the tiles are its crops


class SubmitSkill(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A Moondream skill's device task (``frontend/moondream_skills.Plan.task``)."""
    phase: int
    detect: bool = False
    limit: int = 0
    answer_limit: int = 0
    coords: list[float] = []  # the values of the prompt's coord tokens, in order
    sizes: list[list[float]] = []  # ... of its size tokens (width, height)


class Submit(_Msg, tag="submit"):
    seq_id: SeqId
    prompt_ids: list[TokenId]
    sampling: Sampling = Sampling()
    constrained: bool = False  # the frontend will write mask rows for it
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # the most likely tokens' too
    mask_row: int = -1  # the row of the mask region the frontend writes this request's masks into
    images: list[SubmitImage] = []  # in prompt order
    adapter: Optional[str] = None  # a LoRA adapter's name (the worker's --lora), None = the base model
    skill: Optional[SubmitSkill] = None  # Moondream: the skill's device task


class ImagesCopied(_Msg, tag="images_copied"):
    """Worker -> frontend: these tile blocks are read (copied to the device, or not needed): reuse them."""
    blocks: list[Annotated[int, msgspec.Meta(ge=0)]]


class Cancel(_Msg, tag="cancel"):
    seq_id: SeqId


class Shutdown(_Msg, tag="shutdown"):
    pass


class StatsRequest(_Msg, tag="stats_request"):
    pass


class Stats(_Msg, tag="stats"):
    values: dict[str, Union[int, float]] = {}
    adapters_loaded: list[str] = []  # the LoRA adapters in device slots now


class Progress(_Msg, tag="progress"):
    """Worker start-up: what it is doing (model load, KV cache, CUDA graphs), ``done`` of ``total``."""
    stage: str
    done: int = 0
    total: int = 0


class Ready(_Msg, tag="ready"):
    generation: int
    info: dict[str, Scalar] = {}


class Released(_Msg, tag="released"):
    seq_ids: list[SeqId]


class RequestFailed(_Msg, tag="request_failed"):
    seq_id: SeqId
    code: str
    message: str = ""


Message = Union[Submit, Cancel, Shutdown, StatsRequest, Stats, Progress, Ready, Released, RequestFailed,
                ImagesCopied]
_MESSAGE_TYPES = (Submit, Cancel, Shutdown, StatsRequest, Stats, Progress, Ready, Released, RequestFailed,
                  ImagesCopied)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    if not isinstance(msg, _MESSAGE_TYPES):
        raise MessageError(f"not a control message: {type(msg).__name__}")
    try:
        return _encoder.encode(msg)
    except (TypeError, ValueError, OverflowError) as e:
        raise MessageError(f"cannot encode {type(msg).__name__}: {e}") from None


def decode(data: bytes) -> Message:
    """Decode one message; any malformed input raises ``MessageError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as e:
        raise MessageError(f"invalid message: {e}") from None
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError) as e:
        raise MessageError(f"malformed message: {e}") from None


def to_sampling_params(submit: Submit) -> SamplingParams:
    """The validated SamplingParams of a Submit; ``ValueError`` names the field."""
    return SamplingParams(**msgspec.structs.asdict(submit.sampling))
