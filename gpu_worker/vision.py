"""Idefics3 / SmolVLM image encoder: SigLIP vision transformer + pixel-shuffle connector.

Plain PyTorch in the style of ``model.py``. Input: full tiles of
``image_size × image_size`` pixels (the frontend cuts every image into such
tiles plus one global view, so no patch padding or attention mask is ever
needed and the position ids are a plain ``arange``). Output: one row per
``<image>`` placeholder, already in the text model's hidden size:

    encode_images(pixels [n_tiles, 3, H, W]) -> features [n_tiles * tokens_per_tile, text_hidden]

Row ``k`` of the output replaces the embedding of the ``k``-th ``<image>`` token
of the prompt (transformers' ``masked_scatter`` order: tile by tile, the global
view last). The encoder is Idefics3's ``ImageFamily`` (``image_prefill.py``):
tiles are independent, so one tile is one encode unit and a chunk may end
anywhere inside an image.

Weights load from a transformers-saved ``Idefics3ForConditionalGeneration``
directory (keys ``model.vision_model.*`` and ``model.connector.*``); the text
backbone is loaded by :class:`gpu_worker.model.Llama` from the same directory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.vision_config import VISION_DEFAULTS, ImageProcessorParams, read_config, vision_config

from .model import checkpoint_index

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    text_hidden_size: int  # the connector's output width
    scale_factor: int = 2  # pixel shuffle: scale_factor² neighbouring patches become one token
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}")
        side = self.image_size // self.patch_size
        if side % self.scale_factor:
            raise ValueError(f"{side} patches per side is not divisible by scale_factor {self.scale_factor}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "VisionConfig":
        """Parse an Idefics3 config.json dict (its vision_config plus scale_factor and the text width)."""
        v = vision_config(cfg)
        return cls(text_hidden_size=cfg["text_config"]["hidden_size"], scale_factor=cfg.get("scale_factor", 2),
                   **{k: v[k] for k in VISION_DEFAULTS})


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one tile's patches (q, k, v fused)."""

    def __init__(self, config: VisionConfig, dtype=None, device=None):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.n_heads
        d = config.hidden_size
        self.qkv_proj = nn.Linear(d, 3 * d, dtype=dtype, device=device)
        self.out_proj = nn.Linear(d, d, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, L, d = x.shape
        q, k, v = self.qkv_proj(x).view(n, L, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # no mask: every patch of a full tile is real
        return self.out_proj(out.transpose(1, 2).reshape(n, L, d))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig, dtype=None, device=None):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype, device=device)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig, dtype=None, device=None):
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype, device=device)
        self.self_attn = VisionAttention(config, dtype, device)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype, device=device)
        self.mlp = VisionMLP(config, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """SigLIP ViT + Idefics3 connector: tiles in, text-width features out."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        d, p = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, d, kernel_size=p, stride=p, dtype=dtype, device=device)
        self.position_embedding = nn.Embedding(config.patches_per_side ** 2, d, dtype=dtype, device=device)
        self.layers = nn.ModuleList(VisionLayer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype, device=device)
        self.connector = nn.Linear(d * config.scale_factor ** 2, config.text_hidden_size, bias=False, dtype=dtype,
                                   device=device)

    @property
    def tokens_per_tile(self) -> int:
        return self.config.tokens_per_tile

    # ---- ImageFamily (image_prefill.py) ------------------------------------
    def image_positions(self, prompt: np.ndarray, images: list, params: ImageProcessorParams) -> np.ndarray:
        """Tiles of the processor's side; their rows fill the prompt's ``<image>`` tokens."""
        side = params.tile_size
        for i, image in enumerate(images):
            for block in image.tiles:
                if block.dtype != np.uint8 or block.ndim != 4 or block.shape[1:] != (3, side, side):
                    raise ValueError(f"images[{i}]: tiles must be uint8 [n, 3, {side}, {side}], "
                                     f"got {block.dtype} {list(block.shape)}")
        return np.flatnonzero(prompt == params.image_token_id)

    def encode_unit(self, num_tiles: int) -> tuple[int, int]:
        """One tile is one encode unit: SigLIP and the connector treat tiles independently."""
        return 1, self.config.tokens_per_tile

    def whole_span(self, first: int, end: int) -> None:
        """Text attends to image rows causally: a chunk may split an image span."""
        return None

    def encode_runs(self, runs: list[tuple[list[torch.Tensor], None]], params: ImageProcessorParams,
                    dtype: torch.dtype) -> list[torch.Tensor]:
        """(uint8 tile blocks on the device, tiling: unused) per run of units -> each run's feature
        rows, in one vision forward for all of them."""
        blocks = [t for run, _tiling in runs for t in run]
        tiles = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        features = self.encode_images(normalize_tiles(tiles, params, dtype))
        return list(features.split([sum(len(t) for t in run) * self.config.tokens_per_tile for run, _ in runs]))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.encode_images(pixel_values)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, C, S, S] normalised floats -> features [n * tokens_per_tile, text_hidden]."""
        c = self.config
        n, _, h, w = pixel_values.shape
        if h != c.image_size or w != c.image_size:
            raise ValueError(f"tiles must be {c.image_size}x{c.image_size}, got {h}x{w}")
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [n, D, side, side]
        x = x.flatten(2).transpose(1, 2) + self.position_embedding.weight  # position id = patch index
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        return self.connector(pixel_shuffle(x, c.scale_factor)).reshape(n * c.tokens_per_tile, -1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- construction ------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "VisionEncoder":
        """Load the vision tower and connector of an Idefics3 checkpoint directory."""
        config = VisionConfig.from_hf_config(read_config(path))
        where = checkpoint_index(Path(path))

        def get(name: str) -> torch.Tensor:
            h = where.get(name)
            if h is None:
                raise KeyError(f"checkpoint is missing {name}")
            return h.get_tensor(name)

        return cls._from_tensors(config, get, dtype, device)

    @classmethod
    def _from_tensors(cls, config: VisionConfig, get: Callable[[str], torch.Tensor], dtype,
                      device) -> "VisionEncoder":
        model = cls(config, dtype=dtype, device="meta")

        def put(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
            setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))

        def put_linear(module: nn.Module, prefix: str) -> None:
            put(module, "weight", get(prefix + "weight"))
            put(module, "bias", get(prefix + "bias"))

        v = "model.vision_model."
        put_linear(model.patch_embedding, v + "embeddings.patch_embedding.")
        put(model.position_embedding, "weight", get(v + "embeddings.position_embedding.weight"))
        for i, layer in enumerate(model.layers):
            p = f"{v}encoder.layers.{i}."
            put_linear(layer.layer_norm1, p + "layer_norm1.")
            put_linear(layer.layer_norm2, p + "layer_norm2.")
            qkv = [p + f"self_attn.{n}_proj." for n in "qkv"]
            put(layer.self_attn.qkv_proj, "weight", torch.cat([get(n + "weight") for n in qkv]))
            put(layer.self_attn.qkv_proj, "bias", torch.cat([get(n + "bias") for n in qkv]))
            put_linear(layer.self_attn.out_proj, p + "self_attn.out_proj.")
            put_linear(layer.mlp.fc1, p + "mlp.fc1.")
            put_linear(layer.mlp.fc2, p + "mlp.fc2.")
        put_linear(model.post_layernorm, v + "post_layernorm.")
        put(model.connector, "weight", get("model.connector.modality_projection.proj.weight"))
        return model.eval()


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """Space-to-depth [n, side², D] -> [n, (side / scale)², D · scale²], in Idefics3's exact channel order.

    Each output token concatenates a scale × scale block of neighbouring patches;
    the permutations are transformers' ``Idefics3Connector.pixel_shuffle`` step
    for step, since the connector's weights depend on that channel order.
    """
    n, seq, d = x.shape
    side = int(seq ** 0.5)
    x = x.reshape(n, side, side // scale, d * scale)
    x = x.permute(0, 2, 1, 3).reshape(n, side // scale, side // scale, d * scale * scale)
    return x.permute(0, 2, 1, 3).reshape(n, seq // scale ** 2, d * scale * scale)


def normalize_tiles(tiles: torch.Tensor, params: ImageProcessorParams, dtype: torch.dtype) -> torch.Tensor:
    """uint8 tiles [n, 3, S, S] (as the frontend ships them) -> normalised pixel values in ``dtype``.

    ``(x * rescale_factor - mean) / std`` as transformers' image processor does it,
    computed in float32 on the tiles' device.
    """
    mean = torch.tensor(params.image_mean, dtype=torch.float32, device=tiles.device)[:, None, None]
    std = torch.tensor(params.image_std, dtype=torch.float32, device=tiles.device)[:, None, None]
    return ((tiles.float() * params.rescale_factor - mean) / std).to(dtype)
