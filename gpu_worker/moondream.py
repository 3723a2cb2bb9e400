"""Moondream 2, natively: Phi-style text decoder, SigLIP-shaped vision encoder, region heads.

Plain PyTorch in the style of ``model.py``, checked token for token against the reference
implementation (``vikhyat/moondream``, ``moondream/torch/``) in float32; MOONDREAM.md has the facts.

- **Text**: ``x = x + attn(ln(x)) + mlp(ln(x))`` (one LayerNorm, attention and MLP in parallel,
  every Linear with a bias), partial rotary on the first half of each head, over the engine's
  paged KV cache and packed batches (:func:`gpu_worker.model.paged_attention`). Prefix-LM: the
  image block (BOS + 729 image embeddings = positions 0..729, always prefilled in one chunk)
  attends both ways, everything after it causally.
- **Vision**: crops (global + up to 12 local, ``frontend/moondream/images.py``) are normalised in
  bfloat16 as the reference does, encoded, the local crops stitched and pooled to 27 × 27,
  concatenated with the global crop and projected: 729 embeddings whatever the tiling.
- **Region**: Fourier features + Linear encode a coordinate (or a width/height pair) as an input
  embedding; small MLPs decode them from the pre-``post_ln`` hidden state.

The text forward embeds branch-free: a token whose id is ``coord`` / ``size`` takes the
encoding of its value instead of its ``wte`` row, so region values can stay on the device
between steps. Like ``Llama.forward`` it does no host sync.

Weights load from ``model.safetensors`` in the moondream2 layout; the module tree mirrors its
keys (``model.text.blocks.0.attn.qkv.weight`` is ``self.text.blocks[0].attn.qkv.weight``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.moondream_config import BOS_ID, COORD_ID, EOS_ID, SIZE_ID, MoondreamConfig
from shared.moondream_random import scaled

from .batch import Batch
from .kv_cache import PagedKVCache
from .cpu_backend import PackedLinear
from .model import attention_mask, checkpoint_index, paged_attention

ROPE_THETA = 10000.0


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Mlp(nn.Module):
    def __init__(self, dim: int, inner: int, out: int | None = None, **kw):
        super().__init__()
        self.fc1 = nn.Linear(dim, inner, **kw)
        self.fc2 = nn.Linear(inner, dim if out is None else out, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.fc1, PackedLinear):  # bf16 on a CPU: the gelu fused into the matmul
            return self.fc2(self.fc1.forward_gelu_tanh(x))
        return self.fc2(gelu(self.fc1(x)))


class QkvProj(nn.Module):
    def __init__(self, dim: int, qkv_dim: int, **kw):
        super().__init__()
        self.qkv = nn.Linear(dim, qkv_dim, **kw)
        self.proj = nn.Linear(dim, dim, **kw)


def rope_tables(head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim // 4] for rotating the first head_dim // 2 dims, computed as the
    reference does (float32 angles through a complex exponential)."""
    rot = head_dim // 2
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, rot, 2, dtype=torch.float32)[: rot // 2] / rot))
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None]
    unit = torch.exp(1j * angles)
    return unit.real.contiguous(), unit.imag.contiguous()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D/4]: rotate the first D/2 dims (halves as real/imaginary parts) and
    write the result interleaved, as the reference does; q and k are permuted alike, so scores
    equal plain NeoX rotation, and matching the layout keeps float32 sums in the same order."""
    rot = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    re, im = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), x_pass], dim=-1)


class TextBlock(nn.Module):
    def __init__(self, config: MoondreamConfig, layer_idx: int, **kw):
        super().__init__()
        t = config.text
        self.layer_idx = layer_idx
        self.ln = nn.LayerNorm(t.dim, **kw)
        self.attn = QkvProj(t.dim, t.dim + 2 * t.n_kv_heads * (t.dim // t.n_heads), **kw)
        self.mlp = Mlp(t.dim, t.ff_dim, **kw)

    def forward(self, x: torch.Tensor, attend: "TextAttention") -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn.proj(attend(self.attn.qkv(h), self.layer_idx)) + self.mlp(h)


class TextAttention:
    """One forward's attention for every text layer, from a layer's fused qkv rows: q and k
    rotated, k and v written into the cache, token t attending to its sequence's positions
    0 .. ``last[t]`` -> [T, H·D]. With the linears on AMX (bf16 on a CPU), the kernels: the
    rotary and the cache write in one pass (``partial_rope_kv``), then attention over the pages
    in place (``paged_attention``); else the eager ops, the gather and SDPA under a mask built
    once for all layers."""

    def __init__(self, model: "Moondream", batch: Batch, kv: PagedKVCache, last: torch.Tensor | None, kernels):
        t = model.spec.text
        self.heads, self.kv_heads, self.head_dim = t.n_heads, t.n_kv_heads, t.dim // t.n_heads
        self.batch, self.kv = batch, kv
        self.kernels = kernels if kv.k.dtype == torch.bfloat16 and kv.k.shape[2] % 16 == 0 else None
        if self.kernels is not None:
            self.tables = model.rope_cos, model.rope_sin
            self.last = batch.positions if last is None else last
            self.starts = torch.cat([batch.query_index[:, 0], self.last.new_tensor([batch.num_tokens])])
        else:
            self.cos, self.sin = model.rope_cos[batch.positions], model.rope_sin[batch.positions]
            group = self.heads // self.kv_heads
            self.mask = attention_mask(batch, kv, group, None if last is None else last[batch.query_index])

    def __call__(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        T, H, Hkv, D = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.kernels is None:
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = apply_partial_rope(q.view(T, H, D), self.cos, self.sin)
            k = apply_partial_rope(k.view(T, Hkv, D), self.cos, self.sin)
            return paged_attention(q, k, v.reshape(T, Hkv, D), layer, self.batch, self.kv, self.mask)
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        q = self.kernels.partial_rope_kv(qkv, *self.tables, self.batch.positions, self.batch.slot_mapping,
                                         k_cache, v_cache, H, Hkv)
        return self.kernels.paged_attention(q, k_cache, v_cache, self.batch.block_tables, self.starts, self.last)


class TextModel(nn.Module):
    def __init__(self, config: MoondreamConfig, **kw):
        super().__init__()
        t = config.text
        self.wte = nn.Parameter(torch.empty(t.vocab_size, t.dim, **kw))
        self.blocks = nn.ModuleList(TextBlock(config, i, **kw) for i in range(t.n_layers))
        self.post_ln = nn.LayerNorm(t.dim, **kw)
        self.lm_head = nn.Linear(t.dim, t.vocab_size, **kw)


class VisionBlock(nn.Module):
    def __init__(self, config: MoondreamConfig, **kw):
        super().__init__()
        v = config.vision
        self.n_heads = v.enc_n_heads
        self.ln1 = nn.LayerNorm(v.enc_dim, **kw)
        self.attn = QkvProj(v.enc_dim, 3 * v.enc_dim, **kw)
        self.ln2 = nn.LayerNorm(v.enc_dim, **kw)
        self.mlp = Mlp(v.enc_dim, v.enc_ff_dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.attn.qkv(self.ln1(x))
        kernels = getattr(self.attn.qkv, "kernels", None)
        if kernels is not None:  # bf16, AMX: 2.5x SDPA, head_dim 72 (BENCHMARKS.md "Moondream's attention on AMX")
            out = kernels.full_attention(qkv, self.n_heads)
        else:
            q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn.proj(out)
        return x + self.mlp(self.ln2(x))


class VisionModel(nn.Module):
    def __init__(self, config: MoondreamConfig, **kw):
        super().__init__()
        v = config.vision
        self.config = config
        self.patch_emb = nn.Linear(v.enc_patch_size ** 2 * v.in_channels, v.enc_dim, **kw)
        self.pos_emb = nn.Parameter(torch.empty(1, config.patches_per_crop, v.enc_dim, **kw))
        self.blocks = nn.ModuleList(VisionBlock(config, **kw) for _ in range(v.enc_n_layers))
        self.post_ln = nn.LayerNorm(v.enc_dim, **kw)
        self.proj_mlp = Mlp(2 * v.enc_dim, v.proj_inner_dim, v.proj_out_dim, **kw)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised crops [n, C, S, S] -> patch features [n, grid², enc_dim] (crops are independent)."""
        n, C, _, _ = pixels.shape
        g, p = self.config.grid, self.config.vision.enc_patch_size
        x = pixels.reshape(n, C, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, C * p * p)
        x = self.patch_emb(x) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.post_ln(x)

    def project(self, features: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """Features of one image's crops [1 + t_h·t_w, grid², enc_dim] -> its embeddings [grid², dim]:
        the local crops stitched (each keeps its margin only on the image border), pooled to
        grid × grid, beside the global crop's features, through proj_mlp."""
        g, m = self.config.grid, self.config.vision.overlap_margin
        t_h, t_w = tiling
        local = features[1:].view(t_h, t_w, g, g, -1)
        rows = [torch.cat([local[i, j, 0 if i == 0 else m: g if i == t_h - 1 else g - m,
                                 0 if j == 0 else m: g if j == t_w - 1 else g - m]
                           for j in range(t_w)], dim=1) for i in range(t_h)]
        stitched = torch.cat(rows, dim=0)  # [t_h·(g-2m) + 2m, t_w·(g-2m) + 2m, enc_dim]
        pooled = F.adaptive_avg_pool2d(stitched.permute(2, 0, 1), (g, g)).permute(1, 2, 0).reshape(g * g, -1)
        return self.proj_mlp(torch.cat([features[0], pooled], dim=-1))


def fourier(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    f = 2 * math.pi * x @ freqs
    return torch.cat([f.cos(), f.sin()], dim=-1)


class RegionModel(nn.Module):
    def __init__(self, config: MoondreamConfig, **kw):
        super().__init__()
        r = config.region
        self.coord_features = nn.Parameter(torch.empty(1, r.coord_feat_dim // 2, **kw))
        self.coord_encoder = nn.Linear(r.coord_feat_dim, r.dim, **kw)
        self.coord_decoder = Mlp(r.dim, r.inner_dim, r.coord_out_dim, **kw)
        self.size_features = nn.Parameter(torch.empty(2, r.size_feat_dim // 2, **kw))
        self.size_encoder = nn.Linear(r.size_feat_dim, r.dim, **kw)
        self.size_decoder = Mlp(r.dim, r.inner_dim, r.size_out_dim, **kw)

    def encode_coord(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 1] in [0, 1] -> input embeddings [..., dim]."""
        return self.coord_encoder(fourier(x.to(self.coord_features.dtype), self.coord_features))

    def encode_size(self, wh: torch.Tensor) -> torch.Tensor:
        """(width, height) [..., 2] -> input embeddings [..., dim]."""
        return self.size_encoder(fourier(wh.to(self.size_features.dtype), self.size_features))

    def coord(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-post_ln hidden [R, dim] -> the coordinate [R] (float32): its bin / number of bins."""
        logits = self.coord_decoder(hidden)
        return logits.argmax(-1) / logits.shape[-1]

    def size(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-post_ln hidden [R, dim] -> (width, height) [R, 2] (float32), log-scale bins:
        2^(bin / 1023 · 10 − 10), as the reference maps them."""
        bins = self.size_decoder(hidden).view(hidden.shape[0], 2, -1).argmax(-1)
        return torch.pow(2.0, (bins.float() / 1023.0) * 10.0 - 10.0)


def normalize_crops(crops: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 crops [n, 3, S, S] -> ``dtype``: (x/255 − 0.5)/0.5 computed in bfloat16, each step
    rounded, as the reference does, then cast."""
    x = crops.to(torch.bfloat16)
    return x.div_(255.0).sub_(0.5).div_(0.5).to(dtype)


@dataclass(frozen=True)
class EngineShape:
    """What the engine reads of a model's config, under ``LlamaConfig``'s names."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_id: tuple[int, ...] = (EOS_ID,)
    bos_token_id: int = BOS_ID
    model_type: str = "moondream"

    @classmethod
    def of(cls, config: MoondreamConfig) -> "EngineShape":
        t = config.text
        return cls(t.vocab_size, t.dim, t.n_layers, t.n_heads, t.n_kv_heads, t.dim // t.n_heads, t.max_context)


class Moondream(nn.Module):
    def __init__(self, config: MoondreamConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_model_len: int | None = None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.spec = config
        self.config = EngineShape.of(config)
        self.text = TextModel(config, **kw)
        self.vision = VisionModel(config, **kw)
        self.region = RegionModel(config, **kw)
        self.prefix_len = config.text.prefix_attn  # BOS + image positions, attending both ways
        self.max_model_len = min(max_model_len or config.text.max_context, config.text.max_context)
        if torch.device(device).type != "meta":
            self._init_rope(device)

    def _init_rope(self, device) -> None:
        t = self.spec.text
        cos, sin = rope_tables(t.dim // t.n_heads, self.max_model_len)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    # -- inputs -------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, coord: torch.Tensor | None = None,
              size: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> [T, dim]; a ``coord`` token takes ``encode_coord(coord[t])`` (coord [T]),
        a ``size`` token ``encode_size(size[t])`` (size [T, 2]). Branch-free: every row is encoded
        and selected by its id, so the values never leave the device."""
        x = F.embedding(input_ids, self.text.wte)
        if coord is not None:
            x = torch.where((input_ids == COORD_ID)[:, None], self.region.encode_coord(coord[:, None]).to(x.dtype), x)
        if size is not None:
            x = torch.where((input_ids == SIZE_ID)[:, None], self.region.encode_size(size).to(x.dtype), x)
        return x

    def image_prefix(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """uint8 crops [1 + t_h·t_w, 3, S, S] of one image -> the 730 prefix embeddings [prefix_len, dim]:
        wte[BOS] then the image's."""
        features = self.vision.encode(normalize_crops(crops, self.text.wte.dtype))
        return torch.cat([self.text.wte[:1], self.vision.project(features, tiling)])

    # -- ImageFamily (image_prefill.py) ----------------------------------------------
    def image_positions(self, prompt: np.ndarray, images: list, params=None) -> np.ndarray:
        """One image at most, its crops uint8 [1 + t_h·t_w, 3, S, S] (in blocks) with its tiling;
        its rows (the BOS + image block) fill the prompt's first ``prefix_len`` positions, whose ids
        are placeholders."""
        if not images:
            return np.arange(0)
        crop = self.spec.vision.crop_size
        if len(images) > 1:
            raise ValueError("images: Moondream takes one image per request")
        image = images[0]
        t_h, t_w = image.tiling or (0, 0)
        if (image.tiling is None or image.num_tiles != 1 + t_h * t_w
                or any(b.dtype != np.uint8 or b.shape[1:] != (3, crop, crop) for b in image.tiles)):
            raise ValueError(f"images[0]: a Moondream image is 1 + rows x columns uint8 crops [3, {crop}, {crop}] "
                             "with its tiling")
        if len(prompt) <= self.prefix_len:
            raise ValueError(f"prompt: an image prompt starts with the {self.prefix_len}-position image block")
        return np.arange(self.prefix_len)

    def encode_unit(self, num_tiles: int) -> tuple[int, int]:
        """The crops are stitched and pooled together: one unit, the whole block."""
        return num_tiles, self.prefix_len

    def whole_span(self, first: int, end: int) -> tuple[int, int]:
        """The block attends both ways: no chunk ends inside it."""
        return first, end

    def encode_runs(self, runs: list[tuple[list[torch.Tensor], tuple[int, int]]], params,
                    dtype: torch.dtype) -> list[torch.Tensor]:
        """(uint8 crop blocks on the device, tiling) per image -> its prefix embeddings."""
        return [self.image_prefix(torch.cat(blocks), tiling) for blocks, tiling in runs]

    # -- text forward ---------------------------------------------------------------
    def hidden_states(self, x: torch.Tensor, batch: Batch, kv: PagedKVCache,
                      prefix_index: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings [T, dim] -> last pre-post_ln hidden states [T, dim].

        prefix_index [K]: the tokens of image blocks in this forward (whole blocks at positions
        0 .. prefix_len − 1): they see their whole block; every other token is causal."""
        last = None if prefix_index is None else batch.positions.index_fill(0, prefix_index, self.prefix_len - 1)
        attend = TextAttention(self, batch, kv, last, getattr(self.text.blocks[0].attn.qkv, "kernels", None))
        for block in self.text.blocks:
            x = block(x, attend)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-post_ln hidden [R, dim] -> float32 logits [R, vocab]."""
        return self.text.lm_head(self.text.post_ln(hidden)).float()

    def forward(self, input_ids: torch.Tensor, batch: Batch, kv: PagedKVCache, logits_indices: torch.Tensor,
                image_features: tuple[torch.Tensor, torch.Tensor] | None = None,
                coord: torch.Tensor | None = None, size: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (float32 logits [R, vocab], pre-post_ln hidden [R, dim]) at ``logits_indices``.

        image_features: (token index [K], prefix embeddings [K, dim]) of whole image blocks."""
        x = self.embed(input_ids, coord, size)
        prefix_index = None
        if image_features is not None:
            prefix_index, features = image_features
            x = x.index_copy(0, prefix_index, features.to(x.dtype))
        hidden = self.hidden_states(x, batch, kv, prefix_index)[logits_indices]
        return self.logits(hidden), hidden

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", max_model_len: int | None = None) -> "Moondream":
        """Load ``model.safetensors`` (moondream2 layout, any float dtype on disk) and config.json."""
        model = cls(MoondreamConfig.from_dir(path), dtype=dtype, device="meta", max_model_len=max_model_len)
        index = checkpoint_index(Path(path))
        missing = sorted(set(dict(model.named_parameters())) - {k.removeprefix("model.") for k in index})
        if missing:
            raise KeyError(f"{path}: checkpoint is missing {', '.join(missing[:5])}"
                           + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = index["model." + name].get_tensor("model." + name)
            if tuple(t.shape) != shape:
                raise ValueError(f"{path}: model.{name} has shape {tuple(t.shape)}, the config says {shape}")
            return t

        return model._assign(get, device)

    @classmethod
    def random(cls, config: MoondreamConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", max_model_len: int | None = None) -> "Moondream":
        """Random weights at the scales of ``shared.moondream_random``'s recipe, drawn by torch on
        ``device`` (a GPU draws moondream2's 1.9 B in about a second; no checkpoint is written).
        Deterministic for a seed on one kind of device; not the recipe's numpy values."""
        gen = torch.Generator(device=device).manual_seed(seed)

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return scaled(name, shape, torch.randn(shape, generator=gen, device=device))

        model = cls(config, dtype=dtype, device="meta", max_model_len=max_model_len)
        return model._assign(get, device)

    def _assign(self, get, device) -> "Moondream":
        """Replace this meta-device model's parameters by ``get(name, shape)``, one tensor at a
        time (the peak memory is the model plus one tensor in the source dtype)."""
        state = {name: get(name, tuple(p.shape)).to(device=device, dtype=p.dtype)
                 for name, p in self.named_parameters()}
        self.load_state_dict(state, assign=True)
        self.requires_grad_(False)
        self._init_rope(device)
        return self.eval()
