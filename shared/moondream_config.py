"""What both processes need to know about a Moondream 2 or 3 model directory (torch-free).

``config.json`` comes in two forms (MOONDREAM.md §5, MOONDREAM3.md §5): the hub's
(``model_type: "moondream1"`` or ``"moondream3"``, contents otherwise ignored: the dims are that
version's defaults below) or the reference's override format ``{"text": {...}, "vision": {...},
"region": {...}}`` with the field names of its ``config.py``, which small random models use; a
``text.moe`` section makes it Moondream 3. Unknown fields are refused, so a typo never silently
falls back to a default.

Moondream 3 is Moondream 2's vision encoder, region encoders and prompts around a different text
model (MoE layers from ``moe.start_layer``, tau attention, rotary theta 1.5e6) with single-Linear
region decoders (behind ``region.ln`` when the checkpoint has one), and slightly different skill
rules (:class:`SkillRules`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

HUB_MODEL_TYPE = "moondream1"
MD3_MODEL_TYPE = "moondream3"

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
class MoeConfig:
    num_experts: int = 64
    start_layer: int = 4  # layers before it are dense
    experts_per_token: int = 8
    expert_inner_dim: int = 1024


@dataclass(frozen=True)
class SkillRules:
    """Where the two versions' skills differ (MOONDREAM3.md §3-4)."""
    doubled_answer: bool  # a plain query ends in [3, 3] (Moondream 2), not [3]
    two_way_stop: bool  # after an object, point/detect choose between coord and eos only
    default_max_objects: int
    max_objects: int
    top_p: float  # caption / query's default (temperature 0.5 for both)


MOONDREAM2_RULES = SkillRules(doubled_answer=True, two_way_stop=False, default_max_objects=50, max_objects=1000,
                              top_p=0.3)
# max_objects up to 500, as Cloudflare Workers AI allows for Moondream 3.1.
MOONDREAM3_RULES = SkillRules(doubled_answer=False, two_way_stop=True, default_max_objects=150, max_objects=500,
                              top_p=0.9)


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
    moe: MoeConfig | None = None  # Moondream 3
    # Moondream 3's tau attention GELU: "erf" as the reference (MOONDREAM3.md §8), or "tanh" as Kestrel.
    tau_gelu: str = "erf"


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
        if t.tau_gelu not in ("erf", "tanh"):
            raise ValueError(f"text tau_gelu must be erf or tanh, got {t.tau_gelu!r}")
        m = t.moe
        if m is not None and not (0 <= m.start_layer <= t.n_layers and 1 <= m.experts_per_token <= m.num_experts):
            raise ValueError("text moe: start_layer must lie in [0, n_layers], experts_per_token in [1, num_experts]")
        if m is not None and t.n_kv_heads != t.n_heads:
            raise ValueError("text: Moondream 3's tau attention scales v per query head: n_kv_heads must equal n_heads")

    @property
    def moondream3(self) -> bool:
        return self.text.moe is not None

    @property
    def rules(self) -> SkillRules:
        return MOONDREAM3_RULES if self.moondream3 else MOONDREAM2_RULES

    @property
    def rope_theta(self) -> float:
        return 1.5e6 if self.moondream3 else 10000.0

    @property
    def grid(self) -> int:
        """Patches per side of a crop (27)."""
        return self.vision.crop_size // self.vision.enc_patch_size

    @property
    def patches_per_crop(self) -> int:
        return self.grid ** 2

    @classmethod
    def from_dict(cls, cfg: dict) -> "MoondreamConfig":
        if not any(k in cfg for k in ("text", "vision", "region")):
            if cfg.get("model_type") == HUB_MODEL_TYPE:
                return cls()
            if cfg.get("model_type") == MD3_MODEL_TYPE:
                return cls(TextConfig(max_context=4096, moe=MoeConfig()))

        def part(kind, name, given):
            given = dict(given or {})
            unknown = set(given) - {f.name for f in fields(kind)}
            if unknown:
                raise ValueError(f"config.json {name}: unknown field(s) {', '.join(sorted(unknown))}")
            return kind(**given)

        text = dict(cfg.get("text") or {})
        if "moe" in text:  # the reference builds TextMoeConfig itself, not from the dict
            text["moe"] = part(MoeConfig, "text.moe", text["moe"])
        return cls(part(TextConfig, "text", text), part(VisionConfig, "vision", cfg.get("vision")),
                   part(RegionConfig, "region", cfg.get("region")))

    @classmethod
    def from_dir(cls, path: str | Path) -> "MoondreamConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


def moondream_version(cfg: dict) -> int | None:
    """2 or 3 for a Moondream config.json (hub or override format), None for any other."""
    if cfg.get("model_type") in (HUB_MODEL_TYPE, MD3_MODEL_TYPE):
        return 2 if cfg["model_type"] == HUB_MODEL_TYPE else 3
    if "text" in cfg and "vision" in cfg and "region" in cfg:
        return 3 if isinstance(cfg["text"], dict) and cfg["text"].get("moe") is not None else 2
    return None


def is_moondream_config(cfg: dict) -> bool:
    return moondream_version(cfg) == 2


def is_moondream3_config(cfg: dict) -> bool:
    return moondream_version(cfg) == 3

