"""The image region, frontend -> worker: fixed-size slots of uint8 tiles.

An image of n tiles takes ``ceil(n / slot_tiles)`` slots (any free ones; the
worker reads them as blocks). The frontend owns the free list: it allocates
slots, writes the tiles, sends the slot ids in the Submit, and frees the slots
when the worker reports their host-to-device copy done (``ImagesCopied``) or
the worker generation ends. Requests that find too few free slots wait.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shared.arith import ceil_div

if TYPE_CHECKING:
    from .arena import Arena


def slots_for(num_tiles: int, slot_tiles: int) -> int:
    return ceil_div(num_tiles, slot_tiles)


class ImageSlotWriter:
    """Frontend side: the free list and the writes."""

    def __init__(self, arena: Arena) -> None:
        self.tiles = arena.region("image_tiles")  # [slots, slot_tiles, 3, S, S]
        self.slot_tiles = arena.layout.slot_tiles
        self.capacity = arena.layout.image_slots
        self.free = list(range(self.capacity - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def slots_needed(self, tile_counts: list[int]) -> int:
        return sum(slots_for(n, self.slot_tiles) for n in tile_counts)

    def write(self, tiles: np.ndarray) -> list[int] | None:
        """Copy one image's tiles [n, 3, S, S] into free slots; their ids, or None if too few are free."""
        n = slots_for(len(tiles), self.slot_tiles)
        if n > len(self.free):
            return None
        slots = [self.free.pop() for _ in range(n)]
        for i, slot in enumerate(slots):
            block = tiles[i * self.slot_tiles:(i + 1) * self.slot_tiles]
            self.tiles[slot, :len(block)] = block
        return slots

    def release(self, slots: list[int]) -> None:
        self.free.extend(slots)


class ImageSlotReader:
    """Worker side: views of an image's tiles, block by block (no copy)."""

    def __init__(self, arena: Arena) -> None:
        self.tiles = arena.region("image_tiles")
        self.slot_tiles = arena.layout.slot_tiles
        self.capacity = arena.layout.image_slots

    def blocks(self, slots: list[int], num_tiles: int) -> list[np.ndarray]:
        """The image's tiles as views [k, 3, S, S] into its slots; ValueError on bad ids or counts."""
        if len(slots) != slots_for(num_tiles, self.slot_tiles) or num_tiles < 1:
            raise ValueError(f"{num_tiles} tiles do not fill {len(slots)} image slots of {self.slot_tiles} tiles")
        if len(set(slots)) != len(slots) or any(not 0 <= s < self.capacity for s in slots):
            raise ValueError(f"image slots {slots} are not distinct ids in [0, {self.capacity})")
        out = []
        for i, slot in enumerate(slots):
            out.append(self.tiles[slot, :min(self.slot_tiles, num_tiles - i * self.slot_tiles)])
        return out
