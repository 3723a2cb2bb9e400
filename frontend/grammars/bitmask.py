"""Token bitmask helpers (numpy only, no torch).

Layout (the same as xgrammar's): a row is ``ceil(vocab_size / 32)`` int32
words; bit ``j`` (least significant first) of word ``i`` allows token
``32 * i + j``. Bits at or past ``vocab_size`` are always 0.
"""
from __future__ import annotations

import numpy as np

from shared.arith import ceil_div

BITMASK_DTYPE = np.int32


def mask_words(vocab_size: int) -> int:
    """Number of int32 words in one bitmask row for ``vocab_size`` tokens."""
    return ceil_div(int(vocab_size), 32)


def allocate_bitmask(vocab_size: int, batch_size: int | None = None) -> np.ndarray:
    """A zeroed bitmask: 1-D ``(words,)`` or 2-D ``(batch_size, words)``."""
    shape = (mask_words(vocab_size),) if batch_size is None else (batch_size, mask_words(vocab_size))
    return np.zeros(shape, dtype=BITMASK_DTYPE)


def unpack_bitmask(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Unpack one bitmask row into a bool vector of length ``vocab_size``
    (``True`` = allowed). Torch-free; independent of the host byte order."""
    words = np.ascontiguousarray(mask_row, dtype="<i4")
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    if bits.size < vocab_size:
        raise ValueError(f"bitmask row has {bits.size} bits, fewer than vocab_size={vocab_size}")
    return bits[:vocab_size].astype(bool)


def pack_bool_mask(allowed: np.ndarray) -> np.ndarray:
    """The inverse of :func:`unpack_bitmask`: bool vector -> int32 words."""
    allowed = np.asarray(allowed, dtype=bool)
    n = mask_words(allowed.size)
    padded = np.zeros(n * 32, dtype=np.uint8)
    padded[: allowed.size] = allowed
    return np.packbits(padded, bitorder="little").view("<i4").astype(BITMASK_DTYPE)


def ids_to_words(ids, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sparse form of a token set: (word indices, int32 word values) such that
    ``row[:] = 0; row[idx] = vals`` writes exactly that set."""
    ids = np.unique(np.asarray(list(ids), dtype=np.int64))
    if ids.size and (ids[0] < 0 or ids[-1] >= vocab_size):
        raise ValueError(f"token id out of range 0..{vocab_size - 1}")
    words = ids >> 5
    bits = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
    idx, start = np.unique(words, return_index=True)
    vals = np.bitwise_or.reduceat(bits, start) if ids.size else bits
    return idx.astype(np.intp), vals.astype(np.uint32).view(BITMASK_DTYPE)


def apply_bitmask_numpy(logits_row: np.ndarray, mask_row: np.ndarray) -> np.ndarray:
    """Set the logits of disallowed tokens to ``-inf`` in place and return the
    row. ``logits_row`` may be shorter than the mask's bit count (the model's
    vocab); every position it has is governed by the mask."""
    allowed = unpack_bitmask(mask_row, logits_row.shape[-1])
    logits_row[~allowed] = -np.inf
    return logits_row


def allowed_ids(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Sorted token ids whose bit is set."""
    return np.flatnonzero(unpack_bitmask(mask_row, vocab_size))
