"""The contract every compiled grammar and matcher follows (see the package
docstring for the semantics)."""
from __future__ import annotations

import numpy as np

from .bitmask import BITMASK_DTYPE
from .spec import GrammarError, GrammarSpec


class CompiledGrammar:
    """Immutable, shareable between requests and threads; one per (tokenizer,
    spec). Attributes: ``spec``, ``vocab_size``, ``eos_token_ids``,
    ``n_words`` (= ceil(vocab_size / 32))."""

    __slots__ = ()
    spec: GrammarSpec
    vocab_size: int
    eos_token_ids: tuple
    n_words: int

    def matcher(self) -> "Matcher":  # pragma: no cover - interface
        raise NotImplementedError


class Matcher:
    """Per-request decoding state. Not thread-safe: one request, one thread."""

    __slots__ = ()

    _g: CompiledGrammar  # set by each implementation

    @property
    def spec(self) -> GrammarSpec:
        return self._g.spec

    def _check_row(self, out: np.ndarray) -> None:
        n = self._g.n_words
        if out.shape != (n,) or out.dtype != BITMASK_DTYPE:
            raise ValueError(f"mask row must be int32 of shape ({n},), got {out.dtype} {out.shape}")

    def fill_mask(self, out: np.ndarray) -> None:  # pragma: no cover - interface
        """Write the allowed next tokens into ``out`` (int32, shape
        ``(n_words,)``, e.g. one row of a batch bitmask); does not change state."""
        raise NotImplementedError

    def accept(self, token_id: int) -> bool:  # pragma: no cover - interface
        """Advance by one token. False (state unchanged) if it is not allowed;
        GrammarError if EOS was already accepted."""
        raise NotImplementedError

    def reset(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    is_complete: bool
    is_terminated: bool
    eos_accepted: bool
    text: str
    _ids: list  # accepted token ids, kept by each implementation

    @property
    def token_ids(self) -> list:
        return list(self._ids)

    def _require_complete(self) -> None:
        if not self.is_complete:
            raise GrammarError(f"output is incomplete: {self.text!r}")

    def output(self, text: str | None = None):  # pragma: no cover - interface
        raise NotImplementedError
