"""The mask rows, frontend -> worker: one xgrammar-layout token bitmask per
batch row (bit j of word i allows token 32*i+j) plus a per-row stamp (``mask_stamp``)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import numpy as np

from .errors import MaskNotReady, RingCorrupt
from .tags import _LOW, _SHIFT, _tag
from .wake import AbortFn, _signal, _Waiter

if TYPE_CHECKING:
    from .arena import Arena


class MaskWriter:
    """Frontend side of the mask rows.

    Words are ``(tag << 32) | mask32`` with ``tag = (stamp + 1) mod 2**32``;
    the per-row stamp word (``stamp + 1``; 0 = never written) is written after the
    words, then the ``masks`` eventfd is signalled."""

    def __init__(self, arena: Arena):
        self._a = arena
        self.words_per_row = arena.layout.mask_words
        self._rows = arena.layout.max_batch_rows
        self._stamp = arena.region("mask_stamp")
        self._words = arena.region("mask_words")

    def write_rows(self, rows, stamp: int, masks: np.ndarray) -> None:
        """masks: int32 (len(rows), words_per_row), xgrammar bitmask layout."""
        rows = _check_rows(rows, self._rows)
        masks = np.asarray(masks)
        w = self.words_per_row
        if masks.shape != (len(rows), w) or masks.dtype not in (np.int32, np.uint32):
            raise ValueError(f"masks must be int32 of shape ({len(rows)}, {w}), "
                             f"got {masks.dtype} {masks.shape}")
        if not 0 <= stamp < (1 << 64) - 1:
            raise ValueError(f"stamp must be a uint64, got {stamp}")
        tagged = masks.view(np.uint32).astype(np.uint64) | np.uint64(_tag(stamp) << 32)
        self._words[rows, :w] = tagged
        self._stamp[rows] = np.uint64(stamp + 1)
        _signal(self._a.wake.masks)


def _check_rows(rows, limit: int) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= limit):
        raise ValueError(f"mask rows must be in [0, {limit})")
    return rows


class MaskReader:
    """Worker side of the mask rows: ``wait_rows`` then ``read_rows``."""

    def __init__(self, arena: Arena, spin_s: float = 2e-5, corrupt_after_s: float = 1.0,
                 slice_s: float = 0.05):
        self.words_per_row = arena.layout.mask_words
        self._rows = arena.layout.max_batch_rows
        self._stamp = arena.region("mask_stamp")
        self._words = arena.region("mask_words")
        self._corrupt_after_s = corrupt_after_s
        self._waiter = _Waiter(arena.wake.masks, spin_s, slice_s)

    @property
    def sleeps(self) -> int:
        return self._waiter.sleeps

    def stamped(self, rows, stamp: int) -> bool:
        """True iff every row's stamp is exactly ``stamp`` (never older/newer)."""
        rows = _check_rows(rows, self._rows)
        return bool(np.all(self._stamp[rows] == np.uint64(stamp + 1)))

    def stamped_each(self, rows, stamps) -> np.ndarray:
        """Per row: is its stamp exactly its own entry of ``stamps``? (bool array)"""
        rows = _check_rows(rows, self._rows)
        return self._stamp[rows] == np.asarray(stamps, dtype=np.uint64) + np.uint64(1)

    def wait_rows(self, rows, stamp: int, timeout: Optional[float], abort: AbortFn = None) -> bool:
        """Wait until all ``rows`` are stamped with ``stamp``; False on timeout."""
        rows = _check_rows(rows, self._rows)
        target = np.uint64(stamp + 1)
        return self._waiter.wait(lambda: bool(np.all(self._stamp[rows] == target)), timeout, abort)

    def read_rows(self, rows, stamp: Optional[int] = None) -> np.ndarray:
        """Validated int32 copy (len(rows), words_per_row) of the masks.

        With ``stamp``, every row must be stamped with exactly that stamp
        (``MaskNotReady`` otherwise). Without, each row is read as of its own
        current stamp. Words not yet visible are retried; still torn after
        ``corrupt_after_s`` -> ``RingCorrupt``."""
        rows = _check_rows(rows, self._rows)
        w = self.words_per_row
        deadline = time.monotonic() + self._corrupt_after_s
        while True:
            stamps = self._stamp[rows]  # fancy index: a copy
            if stamp is not None and not np.all(stamps == np.uint64(stamp + 1)):
                bad = rows[stamps != np.uint64(stamp + 1)]
                raise MaskNotReady(f"mask rows {bad[:8].tolist()} are not stamped {stamp}")
            if np.any(stamps == 0):
                raise MaskNotReady(f"mask rows {rows[stamps == 0][:8].tolist()} were never written")
            words = self._words[rows, :w]
            if np.all((words >> _SHIFT) == (stamps & _LOW)[:, None]):
                return (words & _LOW).astype(np.uint32).view(np.int32)
            if time.monotonic() > deadline:
                raise RingCorrupt(f"mask rows stamped but their words carry the wrong tag "
                                  f"for > {self._corrupt_after_s} s")
            time.sleep(0)  # let the other side's stores land


def mask_stamp(seq_id: int, token_index: int) -> int:
    """The stamp of the mask for a request's ``token_index``-th generated token.

    Masks are stamped per (request, token) rather than per engine step: the
    frontend knows how many tokens it has committed, not which engine step will
    sample the next one. The worker samples token k only with a row stamped
    exactly ``mask_stamp(seq, k)``, i.e. built after token k-1 was committed.
    """
    if not (0 <= seq_id <= 0xFFFFFFFF and 0 <= token_index < (1 << 24)):
        raise ValueError("mask_stamp: seq_id must fit 32 bits and token_index 24 bits")
    return (seq_id << 24) | token_index
