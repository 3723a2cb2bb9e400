"""Constrained-decoding grammars: token bitmasks that guarantee well-formed
output, built on the frontend (CPU, numpy; no torch, no CUDA).

Kinds
=====
``point`` / ``box`` (own automaton, pure numpy), ``regex`` / ``json_schema``
(xgrammar on CPU, imported only when such a grammar is compiled).

Point and box text form
-----------------------
::

    point:  0.412,0.300;0.520,0.610            x,y ; x,y ; ...
    box:    0.100,0.200,0.400,0.650;0.5...     x_min,y_min,x_max,y_max ; ...
    empty:  none

* A coordinate is normalised to [0, 1] and written with exactly three
  decimals: ``0.ddd`` or ``1.000``. Fixed width is what makes the box
  constraint enforceable while decoding: two equal-width numbers compare like
  their strings, digit by digit, so while x_max is emitted any digit that
  would make it smaller than x_min (given the digits so far) is masked out,
  and likewise for y_max >= y_min and for the 1.000 ceiling. Three decimals is
  ~1 px on a 1000 px image.
* ``,`` separates the coordinates of one item, ``;`` separates items; no
  spaces, brackets or labels. With digit-splitting tokenizers (SmolLM2, Llama
  3, Qwen) that is 6 tokens per coordinate including its separator: 12 per
  point, 24 per box, the minimum a decimal form can cost. It is also how
  models naturally print coordinate pairs ("0.41,0.30").
* At most ``max_objects`` items; emitting item number ``max_objects``
  completes the output (only EOS may follow). ``none`` is the complete answer
  "there is nothing to point at"; it parses to an empty list. An empty string
  is not an output.
* EOS is allowed exactly where the output is complete: after ``none`` or
  after a whole item.

Parsed results are Moondream's client shapes: ``{"points": [{"x", "y"}]}``
and ``{"objects": [{"x_min", "y_min", "x_max", "y_max"}]}`` (floats).
``json_schema`` parses to the JSON value, ``regex`` to the matched string.

API
===
``GrammarSpec.from_protocol(map)`` validates a request's grammar map;
``GrammarCompiler(tokenizer, vocab_size, eos_token_ids).compile(spec)`` gives
a shareable ``CompiledGrammar`` (cached by (kind, parameters);
``cache_hits`` / ``cache_misses`` count); ``CompiledGrammar.matcher()`` gives
a per-request ``Matcher``:

* ``fill_mask(out)``: ``out`` is an int32 row of ``ceil(vocab_size/32)``
  words (xgrammar's layout: bit j of word i allows token 32*i+j); tokens at
  or past the tokenizer's length, and special tokens other than EOS, are never
  allowed. Does not change state.
* ``accept(token_id) -> bool``: False, state unchanged, for a token the mask
  would not allow. After EOS has been accepted the matcher is finished and
  ``accept`` raises ``GrammarError``; ``fill_mask`` then allows only EOS (so
  a caller that samples anyway cannot produce text).
* ``is_complete``: the output so far is a whole answer (EOS is allowed).
  ``is_terminated``: nothing but EOS may follow (EOS accepted, max_objects
  reached, ``none`` written, or the regex/schema cannot grow); the server may
  stop the request there with or without sampling the EOS.
* ``text`` (accepted text, EOS excluded), ``token_ids``, ``output(text=None)``
  (parses ``text`` or the matcher's own text; GrammarError if incomplete),
  ``reset()``.

``parse_output(spec, text)`` parses/validates text without a matcher.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Mapping

from .base import CompiledGrammar, Matcher
from .bitmask import (
    BITMASK_DTYPE,
    allocate_bitmask,
    allowed_ids,
    apply_bitmask_numpy,
    mask_words,
    pack_bool_mask,
    unpack_bitmask,
)
from .spatial import NONE_TEXT, SpatialGrammar, SpatialVocab, parse_spatial
from .spec import KINDS, MAX_OBJECTS_LIMIT, SPATIAL_KINDS, GrammarError, GrammarSpec
from .vocab import DecodedVocab, decode_vocab
from .xgr import XGrammar, compile_xgr, parse_xgr

__all__ = [
    "BITMASK_DTYPE",
    "KINDS",
    "MAX_OBJECTS_LIMIT",
    "NONE_TEXT",
    "CompiledGrammar",
    "DecodedVocab",
    "GrammarCompiler",
    "GrammarError",
    "GrammarSpec",
    "Matcher",
    "allocate_bitmask",
    "allowed_ids",
    "apply_bitmask_numpy",
    "decode_vocab",
    "mask_words",
    "pack_bool_mask",
    "parse_output",
    "unpack_bitmask",
]


def _as_spec(spec: Any) -> GrammarSpec:
    if isinstance(spec, GrammarSpec):
        return spec
    return GrammarSpec.from_protocol(spec)


def parse_output(spec: GrammarSpec | Mapping, text: str):
    """Parse a finished output: point -> ``{"points": [...]}``, box ->
    ``{"objects": [...]}``, json_schema -> the JSON value, regex and ebnf -> ``text``.
    Raises GrammarError if ``text`` is not a complete, valid output."""
    spec = _as_spec(spec)
    if spec.kind in SPATIAL_KINDS:
        return parse_spatial(spec, text)
    return parse_xgr(spec, text)


class GrammarCompiler:
    """Compiles specs for one tokenizer. Thread-safe.

    ``vocab_size`` is the width of the model's logits (may exceed
    ``len(tokenizer)``; the extra ids are never allowed). ``eos_token_ids``:
    an id or ids that end the output (allowed only where it is complete).
    Compiled grammars are kept in an LRU cache of ``cache_size`` entries keyed
    by ``spec.cache_key``.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: int | Iterable[int],
        *,
        cache_size: int = 256,
    ) -> None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise GrammarError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        eos = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        if not eos:
            raise GrammarError("eos_token_ids must not be empty")
        for t in eos:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise GrammarError(f"eos token id {t!r} is not in 0..{vocab_size - 1}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(dict.fromkeys(eos))
        self.n_words = mask_words(vocab_size)
        self.cache_size = cache_size
        self.cache_hits = 0
        self.cache_misses = 0
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.RLock()
        self._vocab: DecodedVocab | None = None
        self._spatial_vocab: dict = {}
        self._xgr_compiler = None

    @property
    def decoded_vocab(self) -> DecodedVocab:
        with self._lock:
            if self._vocab is None:
                self._vocab = decode_vocab(self.tokenizer, self.vocab_size)
            return self._vocab

    def _xgrammar_compiler(self):
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr  # noqa: PLC0415 - lazy (pulls in torch)

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids)
                )
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._xgr_compiler

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        if spec.kind in SPATIAL_KINDS:
            sv = self._spatial_vocab.get(spec.kind)
            if sv is None:
                v = self.decoded_vocab
                sv = SpatialVocab(spec.kind, v.tokens, v.special_ids | set(self.eos_token_ids), self.vocab_size)
                self._spatial_vocab[spec.kind] = sv
            return SpatialGrammar(spec, sv, self.vocab_size, self.eos_token_ids)
        compiled = compile_xgr(self._xgrammar_compiler(), spec)
        v = self.decoded_vocab
        return XGrammar(spec, compiled, v.tokens, v.special_ids, self.vocab_size, self.eos_token_ids)

    def compile(self, spec: GrammarSpec | Mapping) -> CompiledGrammar:
        """The compiled grammar for ``spec`` (a GrammarSpec or a protocol map).
        GrammarError for an invalid map, regex or schema."""
        spec = _as_spec(spec)
        key = spec.cache_key
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return g
            self.cache_misses += 1
            g = self._build(spec)
            self._cache[key] = g
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return g

    def cache_info(self) -> dict:
        with self._lock:
            return {"hits": self.cache_hits, "misses": self.cache_misses, "size": len(self._cache)}
