"""The byte string of every token, computed once per tokenizer.

Decoding single ids with ``tokenizer.decode`` mangles byte-level BPE tokens
(partial UTF-8 becomes U+FFFD, some decoders strip a leading space), so tokens
are taken from ``convert_ids_to_tokens`` and mapped back through the
tokenizer family's own byte alphabet:

* byte-level BPE (GPT-2, SmolLM2, Llama-3, Qwen): the GPT-2 ``bytes_to_unicode``
  table, inverted;
* SentencePiece (Llama-2, Gemma): ``▁`` is a space, ``<0xNN>`` is one byte;
* anything else: the token string as UTF-8.

Added tokens (``<|im_end|>`` ...) are their literal content; the special ones
are reported separately so that grammars never allow them as text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte table (inverse of bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass(frozen=True)
class DecodedVocab:
    """``tokens[i]`` is the bytes token ``i`` stands for (None past the
    tokenizer's vocabulary); ``special_ids`` are control tokens that are never
    text; ``vocab_type`` is ``byte_level``, ``sentencepiece`` or ``raw``."""

    tokens: tuple
    special_ids: frozenset
    vocab_type: str
    vocab_size: int


def _detect_vocab_type(tokenizer, pieces: list) -> str:
    dec = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            dec = repr(backend.decoder)
        except Exception:  # pragma: no cover - exotic backends
            dec = None
    if dec:
        if "ByteLevel" in dec:
            return "byte_level"
        if "ByteFallback" in dec or "Metaspace" in dec or "▁" in dec:
            return "sentencepiece"
    sample = [p for p in pieces[:5000] if p]
    if any("Ġ" in p or "Ċ" in p for p in sample):
        return "byte_level"
    if any(p.startswith("▁") for p in sample):
        return "sentencepiece"
    return "raw"


def decode_vocab(tokenizer, vocab_size: int) -> DecodedVocab:
    """Decode every token id ``0 .. vocab_size-1`` of a Hugging Face tokenizer."""
    n_tok = min(len(tokenizer), vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n_tok)))
    vtype = _detect_vocab_type(tokenizer, pieces)
    added = {}
    special = set()
    for i, at in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        added[i] = at.content
        if getattr(at, "special", False):
            special.add(i)
    special.update(i for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None)
    bd = byte_decoder()
    tokens: list = [None] * vocab_size
    for i, p in enumerate(pieces):
        if p is None:
            continue
        if i in added:
            tokens[i] = added[i].encode("utf-8")
        elif vtype == "byte_level":
            try:
                tokens[i] = bytes(bd[c] for c in p)
            except KeyError:
                tokens[i] = p.encode("utf-8")
        elif vtype == "sentencepiece":
            m = _BYTE_TOKEN.match(p)
            tokens[i] = bytes([int(m.group(1), 16)]) if m else p.replace("▁", " ").encode("utf-8")
        else:
            tokens[i] = p.encode("utf-8")
    return DecodedVocab(
        tokens=tuple(tokens),
        special_ids=frozenset(i for i in special if 0 <= i < vocab_size),
        vocab_type=vtype,
        vocab_size=vocab_size,
    )
