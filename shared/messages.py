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

from typing import Annotated, Optional, Union

import msgspec

from shared.sampling import SamplingParams

__all__ = [
    "MessageError", "Sampling", "Submit", "Cancel", "Shutdown", "StatsRequest", "Stats",
    "Progress", "Ready", "Released", "RequestFailed", "Message", "encode", "decode", "to_sampling_params",
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


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The wire form of ``shared.sampling.SamplingParams`` (same fields/defaults)."""
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    @classmethod
    def from_params(cls, p: SamplingParams) -> "Sampling":
        return cls(p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed,
                   list(p.stop_token_ids), p.ignore_eos)


class Submit(_Msg, tag="submit"):
    seq_id: SeqId
    prompt_ids: list[TokenId]
    sampling: Sampling = Sampling()
    constrained: bool = False  # the frontend will write mask rows for it
    logprobs: bool = False
    mask_row: int = -1  # the row of the mask region the frontend writes this request's masks into


class Cancel(_Msg, tag="cancel"):
    seq_id: SeqId


class Shutdown(_Msg, tag="shutdown"):
    pass


class StatsRequest(_Msg, tag="stats_request"):
    pass


class Stats(_Msg, tag="stats"):
    values: dict[str, Union[int, float]] = {}


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


Message = Union[Submit, Cancel, Shutdown, StatsRequest, Stats, Progress, Ready, Released, RequestFailed]
_MESSAGE_TYPES = (Submit, Cancel, Shutdown, StatsRequest, Stats, Progress, Ready, Released, RequestFailed)

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
    s = submit.sampling
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k, seed=s.seed, stop_token_ids=tuple(s.stop_token_ids),
                          ignore_eos=s.ignore_eos)
