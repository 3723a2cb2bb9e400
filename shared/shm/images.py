"""The image region, frontend -> worker: fixed-size tile blocks (each ``block_tiles`` uint8 tiles).

An image of n tiles takes ``ceil(n / block_tiles)`` tile blocks (any free ones;
the worker reads them in place). The frontend owns the free list: it allocates
blocks, writes the tiles, sends the block ids in the Submit, and frees the blocks
when the worker reports their host-to-device copy done (``ImagesCopied``) or
the worker generation ends. Requests that find too few free blocks wait.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shared.arith import ceil_div

if TYPE_CHECKING:
    from .arena import Arena


def blocks_for(num_tiles: int, block_tiles: int) -> int:
    return ceil_div(num_tiles, block_tiles)


class TileBlockWriter:
    """Frontend side: the free list and the writes."""

    def __init__(self, arena: Arena) -> None:
        self.tiles = arena.region("image_tiles")  # [tile_blocks, block_tiles, 3, S, S]
        self.block_tiles = arena.layout.block_tiles
        self.capacity = arena.layout.tile_blocks
        self.free = list(range(self.capacity - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, tile_counts: list[int]) -> int:
        return sum(blocks_for(n, self.block_tiles) for n in tile_counts)

    def write(self, tiles: np.ndarray) -> list[int] | None:
        """Copy one image's tiles [n, 3, S, S] into free tile blocks; their ids, or None if too few are free."""
        n = blocks_for(len(tiles), self.block_tiles)
        if n > len(self.free):
            return None
        blocks = [self.free.pop() for _ in range(n)]
        for i, block in enumerate(blocks):
            part = tiles[i * self.block_tiles:(i + 1) * self.block_tiles]
            self.tiles[block, :len(part)] = part
        return blocks

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


class TileBlockReader:
    """Worker side: views of an image's tiles, block by block (no copy)."""

    def __init__(self, arena: Arena) -> None:
        self.tiles = arena.region("image_tiles")
        self.block_tiles = arena.layout.block_tiles
        self.capacity = arena.layout.tile_blocks

    def blocks(self, blocks: list[int], num_tiles: int) -> list[np.ndarray]:
        """The image's tiles as views [k, 3, S, S] into its tile blocks; ValueError on bad ids or counts."""
        if len(blocks) != blocks_for(num_tiles, self.block_tiles) or num_tiles < 1:
            raise ValueError(f"{num_tiles} tiles do not fill {len(blocks)} tile blocks of {self.block_tiles} tiles")
        if len(set(blocks)) != len(blocks) or any(not 0 <= b < self.capacity for b in blocks):
            raise ValueError(f"tile blocks {blocks} are not distinct ids in [0, {self.capacity})")
        out = []
        for i, block in enumerate(blocks):
            out.append(self.tiles[block, :min(self.block_tiles, num_tiles - i * self.block_tiles)])
        return out
