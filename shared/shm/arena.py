"""``Arena``: the mapped memfd plus its wakeup eventfds, its header (layout
words, heartbeats) and the factories of the ring endpoints."""
from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Optional

import numpy as np

from .ack_ring import AckReader, AckWriter
from .errors import LayoutMismatch
from .layout import (
    _H_ACK, _H_BATCH, _H_TILE_BLOCKS, _H_BLOCK_TILES, _H_TILE_SIZE, _H_BEAT, _H_GENERATION, _H_MAGIC, _H_MAX_ROWS, _H_RING, _H_TOTAL,
    _H_VERSION, _H_VOCAB, _HEADER_BYTES, LAYOUT_VERSION, MAGIC, Layout, Side,
)
from .images import TileBlockReader, TileBlockWriter
from .masks import MaskReader, MaskWriter
from .token_ring import TokenRingReader, TokenRingWriter
from .wake import WakeFds


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
        self._heartbeats: list[tuple[threading.Event, threading.Thread]] = []

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
        h[_H_TILE_BLOCKS], h[_H_BLOCK_TILES], h[_H_TILE_SIZE] = layout.tile_blocks, layout.block_tiles, layout.tile_size
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
                                ack_entries=int(h[_H_ACK]), tile_blocks=int(h[_H_TILE_BLOCKS]),
                                block_tiles=int(h[_H_BLOCK_TILES]), tile_size=int(h[_H_TILE_SIZE]))
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
        event is set or the arena is closed (``close`` joins the thread, so no
        beat lands after the header is gone)."""
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                self.beat(side)
                stop.wait(interval_s)

        thread = threading.Thread(target=run, name=f"heartbeat-{Side(side).name.lower()}", daemon=True)
        thread.start()
        self._heartbeats.append((stop, thread))
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

    def image_writer(self) -> "TileBlockWriter":
        return TileBlockWriter(self)

    def image_reader(self) -> "TileBlockReader":
        return TileBlockReader(self)

    def close(self) -> None:
        """Unmap and close this process's fds (the other side is unaffected)."""
        for stop, thread in self._heartbeats:
            stop.set()
            thread.join()
        self._heartbeats.clear()
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
