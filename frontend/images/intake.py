"""Images on the frontend side: from the client's bytes to the worker's tile blocks.

``Service`` makes one call per event and stays the text path: ``check`` and
``start`` at submit, ``take_prepared`` on the loop, ``fits`` / ``hand_over`` when the
request is sent, ``cancel`` with the request, ``close`` with the service.

1. ``start``: the encoded images go to the image pool (``image_pool.py``):
   decoding, resizing and tiling run in child processes at nice 19, so a large
   image neither takes the GIL from the loop nor the CPU from the worker;
2. ``take_prepared`` (loop thread; the pool's helper threads hand results back
   through a deque and the eventfd in ``fds()``): the request's ``render``
   turns the prepared images into prompt ids (the tokenizer runs on the loop
   thread only), and the request is checked against the context and the
   arena's tile blocks; a bad image, or a ``ValueError`` from ``render``, fails
   only its own request (``bad_request`` naming the field);
3. the prepared request waits in the service's ``unsent`` until enough tile
   blocks are free (``fits``); ``hand_over`` writes its tiles into free blocks and
   returns the ``SubmitImage`` list its ``Submit`` carries (block ids, hash, tile
   count: pixels never go through the control channel);
4. a tile block is reused only after the worker's ``ImagesCopied`` (``TileBlockWriter.release``).

A cancel at any of these phases ends the request at once (one still queued in
the pool never runs; a result that arrives for an ended request is dropped).

A vision family plugs in here with an ``IntakeFamily`` (``INTAKES``, by its family's name): the
function the pool runs (Idefics3: ``images.prepare_images``; Moondream:
``moondream_images.prepare_images``), its tiles' geometry and how many prompt
positions an image fills; the caller brings the renderer. The tile blocks, the
pool's processes, the checks and the hand-over are the same.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import CancelledError, Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

from shared.arith import ceil_div
from shared.messages import SubmitImage
from shared.models.info import ModelInfo
from shared.shm.images import TileBlockWriter
from shared.vision_config import ImageProcessorParams

from frontend.moondream import images as moondream_images
from frontend.images.pool import ImagePool
from frontend.images.idefics3 import MAX_IMAGES, PreparedImage, check_image_count, max_tiles_per_image, prepare_images
from frontend.moondream.skills import PREFIX_LEN

log = logging.getLogger("tandem.frontend")

Render = Callable[[list[PreparedImage]], list[int]]


@dataclass(frozen=True)
class IntakeFamily:
    """What is a vision family's own on the frontend side."""
    prepare: Callable[[list[bytes], Any], list[PreparedImage]]  # what the pool runs (module-level: pickled)
    params: ImageProcessorParams | None  # prepare's second argument
    max_tiles: int  # tiles of the largest image (the default tile block count has room for a request of them)
    tile_side: int
    image_tokens: Callable[[list[int], list[PreparedImage]], int]  # rendered prompt ids -> positions filled
    tiling: bool = False  # the worker needs each image's tiling (Moondream encodes its crops together)


def _idefics3(model: ModelInfo) -> IntakeFamily:
    params = ImageProcessorParams.from_model_dir(model.path)
    return IntakeFamily(prepare_images, params, max_tiles_per_image(params), params.tile_size,
                        lambda ids, images: ids.count(params.image_token_id))  # one feature row each


def _moondream(model: ModelInfo) -> IntakeFamily:  # the BOS + image block of each image
    return IntakeFamily(moondream_images.prepare_images, None, 1 + moondream_images.MAX_CROPS,
                        moondream_images.CROP_SIZE, lambda ids, images: PREFIX_LEN * len(images), tiling=True)


# Each vision family's intake, by its shared.families name.
INTAKES: dict[str, Callable[[ModelInfo], IntakeFamily]] = {"idefics3": _idefics3, "moondream": _moondream,
                                                             "moondream3": _moondream}


def intake_family(model: ModelInfo) -> IntakeFamily | None:
    """The model's vision family on the frontend side; None for a text-only model."""
    return INTAKES[model.family.name](model) if model.vision else None


@dataclass(eq=False)
class RequestImages:
    """One request's images, from submit to the hand-over."""
    render: Render  # prepared images -> prompt ids (e.g. ``images.image_prompt_ids`` of the rendered text)
    preparation: Future | None = None  # its work in the image pool, until the result is taken
    prepared: list[PreparedImage] | None = None  # tiles waiting for tile blocks (dropped once handed over)
    tokens: int = 0  # prompt positions their features fill

    @property
    def preparing(self) -> bool:
        return self.preparation is not None

    @property
    def tile_counts(self) -> list[int]:
        return [im.num_tiles for im in self.prepared]


class ImageIntake:
    def __init__(self, family: IntakeFamily, tile_blocks: int | None, block_tiles: int,
                 image_workers: int | None) -> None:
        self.family = family
        self.params = family.params
        self.block_tiles = max(1, block_tiles)
        # None: room for one request of the largest images
        self.tile_blocks = tile_blocks if tile_blocks is not None else (
            MAX_IMAGES * ceil_div(family.max_tiles, self.block_tiles))
        self.pool = ImagePool(family.params, image_workers, family.prepare)
        self._prepared: deque = deque()  # (request, prepared images or the exception), from pool threads
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    @property
    def region(self) -> tuple[int, int, int]:
        """(tile blocks, tiles per block, tile side) of the arena's image region."""
        return self.tile_blocks, self.block_tiles, self.family.tile_side

    def fds(self) -> list[int]:
        return [self._fd]

    # ------------------------------------------------------------------ 1. submit
    def check(self, images: list[bytes]) -> None:
        """What needs no decoding (ValueError naming the field)."""
        try:
            check_image_count(len(images))
        except ValueError as e:
            raise ValueError(f"images: {e}") from None

    def start(self, req: Any, images: list[bytes], render: Render) -> RequestImages:
        """Send a request's encoded images to the pool."""
        state = RequestImages(render)
        state.preparation = self.pool.submit(list(images), lambda result: self._hand_back(req, result))
        return state

    def _hand_back(self, req: Any, result) -> None:
        """Pool thread (or the cancelling one): queue the prepared images or the exception for the loop."""
        self._prepared.append((req, result))
        os.eventfd_write(self._fd, 1)

    # ------------------------------------------------------------------ 2. prepared
    def take_prepared(self, max_len: int, blocks: TileBlockWriter) -> list[tuple[Any, tuple[str, str] | None]]:
        """Loop thread: the requests whose images the pool finished, each with its prompt rendered
        and ``None``, or the (code, message) it fails with. Ended requests are dropped."""
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass
        out = []
        while self._prepared:
            req, result = self._prepared.popleft()
            req.images.preparation = None
            if req.ended or isinstance(result, CancelledError):  # cancelled (or failed) while being prepared
                continue
            out.append((req, self._prepared_request(req, result, max_len, blocks)))
        return out

    def _prepared_request(self, req: Any, result, max_len: int, blocks: TileBlockWriter) -> tuple[str, str] | None:
        if isinstance(result, ValueError):
            return ("bad_request", str(result))
        if isinstance(result, BrokenProcessPool):
            log.error("the image pool process preparing request %d died: %s", req.seq_id, result)
            return ("internal", "the process preparing the images died (killed, or crashed decoding an image); "
                                "retry the request")
        if isinstance(result, Exception):
            log.error("preparing the images of request %d failed: %r", req.seq_id, result)
            return ("internal", f"{type(result).__name__}: {result}")
        images = req.images
        images.prepared = result
        try:
            req.prompt_ids = [int(t) for t in images.render(result)]
        except ValueError as e:
            return ("bad_request", str(e))
        except Exception as e:  # noqa: BLE001 - a renderer bug fails its request, never the loop
            log.exception("rendering the prompt of request %d failed", req.seq_id)
            return ("internal", f"{type(e).__name__}: {e}")
        if len(req.prompt_ids) >= max_len:
            return ("context_length_exceeded", f"the prompt has {len(req.prompt_ids)} tokens with its images; the "
                                               f"context holds {max_len} (prompt + at least one generated token)")
        need = blocks.blocks_needed(images.tile_counts)
        if need > blocks.capacity:
            return ("bad_request", f"images: {sum(images.tile_counts)} tiles need {need} tile blocks; the server "
                                   f"has {blocks.capacity} (--tile-blocks)")
        images.tokens = self.family.image_tokens(req.prompt_ids, result)
        return None

    # ------------------------------------------------------------------ 3. hand-over
    def fits(self, req: Any, blocks: TileBlockWriter) -> bool:
        """Enough tile blocks are free for the request's tiles."""
        return blocks.num_free >= blocks.blocks_needed(req.images.tile_counts)

    def hand_over(self, req: Any, blocks: TileBlockWriter) -> list[SubmitImage]:
        """Write the request's tiles into free tile blocks (``fits`` said they are free); the tiles are
        dropped here, the blocks come back with the worker's ``ImagesCopied``."""
        images = req.images
        out = [SubmitImage(hash=im.hash, num_tiles=im.num_tiles, blocks=blocks.write(im.tiles),
                           tiling=[im.rows, im.cols] if self.family.tiling else None)
               for im in images.prepared]
        images.prepared = None
        return out

    # ------------------------------------------------------------------ cancel, close
    def cancel(self, req: Any) -> None:
        if req.images.preparation is not None:
            req.images.preparation.cancel()  # frees its pool place if it has not started (else its result is dropped)

    def close(self) -> None:
        self.pool.close()  # first: no pool thread writes to the eventfd once it is closed
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
