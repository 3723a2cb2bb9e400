"""Sampling parameters: the one definition of the sampling fields.

Pure Python (no torch, no numpy) so the frontend, the worker and the client can
all import it. Invalid values raise ``ValueError`` naming the field.

Every other layer derives its sampling fields from :class:`SamplingParams`
through :data:`SAMPLING_FIELDS`: the control-message struct between the
processes (``shared.messages.Sampling``), the client protocol's ``generate``
parsing (``frontend.protocol.parse``, same names and defaults on the wire), the
client's option names (``frontend.client``) and the command line. To add a
field: declare it here with its ``must_be`` and ``help``, and check its range
in :meth:`SamplingParams.validate`.
"""
from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

__all__ = ["MAX_STOP_TOKEN_IDS", "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "LOGIT_BIAS_LIMIT", "SamplingParams", "SamplingField", "SAMPLING_FIELDS", "SAMPLING_FIELD_NAMES"]

MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs; the worker always computes this many
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (a fixed-size table per batch row on the device)
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-100, 100], as OpenAI documents and vLLM does


def _about(default: Any, must_be: str, help: str) -> Any:
    """A field with its default, what a valid value is (``"max_tokens must be <must_be>"``,
    for type errors at the protocol boundary) and one line of help (command line, docs)."""
    meta = {"must_be": must_be, "help": help}
    if isinstance(default, dict):  # a mutable default: a fresh one per object
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = _about(None, "an integer >= 1", "Most tokens to generate (default: the rest of the "
                                                             "context, as vLLM).")
    temperature: float = _about(0.0, "a finite number >= 0", "0 = greedy.")
    top_p: float = _about(1.0, "a number in (0, 1]", "Nucleus sampling: keep the most likely tokens "
                                                     "up to this total probability (1 = off).")
    top_k: int = _about(0, "an integer >= 0", "Keep only the k most likely tokens (0 = off).")
    seed: int | None = _about(None, "a 64-bit integer", "Random seed (default: a fresh one per request).")
    stop_token_ids: tuple[int, ...] = _about((), "an array of integers", "Stop token id (repeatable).")
    ignore_eos: bool = _about(False, "a bool", "Keep generating past the end-of-sequence token.")
    presence_penalty: float = _about(0.0, "a number in [-2, 2]", "Subtract this from the logit of every token "
                                                                 "generated so far (OpenAI).")
    frequency_penalty: float = _about(0.0, "a number in [-2, 2]", "Subtract this times its count so far from "
                                                                  "each generated token's logit (OpenAI).")
    repetition_penalty: float = _about(1.0, "a number > 0", "Divide the positive logits (multiply the negative) "
                                                            "of the prompt's and generated tokens (1 = off).")
    min_p: float = _about(0.0, "a number in [0, 1]", "Drop tokens less likely than min_p times the most "
                                                     "likely one (0 = off).")
    logit_bias: dict = _about({}, "a map of token id to number", "Add a bias in [-100, 100] to these tokens' "
                                                                 "logits (token id: bias).")
    min_tokens: int = _about(0, "an integer >= 0", "Generate at least this many tokens: EOS and stop_token_ids "
                                                   "cannot be sampled before, stop strings do not match (vLLM).")
    # How the frontend turns tokens into text (vLLM keeps these in its sampling parameters too).
    include_stop_str_in_output: bool = _about(False, "a bool", "Keep the stop string that ended the answer "
                                                               "at the end of its text.")
    skip_special_tokens: bool = _about(True, "a bool", "Leave special tokens (EOS, chat markers) out of the text.")

    def __post_init__(self) -> None:
        # Normalise lists to tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self.validate()

    @property
    def penalized(self) -> bool:
        """Some penalty needs the row's token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return (isinstance(v, (int, float))) and not isinstance(v, bool)

        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not is_num(self.repetition_penalty) or not (0.0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for t in self.logit_bias:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"logit_bias contains an invalid token id {t!r}")


def _logit_bias(bias: Any) -> dict[int, float]:
    """``{token id: bias}`` with int keys (decimal strings accepted: JSON object keys) and biases
    clamped to [-100, 100]; ``ValueError`` names the field for anything else."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id to number, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        token = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
            raise ValueError(f"logit_bias[{k!r}] must be a number, got {v!r}")
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v)))
    return out


@dataclass(frozen=True)
class SamplingField:
    """One field of :class:`SamplingParams`, described for the layers that derive from it."""

    name: str
    type: type  # int, float or bool; tuple for a list of token ids; dict for token id -> number
    default: Any  # None only where the field may be left unset (seed)
    must_be: str  # a valid value in words: "<name> must be <must_be>, got <type>"
    help: str  # one line for a command line or docs


def _value_type(hint: Any) -> type:
    """``int | None`` -> int, ``tuple[int, ...]`` -> tuple, ``float`` -> float, ``dict`` -> dict."""
    if typing.get_origin(hint) is tuple:
        return tuple
    if hint is dict:
        return dict
    members = [a for a in typing.get_args(hint) if a is not type(None)]
    return members[0] if members else hint


_HINTS = typing.get_type_hints(SamplingParams)

SAMPLING_FIELDS: tuple[SamplingField, ...] = tuple(
    SamplingField(f.name, _value_type(_HINTS[f.name]), f.default if f.default is not MISSING else f.default_factory(),
                  f.metadata["must_be"], f.metadata["help"])
    for f in fields(SamplingParams)
)
SAMPLING_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in SAMPLING_FIELDS)
