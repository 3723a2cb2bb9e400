"""Sampling parameters: the one definition of the sampling fields.

Pure Python (no torch, no numpy) so the frontend, the worker and the client can
all import it. Invalid values raise ``ValueError`` naming the field.

Every other layer derives its sampling fields from :class:`SamplingParams`
through :data:`SAMPLING_FIELDS`: the control-message struct between the
processes (``shared.messages.Sampling``), the client protocol's ``generate``
parsing (``frontend.protocol``, same names and defaults on the wire), the
client's option names (``frontend.client``) and the command line. To add a
field: declare it here with its ``must_be`` and ``help``, and check its range
in :meth:`SamplingParams.validate`.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["MAX_STOP_TOKEN_IDS", "SamplingParams", "SamplingField", "SAMPLING_FIELDS", "SAMPLING_FIELD_NAMES"]

MAX_STOP_TOKEN_IDS = 64


def _about(default: Any, must_be: str, help: str) -> Any:
    """A field with its default, what a valid value is (``"max_tokens must be <must_be>"``,
    for type errors at the protocol boundary) and one line of help (command line, docs)."""
    return field(default=default, metadata={"must_be": must_be, "help": help})


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = _about(256, "an integer >= 1", "Most tokens to generate.")
    temperature: float = _about(0.0, "a finite number >= 0", "0 = greedy.")
    top_p: float = _about(1.0, "a number in (0, 1]", "Nucleus sampling: keep the most likely tokens "
                                                     "up to this total probability (1 = off).")
    top_k: int = _about(0, "an integer >= 0", "Keep only the k most likely tokens (0 = off).")
    seed: int | None = _about(None, "a 64-bit integer", "Random seed (default: a fresh one per request).")
    stop_token_ids: tuple[int, ...] = _about((), "an array of integers", "Stop token id (repeatable).")
    ignore_eos: bool = _about(False, "a bool", "Keep generating past the end-of-sequence token.")

    def __post_init__(self) -> None:
        # Normalise lists to tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return (isinstance(v, (int, float))) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_num(self.temperature) or not (0.0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not (-(2**63) <= self.seed < 2**64)):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop_token_ids contains an invalid token id {t!r}")


@dataclass(frozen=True)
class SamplingField:
    """One field of :class:`SamplingParams`, described for the layers that derive from it."""

    name: str
    type: type  # int, float or bool; tuple for a list of token ids
    default: Any  # None only where the field may be left unset (seed)
    must_be: str  # a valid value in words: "<name> must be <must_be>, got <type>"
    help: str  # one line for a command line or docs


def _value_type(hint: Any) -> type:
    """``int | None`` -> int, ``tuple[int, ...]`` -> tuple, ``float`` -> float."""
    if typing.get_origin(hint) is tuple:
        return tuple
    members = [a for a in typing.get_args(hint) if a is not type(None)]
    return members[0] if members else hint


_HINTS = typing.get_type_hints(SamplingParams)

SAMPLING_FIELDS: tuple[SamplingField, ...] = tuple(
    SamplingField(f.name, _value_type(_HINTS[f.name]), f.default, f.metadata["must_be"], f.metadata["help"])
    for f in fields(SamplingParams)
)
SAMPLING_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in SAMPLING_FIELDS)
