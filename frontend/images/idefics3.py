"""Image input for vision-language models: decode, validate, tile, hash, expand the prompt.

Torch-free (Pillow + numpy): this runs in the frontend. The preprocessing is
transformers' Idefics3 image processor (PIL backend) step for step, so the
tiles are bit-identical to what ``Idefics3Processor`` feeds the model:

1. convert to RGB; resize (LANCZOS) so the longest edge is ``longest_edge``
   (small images are upscaled; the short side is made even; both capped at 4096);
2. resize again so both sides are multiples of ``tile_size``;
3. if larger than one tile: cut ``rows × cols`` tiles, then add the whole
   (already resized) picture resized to one tile as the global view;
   otherwise the picture is the one tile.

Tiles stay ``uint8`` (a quarter of the float32 bytes) on their way to the
worker, which normalises them on the device (``gpu_worker.vision.normalize_tiles``);
:func:`normalize_tiles` here is the same arithmetic in numpy.

Each ``<image>`` in the prompt text becomes the image's token span
(:func:`image_placeholder_text`); only the ``<image>`` tokens in it receive
image features, one row per token.
"""
from __future__ import annotations

import hashlib
import io
import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

from shared.arith import ceil_div
from shared.vision_config import ImageProcessorParams

from frontend.protocol.wire import MAX_IMAGE_BYTES, MAX_IMAGE_SIDE, MAX_IMAGES  # noqa: F401 - the contract's limits

MAX_RESIZED_SIDE = 4096  # transformers' Idefics3 MAX_IMAGE_SIZE

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


@dataclass
class PreparedImage:
    """One image, ready for the worker."""

    tiles: np.ndarray  # uint8 [num_tiles, 3, tile_size, tile_size]: row-major tiles, then the global view
    rows: int  # tile grid; 0 x 0 means a single tile (no split, no global view)
    cols: int
    hash: str  # blake2b of the bytes and the preprocessing parameters (encoder-cache key)

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[0]


def check_image_count(n: int) -> None:
    if n > MAX_IMAGES:
        raise ValueError(f"too many images: {n} (at most {MAX_IMAGES} per request)")


def decode_image(data: bytes) -> Image.Image:
    """Decode and validate encoded image bytes into an RGB PIL image.

    The pixel-count limit is checked on the header, before any pixel is decoded,
    so a small file that inflates to gigabytes is refused cheaply.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"image must be bytes, got {type(data).__name__}")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"image is {len(data)} bytes, more than the limit of {MAX_IMAGE_BYTES} (20 MiB)")
    if len(data) == 0:
        raise ValueError("image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:  # Pillow's own, higher limit
        raise ValueError(f"image has too many pixels (more than {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE})") from None
    except Image.UnidentifiedImageError:
        raise ValueError("data is not an image in a format Pillow can read (PNG, JPEG, WebP, GIF, ...)") from None
    except Exception as e:  # a header Pillow recognised but could not parse
        raise ValueError(f"image header is corrupt: {e}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"image has an empty size {width}x{height}")
    if width * height > MAX_IMAGE_SIDE * MAX_IMAGE_SIDE:
        raise ValueError(f"image is {width}x{height} pixels, more than {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE}")
    try:
        image.load()
    except Exception as e:  # truncated or corrupt pixel data (OSError, SyntaxError, zlib errors, ...)
        raise ValueError(f"image data is truncated or corrupt ({image.format}): {e}") from None
    if image.format == "PNG":
        _check_png_complete(data, width, height)
    if image.mode == "RGB":
        return image
    try:
        return image.convert("RGB")  # as transformers does: alpha dropped, palettes and grey expanded
    except Exception as e:
        raise ValueError(f"cannot convert a {image.mode} image to RGB: {e}") from None


# PNG colour type -> channels per pixel (grey, RGB, palette, grey + alpha, RGBA)
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
# Adam7 interlacing: (x0, y0, dx, dy) of the seven passes
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _png_raw_size(width: int, height: int, depth: int, color_type: int, interlaced: bool) -> int:
    """Bytes of filtered scanlines (one filter byte per row) the IDAT stream must inflate to."""
    bits = _PNG_CHANNELS.get(color_type, 4) * depth

    def scanlines(w: int, h: int) -> int:
        return 0 if w == 0 or h == 0 else h * (1 + ceil_div(w * bits, 8))

    if not interlaced:
        return scanlines(width, height)
    return sum(scanlines(ceil_div(width - x0, dx), ceil_div(height - y0, dy)) for x0, y0, dx, dy in _ADAM7)


def _check_png_complete(data: bytes, width: int, height: int) -> None:
    """Refuse a PNG whose pixel data ends early. Pillow zero-fills the rows a complete but short
    zlib stream leaves out (a header claiming 8192x8192 over one row of data decodes "fine"),
    so the IDAT stream is inflated once more, counting bytes, without keeping them."""
    view = memoryview(data)
    depth, color_type, interlace = view[24], view[25], view[28]  # IHDR, the first chunk (Pillow checked it)
    need = _png_raw_size(width, height, depth, color_type, interlace == 1)
    inflate, got, pos = zlib.decompressobj(), 0, 8
    while pos + 8 <= len(view) and got < need:
        length, kind = struct.unpack_from(">I4s", view, pos)
        if kind == b"IEND":
            break
        if kind == b"IDAT":
            chunk = view[pos + 8:pos + 8 + length]
            while chunk and got < need:  # at most 1 MiB inflated at a time
                got += len(inflate.decompress(chunk, 1 << 20))
                chunk = inflate.unconsumed_tail
        pos += 12 + length
    if got < need:
        raise ValueError(f"image data is truncated (PNG): its pixel data inflates to {got} bytes where "
                         f"{width}x{height} needs {need}")


def image_hash(data: bytes, params: ImageProcessorParams) -> str:
    """Key of an image's encoder output: its bytes plus every preprocessing parameter."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(params.as_dict(), sort_keys=True).encode())
    h.update(bytes(data))
    return h.hexdigest()


def _longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """transformers' resize-to-longest-edge size, with its integer rounding."""
    aspect = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    # Cap at MAX_RESIZED_SIDE, keeping the aspect ratio.
    aspect = width / height
    if width >= height and width > MAX_RESIZED_SIDE:
        width, height = MAX_RESIZED_SIDE, int(MAX_RESIZED_SIDE / aspect)
    elif height > width and height > MAX_RESIZED_SIDE:
        height, width = MAX_RESIZED_SIDE, int(MAX_RESIZED_SIDE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides rounded up to multiples of the tile size (transformers' resize_for_vision_encoder)."""
    aspect = width / height
    if width >= height:
        width = ceil_div(width, tile) * tile
        height = ceil_div(int(width / aspect), tile) * tile
    else:
        height = ceil_div(height, tile) * tile
        width = ceil_div(int(height * aspect), tile) * tile
    return height, width


def tile_image(image: Image.Image, params: ImageProcessorParams) -> tuple[np.ndarray, int, int]:
    """RGB image -> (uint8 tiles [n, 3, S, S], rows, cols), as transformers' Idefics3 processor cuts it."""
    tile, resample = params.tile_size, params.resample

    def resized(img: Image.Image, height: int, width: int) -> Image.Image:
        return img.resize((width, height), resample=resample)

    image = resized(image, *_longest_edge_size(image.height, image.width, params.longest_edge))
    if not params.do_image_splitting:
        return _chw(np.asarray(resized(image, tile, tile)))[None], 0, 0
    image = resized(image, *_tile_multiple_size(image.height, image.width, tile))
    if image.height <= tile and image.width <= tile:
        return _chw(np.asarray(image))[None], 0, 0
    rows, cols = image.height // tile, image.width // tile
    pixels = np.asarray(image)  # [rows * S, cols * S, 3]
    tiles = pixels.reshape(rows, tile, cols, tile, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, tile, tile)
    global_view = _chw(np.asarray(resized(image, tile, tile)))
    return np.concatenate([tiles, global_view[None]]), rows, cols


def _chw(hwc: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


def prepare_image(data: bytes, params: ImageProcessorParams) -> PreparedImage:
    """Encoded bytes -> validated, tiled, hashed image. Raises ValueError on bad input."""
    tiles, rows, cols = tile_image(decode_image(data), params)
    return PreparedImage(tiles=tiles, rows=rows, cols=cols, hash=image_hash(data, params))


def prepare_images(images: list[bytes], params: ImageProcessorParams) -> list[PreparedImage]:
    check_image_count(len(images))
    out = []
    for i, data in enumerate(images):
        try:
            out.append(prepare_image(data, params))
        except ValueError as e:
            raise ValueError(f"images[{i}]: {e}") from None
    return out


def max_tiles_per_image(params: ImageProcessorParams) -> int:
    """The most tiles one image can become (its grid plus the global view)."""
    if not params.do_image_splitting:
        return 1
    side = ceil_div(min(params.longest_edge, MAX_RESIZED_SIDE), params.tile_size)
    return side * side + (1 if side > 1 else 0)


def normalize_tiles(tiles: np.ndarray, params: ImageProcessorParams) -> np.ndarray:
    """uint8 tiles -> float32 model input, exactly transformers' rescale then normalize."""
    x = (tiles.astype(np.float64) * params.rescale_factor).astype(np.float32)
    mean = np.asarray(params.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(params.image_std, dtype=np.float32)[:, None, None]
    return (x - mean) / std


def image_placeholder_text(rows: int, cols: int, image_seq_len: int) -> str:
    """The text one ``<image>`` expands to for a rows x cols tiling (0 x 0: a single tile)."""
    image_tokens = IMAGE_TOKEN * image_seq_len
    global_view = f"{FAKE_TOKEN}{GLOBAL_IMAGE_TOKEN}{image_tokens}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return global_view
    grid = "".join(
        "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{image_tokens}" for c in range(cols)) + "\n"
        for r in range(rows))
    return grid + "\n" + global_view


def expand_image_tokens(text: str, images: list[PreparedImage], params: ImageProcessorParams) -> str:
    """Replace the i-th ``<image>`` of ``text`` by image i's token span."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 != len(images):
        raise ValueError(f"the prompt has {len(parts) - 1} {IMAGE_TOKEN} placeholders but {len(images)} "
                         "images were given")
    spans = [image_placeholder_text(im.rows, im.cols, params.image_seq_len) for im in images]
    return parts[0] + "".join(span + part for span, part in zip(spans, parts[1:]))


def image_prompt_ids(tokenizer, text: str, images: list[PreparedImage], params: ImageProcessorParams) -> list[int]:
    """Token ids of ``text`` (already rendered, e.g. by the chat template) with its images expanded.

    Checks that the ids hold exactly one ``<image>`` token per feature row, so a
    tokenizer without the image tokens fails here, not in the worker.
    """
    ids = [int(t) for t in tokenizer.encode(expand_image_tokens(text, images, params), add_special_tokens=False)]
    want = sum(im.num_tiles for im in images) * params.image_seq_len
    got = sum(1 for t in ids if t == params.image_token_id)
    if got != want:
        raise ValueError(f"prompt has {got} image tokens (id {params.image_token_id}) where {want} are needed: "
                         "does the tokenizer have the Idefics3 image tokens?")
    return ids
