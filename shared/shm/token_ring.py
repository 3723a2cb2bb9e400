"""The token ring, worker -> frontend: one entry per committed step
(``TokenRingWriter`` in the worker, ``TokenRingReader`` in the frontend).

The entry layout, back-pressure and device copies (``reserve`` / ``stamp``)
are described in the package docstring (``shared.shm``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional

import numpy as np

from .errors import RingCorrupt, RingTimeout
from .layout import (
    _C_FLAGS, _C_LOGP, _C_SEQ, _C_TOK, _C_TOP, _C_VALUES, _H_CONSUMED, _M_COMMIT, _M_STEP_HI, _M_STEP_LO, _NCOLS,
    MAX_TOP_LOGPROBS, NUM_VALUES, Kind,
)
from .tags import _U32, _TornClock, _prev_tag, _tag, _tagged, _tags_ok
from .wake import AbortFn, _drain, _signal, _Waiter

if TYPE_CHECKING:
    from .arena import Arena


class Entry(NamedTuple):
    """One committed step, copied out of the ring (safe to keep)."""
    position: int                 # ring position (0, 1, 2, ...): pass to consume()
    step: int
    kind: Kind
    seq_ids: np.ndarray           # uint32
    token_ids: np.ndarray         # int32
    flags: np.ndarray             # uint32 (TokenFlag bits)
    logprobs: Optional[np.ndarray]  # float32 or None
    values: Optional[np.ndarray] = None  # float32 [rows, 3]: Moondream's region values, or None
    top_ids: Optional[np.ndarray] = None  # int32 [rows, MAX_TOP_LOGPROBS]: most likely first, or None
    top_logprobs: Optional[np.ndarray] = None  # float32 [rows, MAX_TOP_LOGPROBS], or None


@dataclass
class PendingEntry:
    """A reserved entry. ``token_ids`` is its int32 staging row (``max_rows``
    long, page-locked arena memory) that a device copy may write into before
    ``stamp``; what the entry holds (step, kind, rows) is decided when it is stamped."""
    position: int
    index: int  # its place in the ring: position % ring_entries
    token_ids: np.ndarray


_NARROW_U = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))
_NARROW_I = (np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32))


def _as_u32(name: str, a, n: int) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {a.shape}")
    if a.dtype.kind not in "iu" and n:
        raise ValueError(f"{name} must be an integer array, got {a.dtype}")
    if n and a.dtype not in _NARROW_U and (int(a.min()) < 0 or int(a.max()) > _U32):
        raise ValueError(f"{name} values must fit in uint32")
    return a.astype(np.uint32, copy=False)


class TokenRingWriter:
    """Worker side of the token ring. ``publish`` = ``reserve`` + ``stamp``.

    Several reservations may be outstanding (pipelined device copies) but they
    must be stamped in reservation order.
    """

    def __init__(self, arena: Arena, spin_s: float = 2e-5, slice_s: float = 0.05):
        self._a = arena
        self._cap = arena.layout.ring_entries
        self._max_rows = arena.layout.max_rows
        self._meta = arena.region("ring_meta")
        self._rows = arena.region("ring_rows")
        self._stage = arena.region("ring_stage")
        self._next = 0         # next position to reserve
        self._stamp_next = 0  # next position to stamp
        self._waiter = _Waiter(arena.wake.space, spin_s, slice_s)
        self.blocked = 0       # reservations that found the ring full

    @property
    def sleeps(self) -> int:
        return self._waiter.sleeps

    def consumed(self) -> int:
        return self._a._hword(_H_CONSUMED)

    def has_space(self) -> bool:
        return self._next - self.consumed() < self._cap

    def try_reserve(self) -> Optional[PendingEntry]:
        """Reserve the next entry, or None if the ring is full."""
        if not self.has_space():
            return None
        position, index = self._next, self._next % self._cap
        self._next += 1
        return PendingEntry(position, index, self._stage[index])

    def reserve(self, *, timeout: Optional[float] = None, abort: AbortFn = None) -> PendingEntry:
        """Like ``try_reserve`` but blocks while the ring is full; raises
        ``RingTimeout`` after ``timeout`` s or ``RingAborted`` when ``abort()``."""
        p = self.try_reserve()
        if p is not None:
            return p
        self.blocked += 1
        if not self._waiter.wait(self.has_space, timeout, abort):
            raise RingTimeout(f"token ring full for {timeout} s "
                              f"(consumed={self.consumed()}, next={self._next})")
        return self.try_reserve()

    def stamp(self, p: PendingEntry, step: int, kind: Kind, seq_ids, flags, logprobs=None,
              token_ids=None, values=None, top=None) -> int:
        """Fill a reserved entry with one step's rows and publish it. Token ids
        come from ``token_ids`` if given, else from the first rows of
        ``p.token_ids`` (the staging row a device copy wrote: that copy must
        have completed, e.g. after ``event.synchronize()``). ``values``: float32 [rows, 3]
        region values (Moondream). ``top``: (int32 ids, float32 logprobs), each
        [rows, MAX_TOP_LOGPROBS], the most likely tokens. Returns the ring position."""
        if p.position != self._stamp_next:
            raise ValueError(f"stamp out of order: got position {p.position}, expected {self._stamp_next}")
        return self._write(p, *self._validate(step, kind, seq_ids, flags, token_ids, logprobs, values, top))

    def _validate(self, step: int, kind: Kind, seq_ids, flags, token_ids, logprobs, values=None, top=None) -> tuple:
        """(step, kind, seq_ids u32, flags u32, token_ids i32 | None, logprobs f32 | None,
        values f32 [n, 3] | None, top (i32, f32) [n, K] | None), checked."""
        n = len(seq_ids)
        if not 0 <= n <= self._max_rows:
            raise ValueError(f"an entry holds 0..{self._max_rows} rows (nrows), got {n}")
        if not 0 <= step < 1 << 64:
            raise ValueError(f"step must be a uint64, got {step}")
        if values is not None:
            values = np.asarray(values, dtype=np.float32)
            if values.shape != (n, NUM_VALUES):
                raise ValueError(f"values must have shape ({n}, {NUM_VALUES}), got {values.shape}")
        if top is not None:
            top = (np.asarray(top[0], dtype=np.int32), np.asarray(top[1], dtype=np.float32))
            if top[0].shape != (n, MAX_TOP_LOGPROBS) or top[1].shape != (n, MAX_TOP_LOGPROBS):
                raise ValueError(f"top must be two arrays of shape ({n}, {MAX_TOP_LOGPROBS})")
        return (step, Kind(kind), *_normalize_rows(n, seq_ids, flags, token_ids, logprobs), values, top)

    def _write(self, p: PendingEntry, step: int, kind: Kind, seq_ids, flags, tok, lp, values=None, top=None) -> int:
        tag, index, n = _tag(p.position), p.index, len(seq_ids)
        if tok is None:
            tok = p.token_ids[:n]
        has_lp, has_values, has_top = lp is not None, values is not None, top is not None
        ncols = _NCOLS if has_top else _C_TOP if has_values else _C_VALUES if has_lp else _C_LOGP
        payload = np.zeros((ncols, n), np.uint32)
        payload[_C_SEQ], payload[_C_TOK], payload[_C_FLAGS] = seq_ids, tok.view(np.uint32), flags
        if has_lp:
            payload[_C_LOGP] = lp.view(np.uint32)
        if has_values:
            payload[_C_VALUES:_C_TOP] = np.ascontiguousarray(values.T).view(np.uint32)
        if has_top:
            payload[_C_TOP:_C_TOP + MAX_TOP_LOGPROBS] = np.ascontiguousarray(top[0].T).view(np.uint32)
            payload[_C_TOP + MAX_TOP_LOGPROBS:] = np.ascontiguousarray(top[1].T).view(np.uint32)
        # Payload words first ...
        _tagged(tag, payload, self._rows[index, :ncols, :n])
        meta, hi = self._meta[index], tag << 32
        meta[_M_STEP_LO] = hi | (step & _U32)
        meta[_M_STEP_HI] = hi | (step >> 32)
        # ... the commit word last: readers key on it.
        meta[_M_COMMIT] = hi | n | (int(kind) << 24) | (int(has_lp) << 28) | (int(has_values) << 29) | \
            (int(has_top) << 30)
        self._stamp_next += 1
        _signal(self._a.wake.tokens)
        return p.position

    def _no_outstanding(self) -> None:
        if self._stamp_next != self._next:
            raise ValueError("publish while reservations are outstanding: stamp them first")

    def try_publish(self, step: int, kind: Kind, seq_ids, token_ids, flags, logprobs=None
                    ) -> Optional[int]:
        """Non-blocking publish: the ring position, or None if the ring is full."""
        if token_ids is None:
            raise ValueError("publish needs token_ids (use reserve/stamp for device copies)")
        entry = self._validate(step, kind, seq_ids, flags, token_ids, logprobs)
        self._no_outstanding()
        p = self.try_reserve()
        return None if p is None else self._write(p, *entry)

    def publish(self, step: int, kind: Kind, seq_ids, token_ids, flags, logprobs=None, *,
                timeout: Optional[float] = None, abort: AbortFn = None) -> int:
        """Publish one step; blocks while the ring is full (see ``reserve``)."""
        # Validate before reserving so a bad call never leaves a dangling reservation.
        if token_ids is None:
            raise ValueError("publish needs token_ids (use reserve/stamp for device copies)")
        entry = self._validate(step, kind, seq_ids, flags, token_ids, logprobs)
        self._no_outstanding()
        p = self.reserve(timeout=timeout, abort=abort)
        return self._write(p, *entry)


def _normalize_rows(n: int, seq_ids, flags, token_ids, logprobs):
    """Validated (seq_ids u32, flags u32, token_ids i32 | None, logprobs f32 | None)."""
    seq_ids = _as_u32("seq_ids", seq_ids, n)
    flags = _as_u32("flags", flags, n)
    tok = None
    if token_ids is not None:
        tok = np.asarray(token_ids)
        if tok.shape != (n,) or (n and tok.dtype.kind not in "iu"):
            raise ValueError(f"token_ids must be an integer array of shape ({n},)")
        if n and tok.dtype not in _NARROW_I and (int(tok.min()) < -(1 << 31) or int(tok.max()) >= 1 << 31):
            raise ValueError("token_ids must fit in int32")
        tok = tok.astype(np.int32, copy=False)
    lp = None
    if logprobs is not None:
        lp = np.asarray(logprobs, dtype=np.float32)
        if lp.shape != (n,):
            raise ValueError(f"logprobs must have shape ({n},), got {lp.shape}")
    return seq_ids, flags, tok, lp


class TokenRingReader:
    """Frontend side of the token ring: ``poll``/``wait`` then ``consume``."""

    def __init__(self, arena: Arena, spin_s: float = 5e-5, corrupt_after_s: float = 1.0,
                 slice_s: float = 0.05):
        self._a = arena
        self._cap = arena.layout.ring_entries
        self._max_rows = arena.layout.max_rows
        self._meta = arena.region("ring_meta")
        self._rows = arena.region("ring_rows")
        self._next = arena._hword(_H_CONSUMED)  # resume after what was consumed
        self._consumed = self._next
        self._torn = _TornClock(corrupt_after_s)
        self._waiter = _Waiter(arena.wake.tokens, spin_s, slice_s)

    @property
    def next_position(self) -> int:
        """Position the next ``poll`` returns."""
        return self._next

    @property
    def sleeps(self) -> int:
        return self._waiter.sleeps

    def fileno(self) -> int:
        """The tokens eventfd (for zmq.Poller / selectors); -1 if absent."""
        return self._a.wake.tokens

    def clear_wakeup(self) -> None:
        """Drain the eventfd after an external poller reported it readable."""
        _drain(self._a.wake.tokens)

    def _commit_word(self) -> int:
        return int(self._meta[self._next % self._cap, _M_COMMIT])

    def ready(self) -> bool:
        """Cheap check: has the next entry's commit word been published?"""
        return (self._commit_word() >> 32) == _tag(self._next)

    def poll(self) -> Optional[Entry]:
        """The next entry in order, or None if it is not (fully) visible yet.
        Raises ``RingCorrupt`` instead of ever returning unvalidated data."""
        pos = self._next
        index, tag = pos % self._cap, _tag(pos)
        step_lo, step_hi, commit = self._meta[index, :3].tolist()
        ctag = commit >> 32
        if ctag != tag:
            prev = _prev_tag(pos, self._cap)
            if ctag == prev:
                return None
            raise RingCorrupt(f"token ring entry {index}: commit tag {ctag:#x} is neither the "
                              f"expected {tag:#x} (position {pos}) nor the previous {prev:#x}")
        n, kind_v, has_lp, has_values = commit & 0xFFFFFF, (commit >> 24) & 0xF, (commit >> 28) & 1, (commit >> 29) & 1
        has_top = (commit >> 30) & 1
        if n > self._max_rows or kind_v not in (Kind.PREFILL, Kind.DECODE) or commit >> 31 & 0x1:
            raise RingCorrupt(f"token ring entry {index}: invalid commit word {commit:#018x}")
        # Copy first, then validate the copy. Load order does not matter: a
        # step or row word read "too early" carries an older tag and fails.
        ncols = _NCOLS if has_top else _C_TOP if has_values else _C_VALUES if has_lp else _C_LOGP
        rows = self._rows[index, :ncols, :n].copy()
        if not ((step_lo >> 32) == (step_hi >> 32) == tag and _tags_ok(rows, tag)):
            if self._torn.expired(pos):
                raise RingCorrupt(f"token ring entry {index} (position {pos}) has been published "
                                  f"for > {self._torn.limit_s} s but its row words carry the wrong tag")
            return None
        self._torn.clear()
        self._next += 1
        low = rows.astype(np.uint32)  # truncation keeps exactly the payload half
        return Entry(pos, (step_lo & _U32) | (step_hi & _U32) << 32, Kind(kind_v), low[_C_SEQ],
                     low[_C_TOK].view(np.int32), low[_C_FLAGS],
                     low[_C_LOGP].view(np.float32) if has_lp else None,
                     np.ascontiguousarray(low[_C_VALUES:_C_TOP].view(np.float32).T) if has_values else None,
                     np.ascontiguousarray(low[_C_TOP:_C_TOP + MAX_TOP_LOGPROBS].view(np.int32).T) if has_top else None,
                     np.ascontiguousarray(low[_C_TOP + MAX_TOP_LOGPROBS:].view(np.float32).T) if has_top else None)

    def wait(self, timeout: Optional[float] = None, abort: AbortFn = None) -> bool:
        """Block until the next entry's commit word is visible (spin ``spin_s``,
        then sleep on the eventfd). Returns False on timeout."""
        return self._waiter.wait(self.ready, timeout, abort)

    def consume(self, upto_position: int) -> None:
        """Hand entries up to and including ``upto_position`` back to the writer."""
        if upto_position >= self._next:
            raise ValueError(f"cannot consume position {upto_position}: only {self._next} polled")
        if upto_position + 1 > self._consumed:
            self._consumed = upto_position + 1
            self._a._set_hword(_H_CONSUMED, self._consumed)
            _signal(self._a.wake.space)
