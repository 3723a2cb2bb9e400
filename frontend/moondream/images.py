"""Moondream's overlap-crop tiling: decode, choose the tiling, cut the crops (torch-free).

The reference's ``overlap_crop_image`` step for step (MOONDREAM.md §2), with PIL's LANCZOS
resize (the reference's fallback when pyvips is missing, which its fixture used):

1. the tiling ``(t_h, t_w)`` comes from :func:`select_tiling` on the image less a 2 × 56 px
   margin, with a 266 px usable window per crop and at most 12 crops;
2. crop 0 is the whole image resized to 378 × 378 (the global crop);
3. the image resized to ``(t_h·266 + 112, t_w·266 + 112)`` gives local crop (i, j) = rows
   ``i·266 …`` and columns ``j·266 …``, 378 px each (zero-padded if short), row-major.

The crops stay uint8 ``[n, 3, 378, 378]`` (the layout of every image tile on its way to the
worker), which normalises them on the device in bfloat16 as the reference does
(``gpu_worker.moondream.normalize_crops``).
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
from PIL import Image

from shared.arith import ceil_div

from frontend.images.idefics3 import PreparedImage, check_image_count, decode_image

CROP_SIZE = 378
PATCH_SIZE = 14
OVERLAP_MARGIN = 4  # patches kept on every side of a crop that overlaps its neighbour
MAX_CROPS = 12  # local crops; the global crop comes on top
MARGIN_PX = OVERLAP_MARGIN * PATCH_SIZE  # 56
WINDOW_PX = CROP_SIZE - 2 * MARGIN_PX  # 266: the part of a crop no neighbour covers


def select_tiling(height: int, width: int, window: int = WINDOW_PX, max_crops: int = MAX_CROPS) -> tuple[int, int]:
    """How many crops (rows, columns) cover a ``height × width`` area of ``window``-sized windows."""
    if height <= window or width <= window:
        return 1, 1
    min_h, min_w = ceil_div(height, window), ceil_div(width, window)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio))
    h_tiles = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    w_tiles = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if h_tiles * w_tiles > max_crops:
        if w_tiles > h_tiles:
            w_tiles = math.floor(max_crops / h_tiles)
        else:
            h_tiles = math.floor(max_crops / w_tiles)
    return max(1, h_tiles), max(1, w_tiles)


def image_tiling(height: int, width: int) -> tuple[int, int]:
    """The tiling of an image of that size (its margins are not part of any window)."""
    return select_tiling(height - 2 * MARGIN_PX, width - 2 * MARGIN_PX)


def overlap_crops(image: Image.Image | np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    """RGB image -> (uint8 crops [1 + t_h·t_w, 3, 378, 378]: the global crop, then row-major; tiling)."""
    pil = image if isinstance(image, Image.Image) else Image.fromarray(image)
    pil = pil.convert("RGB")
    t_h, t_w = image_tiling(pil.height, pil.width)
    crops = np.zeros((1 + t_h * t_w, CROP_SIZE, CROP_SIZE, 3), dtype=np.uint8)
    crops[0] = np.asarray(pil.resize((CROP_SIZE, CROP_SIZE), resample=Image.Resampling.LANCZOS))
    size = (t_w * WINDOW_PX + 2 * MARGIN_PX, t_h * WINDOW_PX + 2 * MARGIN_PX)  # PIL: (width, height)
    resized = np.asarray(pil.resize(size, resample=Image.Resampling.LANCZOS))
    for i in range(t_h):
        for j in range(t_w):
            part = resized[i * WINDOW_PX:i * WINDOW_PX + CROP_SIZE, j * WINDOW_PX:j * WINDOW_PX + CROP_SIZE]
            crops[1 + i * t_w + j, :part.shape[0], :part.shape[1]] = part
    return np.ascontiguousarray(crops.transpose(0, 3, 1, 2)), (t_h, t_w)


def prepare_images(images: list[bytes], params=None) -> list[PreparedImage]:
    """Encoded bytes -> validated images as their crops (``rows``, ``cols`` = the tiling); the image
    pool's work for a Moondream model (``params`` is unused: the crop geometry is fixed)."""
    check_image_count(len(images))
    out = []
    for i, data in enumerate(images):
        try:
            crops, (t_h, t_w) = overlap_crops(decode_image(data))
        except ValueError as e:
            raise ValueError(f"images[{i}]: {e}") from None
        digest = hashlib.blake2b(b"moondream-overlap-crops:" + bytes(data), digest_size=16).hexdigest()
        out.append(PreparedImage(tiles=crops, rows=t_h, cols=t_w, hash=digest))
    return out
