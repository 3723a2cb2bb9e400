"""What both processes agree on about the arena's bytes: the header's magic
and version, the enums stored in ring words, the header word indices, the
token-ring entry layout and the region offsets (``Layout``)."""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import numpy as np

from shared.arith import ceil_div
from shared.sampling import MAX_TOP_LOGPROBS

MAGIC = int.from_bytes(b"TANDEMAR", "little")
LAYOUT_VERSION = 5  # 4: token-ring rows carry region values; 5: and top logprobs
CACHE_LINE = 64


# ------------------------------------------------------------------- constants
class Side(IntEnum):
    FRONTEND = 0
    WORKER = 1


class Kind(IntEnum):
    """What kind of step produced a token-ring entry."""
    PREFILL = 0
    DECODE = 1


class TokenFlag(IntFlag):
    """Per-row flags of a token-ring entry (a uint32 bitfield): the low bits
    hold the row's ``FinishReason`` (NONE while the request runs on)."""
    NONE = 0
    FINISH_MASK = 0x7    # a shared.finish.FinishReason
    ZOMBIE = 1 << 3      # the frontend already ended this request: ignore the row


# On a request's first row, flags >> CACHED_SHIFT = its prompt tokens mapped from the prefix cache.
CACHED_SHIFT = 8


# Header word indices (uint64 words). Line 0-1: static; 2/3: heartbeats;
# 4: frontend-written control; 5: worker-written control.
_H_MAGIC, _H_VERSION, _H_TOTAL, _H_GENERATION = 0, 1, 2, 3
_H_RING, _H_MAX_ROWS, _H_BATCH, _H_VOCAB, _H_ACK = 4, 5, 6, 7, 8
_H_TILE_BLOCKS, _H_BLOCK_TILES, _H_TILE_SIZE = 9, 10, 11
_H_BEAT = {Side.FRONTEND: 16, Side.WORKER: 24}
_H_CONSUMED = 32       # frontend: token entries consumed (next seq not consumed)
_H_ACK_CONSUMED = 40   # worker: ack events consumed
_HEADER_BYTES = 512

# Token-ring meta words per entry (one cache line per entry).
_M_STEP_LO, _M_STEP_HI, _M_COMMIT = 0, 1, 2
# commit payload: nrows in bits 0-23, kind in 24-27, has-logprobs in bit 28, has-values in bit 29,
# has-top-logprobs in bit 30.
# Row columns of an entry (one (47, rows) block so an entry is one vectorised op); then three
# for a Moondream row's region values (coordinate, width, height; float32); then the row's
# MAX_TOP_LOGPROBS most likely token ids (int32) and their logprobs (float32). An entry
# writes (and a reader copies) only the columns up to the last it uses.
_C_SEQ, _C_TOK, _C_FLAGS, _C_LOGP, _C_VALUES, _C_TOP = 0, 1, 2, 3, 4, 7
_NCOLS = _C_TOP + 2 * MAX_TOP_LOGPROBS
NUM_VALUES = _C_TOP - _C_VALUES
_MAX_ROWS_LIMIT = 1 << 24


def _align(n: int, a: int = CACHE_LINE) -> int:
    return ceil_div(n, a) * a


# ---------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """Sizes of an arena; both processes derive identical offsets from it."""
    vocab_size: int
    ring_entries: int = 64
    max_rows: int = 1024        # rows per token-ring entry
    max_batch_rows: int = 256   # mask rows: as many as the batch has rows, lent per request (not by batch row)
    ack_entries: int = 4096
    tile_blocks: int = 0        # image region: tile blocks of block_tiles uint8 tiles [3, tile_size, tile_size]
    block_tiles: int = 1
    tile_size: int = 0

    def __post_init__(self) -> None:
        for name, lo, hi in (("vocab_size", 1, 1 << 31), ("ring_entries", 2, 1 << 20),
                             ("max_rows", 1, _MAX_ROWS_LIMIT), ("max_batch_rows", 1, 1 << 20),
                             ("ack_entries", 2, 1 << 24), ("tile_blocks", 0, 1 << 20),
                             ("block_tiles", 1, 1 << 10), ("tile_size", 0, 1 << 14)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
                raise ValueError(f"Layout.{name} must be an integer in [{lo}, {hi}), got {v!r}")

    @property
    def mask_words(self) -> int:
        """int32 words per mask row: ceil(vocab / 32)."""
        return ceil_div(self.vocab_size, 32)

    def regions(self) -> dict[str, tuple[int, tuple[int, ...], np.dtype]]:
        """name -> (offset, shape, dtype). Row strides are padded so that every
        row of every region starts on a cache line."""
        r, b, a = self.ring_entries, self.max_batch_rows, self.ack_entries
        rows = _align(self.max_rows, 16)     # 16 int32 = 64 bytes
        words = _align(self.mask_words, 8)   # 8 uint64 = 64 bytes
        u64, i32 = np.dtype(np.uint64), np.dtype(np.int32)
        specs = [
            ("ring_meta", (r, 8), u64),
            ("ring_rows", (r, _NCOLS, rows), u64),  # columns: seq, token, flags, logprob, 3 values, top
            ("ring_stage", (r, rows), i32),   # raw token ids from device copies
            ("ack_events", (a, 2), u64),
            ("mask_stamp", (b,), u64),
            ("mask_words", (b, words), u64),
            ("image_tiles", (self.tile_blocks, self.block_tiles, 3, self.tile_size, self.tile_size), np.dtype(np.uint8)),
        ]
        out, off = {}, _HEADER_BYTES
        for name, shape, dt in specs:
            off = _align(off)
            out[name] = (off, shape, dt)
            off += int(np.prod(shape)) * dt.itemsize
        return out

    @property
    def total_bytes(self) -> int:
        off, shape, dt = self.regions()["image_tiles"]
        return _align(off + int(np.prod(shape)) * dt.itemsize, mmap.PAGESIZE)
