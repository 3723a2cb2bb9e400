"""Moondream 2 and 3, natively: Phi-style text decoder, SigLIP-shaped vision encoder, region heads.

Plain PyTorch in the style of ``model.py``, checked token for token against the reference
implementations (``vikhyat/moondream``, ``moondream/torch/``; the moondream3-preview hub code) in
float32; MOONDREAM.md and MOONDREAM3.md have the facts.

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

Moondream 3 (``config.moondream3``) is the same model with three changes: its layers from
``moe.start_layer`` on are mixtures of experts (:class:`MoeMlp`), every layer scales q and v per
head before the rotary (:class:`Tau`, rotary theta 1.5e6), and its region decoders are single
Linears behind ``region.ln`` (when the checkpoint has it).

Weights load from ``model.safetensors`` in the moondream2 / moondream3 layout; the module tree mirrors
its keys (``model.text.blocks.0.attn.qkv.weight`` is ``self.text.blocks[0].attn.qkv.weight``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.moondream_config import BOS_ID, COORD_ID, EOS_ID, SIZE_ID, MoeConfig, MoondreamConfig
from shared.moondream_random import scaled

from .batch import Batch
from .kv_cache import PagedKVCache
from .cpu_backend import PackedLinear
from .model import attention_mask, checkpoint_index, paged_attention


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


class Tau(nn.Module):
    """Moondream 3's tau attention (MOONDREAM3.md §1): q and v of head h scaled by
    ``tanh(gelu(qkv) @ w[h]) + 1 + (sigmoid(alpha[h] · ln(p + 1)) − 0.5)`` at absolute position p,
    before the rotary (so the V cache holds scaled values); k untouched. Written as the reference
    writes it, op for op (the order of the float32 roundings is its own)."""

    def __init__(self, n_heads: int, qkv_dim: int, gelu_kind: str, **kw):
        super().__init__()
        self.wq = nn.Parameter(torch.empty(n_heads, qkv_dim, **kw))
        self.wv = nn.Parameter(torch.empty(n_heads, qkv_dim, **kw))
        self.alpha = nn.Parameter(torch.empty(n_heads, **kw))
        self.approximate = "none" if gelu_kind == "erf" else "tanh"

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """qkv [T, (H + 2·H)·D] (the Linear's whole output), positions [T] -> the same with q, v scaled."""
        H = self.alpha.shape[0]
        T = qkv.shape[0]
        features = F.gelu(qkv, approximate=self.approximate)
        tok_q = torch.tanh(torch.matmul(features, self.wq.t()))  # [T, H]
        tok_v = torch.tanh(torch.matmul(features, self.wv.t()))
        pos = positions.to(qkv.dtype) + 1
        tau_pos = 1 + (torch.sigmoid(self.alpha[None, :] * pos.log()[:, None]) - 0.5)  # [T, H]
        q, k, v = qkv.view(T, 3, H, -1).unbind(1)
        q = q * (tok_q + tau_pos)[..., None]
        v = v * (tok_v + tau_pos)[..., None]
        return torch.stack([q, k, v], dim=1).view(T, -1)


class QkvProj(nn.Module):
    def __init__(self, dim: int, qkv_dim: int, tau: Tau | None = None, **kw):
        super().__init__()
        self.qkv = nn.Linear(dim, qkv_dim, **kw)
        self.proj = nn.Linear(dim, dim, **kw)
        self.tau = tau


class Experts(nn.Module):
    """One 3-D weight stack [experts, out, in] (the checkpoint's ``mlp.fc1.weight``), no bias; or,
    quantized, one weight-only quantized linear per expert (``quant.QuantLinear``)."""

    def __init__(self, experts: int, out: int, inner: int, **kw):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out, inner, **kw))
        self.quantized: nn.ModuleList | None = None

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] through expert ``expert`` -> [n, out]."""
        if self.quantized is not None:
            return self.quantized[expert](x)
        return F.linear(x, self.weight[expert])

    def quantize(self, method: str, group: int, kernels, stack: torch.Tensor | None = None) -> None:
        """Hold the experts in ``method`` (int8, int4) in groups of ``group``: ``stack`` [experts,
        out, in] (default: this module's; a loader passes each stack as it reads it, so the float
        stacks are never all held). The whole stack is quantized at once and each expert's linear
        is a view of it: per-expert temporaries would fragment the heap (tens of GB for 9 B)."""
        from .quant import QuantLinear, quantize
        stack = self.weight if stack is None else stack
        E, N, K = stack.shape
        whole = quantize(stack.reshape(E * N, K), method, group)
        self.quantized = nn.ModuleList(QuantLinear([whole.rows(slice(e * N, (e + 1) * N))], None, kernels)
                                       for e in range(E))
        del self.weight


class MoeMlp(nn.Module):
    """Moondream 3's mixture of experts (MOONDREAM3.md §1): a router with a bias, top-k, a softmax
    over the chosen k in float32; expert e is ``fc2[e](gelu_erf(a) · (g + 1))`` with ``a | g =
    fc1[e](x)``; the output the weighted sum of the k experts.

    The whole forward's (token, expert) pairs are sorted by expert and each expert that has rows
    runs one matmul pair on all of them (no per-token loop; the expert counts come to the host,
    so this layer is not for a captured CUDA graph). The sum follows the reference's order, which
    float32 bits depend on: a token alone in its forward (a decode step) adds its k outputs in
    top-k order, a prompt's tokens in ascending expert id."""

    def __init__(self, dim: int, moe: MoeConfig, **kw):
        super().__init__()
        self.top_k, self.inner = moe.experts_per_token, moe.expert_inner_dim
        self.router = nn.Linear(dim, moe.num_experts, **kw)
        self.fc1 = Experts(moe.num_experts, 2 * moe.expert_inner_dim, dim, **kw)
        self.fc2 = Experts(moe.num_experts, dim, moe.expert_inner_dim, **kw)

    def forward(self, x: torch.Tensor, alone: torch.Tensor) -> torch.Tensor:
        """x [T, dim], alone [T] bool (the token is the only one of its sequence in this forward)."""
        T, C = x.shape
        k, n_experts = self.top_k, self.router.out_features
        top_logits, experts = torch.topk(self.router(x), k, dim=-1)  # sorted, descending
        weights = F.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype)
        flat = experts.flatten()  # pair i = (token i // k, its i % k-th expert)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_experts).tolist()
        rows = x[order // k]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                a, g = self.fc1(e, rows[start:start + n]).chunk(2, dim=-1)
                out[start:start + n] = self.fc2(e, F.gelu(a) * (g + 1))
                start += n
        y = torch.empty_like(out).index_copy_(0, order, out).view(T, k, C) * weights[..., None]
        sum_order = torch.where(alone[:, None], torch.arange(k, device=x.device), experts.argsort(dim=-1))
        y = y.gather(1, sum_order[..., None].expand(T, k, C))
        total = y[:, 0]
        for j in range(1, k):
            total = total + y[:, j]
        return total


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim // 4] for rotating the first head_dim // 2 dims, computed as the
    reference does (float32 angles through a complex exponential)."""
    rot = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32)[: rot // 2] / rot))
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
        qkv_dim = t.dim + 2 * t.n_kv_heads * (t.dim // t.n_heads)
        tau = Tau(t.n_heads, qkv_dim, t.tau_gelu, **kw) if config.moondream3 else None
        self.attn = QkvProj(t.dim, qkv_dim, tau, **kw)
        self.moe = t.moe is not None and layer_idx >= t.moe.start_layer
        self.mlp = MoeMlp(t.dim, t.moe, **kw) if self.moe else Mlp(t.dim, t.ff_dim, **kw)

    def forward(self, x: torch.Tensor, attend: "TextAttention") -> torch.Tensor:
        h = self.ln(x)
        qkv = self.attn.qkv(h)
        if self.attn.tau is not None:
            qkv = self.attn.tau(qkv, attend.batch.positions)
        mlp = self.mlp(h, attend.alone) if self.moe else self.mlp(h)
        return x + self.attn.proj(attend(qkv, self.layer_idx)) + mlp


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
        self._alone = None
        self.kernels = kernels if kv.k.dtype == torch.bfloat16 and kv.page_size % 16 == 0 else None
        if self.kernels is not None:
            self.tables = model.rope_cos, model.rope_sin
            self.last = batch.positions if last is None else last
            self.starts = torch.cat([batch.query_index[:, 0], self.last.new_tensor([batch.num_tokens])])
        else:
            self.cos, self.sin = model.rope_cos[batch.positions], model.rope_sin[batch.positions]
            group = self.heads // self.kv_heads
            self.mask = attention_mask(batch, kv, group, None if last is None else last[batch.query_index])

    @property
    def alone(self) -> torch.Tensor:
        """[T] bool: the token is the only one of its sequence in this forward (a decode step)."""
        if self._alone is None:
            b = self.batch
            seq = b.token_to_padded // b.max_query_len
            self._alone = torch.bincount(seq, minlength=b.num_seqs)[seq] == 1
        return self._alone

    def __call__(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        T, H, Hkv, D = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.kernels is None:
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = apply_partial_rope(q.view(T, H, D), self.cos, self.sin)
            k = apply_partial_rope(k.view(T, Hkv, D), self.cos, self.sin)
            return paged_attention(q, k, v.reshape(T, Hkv, D), layer, self.batch, self.kv, self.mask)
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        q = self.kernels.partial_rope_kv(qkv, *self.tables, self.batch.positions, self.batch.kv_index,
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
        kernels = self.attn.qkv.kernels if isinstance(self.attn.qkv, PackedLinear) else None
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
    """Moondream 2 decodes with MLPs; Moondream 3 with single Linears, after ``ln`` when the
    checkpoint has one (the "modelv2" weights; the first preview shards have none)."""

    def __init__(self, config: MoondreamConfig, ln: bool = False, **kw):
        super().__init__()
        r = config.region
        self.coord_features = nn.Parameter(torch.empty(1, r.coord_feat_dim // 2, **kw))
        self.coord_encoder = nn.Linear(r.coord_feat_dim, r.dim, **kw)
        self.size_features = nn.Parameter(torch.empty(2, r.size_feat_dim // 2, **kw))
        self.size_encoder = nn.Linear(r.size_feat_dim, r.dim, **kw)
        if config.moondream3:
            self.coord_decoder = nn.Linear(r.dim, r.coord_out_dim, **kw)
            self.size_decoder = nn.Linear(r.dim, r.size_out_dim, **kw)
        else:
            self.coord_decoder = Mlp(r.dim, r.inner_dim, r.coord_out_dim, **kw)
            self.size_decoder = Mlp(r.dim, r.inner_dim, r.size_out_dim, **kw)
        self.ln = nn.LayerNorm(r.dim, **kw) if ln else None

    def _decoder_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.ln is None else self.ln(hidden)

    def encode_coord(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 1] in [0, 1] -> input embeddings [..., dim]."""
        return self.coord_encoder(fourier(x.to(self.coord_features.dtype), self.coord_features))

    def encode_size(self, wh: torch.Tensor) -> torch.Tensor:
        """(width, height) [..., 2] -> input embeddings [..., dim]."""
        return self.size_encoder(fourier(wh.to(self.size_features.dtype), self.size_features))

    def coord(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-post_ln hidden [R, dim] -> the coordinate [R] (float32): its bin / number of bins."""
        logits = self.coord_decoder(self._decoder_input(hidden))
        return logits.argmax(-1) / logits.shape[-1]

    def size(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-post_ln hidden [R, dim] -> (width, height) [R, 2] (float32), log-scale bins:
        2^(bin / 1023 · 10 − 10), as the reference maps them."""
        bins = self.size_decoder(self._decoder_input(hidden)).view(hidden.shape[0], 2, -1).argmax(-1)
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
    bos_token_id: int = BOS_ID
    model_type: str = "moondream"

    @classmethod
    def of(cls, config: MoondreamConfig) -> "EngineShape":
        t = config.text
        return cls(t.vocab_size, t.dim, t.n_layers, t.n_heads, t.n_kv_heads, t.dim // t.n_heads, t.max_context)


class Moondream(nn.Module):
    def __init__(self, config: MoondreamConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_model_len: int | None = None, region_ln: bool = False):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.spec = config
        self.rules = config.rules
        self.config = EngineShape.of(config)
        self.text = TextModel(config, **kw)
        self.vision = VisionModel(config, **kw)
        self.region = RegionModel(config, region_ln, **kw)
        self.prefix_len = config.text.prefix_attn  # BOS + image positions, attending both ways
        self.max_model_len = min(max_model_len or config.text.max_context, config.text.max_context)
        if torch.device(device).type != "meta":
            self._init_rope(device)

    def _init_rope(self, device) -> None:
        t = self.spec.text
        cos, sin = rope_tables(t.dim // t.n_heads, self.max_model_len, self.spec.rope_theta)
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

    def coord_over_eos(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-post_ln hidden [R, dim] -> [R] bool: Moondream 3's two-way stop test after an object
        (the logits of coord and eos alone, a matmul then the bias as the reference computes them;
        a tie goes to coord)."""
        pick = torch.tensor([COORD_ID, EOS_ID], device=hidden.device)
        two = self.text.post_ln(hidden) @ self.text.lm_head.weight[pick].T + self.text.lm_head.bias[pick]
        return two[:, 0] >= two[:, 1]

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

    @property
    def graph_capturable(self) -> bool:
        """Moondream 3's expert dispatch brings its row counts to the host: no CUDA graph holds it."""
        return not self.spec.moondream3

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- construction -------------------------------------------------------------
    def quantize_weights(self, method: str, group: int, kernels) -> None:
        """``--quantization int8|int4`` (a CPU): the text blocks' linears and experts, the vision
        encoder's blocks and its projection held in ``method`` (``quant.py``); the router, ``wte``,
        ``lm_head``, the patch embedding, the region heads (a point is the argmax over 1024 bins of a
        region head) and any linear whose in-features the group does not divide (the encoder's fc2,
        4304) stay float. Experts quantized while loading (``quantize=`` of the constructors) are
        left as they are."""
        from .gguf_weights import quantize_linears
        blocks, vision = self.text.blocks, self.vision
        quantize_linears(nn.ModuleList([b.attn for b in blocks] + [b.mlp for b in blocks if not b.moe]
                                       + [m for b in vision.blocks for m in (b.attn, b.mlp)] + [vision.proj_mlp]),
                         method, group, kernels)
        for block in blocks:
            for experts in (block.mlp.fc1, block.mlp.fc2) if block.moe else ():
                if experts.quantized is None:
                    experts.quantize(method, group, kernels)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", max_model_len: int | None = None,
                        quantize: tuple | None = None) -> "Moondream":
        """Load ``model.safetensors`` (moondream2 / moondream3 layout, any float dtype on disk) and
        config.json; ``quantize`` (method, group, ``QuantKernels``): the experts quantized as they
        are read, one stack at a time (Moondream 3's 9.27 B would not fit in float32)."""
        index = checkpoint_index(Path(path))
        model = cls(MoondreamConfig.from_dir(path), dtype=dtype, device="meta", max_model_len=max_model_len,
                    region_ln="model.region.ln.weight" in index)
        missing = sorted(set(dict(model.named_parameters())) - {k.removeprefix("model.") for k in index})
        if missing:
            raise KeyError(f"{path}: checkpoint is missing {', '.join(missing[:5])}"
                           + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = index["model." + name].get_tensor("model." + name)
            if tuple(t.shape) != shape:
                raise ValueError(f"{path}: model.{name} has shape {tuple(t.shape)}, the config says {shape}")
            return t

        return model._assign(get, device, quantize)

    @classmethod
    def random(cls, config: MoondreamConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", max_model_len: int | None = None,
               quantize: tuple | None = None) -> "Moondream":
        """Random weights at the scales of ``shared.moondream_random``'s recipe, drawn by torch on
        ``device`` (a GPU draws moondream2's 1.9 B in about a second; no checkpoint is written).
        Deterministic for a seed on one kind of device; not the recipe's numpy values. ``quantize``:
        as ``from_pretrained``'s (random-moondream3 on a CPU)."""
        gen = torch.Generator(device=device).manual_seed(seed)

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return scaled(name, shape, torch.randn(shape, generator=gen, device=device))

        model = cls(config, dtype=dtype, device="meta", max_model_len=max_model_len, region_ln=config.moondream3)
        return model._assign(get, device, quantize)

    def _assign(self, get, device, quantize: tuple | None = None) -> "Moondream":
        """Replace this meta-device model's parameters by ``get(name, shape)``, one tensor at a
        time (the peak memory is the model plus one tensor in the source dtype); with ``quantize``
        (method, group, kernels) the expert stacks are quantized expert by expert first."""
        for name, module in self.named_modules() if quantize is not None else ():
            if isinstance(module, Experts):
                module.quantize(*quantize, stack=get(name + ".weight", tuple(module.weight.shape)))
        state = {name: get(name, tuple(p.shape)).to(device=device, dtype=p.dtype)
                 for name, p in self.named_parameters()}
        self.load_state_dict(state, assign=True)
        self.requires_grad_(False)
        self._init_rope(device)
        return self.eval()
