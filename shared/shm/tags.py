"""Helpers of the memory-ordering invariant (see the package docstring).

Every 64-bit word a reader relies on is ``(tag << 32) | payload32`` with
``tag = (position + 1) mod 2**32``; readers accept a copy only if every word
carries the expected tag, and ``_TornClock`` decides when a copy has looked
published-but-torn for long enough to be ``RingCorrupt``."""
from __future__ import annotations

import time

import numpy as np

_U32 = 0xFFFFFFFF
_SHIFT = np.uint64(32)
_LOW = np.uint64(_U32)


def _tag(pos: int) -> int:
    return (pos + 1) & _U32


def _tags(first: int, n: int) -> np.ndarray:
    """Tags of positions first .. first+n-1 (uint64), vectorised."""
    return (np.arange(first + 1, first + 1 + n, dtype=np.uint64) & _LOW)


def _prev_tag(pos: int, capacity: int) -> int:
    """Tag left in a ring entry by its previous occupant (0 = never written)."""
    return _tag(pos - capacity) if pos >= capacity else 0


def _tagged(tag: int, payload32: np.ndarray, out: np.ndarray) -> None:
    """out[:] = (tag << 32) | payload32, written straight into shared memory."""
    # (explicit uint64 operands: numpy 1.x value-based casting would pick int64)
    np.bitwise_or(payload32.astype(np.uint64), np.uint64(tag << 32), out=out)


def _tags_ok(words: np.ndarray, tag: int) -> bool:
    """Do all words carry ``tag``? The tag is the high half, so min and max
    both carrying it implies every word does (two reductions, no temporaries)."""
    return words.size == 0 or (int(words.min()) >> 32 == tag and int(words.max()) >> 32 == tag)


class _TornClock:
    """Tracks how long one position has looked published-but-torn."""

    def __init__(self, limit_s: float):
        self.limit_s, self.pos, self.since = limit_s, -1, 0.0

    def expired(self, pos: int) -> bool:
        now = time.monotonic()
        if pos != self.pos:
            self.pos, self.since = pos, now
            return False
        return now - self.since > self.limit_s

    def clear(self) -> None:
        self.pos = -1
