"""The ack ring, frontend -> worker: "this request has ended" events (seq_id, FinishReason)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .errors import AckRingFull, RingCorrupt
from shared.finish import FinishReason

from .layout import _H_ACK_CONSUMED
from .tags import _LOW, _SHIFT, _U32, _TornClock, _prev_tag, _tag, _tags

if TYPE_CHECKING:
    from .arena import Arena


class AckEvent(NamedTuple):
    seq_id: int
    reason: FinishReason  # STOP (stop string, grammar complete), CANCELLED or ERROR


class AckWriter:
    """Frontend side of the ack ring.

    Entry words: [(tag << 32) | seq_id, (tag << 32) | reason];
    the second is the commit word and is written last."""

    def __init__(self, arena: Arena):
        self._a = arena
        self._cap = arena.layout.ack_entries
        self._events = arena.region("ack_events")
        self._next = 0  # the arena's one ack writer: positions start at 0

    def pending(self) -> int:
        """Events pushed but not yet consumed by the worker."""
        return self._next - self._a._hword(_H_ACK_CONSUMED)

    def has_space(self) -> bool:
        return self.pending() < self._cap

    def try_push(self, seq_id: int, reason: FinishReason) -> bool:
        reason = FinishReason(reason)
        if not 0 <= seq_id <= _U32 or reason == FinishReason.NONE:
            raise ValueError(f"seq_id must fit uint32 and reason must be an end ({seq_id}, {reason!r})")
        if not self.has_space():
            return False
        pos = self._next
        hi = _tag(pos) << 32
        ev = self._events[pos % self._cap]
        ev[0] = hi | int(seq_id)
        ev[1] = hi | int(reason)  # commit word last
        self._next += 1
        return True

    def push(self, seq_id: int, reason: FinishReason, timeout: float = 0.0) -> None:
        """Push, waiting up to ``timeout`` s for space; raises ``AckRingFull``."""
        deadline = time.monotonic() + timeout
        while not self.try_push(seq_id, reason):
            if time.monotonic() >= deadline:
                raise AckRingFull(f"ack ring full ({self._cap} events unconsumed by the worker)")
            time.sleep(0.0002)


class AckReader:
    """Worker side of the ack ring: ``poll`` returns all newly visible events
    in order and marks them consumed."""

    def __init__(self, arena: Arena, chunk: int = 256, corrupt_after_s: float = 1.0):
        self._a = arena
        self._cap = arena.layout.ack_entries
        self._events = arena.region("ack_events")
        self._next = arena._hword(_H_ACK_CONSUMED)
        self._chunk = min(chunk, self._cap)
        self._torn = _TornClock(corrupt_after_s)

    def poll(self) -> list[AckEvent]:
        # Fast path for the common "nothing new" case: one scalar read.
        pos = self._next
        if int(self._events[pos % self._cap, 1]) >> 32 == _prev_tag(pos, self._cap):
            return []
        out: list[AckEvent] = []
        while True:
            got = self._poll_chunk(out)
            if got < self._chunk:
                break
        if out:
            self._a._set_hword(_H_ACK_CONSUMED, self._next)
        return out

    def _poll_chunk(self, out: list[AckEvent]) -> int:
        pos, k = self._next, self._chunk
        words = self._events[(pos + np.arange(k)) % self._cap]  # fancy index: a copy
        tags = _tags(pos, k)
        ok = (words[:, 1] >> _SHIFT) == tags
        n = k if ok.all() else int(np.argmin(ok))
        if n < k:  # first unpublished entry: must hold its previous occupant's tag
            got, prev = int(words[n, 1]) >> 32, _prev_tag(pos + n, self._cap)
            if got != prev:
                raise RingCorrupt(f"ack ring position {pos + n}: commit tag {got:#x}, expected "
                                  f"{int(tags[n]):#x} or previous {prev:#x}")
        body_ok = (words[:n, 0] >> _SHIFT) == tags[:n]
        if not body_ok.all():
            m = int(np.argmin(body_ok))
            if self._torn.expired(pos + m):
                raise RingCorrupt(f"ack ring position {pos + m} published but its seq word "
                                  f"carries the wrong tag for > {self._torn.limit_s} s")
            n = m
        else:
            self._torn.clear()
        if n:
            seq = (words[:n, 0] & _LOW).tolist()
            reasons = (words[:n, 1] & _LOW).tolist()
            try:
                out.extend(AckEvent(s, FinishReason(r)) for s, r in zip(seq, reasons))
            except ValueError as e:
                raise RingCorrupt(f"ack ring holds an invalid finish reason: {e}") from None
            self._next += n
        return n
