"""What both processes need to know about a vision-language model directory.

The frontend preprocesses images and expands the prompt; the worker encodes the
tiles. Both read the same files (config.json and the processor config), so the
parsing lives here, torch-free.

Layouts accepted: transformers 5 saves the image processor nested in
``processor_config.json`` (``{"image_processor": {...}, "image_seq_len": 64}``);
Hub checkpoints such as SmolVLM-256M-Instruct ship a flat
``preprocessor_config.json`` next to a ``processor_config.json`` holding
``image_seq_len``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# PIL's resampling filter numbers, as saved in preprocessor configs.
PIL_LANCZOS = 1


# transformers' Idefics3VisionConfig defaults: a Hub config.json may list only the
# fields that differ from them (SmolVLM-256M's omits intermediate_size and the layer count).
VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                       num_channels=3, image_size=224, patch_size=32, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6)


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def vision_config(config: dict) -> dict:
    """The vision_config of an Idefics3 config.json dict, with transformers' defaults filled in."""
    return {**VISION_DEFAULTS, **config.get("vision_config", {})}


@dataclass(frozen=True)
class ImageProcessorParams:
    """Idefics3 image-processor parameters plus the token layout of one image.

    Names follow transformers' ``Idefics3ImageProcessor``: ``longest_edge`` is
    ``size["longest_edge"]`` (the whole image is resized to it), ``tile_size`` is
    ``max_image_size["longest_edge"]`` (the vision encoder's input side).
    """

    longest_edge: int
    tile_size: int
    image_seq_len: int  # <image> tokens (= feature rows) per tile
    image_token_id: int
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = PIL_LANCZOS
    do_image_splitting: bool = True

    def as_dict(self) -> dict:
        """Every field, for hashing an image together with how it was preprocessed."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ImageProcessorParams":
        path = Path(path)
        config = read_config(path)
        if "vision_config" not in config or "image_token_id" not in config:
            raise ValueError(f"{path} is not an Idefics3-style vision-language model (no vision_config / image_token_id)")
        processor = _read_json(path / "processor_config.json")
        image = _read_json(path / "preprocessor_config.json") or processor.get("image_processor") or {}
        if not image:
            raise FileNotFoundError(f"{path}: no image processor config (preprocessor_config.json or "
                                    "processor_config.json's image_processor)")
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if image.get(flag) is False:
                raise NotImplementedError(f"{path}: image processor with {flag}=false is not supported")
        vision = vision_config(config)
        tokens_per_tile = (vision["image_size"] // vision["patch_size"]) ** 2 // config.get("scale_factor", 2) ** 2
        image_seq_len = int(processor.get("image_seq_len", tokens_per_tile))
        if image_seq_len != tokens_per_tile:
            raise ValueError(f"{path}: processor image_seq_len {image_seq_len} != the model's {tokens_per_tile} "
                             "feature rows per tile")
        tile_size = int(image["max_image_size"]["longest_edge"])
        if tile_size != vision["image_size"]:
            raise ValueError(f"{path}: tile size {tile_size} != vision image_size {vision['image_size']}")
        return cls(
            longest_edge=int(image["size"]["longest_edge"]),
            tile_size=tile_size,
            image_seq_len=image_seq_len,
            image_token_id=int(config["image_token_id"]),
            image_mean=tuple(float(x) for x in image.get("image_mean", cls.image_mean)),
            image_std=tuple(float(x) for x in image.get("image_std", cls.image_std)),
            rescale_factor=float(image.get("rescale_factor", cls.rescale_factor)),
            resample=int(image.get("resample", PIL_LANCZOS)),
            do_image_splitting=bool(image.get("do_image_splitting", True)),
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
