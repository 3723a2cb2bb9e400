"""What both processes need to know about a Moondream 2 model directory (torch-free).

``config.json`` comes in two forms (MOONDREAM.md §5): the hub's (``model_type: "moondream1"``,
contents otherwise ignored: the dims are moondream2's defaults below) or the reference's
override format ``{"text": {...}, "vision": {...}, "region": {...}}`` with the field names of
its ``config.py``, which small random models use. Unknown fields are refused, so a typo never
silently falls back to a default.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

HUB_MODEL_TYPE = "moondream1"

# Special ids of the starmie-v1 tokenizer the templates are written in.
BOS_ID = EOS_ID = 0
ANSWER_ID = 3
THINKING_ID = 4
COORD_ID = 5
SIZE_ID = 6
GROUND_START_ID = 7
GROUND_END_ID = 9

# The first phase of a skill row on the device (gpu_worker/moondream_skills.py has them all).
ANSWER_FIRST, REASON, DECIDE = 0, 2, 3


@dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730
    group_size: int | None = None  # quantised checkpoints: not supported


@dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192


@dataclass(frozen=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int = 8192
    group_size: int | None = None


@dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    region: RegionConfig = field(default_factory=RegionConfig)

    def __post_init__(self):
        t, v, r = self.text, self.vision, self.region
        if t.group_size is not None or r.group_size is not None:
            raise NotImplementedError("quantised Moondream checkpoints (group_size) are not supported")
        if t.dim % t.n_heads or t.n_heads % t.n_kv_heads:
            raise ValueError("text dim must be a multiple of n_heads, n_heads a multiple of n_kv_heads")
        if v.crop_size % v.enc_patch_size or v.enc_dim % v.enc_n_heads:
            raise ValueError("crop_size must be a multiple of enc_patch_size, enc_dim of enc_n_heads")
        if r.dim != t.dim or v.proj_out_dim != t.dim:
            raise ValueError("region dim and vision proj_out_dim must equal the text dim")
        if t.prefix_attn != 1 + self.patches_per_crop:
            raise ValueError(f"prefix_attn {t.prefix_attn} != 1 + {self.patches_per_crop} image positions")
        if r.size_out_dim != 2 * r.coord_out_dim:
            raise ValueError("size_out_dim must be 2 x coord_out_dim (width and height bins)")

    @property
    def grid(self) -> int:
        """Patches per side of a crop (27)."""
        return self.vision.crop_size // self.vision.enc_patch_size

    @property
    def patches_per_crop(self) -> int:
        return self.grid ** 2

    @classmethod
    def from_dict(cls, cfg: dict) -> "MoondreamConfig":
        if cfg.get("model_type") == HUB_MODEL_TYPE and not any(k in cfg for k in ("text", "vision", "region")):
            return cls()

        def part(kind, name):
            given = dict(cfg.get(name) or {})
            unknown = set(given) - {f.name for f in fields(kind)}
            if unknown:
                raise ValueError(f"config.json {name}: unknown field(s) {', '.join(sorted(unknown))}")
            return kind(**given)

        return cls(part(TextConfig, "text"), part(VisionConfig, "vision"), part(RegionConfig, "region"))

    @classmethod
    def from_dir(cls, path: str | Path) -> "MoondreamConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


def is_moondream_config(cfg: dict) -> bool:
    return cfg.get("model_type") == HUB_MODEL_TYPE or ("text" in cfg and "vision" in cfg and "region" in cfg)

