"""The shared-memory arena between the frontend and one GPU worker.

One arena per worker. The frontend creates it (``Arena.create``) as a memfd plus
three non-blocking eventfds and hands all four to the worker at spawn::

    arena = Arena.create(Layout(vocab_size=49152))
    proc = subprocess.Popen([sys.executable, "-m", "gpu_worker", "--arena", arena.fd_spec()],
                            pass_fds=arena.pass_fds)      # (arena fd, tokens, space, masks)
    # in the worker:  arena = Arena.attach_spec(args.arena)

Nothing is named in /dev/shm, so nothing needs unlinking and nothing leaks when
either process is killed: the memory lives exactly as long as some process
holds the fd or the mapping. (multiprocessing.shared_memory is deliberately not
used: its resource tracker unlinks segments behind our back.)

Regions (every one 64-byte aligned; each cache line has exactly one writer):

* header      static layout words (written once by the creator before the
              worker exists), one heartbeat line per side, one control line per
              side (frontend: ``consumed`` token entries; worker: ``ack_consumed``).
* token ring  worker -> frontend. ``ring_entries`` slots, one per committed step:
              a meta line (step, kind, row count) and a (4, max_rows) block of
              row columns (sequence id uint32, token id int32, flags uint32,
              optional float32 logprob), plus an int32 token staging row.
* ack ring    frontend -> worker. finalize(seq, reason) / cancel(seq) events.
* mask rows   frontend -> worker. One xgrammar-layout token bitmask per batch row
              (bit j of word i allows token 32*i+j) plus a per-row step stamp.

Memory-ordering invariant (no fences are available from Python, and ARM may
reorder both stores and loads): every 64-bit word a reader relies on carries
the tag of the entry it belongs to, ``word = (tag << 32) | payload32``, where
``tag = (position + 1) mod 2**32`` (so zeroed memory is never valid). Aligned
8-byte words are written and read whole (numpy and memoryview copy aligned
words with single loads/stores on x86-64 and AArch64), so a word is either
entirely old or entirely new. Writers fill payload words first and the
header/commit word last; readers copy the words and accept a copy only if the
commit word and every payload word carry the expected tag. A copy that mixes
tags is "not yet visible" and is retried; if the commit word has been visible
for longer than ``corrupt_after_s`` while payload words still carry the wrong
tag, or a commit word carries a tag that is neither the expected one nor the
slot's previous occupant's, the reader raises ``RingCorrupt``. It never
returns data it could not validate.

Back-pressure: the token writer never reuses a slot the frontend has not
consumed (``consumed`` word); it spins briefly, then sleeps on the ``space``
eventfd that the reader signals after each ``consume``. The reader spins
briefly, then sleeps on the ``tokens`` eventfd that the writer signals after
each publish (that fd can sit in a zmq.Poller: call ``clear_wakeup`` then
``poll``). Eventfds are counters, so a signal sent before the waiter sleeps is
never lost; waiters drain the fd and re-check the shared words.

Device copies: the worker may page-lock the whole mapping once (e.g.
``cudaHostRegister`` on the address of ``arena.buffer``, ``layout.total_bytes``
long) and let the GPU write sampled token ids straight into a reserved slot:
``p = writer.reserve(step, kind, n)``; ``torch.from_numpy(p.token_ids).copy_(
dev_ids, non_blocking=True)``; record an event; later, once the event has
completed, ``writer.commit(p, seq_ids, flags)`` stamps the tagged words (from
the staging row) and the commit word. Reservations commit in order.

Each ring has exactly one writer object and one reader object, each used from
a single thread.
"""
from __future__ import annotations

import math
import mmap
import os
import select
import threading
import time
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Callable, NamedTuple, Optional, Union

import numpy as np

__all__ = [
    "ArenaError", "LayoutMismatch", "RingCorrupt", "RingTimeout", "RingAborted",
    "AckRingFull", "MaskNotReady",
    "Side", "Kind", "TokenFlag", "AckKind", "FinishReason",
    "Layout", "WakeFds", "Arena",
    "Entry", "PendingEntry", "TokenRingWriter", "TokenRingReader",
    "AckEvent", "AckWriter", "AckReader", "MaskWriter", "MaskReader", "mask_stamp",
]

MAGIC = int.from_bytes(b"TANDEMAR", "little")
LAYOUT_VERSION = 1
CACHE_LINE = 64

_U32 = 0xFFFFFFFF
_SHIFT = np.uint64(32)
_LOW = np.uint64(_U32)


# ----------------------------------------------------------------------- errors
class ArenaError(RuntimeError):
    """Base class of every error raised by this module."""


class LayoutMismatch(ArenaError, ValueError):
    """The fd handed to ``Arena.attach`` is not an arena of the expected layout."""


class RingCorrupt(ArenaError):
    """Published data failed validation for too long: never returned as data."""


class RingTimeout(ArenaError, TimeoutError):
    """A blocking call ran out of time."""


class RingAborted(ArenaError):
    """A blocking call was interrupted by its abort callback (shutdown)."""


class AckRingFull(ArenaError):
    """The ack ring stayed full: the worker is not draining events."""


class MaskNotReady(ArenaError):
    """``read_rows`` was asked for rows not stamped with the requested step."""


# ------------------------------------------------------------------- constants
class Side(IntEnum):
    FRONTEND = 0
    WORKER = 1


class Kind(IntEnum):
    """What kind of step produced a token-ring entry."""
    PREFILL = 0
    DECODE = 1


class TokenFlag(IntFlag):
    """Per-row flags of a token-ring entry (a uint32 bitfield)."""
    NONE = 0
    FIRST = 1 << 0       # first generated token of the sequence
    EOS = 1 << 1         # the token is EOS (sequence finished)
    LENGTH = 1 << 2      # max_tokens reached with this token
    STOP_TOKEN = 1 << 3  # the token is one of stop_token_ids
    ZOMBIE = 1 << 4      # the frontend already finalized/cancelled it: ignore
    FINISHED = EOS | LENGTH | STOP_TOKEN


class AckKind(IntEnum):
    FINALIZE = 1  # the frontend is done with the sequence: free it
    CANCEL = 2    # the client went away: stop generating


class FinishReason(IntEnum):
    """Reason carried by a finalize/cancel event (uint16)."""
    NONE = 0
    STOP = 1        # a stop string matched (detected by the frontend)
    EOS = 2
    LENGTH = 3
    STOP_TOKEN = 4
    ABORT = 5       # client disconnected / cancelled
    ERROR = 6


# Header word indices (uint64 words). Line 0-1: static; 2/3: heartbeats;
# 4: frontend-written control; 5: worker-written control.
_H_MAGIC, _H_VERSION, _H_TOTAL, _H_GENERATION = 0, 1, 2, 3
_H_RING, _H_MAX_ROWS, _H_BATCH, _H_VOCAB, _H_ACK = 4, 5, 6, 7, 8
_H_BEAT = {Side.FRONTEND: 16, Side.WORKER: 24}
_H_CONSUMED = 32       # frontend: token entries consumed (next seq not consumed)
_H_ACK_CONSUMED = 40   # worker: ack events consumed
_HEADER_BYTES = 512

# Token-ring meta words per slot (one cache line per slot).
_M_STEP_LO, _M_STEP_HI, _M_COMMIT = 0, 1, 2
# commit payload: nrows in bits 0-23, kind in 24-27, has-logprobs in bit 28.
# Row columns of a slot (one (4, rows) block so an entry is one vectorised op).
_C_SEQ, _C_TOK, _C_FLAGS, _C_LOGP, _NCOLS = 0, 1, 2, 3, 4
_MAX_ROWS_LIMIT = 1 << 24


def _align(n: int, a: int = CACHE_LINE) -> int:
    return (n + a - 1) // a * a


def _tag(pos: int) -> int:
    return (pos + 1) & _U32


def _tags(first: int, n: int) -> np.ndarray:
    """Tags of positions first .. first+n-1 (uint64), vectorised."""
    return (np.arange(first + 1, first + 1 + n, dtype=np.uint64) & _LOW)


def _prev_tag(pos: int, capacity: int) -> int:
    """Tag left in a slot by its previous occupant (0 = never written)."""
    return _tag(pos - capacity) if pos >= capacity else 0


def _tagged(tag: int, payload32: np.ndarray, out: np.ndarray) -> None:
    """out[:] = (tag << 32) | payload32, written straight into shared memory."""
    # (explicit uint64 operands: numpy 1.x value-based casting would pick int64)
    np.bitwise_or(payload32.astype(np.uint64), np.uint64(tag << 32), out=out)


def _tags_ok(words: np.ndarray, tag: int) -> bool:
    """Do all words carry ``tag``? The tag is the high half, so min and max
    both carrying it implies every word does (two reductions, no temporaries)."""
    return words.size == 0 or (int(words.min()) >> 32 == tag and int(words.max()) >> 32 == tag)


# ---------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """Sizes of an arena; both processes derive identical offsets from it."""
    vocab_size: int
    ring_entries: int = 64
    max_rows: int = 1024        # rows per token-ring entry
    max_batch_rows: int = 256   # mask rows
    ack_entries: int = 4096

    def __post_init__(self) -> None:
        for name, lo, hi in (("vocab_size", 1, 1 << 31), ("ring_entries", 2, 1 << 20),
                             ("max_rows", 1, _MAX_ROWS_LIMIT), ("max_batch_rows", 1, 1 << 20),
                             ("ack_entries", 2, 1 << 24)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
                raise ValueError(f"Layout.{name} must be an integer in [{lo}, {hi}), got {v!r}")

    @property
    def mask_words(self) -> int:
        """int32 words per mask row: ceil(vocab / 32)."""
        return (self.vocab_size + 31) // 32

    def regions(self) -> dict[str, tuple[int, tuple[int, ...], np.dtype]]:
        """name -> (offset, shape, dtype). Row strides are padded so that every
        row of every region starts on a cache line."""
        r, b, a = self.ring_entries, self.max_batch_rows, self.ack_entries
        rows = _align(self.max_rows, 16)     # 16 int32 = 64 bytes
        words = _align(self.mask_words, 8)   # 8 uint64 = 64 bytes
        u64, i32 = np.dtype(np.uint64), np.dtype(np.int32)
        specs = [
            ("ring_meta", (r, 8), u64),
            ("ring_rows", (r, _NCOLS, rows), u64),  # columns: seq, token, flags, logprob
            ("ring_stage", (r, rows), i32),   # raw token ids from device copies
            ("ack_events", (a, 2), u64),
            ("mask_stamp", (b,), u64),
            ("mask_words", (b, words), u64),
        ]
        out, off = {}, _HEADER_BYTES
        for name, shape, dt in specs:
            off = _align(off)
            out[name] = (off, shape, dt)
            off += int(np.prod(shape)) * dt.itemsize
        return out

    @property
    def total_bytes(self) -> int:
        off, shape, dt = self.regions()["mask_words"]
        return _align(off + int(np.prod(shape)) * dt.itemsize, mmap.PAGESIZE)


class WakeFds(NamedTuple):
    """Eventfds (-1 = absent: waiters fall back to short sleeps)."""
    tokens: int  # worker -> frontend: an entry was published
    space: int   # frontend -> worker: entries were consumed
    masks: int   # frontend -> worker: mask rows were stamped


# ------------------------------------------------------------------ wait helper
def _signal(fd: int) -> None:
    if fd >= 0:
        try:
            os.eventfd_write(fd, 1)
        except BlockingIOError:
            pass  # counter saturated: the waiter will wake anyway


def _drain(fd: int) -> None:
    if fd >= 0:
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            pass


AbortFn = Union[Callable[[], bool], threading.Event, None]


def _abort_fn(abort: AbortFn) -> Optional[Callable[[], bool]]:
    return getattr(abort, "is_set", abort)


class _Waiter:
    """Spin for ``spin_s``, then sleep on an eventfd until a condition holds.

    The condition is re-checked after every wakeup (eventfd counts may be
    stale); the sleep is sliced so the abort callback is polled regularly.
    """

    def __init__(self, fd: int, spin_s: float, slice_s: float = 0.05):
        self.fd, self.spin_s, self.slice_s = fd, spin_s, slice_s
        self.sleeps = 0  # how often this waiter actually went to sleep
        self._poll = None
        if fd >= 0:
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)

    def wait(self, cond: Callable[[], bool], timeout: Optional[float],
             abort: AbortFn = None) -> bool:
        if cond():
            return True
        now = time.perf_counter()
        deadline = math.inf if timeout is None else now + timeout
        spin_end = min(now + self.spin_s, deadline)
        while time.perf_counter() < spin_end:
            if cond():
                return True
        aborted = _abort_fn(abort)
        while True:
            if aborted is not None and aborted():
                raise RingAborted("wait aborted")
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return cond()
            self.sleeps += 1
            nap = min(remaining, self.slice_s)
            if self._poll is not None:
                self._poll.poll(max(1, math.ceil(nap * 1000)))
                _drain(self.fd)
            else:
                time.sleep(min(nap, 0.0005))
            if cond():
                return True


# ----------------------------------------------------------------------- arena
class Arena:
    """A mapped arena plus its wakeup eventfds. Use ``create`` or ``attach``."""

    def __init__(self, fd: int, mm: mmap.mmap, layout: Layout, generation: int,
                 wake: WakeFds):
        self.fd, self.layout, self.generation, self.wake = fd, layout, generation, wake
        self._mm = mm
        self._header = np.frombuffer(mm, np.uint64, _HEADER_BYTES // 8, 0)
        self._views = {
            name: np.frombuffer(mm, dt, int(np.prod(shape)), off).reshape(shape)
            for name, (off, shape, dt) in layout.regions().items()
        }

    # -- construction -------------------------------------------------------
    @classmethod
    def create(cls, layout: Layout, generation: int = 0) -> "Arena":
        """Frontend side: a fresh zeroed memfd arena and three eventfds."""
        size = layout.total_bytes
        fd = os.memfd_create("tandem-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            try:  # the worker must not be able to shrink it under us (SIGBUS)
                import fcntl
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            except (ImportError, AttributeError, OSError):
                pass
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
        wake = WakeFds(os.eventfd(0, flags), os.eventfd(0, flags), os.eventfd(0, flags))
        h = np.frombuffer(mm, np.uint64, _HEADER_BYTES // 8, 0)
        h[_H_VERSION], h[_H_TOTAL], h[_H_GENERATION] = LAYOUT_VERSION, size, generation
        h[_H_RING], h[_H_MAX_ROWS] = layout.ring_entries, layout.max_rows
        h[_H_BATCH], h[_H_VOCAB], h[_H_ACK] = layout.max_batch_rows, layout.vocab_size, layout.ack_entries
        h[_H_MAGIC] = MAGIC  # last: a half-initialised header never validates
        del h
        return cls(fd, mm, layout, generation, wake)

    @classmethod
    def attach(cls, fd: int, tokens_fd: int = -1, space_fd: int = -1, masks_fd: int = -1, *,
               expect: Optional[Layout] = None,
               expect_generation: Optional[int] = None) -> "Arena":
        """Worker side: map an arena received by fd and validate its header.

        Raises ``LayoutMismatch`` naming the offending field when the fd is not
        an arena of this layout version (or not the ``expect``-ed sizes)."""
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            raise LayoutMismatch(f"arena fd {fd} is not usable: {e}") from None
        if size < _HEADER_BYTES:
            raise LayoutMismatch(f"arena fd {fd} is {size} bytes, smaller than the header")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            h = np.frombuffer(mm, np.uint64, _HEADER_BYTES // 8, 0).copy()
            if int(h[_H_MAGIC]) != MAGIC:
                raise LayoutMismatch(f"arena fd {fd}: bad magic {int(h[_H_MAGIC]):#x}")
            if int(h[_H_VERSION]) != LAYOUT_VERSION:
                raise LayoutMismatch(f"arena layout version {int(h[_H_VERSION])}, "
                                     f"this build understands {LAYOUT_VERSION}")
            try:
                layout = Layout(vocab_size=int(h[_H_VOCAB]), ring_entries=int(h[_H_RING]),
                                max_rows=int(h[_H_MAX_ROWS]), max_batch_rows=int(h[_H_BATCH]),
                                ack_entries=int(h[_H_ACK]))
            except ValueError as e:
                raise LayoutMismatch(f"arena header holds an invalid layout: {e}") from None
            if int(h[_H_TOTAL]) != layout.total_bytes or size != layout.total_bytes:
                raise LayoutMismatch(f"arena size {size} (header says {int(h[_H_TOTAL])}) does "
                                     f"not match its layout ({layout.total_bytes} bytes)")
            if expect is not None and expect != layout:
                diff = [f"{k}={getattr(layout, k)} (expected {getattr(expect, k)})"
                        for k in expect.__dataclass_fields__
                        if getattr(layout, k) != getattr(expect, k)]
                raise LayoutMismatch("arena layout differs: " + ", ".join(diff))
            generation = int(h[_H_GENERATION])
            if expect_generation is not None and generation != expect_generation:
                raise LayoutMismatch(f"arena generation {generation}, expected {expect_generation}")
        except BaseException:
            mm.close()
            raise
        return cls(fd, mm, layout, generation, WakeFds(tokens_fd, space_fd, masks_fd))

    @property
    def pass_fds(self) -> tuple[int, int, int, int]:
        """What to give ``subprocess.Popen(pass_fds=...)``: arena + eventfds."""
        return (self.fd, *self.wake)

    def fd_spec(self) -> str:
        """"fd,tokens,space,masks": pass on the worker's command line."""
        return ",".join(str(f) for f in self.pass_fds)

    @classmethod
    def attach_spec(cls, spec: str, **kw) -> "Arena":
        try:
            fds = [int(x) for x in spec.split(",")]
        except ValueError:
            raise LayoutMismatch(f"bad arena fd spec {spec!r}") from None
        if not 1 <= len(fds) <= 4:
            raise LayoutMismatch(f"bad arena fd spec {spec!r}")
        return cls.attach(*fds, **kw)

    # -- raw access ---------------------------------------------------------
    @property
    def buffer(self) -> mmap.mmap:
        """The mapping (e.g. to page-lock it with cudaHostRegister)."""
        return self._mm

    def region(self, name: str) -> np.ndarray:
        return self._views[name]

    def _hword(self, i: int) -> int:
        return int(self._header[i])

    def _set_hword(self, i: int, v: int) -> None:
        self._header[i] = v

    # -- liveness -----------------------------------------------------------
    def beat(self, side: Side) -> None:
        """Record that ``side`` is alive now (call periodically)."""
        self._header[_H_BEAT[Side(side)]] = time.monotonic_ns()

    def last_beat_ns(self, side: Side) -> int:
        """CLOCK_MONOTONIC ns of the side's last beat (0 = never); the clock is
        system-wide, so both processes compare against the same time base."""
        return int(self._header[_H_BEAT[Side(side)]])

    def is_alive(self, side: Side, timeout_s: float) -> bool:
        """Has ``side`` beaten within the last ``timeout_s`` seconds?"""
        last = self.last_beat_ns(side)
        return last != 0 and time.monotonic_ns() - last <= timeout_s * 1e9

    def start_heartbeat(self, side: Side, interval_s: float = 0.1) -> threading.Event:
        """Beat from a daemon thread every ``interval_s`` until the returned
        event is set."""
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                self.beat(side)
                stop.wait(interval_s)

        threading.Thread(target=run, name=f"heartbeat-{Side(side).name.lower()}",
                         daemon=True).start()
        return stop

    # -- endpoints ----------------------------------------------------------
    def token_writer(self, **kw) -> "TokenRingWriter":
        return TokenRingWriter(self, **kw)

    def token_reader(self, **kw) -> "TokenRingReader":
        return TokenRingReader(self, **kw)

    def ack_writer(self, **kw) -> "AckWriter":
        return AckWriter(self, **kw)

    def ack_reader(self, **kw) -> "AckReader":
        return AckReader(self, **kw)

    def mask_writer(self) -> "MaskWriter":
        return MaskWriter(self)

    def mask_reader(self, **kw) -> "MaskReader":
        return MaskReader(self, **kw)

    def close(self) -> None:
        """Unmap and close this process's fds (the other side is unaffected)."""
        self._views.clear()
        self._header = None
        try:
            self._mm.close()
        except BufferError:
            pass  # views still exported by callers: unmapped when they are freed
        for fd in (self.fd, *self.wake):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd, self.wake = -1, WakeFds(-1, -1, -1)

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------ token ring
class Entry(NamedTuple):
    """One committed step, copied out of the ring (safe to keep)."""
    seq: int                      # ring position (0, 1, 2, ...): pass to consume()
    step: int
    kind: Kind
    seq_ids: np.ndarray           # uint32
    token_ids: np.ndarray         # int32
    flags: np.ndarray             # uint32 (TokenFlag bits)
    logprobs: Optional[np.ndarray]  # float32 or None


@dataclass
class PendingEntry:
    """A reserved slot. ``token_ids`` is the int32 staging view (page-locked
    arena memory) that a device copy may write into before ``commit``."""
    seq: int
    slot: int
    step: int
    kind: Kind
    nrows: int
    logprobs: bool
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
    """Worker side of the token ring. ``publish`` = ``reserve`` + ``commit``.

    Several reservations may be outstanding (pipelined device copies) but they
    must be committed in reservation order.
    """

    def __init__(self, arena: Arena, spin_s: float = 2e-5, slice_s: float = 0.05):
        self._a = arena
        self._cap = arena.layout.ring_entries
        self._max_rows = arena.layout.max_rows
        self._meta = arena.region("ring_meta")
        self._rows = arena.region("ring_rows")
        self._stage = arena.region("ring_stage")
        self._next = 0         # next position to reserve
        self._commit_next = 0  # next position to commit
        self._waiter = _Waiter(arena.wake.space, spin_s, slice_s)
        self.blocked = 0       # reservations that found the ring full

    @property
    def sleeps(self) -> int:
        return self._waiter.sleeps

    def consumed(self) -> int:
        return self._a._hword(_H_CONSUMED)

    def has_space(self) -> bool:
        return self._next - self.consumed() < self._cap

    def try_reserve(self, step: int, kind: Kind, nrows: int, *, logprobs: bool = False
                    ) -> Optional[PendingEntry]:
        """Reserve the next slot, or None if the ring is full."""
        if not 0 <= nrows <= self._max_rows:
            raise ValueError(f"nrows must be in [0, {self._max_rows}], got {nrows}")
        if not 0 <= step < 1 << 64:
            raise ValueError(f"step must be a uint64, got {step}")
        kind = Kind(kind)
        if not self.has_space():
            return None
        seq, slot = self._next, self._next % self._cap
        self._next += 1
        return PendingEntry(seq, slot, step, kind, nrows, bool(logprobs),
                            self._stage[slot, :nrows])

    def reserve(self, step: int, kind: Kind, nrows: int, *, logprobs: bool = False,
                timeout: Optional[float] = None, abort: AbortFn = None) -> PendingEntry:
        """Like ``try_reserve`` but blocks while the ring is full; raises
        ``RingTimeout`` after ``timeout`` s or ``RingAborted`` when ``abort()``."""
        p = self.try_reserve(step, kind, nrows, logprobs=logprobs)
        if p is not None:
            return p
        self.blocked += 1
        if not self._waiter.wait(self.has_space, timeout, abort):
            raise RingTimeout(f"token ring full for {timeout} s "
                              f"(consumed={self.consumed()}, next={self._next})")
        return self.try_reserve(step, kind, nrows, logprobs=logprobs)

    def commit(self, p: PendingEntry, seq_ids, flags, logprobs=None, token_ids=None) -> int:
        """Stamp a reserved entry and publish it. Token ids come from
        ``token_ids`` if given, else from ``p.token_ids`` (the staging view a
        device copy wrote: that copy must have completed, e.g. after
        ``event.synchronize()``). Returns the ring position."""
        if p.seq != self._commit_next:
            raise ValueError(f"commit out of order: got position {p.seq}, expected {self._commit_next}")
        rows = _normalize_rows(p.nrows, seq_ids, flags, token_ids, logprobs, p.logprobs)
        return self._write(p, *rows)

    def _write(self, p: PendingEntry, seq_ids, flags, tok, lp) -> int:
        tag, slot, n = _tag(p.seq), p.slot, p.nrows
        if tok is None:
            tok = p.token_ids
        ncols = _NCOLS if p.logprobs else _C_LOGP
        payload = np.empty((ncols, n), np.uint32)
        payload[_C_SEQ], payload[_C_TOK], payload[_C_FLAGS] = seq_ids, tok.view(np.uint32), flags
        if p.logprobs:
            payload[_C_LOGP] = lp.view(np.uint32)
        # Payload words first ...
        _tagged(tag, payload, self._rows[slot, :ncols, :n])
        meta, hi = self._meta[slot], tag << 32
        meta[_M_STEP_LO] = hi | (p.step & _U32)
        meta[_M_STEP_HI] = hi | (p.step >> 32)
        # ... the commit word last: readers key on it.
        meta[_M_COMMIT] = hi | n | (int(p.kind) << 24) | (int(p.logprobs) << 28)
        self._commit_next += 1
        _signal(self._a.wake.tokens)
        return p.seq

    def _no_outstanding(self) -> None:
        if self._commit_next != self._next:
            raise ValueError("publish while reservations are outstanding: commit them first")

    def try_publish(self, step: int, kind: Kind, seq_ids, token_ids, flags, logprobs=None
                    ) -> Optional[int]:
        """Non-blocking publish: the ring position, or None if the ring is full."""
        if token_ids is None:
            raise ValueError("publish needs token_ids (use reserve/commit for device copies)")
        rows = _normalize_rows(len(seq_ids), seq_ids, flags, token_ids, logprobs, logprobs is not None)
        self._no_outstanding()
        p = self.try_reserve(step, kind, len(seq_ids), logprobs=logprobs is not None)
        return None if p is None else self._write(p, *rows)

    def publish(self, step: int, kind: Kind, seq_ids, token_ids, flags, logprobs=None, *,
                timeout: Optional[float] = None, abort: AbortFn = None) -> int:
        """Publish one step; blocks while the ring is full (see ``reserve``)."""
        # Validate before reserving so a bad call never leaves a dangling slot.
        if token_ids is None:
            raise ValueError("publish needs token_ids (use reserve/commit for device copies)")
        rows = _normalize_rows(len(seq_ids), seq_ids, flags, token_ids, logprobs, logprobs is not None)
        self._no_outstanding()
        p = self.reserve(step, kind, len(seq_ids), logprobs=logprobs is not None,
                         timeout=timeout, abort=abort)
        return self._write(p, *rows)


def _normalize_rows(n: int, seq_ids, flags, token_ids, logprobs, want_lp: bool):
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
    if want_lp:
        if logprobs is None:
            raise ValueError("entry was reserved with logprobs=True but none were given")
        lp = np.asarray(logprobs, dtype=np.float32)
        if lp.shape != (n,):
            raise ValueError(f"logprobs must have shape ({n},), got {lp.shape}")
    elif logprobs is not None:
        raise ValueError("logprobs given for an entry reserved without them")
    return seq_ids, flags, tok, lp


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
    def next_seq(self) -> int:
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
        slot, tag = pos % self._cap, _tag(pos)
        step_lo, step_hi, commit = self._meta[slot, :3].tolist()
        ctag = commit >> 32
        if ctag != tag:
            prev = _prev_tag(pos, self._cap)
            if ctag == prev:
                return None
            raise RingCorrupt(f"token ring slot {slot}: commit tag {ctag:#x} is neither the "
                              f"expected {tag:#x} (position {pos}) nor the previous {prev:#x}")
        n, kind_v, has_lp = commit & 0xFFFFFF, (commit >> 24) & 0xF, (commit >> 28) & 1
        if n > self._max_rows or kind_v not in (Kind.PREFILL, Kind.DECODE) or commit >> 29 & 0x7:
            raise RingCorrupt(f"token ring slot {slot}: invalid commit word {commit:#018x}")
        # Copy first, then validate the copy. Load order does not matter: a
        # step or row word read "too early" carries an older tag and fails.
        rows = self._rows[slot, :_NCOLS if has_lp else _C_LOGP, :n].copy()
        if not ((step_lo >> 32) == (step_hi >> 32) == tag and _tags_ok(rows, tag)):
            if self._torn.expired(pos):
                raise RingCorrupt(f"token ring slot {slot} (position {pos}) has been published "
                                  f"for > {self._torn.limit_s} s but its row words carry the wrong tag")
            return None
        self._torn.clear()
        self._next += 1
        low = rows.astype(np.uint32)  # truncation keeps exactly the payload half
        return Entry(pos, (step_lo & _U32) | (step_hi & _U32) << 32, Kind(kind_v), low[_C_SEQ],
                     low[_C_TOK].view(np.int32), low[_C_FLAGS],
                     low[_C_LOGP].view(np.float32) if has_lp else None)

    def wait(self, timeout: Optional[float] = None, abort: AbortFn = None) -> bool:
        """Block until the next entry's commit word is visible (spin ``spin_s``,
        then sleep on the eventfd). Returns False on timeout."""
        return self._waiter.wait(self.ready, timeout, abort)

    def consume(self, upto_seq: int) -> None:
        """Hand slots up to and including position ``upto_seq`` back to the writer."""
        if upto_seq >= self._next:
            raise ValueError(f"cannot consume position {upto_seq}: only {self._next} polled")
        if upto_seq + 1 > self._consumed:
            self._consumed = upto_seq + 1
            self._a._set_hword(_H_CONSUMED, self._consumed)
            _signal(self._a.wake.space)


# -------------------------------------------------------------------- ack ring
class AckEvent(NamedTuple):
    kind: AckKind
    seq_id: int
    reason: int


class AckWriter:
    """Frontend side of the ack ring (finalize / cancel events).

    Slot words: [(tag << 32) | seq_id, (tag << 32) | kind << 16 | reason];
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

    def try_push(self, kind: AckKind, seq_id: int, reason: int = 0) -> bool:
        kind = AckKind(kind)
        if not 0 <= seq_id <= _U32 or not 0 <= reason < 1 << 16:
            raise ValueError(f"seq_id must fit uint32 and reason uint16 ({seq_id}, {reason})")
        if not self.has_space():
            return False
        pos = self._next
        hi = _tag(pos) << 32
        ev = self._events[pos % self._cap]
        ev[0] = hi | int(seq_id)
        ev[1] = hi | (int(kind) << 16) | int(reason)  # commit word last
        self._next += 1
        return True

    def push(self, kind: AckKind, seq_id: int, reason: int = 0, timeout: float = 0.0) -> None:
        """Push, waiting up to ``timeout`` s for space; raises ``AckRingFull``."""
        deadline = time.monotonic() + timeout
        while not self.try_push(kind, seq_id, reason):
            if time.monotonic() >= deadline:
                raise AckRingFull(f"ack ring full ({self._cap} events unconsumed by the worker)")
            time.sleep(0.0002)

    def finalize(self, seq_id: int, reason: int = FinishReason.NONE, timeout: float = 0.0) -> None:
        self.push(AckKind.FINALIZE, seq_id, reason, timeout)

    def cancel(self, seq_id: int, timeout: float = 0.0) -> None:
        self.push(AckKind.CANCEL, seq_id, FinishReason.ABORT, timeout)


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

    def consumed_seq(self) -> int:
        """Token-ring entries the frontend has consumed (its ``consumed`` word)."""
        return self._a._hword(_H_CONSUMED)

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
        if n < k:  # first unpublished slot: must hold its previous occupant's tag
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
            kr = (words[:n, 1] & _LOW)
            kinds, reasons = (kr >> np.uint64(16)).tolist(), (kr & np.uint64(0xFFFF)).tolist()
            try:
                out.extend(AckEvent(AckKind(k_), s, r) for k_, s, r in zip(kinds, seq, reasons))
            except ValueError as e:
                raise RingCorrupt(f"ack ring holds an invalid event kind: {e}") from None
            self._next += n
        return n


# ------------------------------------------------------------------ mask rows
class MaskWriter:
    """Frontend side of the mask rows.

    Words are ``(tag << 32) | mask32`` with ``tag = (step + 1) mod 2**32``;
    the per-row stamp (``step + 1``; 0 = never written) is written after the
    words, then the ``masks`` eventfd is signalled."""

    def __init__(self, arena: Arena):
        self._a = arena
        self.words_per_row = arena.layout.mask_words
        self._rows = arena.layout.max_batch_rows
        self._stamp = arena.region("mask_stamp")
        self._words = arena.region("mask_words")

    def write_rows(self, rows, step: int, masks: np.ndarray) -> None:
        """masks: int32 (len(rows), words_per_row), xgrammar bitmask layout."""
        rows = _check_rows(rows, self._rows)
        masks = np.asarray(masks)
        w = self.words_per_row
        if masks.shape != (len(rows), w) or masks.dtype not in (np.int32, np.uint32):
            raise ValueError(f"masks must be int32 of shape ({len(rows)}, {w}), "
                             f"got {masks.dtype} {masks.shape}")
        if not 0 <= step < (1 << 64) - 1:
            raise ValueError(f"step must be a uint64, got {step}")
        tagged = masks.view(np.uint32).astype(np.uint64) | np.uint64(_tag(step) << 32)
        self._words[rows, :w] = tagged
        self._stamp[rows] = np.uint64(step + 1)
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

    def stamped(self, rows, step: int) -> bool:
        """True iff every row's stamp is exactly ``step`` (never older/newer)."""
        rows = _check_rows(rows, self._rows)
        return bool(np.all(self._stamp[rows] == np.uint64(step + 1)))

    def wait_rows(self, rows, step: int, timeout: Optional[float], abort: AbortFn = None) -> bool:
        """Wait until all ``rows`` are stamped with ``step``; False on timeout."""
        rows = _check_rows(rows, self._rows)
        target = np.uint64(step + 1)
        return self._waiter.wait(lambda: bool(np.all(self._stamp[rows] == target)), timeout, abort)

    def read_rows(self, rows, step: Optional[int] = None) -> np.ndarray:
        """Validated int32 copy (len(rows), words_per_row) of the masks.

        With ``step``, every row must be stamped with exactly that step
        (``MaskNotReady`` otherwise). Without, each row is read as of its own
        current stamp. Words not yet visible are retried; still torn after
        ``corrupt_after_s`` -> ``RingCorrupt``."""
        rows = _check_rows(rows, self._rows)
        w = self.words_per_row
        deadline = time.monotonic() + self._corrupt_after_s
        while True:
            stamps = self._stamp[rows]  # fancy index: a copy
            if step is not None and not np.all(stamps == np.uint64(step + 1)):
                bad = rows[stamps != np.uint64(step + 1)]
                raise MaskNotReady(f"mask rows {bad[:8].tolist()} are not stamped for step {step}")
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
