"""Images in prefill launches: everything the worker does for a request's images, in one place.

The engine makes one call per event and stays the text path: ``check`` at
submit, ``admit`` at admission, ``add_chunk`` for each prefill chunk of a
launch, ``committed`` at that launch's commit, ``release`` at the request's
release, ``device_failed`` after a failed launch. The host tiles it no longer
reads are handed back through ``take_handed_back`` (the engine returns them in
``Tick.tiles_done``; the worker then frees their shared-memory tile blocks).

What happens to one image (docs/DESIGN.md §4.5):
- at admission the request takes a reference to the image's entry in the
  encoder cache (``encoder_cache.py``: a hit, or a new entry on a miss);
- a launch encodes only the *encode units* its chunks reach that no launch has
  enqueued yet (a chunk whose image rows end inside unit u needs units up to
  u), on the compute stream before its text forward, so the prefill budget
  bounds the encoder work too (at most ceil(budget / rows per unit) + 1 units
  per chunk). The units come from the host tiles of the request whose chunk
  reaches them first; their rows land in the entry's preallocated features,
  and stream order makes them readable by every later launch. A chunk may
  split an image span unless the family says otherwise (``whole_span``);
- the reference keeps the features until the request's last prefill chunk has
  been committed; an image wholly inside a prefix-cache hit needs no features,
  and a hit ending inside an image skips the units before it;
- the host tiles are handed back once the engine will never read them: every
  unit the request still needs is enqueued (by it or by another request) and
  no uncommitted launch copies from them, checked at admission, when a chunk
  reaches the image and when a launch that copied them commits; or at the
  request's release.

A vision family plugs in through ``ImageFamily`` (``vision.VisionEncoder`` is
Idefics3's, ``moondream.Moondream`` Moondream's): its rules for a request's
images and where their rows go in the prompt, how many tiles and feature rows
make one encode unit, which prompt span a chunk must not split, and the device
work of encoding runs of units. Everything else here is the families' common
bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from shared.arith import ceil_div

from .encoder_cache import EncoderCache

if TYPE_CHECKING:
    from shared.vision_config import ImageProcessorParams

    from .scheduler import PrefillChunk
    from .sequence import Sequence


class ImageFamily(Protocol):
    """What the room needs from a vision encoder besides its device forward (``encode_runs``)."""

    def image_positions(self, prompt: np.ndarray, images: list[ImageInput],
                        params: ImageProcessorParams | None) -> np.ndarray:
        """The family's rules for a request's images (tile shapes, how many; ValueError naming the
        field) -> the sorted prompt positions their feature rows fill: Idefics3's ``<image>``
        tokens, Moondream's image block (the prompt's first positions)."""

    def encode_unit(self, num_tiles: int) -> tuple[int, int]:
        """(tiles, feature rows) of one encode unit of an image of ``num_tiles`` tiles: the fewest
        tiles whose rows are computed together. Idefics3 encodes tiles independently, (1, 64); a
        family whose rows mix every tile (Moondream's stitched and pooled crops) has one unit,
        (num_tiles, 730): BOS + 729 rows."""

    def whole_span(self, first: int, end: int) -> tuple[int, int] | None:
        """For an image at prompt positions ``first .. end - 1``: the positions a prefill chunk must
        not end inside (a block that attends both ways, e.g. Moondream's BOS + 729), or None."""


def image_rows_in_chunk(image_positions: np.ndarray, start: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Which image feature rows a prefill chunk needs, and where they go.

    image_positions: sorted prompt positions of a request's ``<image>`` tokens (row
    ``k`` of its features belongs at ``image_positions[k]``). For the chunk covering
    positions ``start .. start + num_tokens - 1`` returns (offsets within the
    chunk, feature row indices), both int64; empty when the chunk has no image
    token. A chunk may start or end inside an image span.
    """
    lo, hi = np.searchsorted(image_positions, [start, start + num_tokens])
    rows = np.arange(lo, hi, dtype=np.int64)
    return image_positions[lo:hi].astype(np.int64) - start, rows


@dataclass(eq=False)
class ImageInput:
    """One image of a request, as the engine receives it."""
    hash: str  # the encoder-cache key (bytes + preprocessing parameters)
    tiles: list[np.ndarray] | np.ndarray  # uint8 [n, 3, S, S], or a list of such blocks (shared-memory tile blocks)
    tag: object = None  # the caller's handle, given back in Tick.tiles_done (the worker: its tile block ids)
    tiling: tuple[int, int] | None = None  # Moondream: its local crops' (rows, columns)

    def __post_init__(self) -> None:
        if isinstance(self.tiles, np.ndarray):
            self.tiles = [self.tiles]
        self.tiles = list(self.tiles)

    @property
    def num_tiles(self) -> int:
        return sum(len(t) for t in self.tiles)

    def tile_blocks(self, first: int, end: int) -> list[np.ndarray]:
        """Tiles ``first .. end - 1`` as views of the blocks that hold them (no copy)."""
        out, base = [], 0
        for block in self.tiles:
            a, b = max(first - base, 0), min(end - base, len(block))
            if a < b:
                out.append(block[a:b])
            base += len(block)
        return out


@dataclass(eq=False)
class SeqImage:
    """An image inside a sequence: its feature rows and what it holds."""
    input: ImageInput
    row_start: int  # first of its rows among the sequence's feature rows
    num_rows: int
    unit_tiles: int  # tiles per encode unit
    unit_rows: int  # feature rows per encode unit
    holds_tiles: bool = True  # the engine may still read input.tiles
    first_unit: int = 0  # the first unit whose rows this request computes (earlier ones: its prefix-cache hit)
    copies: int = 0  # launches, not yet committed, that encode some of its units (they read input.tiles)
    entry: object = None  # its EncoderCache entry, from admission until the prefill is committed

    @property
    def row_end(self) -> int:
        return self.row_start + self.num_rows

    @property
    def num_units(self) -> int:
        return self.num_rows // self.unit_rows


@dataclass
class LaunchImages:
    """One launch's image work, built chunk by chunk, read by the model runner and at the commit."""
    encode: list = field(default_factory=list)  # (host tile blocks, FeatureHolder, first row, image rows, tiling)
    index: list = field(default_factory=list)  # per chunk: packed token index of its <image> tokens
    segments: list = field(default_factory=list)  # where those tokens' features are: (FeatureHolder, first, end)
    encoded: list = field(default_factory=list)  # (SeqImage, units) encoded from its host tiles by this launch
    prefill_ended: list = field(default_factory=list)  # sequences with images whose last prefill chunk is in it

    def inputs(self) -> dict:
        """The ``LaunchInputs`` fields of this work."""
        return {"encode": self.encode, "image_index": np.concatenate(self.index) if self.index else None,
                "image_segments": self.segments}


@dataclass
class ImageStats:
    encoder_launches: int = 0  # vision forwards (one per launch that encodes)
    encoded_images: int = 0  # images whose last missing unit was enqueued
    encoded_tiles: int = 0
    image_tokens: int = 0  # prompt positions filled by image features, of admitted requests


class ImagePrefill:
    def __init__(self, family: ImageFamily | None, params: ImageProcessorParams | None, row_bytes: int,
                 cache_bytes: int) -> None:
        """``family`` None: a text-only model (``check`` refuses images). ``row_bytes``: device bytes
        of one feature row."""
        self.family = family
        self.params = params
        self.row_bytes = row_bytes
        self.cache = EncoderCache(cache_bytes)
        self.counts = ImageStats()
        self._handed_back: list[ImageInput] = []

    # ------------------------------------------------------------------ submit
    def check(self, prompt: list[int], images: list[ImageInput]) -> tuple[list[SeqImage], np.ndarray | None,
                                                                              list[tuple[int, int]]]:
        """Validate a request's images against its prompt: (its images, the sorted prompt positions
        of its ``<image>`` tokens, the spans a chunk must not split). ValueError names the field."""
        if self.family is None:
            if images:
                raise ValueError("images: this model takes no images")
            return [], None, []
        positions = self.family.image_positions(np.asarray(prompt), images, self.params)
        seq_images, row = [], 0
        for i, image in enumerate(images):
            if image.num_tiles < 1:
                raise ValueError(f"images[{i}]: no tiles")
            unit_tiles, unit_rows = self.family.encode_unit(image.num_tiles)
            rows = image.num_tiles // unit_tiles * unit_rows
            seq_images.append(SeqImage(image, row, rows, unit_tiles, unit_rows))
            row += rows
        if row != len(positions):
            raise ValueError(f"images: the prompt has {len(positions)} image tokens but the images have {row} "
                             "feature rows")
        if not images:
            return [], None, []
        spans = [self.family.whole_span(int(positions[im.row_start]), int(positions[im.row_end - 1]) + 1)
                 for im in seq_images]
        return seq_images, positions, [s for s in spans if s is not None]

    # ------------------------------------------------------------------ admission
    def admit(self, seq: Sequence) -> None:
        """A reference to each image's cache entry; a hit on features already computed (or
        enqueued) never reads this request's tiles, nor does an image inside its prefix-cache hit."""
        self.counts.image_tokens += seq.image_tokens
        for image in seq.images:
            if int(seq.image_positions[image.row_end - 1]) < seq.cached_tokens:
                self._hand_back(image)  # wholly in the prefix-cache hit: its KV is there already
                continue
            image.entry, _hit = self.cache.acquire(image.input.hash, image.num_rows * self.row_bytes,
                                                   image.num_units)
            # A prefix-cache hit may end inside the image: its earlier units are never read.
            first_row = int(np.searchsorted(seq.image_positions, seq.cached_tokens)) - image.row_start
            image.first_unit = max(first_row, 0) // image.unit_rows
            self._maybe_hand_back(image)

    # ------------------------------------------------------------------ launch
    def add_chunk(self, work: LaunchImages | None, chunk: PrefillChunk, offset: int) -> LaunchImages:
        """A prefill chunk of a launch (its tokens start at packed index ``offset``): encode the units
        its image rows need that nobody has enqueued yet, say where each row's features are.
        Returns the launch's work (created by its first chunk with images)."""
        work = work if work is not None else LaunchImages()
        seq = chunk.seq
        if chunk.final:
            work.prefill_ended.append(seq)
        offsets, rows = image_rows_in_chunk(seq.image_positions, chunk.start, chunk.length)
        if not len(rows):
            return work
        work.index.append(offsets + offset)
        lo, hi = int(rows[0]), int(rows[-1]) + 1  # a chunk's image rows are contiguous
        for image in seq.images:
            if image.row_end <= lo or image.row_start >= hi:
                continue
            entry = image.entry
            first, end = max(lo, image.row_start) - image.row_start, min(hi, image.row_end) - image.row_start
            per = image.unit_rows
            missing = entry.missing(first // per, ceil_div(end, per))
            if len(missing):
                assert image.holds_tiles, "units to encode without the host tiles"
                if not work.encode:
                    self.counts.encoder_launches += 1
                entry.enqueued[missing] = True
                entry.pending += len(missing)
                image.copies += 1
                work.encoded.append((image, len(missing)))
                for run in np.split(missing, np.flatnonzero(np.diff(missing) > 1) + 1):  # contiguous runs
                    a, b = int(run[0]), int(run[-1]) + 1
                    blocks = image.input.tile_blocks(a * image.unit_tiles, b * image.unit_tiles)
                    work.encode.append((blocks, entry.holder, a * per, image.num_rows, image.input.tiling))
                self.counts.encoded_tiles += len(missing) * image.unit_tiles
                self.counts.encoded_images += entry.complete()
            self._maybe_hand_back(image)  # e.g. another request enqueued the rest
            work.segments.append((entry.holder, first, end))
        return work

    # ------------------------------------------------------------------ commit, release, failure
    def committed(self, work: LaunchImages) -> None:
        """The launch's host-to-device copies are done, and no later launch reads the features of
        the requests whose prefill it ended."""
        for image, units in work.encoded:
            image.copies -= 1
            if image.entry is not None:
                image.entry.pending -= units
            self._maybe_hand_back(image)
        for seq in work.prefill_ended:
            self._release_features(seq)

    def release(self, seq: Sequence) -> None:
        """The request's release: its tiles and features, exactly once."""
        for image in seq.images:
            self._hand_back(image)
        self._release_features(seq)

    def device_failed(self, running: list[Sequence]) -> list[Sequence]:
        """Features whose encode never completed are garbage: forget them. Returns the running
        requests that would read them (a request admitted later may have hit on them)."""
        broken = {e for e in self.cache.entries.values() if e.pending}
        for entry in broken:
            self.cache.invalidate(entry)
        if not broken:
            return []
        return [s for s in running if any(i.entry in broken for i in s.images)]

    def take_handed_back(self) -> list[ImageInput]:
        """The host tiles handed back since the last call: the engine never reads them again."""
        out, self._handed_back = self._handed_back, []
        return out

    def stats(self) -> dict:
        return {**self.counts.__dict__, **self.cache.stats()}

    def reset_stats(self) -> None:
        self.counts = ImageStats()

    # ------------------------------------------------------------------ helpers
    def _maybe_hand_back(self, image: SeqImage) -> None:
        """Hand the tiles back if every unit the request still needs is enqueued and no
        uncommitted launch copies from them."""
        if not image.copies and (image.entry is None or image.entry.complete(image.first_unit)):
            self._hand_back(image)

    def _hand_back(self, image: SeqImage) -> None:
        if image.holds_tiles:
            image.holds_tiles = False
            self._handed_back.append(image.input)

    def _release_features(self, seq: Sequence) -> None:
        for image in seq.images:
            if image.entry is not None:
                self.cache.release(image.entry)
                image.entry = None
