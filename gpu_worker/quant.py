"""Weight-only quantized linears on a CPU: weights kept as 4- or 8-bit integers (or bf16), expanded
to float32 in registers by ``kernels/quant.c`` (``wlinear``); activations float32 or bf16.

Where the weights come from:

- **GGUF files as they are** (:func:`from_gguf`): Q8_0, Q4_0, Q4_1, Q4_K and Q6_K blocks are
  repacked once at load into the kernel's two formats, never through float32 (a Q4_K_M file
  mixes Q4_K and Q6_K). The expanded weights are bit for bit ``gguf.quants.dequantize``'s (where a
  level has bf16 dot products, bf16 activations multiply them rounded to bf16:
  :meth:`QuantKernels.multiplied_weight`).
- **Checkpoints quantized at load** (:func:`quantize`), in groups of 32, 64 or 128 along K, a
  scale and an offset per group (its min and max mapped to the ends of the range). Measured on
  SmolLM2-135M (teacher-forced top-1 against float32): int8 per output channel, symmetric, kept
  94% of the tokens; symmetric in groups of 32 (Q8_0's scheme) 97%; bf16 weights 99%. The
  output head, whose errors land on the logits directly, is kept at 8 bits in Q8_0's scheme
  whatever the method (llama.cpp's 4-bit files keep theirs at Q6_K or Q8_0 likewise).

The kernel's formats (``QWeight.fmt``): ``q8``: int8 [N, K] and a float32 scale (and offset)
per group of ``group`` k; ``q4``: nibbles [N, K / 2] (per 32 k, byte j holds k = j low and k = j + 16 high)
and a float32 scale and offset per group. ``bf16``: a plain bf16 weight (CPUs whose oneDNN
refuses bf16). ``t8`` / ``t4``: q8 / q4 in groups of 32 or more repacked (:func:`tile`) into tiles
of 16 output rows (their scales in fp16 where every one is an fp16 number) for ``kernels/tiled.c``, which multiplies them by activations rounded to int16
per 32 k (:meth:`QuantKernels.multiplied_activation`); :class:`QuantLinear` tiles its weights at
the levels that have that kernel (``QuantKernels.tile_rows``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from gpu_worker.cpu_kernels import CpuKernels
from shared.config import INT4_GROUPS

FORMATS = {"q8": 0, "q4": 1, "bf16": 2, "t8": 4, "t4": 5}  # kernels/quant.h's FMT_*
HALF_SCALES = 8  # kernels/quant.h's FMT_HALF: a tiled weight's scales and offsets in fp16
TILE = 16  # output rows of a t8 / t4 tile (kernels/tiled.c)


@dataclass
class QWeight:
    """One weight [N, K] in a kernel format (see the module's docstring)."""
    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None  # float32 [N, ceil(K / group)] (t8 / t4: maybe fp16, see tile())
    offset: torch.Tensor | None  # as scale; None: no offset
    group: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.offset) if t is not None)

    @property
    def code(self) -> int:
        """The format as the kernels take it (``FMT_*``, with ``FMT_HALF`` for fp16 scales)."""
        half = self.scale is not None and self.scale.dtype == torch.float16
        return FORMATS[self.fmt] | (HALF_SCALES if half else 0)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernel multiplies by (for references and tests)."""
        N, K = self.shape
        if self.fmt in ("t8", "t4"):
            return untile(self).dequantize()
        if self.fmt == "bf16":
            return self.data.float()
        if self.fmt == "q8":
            q = self.data.float()
        else:
            lo, hi = (self.data & 15).view(N, K // 32, 16), (self.data >> 4).view(N, K // 32, 16)
            q = torch.cat([lo, hi], dim=-1).view(N, K).float()
        scale = self.scale.repeat_interleave(self.group, dim=1)[:, :K]
        if self.offset is None:
            return q * scale
        return torch.addcmul(self.offset.repeat_interleave(self.group, dim=1)[:, :K], q, scale)

    def rows(self, index) -> "QWeight":
        """The rows ``index`` (a permutation or a slice) of the weight."""
        pick = lambda t: None if t is None else t[index].contiguous()
        data = pick(self.data)
        return QWeight(self.fmt, data, pick(self.scale), pick(self.offset), self.group, (data.shape[0], self.shape[1]))


def tile(w: QWeight) -> QWeight:
    """A row-major q8 / q4 weight as t8 / t4 (see ``kernels/tiled.c``'s layouts): the rows padded with
    zeros to whole tiles, each block of 32 k of a tile as 8 k-quads of 16 rows x 4 k (t4: k-quads
    c and c + 4 in the low and high nibbles of one 64-byte chunk); the scales
    (and offsets) [N / 16, K / group, 16], in fp16 where every one of them is an fp16 number (a GGUF
    file's Q4_0, Q4_1 and Q8_0 blocks, the quantizer's own scales): a sixth of a q4 tile's bytes
    less to read, the same values."""
    N, K = w.shape
    tiles, blocks = -(-N // TILE), K // 32
    if w.fmt == "q4":
        b = w.data.view(N, blocks, 16)
        q = torch.cat([b & 15, b >> 4], dim=2)  # k order within each block
    else:
        q = w.data.view(N, blocks, 32)
    padded = torch.zeros((tiles * TILE, blocks, 32), dtype=q.dtype)
    padded[:N] = q
    quads = padded.view(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, 8, 4 * TILE)
    data = quads[:, :, :4] | (quads[:, :, 4:] << 4) if w.fmt == "q4" else quads

    def per_tile(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        rows = torch.zeros((tiles * TILE, t.shape[1]), dtype=t.dtype)
        rows[:N] = t
        return rows.view(tiles, TILE, -1).transpose(1, 2).contiguous()

    scales = [t for t in (w.scale, w.offset) if t is not None]
    half = all(torch.equal(t.half().float(), t) for t in scales)
    scale, offset = (None if t is None else t.half() if half else t for t in (per_tile(w.scale), per_tile(w.offset)))
    return QWeight("t" + w.fmt[1], data.contiguous(), scale, offset, w.group, w.shape)


def untile(w: QWeight) -> QWeight:
    """The row-major q8 / q4 weight of a t8 / t4 one (:func:`tile`'s inverse)."""
    N, K = w.shape
    tiles, blocks = -(-N // TILE), K // 32
    quads = torch.cat([w.data & 15, w.data >> 4], dim=2) if w.fmt == "t4" else w.data  # [tiles, blocks, 8, 64]
    q = quads.reshape(tiles, blocks, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks, 32)[:N]
    data = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(N, K // 2) if w.fmt == "t4" else q.reshape(N, K)
    rows = lambda t: None if t is None else t.transpose(1, 2).reshape(tiles * TILE, -1)[:N].float().contiguous()  # noqa: E731
    return QWeight("q" + w.fmt[1], data.contiguous(), rows(w.scale), rows(w.offset), w.group, w.shape)


def concat(parts: list[QWeight]) -> list[QWeight]:
    """Weights stacked along N (a fused qkv or gate_up), merged where their format and group agree."""
    merged: list[QWeight] = []
    for w in parts:
        last = merged[-1] if merged else None
        if last is not None and (last.fmt, last.group, last.shape[1]) == (w.fmt, w.group, w.shape[1]):
            cat = lambda a, b: None if a is None else torch.cat([a, b])
            merged[-1] = QWeight(w.fmt, cat(last.data, w.data), cat(last.scale, w.scale), cat(last.offset, w.offset),
                                 w.group, (last.shape[0] + w.shape[0], w.shape[1]))
        else:
            merged.append(w)
    return merged


# ---- GGUF blocks -> kernel formats ---------------------------------------------------------------

def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q [N, K] in 0..15 -> bytes [N, K / 2] in the kernel's order (per 32 k: j low, j + 16 high)."""
    N, K = q.shape
    q = q.reshape(N, K // 32, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N, K // 2).astype(np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _q4_0(blocks: np.ndarray):  # [n, 18]: fp16 d, 16 bytes
    d = _f16(blocks[:, :2])
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=1)  # GGUF: low nibbles k = 0..15, high 16..31
    return q, d, -8 * d  # d (q - 8) = d q - 8 d, both exact in float32


def _q4_1(blocks: np.ndarray):  # [n, 20]: fp16 d, fp16 m, 16 bytes
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    qs = blocks[:, 4:]
    return np.concatenate([qs & 15, qs >> 4], axis=1), d, m


def _q4_k(blocks: np.ndarray):  # [n, 144]: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    s = blocks[:, 4:16].reshape(n, 3, 4)
    sc = np.concatenate([s[:, 0] & 0x3F, (s[:, 2] & 0x0F) | ((s[:, 0] >> 2) & 0x30)], axis=1)
    mn = np.concatenate([s[:, 1] & 0x3F, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 0x30)], axis=1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)  # per 64 k: 32 bytes, low nibbles the first 32 k
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n * 8, 32)
    return q, (d * sc).reshape(-1, 1), -(dmin * mn).reshape(-1, 1)


def _q6_k(blocks: np.ndarray):  # [n, 210]: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    ql = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    qh = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (ql.reshape(n, 2, 4, 32) | (qh << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(n * 16, 16), (d * sc).reshape(-1, 1)


_Q4 = {"Q4_0": (_q4_0, 32), "Q4_1": (_q4_1, 32), "Q4_K": (_q4_k, 256)}
_Q8 = {"Q8_0": 32, "Q6_K": 256}
GGUF_TYPES = ("F32", "F16", "BF16", *_Q8, *_Q4)


def from_gguf(tensor) -> QWeight | torch.Tensor:
    """A ``gguf.GGUFReader`` tensor [N, K] as a :class:`QWeight` (quantized types, BF16 matrices)
    or a float32 tensor (F32, F16, BF16 vectors); other types are refused with their name."""
    kind = tensor.tensor_type.name
    K, N = (int(d) for d in tensor.shape[:2]) if len(tensor.shape) > 1 else (int(tensor.shape[0]), 1)
    if kind in ("F32", "F16"):
        return torch.from_numpy(np.asarray(tensor.data).astype(np.float32).reshape((N, K) if N > 1 else (K,)))
    if kind == "BF16":  # a matrix stays bf16 (the kernel expands it exactly); a vector becomes float32
        w = torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.int16).copy()).view(torch.bfloat16)
        return QWeight("bf16", w.reshape(N, K), None, None, 0, (N, K)) if N > 1 else w.float().reshape(K)
    blocks = np.ascontiguousarray(tensor.data).reshape(-1, tensor.data.shape[-1])
    if kind in _Q8:
        per_block = tensor.data.shape[-1] // (K // _Q8[kind])
        blocks = blocks.reshape(-1, per_block)
        if kind == "Q8_0":
            q, scale, group = blocks[:, 2:].view(np.int8), _f16(blocks[:, :2]), 32
        else:
            q, scale = _q6_k(blocks)
            group = 16
        return QWeight("q8", torch.from_numpy(np.ascontiguousarray(q).reshape(N, K)),
                       torch.from_numpy(scale.reshape(N, K // group).copy()), None, group, (N, K))
    if kind in _Q4:
        unpack, per = _Q4[kind]
        blocks = blocks.reshape(N * (K // per), -1)
        q, scale, offset = unpack(blocks)
        return QWeight("q4", torch.from_numpy(_pack_nibbles(q.reshape(N, K))),
                       torch.from_numpy(scale.reshape(N, K // 32).astype(np.float32)),
                       torch.from_numpy(offset.reshape(N, K // 32).astype(np.float32)), 32, (N, K))
    raise ValueError(f"GGUF tensor {tensor.name}: type {kind} is not supported (supported: {', '.join(GGUF_TYPES)})")


# ---- quantizing float weights at load --------------------------------------------------------------

def _fp16_where_normal(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to fp16 numbers (kept in float32) where every value is 0 or an fp16 normal: the
    scales tile() can then hold in fp16, as GGUF files hold theirs; else ``t`` itself."""
    magnitude = t.abs()
    normal = bool(((magnitude == 0) | ((magnitude >= 2 ** -14) & (magnitude <= 65504))).all())
    return t.half().float() if normal else t


def quantize(weight: torch.Tensor, method: str, group: int = 32, symmetric: bool = False) -> QWeight:
    """``weight`` [N, K] quantized in groups of ``group`` along K (one of INT4_GROUPS, dividing K),
    the group's min and max mapped to the ends of the range (``int8``: -128 and 127, ``int4``: 0
    and 15), rounded to nearest: a scale and an offset per group. ``symmetric`` (int8): a scale
    alone, the group's largest magnitude mapped to 127 (GGUF's Q8_0 at group 32)."""
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {method!r} (int8 or int4)")
    w = weight.detach().float()
    N, K = w.shape
    if group not in INT4_GROUPS or K % group:
        raise ValueError(f"{method} needs a group of {INT4_GROUPS} dividing K = {K} (got {group})")
    g = w.view(N, K // group, group)
    if symmetric and method == "int8":
        scale = _fp16_where_normal(g.abs().amax(dim=2, keepdim=True) / 127)
        q = torch.where(scale > 0, g / scale, 0).round().clamp(-127, 127).to(torch.int8).view(N, K)
        return QWeight("q8", q, scale.view(N, -1).contiguous(), None, group, (N, K))
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    levels = 255 if method == "int8" else 15
    lo = _fp16_where_normal(lo)
    scale = _fp16_where_normal((hi - lo) / levels)
    q = torch.where(scale > 0, (g - lo) / scale, 0).round().clamp(0, levels).view(N, K)
    if method == "int8":  # q - 128 in int8, the offset moved by 128 steps to match
        q8 = (q - 128).to(torch.int8)
        return QWeight("q8", q8, scale.view(N, -1).contiguous(), (lo + 128 * scale).view(N, -1).contiguous(), group,
                       (N, K))
    packed = torch.from_numpy(_pack_nibbles(q.to(torch.uint8).numpy()))
    return QWeight("q4", packed, scale.view(N, -1).contiguous(), lo.view(N, -1).contiguous(), group, (N, K))


# ---- the modules ---------------------------------------------------------------------------------

class QuantKernels:
    """``kernels/quant.c``'s ``wlinear`` and ``wgather`` (the ops ``tandem::wlinear`` and ``tandem::wgather``) of
    the CPU kernels' library."""

    def __init__(self, kernels: CpuKernels):
        self.source, self.level = kernels, kernels.level
        # At this level bf16 activations multiply the weights rounded to bf16 (vdpbf16ps: the products
        # exact, the sums float32); float32 activations always multiply the float32 expansion.
        self.bf16_dot = bool(kernels.function("wlinear_bf16_dot")())
        self.tile_rows = kernels.function("wlinear_tile_rows")()  # 0: no tiled kernel; q8 / q4 stay row-major

    def tiles(self, w: QWeight) -> bool:
        """Whether :class:`QuantLinear` holds ``w`` in tiles here: q8 / q4 in groups of 32 or more."""
        return bool(self.tile_rows) and w.fmt in ("q8", "q4") and w.group >= 32

    def multiplied_weight(self, w: "QWeight", x_dtype: torch.dtype) -> torch.Tensor:
        """The float32 weight [N, K] that :meth:`linear` multiplies activations of ``x_dtype`` by."""
        dense = w.dequantize()
        bf16_dot = self.bf16_dot and x_dtype == torch.bfloat16 and w.fmt in ("q8", "q4", "bf16")
        return dense.bfloat16().float() if bf16_dot else dense

    @staticmethod
    def multiplied_activation(x: torch.Tensor, w: QWeight) -> torch.Tensor:
        """The float32 x [M, K] that :meth:`linear` multiplies ``w`` by: x itself, or for a tiled weight
        each 32 of a row rounded to int16 steps of its largest |x| / 32767 (nearest even)."""
        if w.fmt not in ("t8", "t4"):
            return x.float()
        M, K = x.shape
        blocks = x.float().reshape(M, K // 32, 32)
        amax = blocks.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
        return ((blocks * inv).round() * (amax / 32767)).reshape(M, K)

    def linear(self, x: torch.Tensor, w: QWeight, bias: torch.Tensor | None, y: torch.Tensor) -> None:
        """y [M, ldy]'s first N columns (a view) = x [M, K] @ w^T + bias (float32 or None)."""
        self.source.run("wlinear", w.code, x, w.data, w.scale, w.offset, w.group, w.shape[0], bias, y)

    def gather(self, w: QWeight, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.contiguous()
        out = torch.empty((ids.numel(), w.shape[1]), dtype=torch.float32)
        self.source.run("wgather", FORMATS[w.fmt], w.data, w.scale, w.offset, w.group, ids, out)
        return out


class QuantLinear(nn.Module):
    """A linear layer over :class:`QWeight` parts stacked along N (a fused projection whose parts
    came in different formats stays several parts), bias in float32."""

    def __init__(self, parts: list[QWeight], bias: torch.Tensor | None, kernels: QuantKernels):
        super().__init__()
        for p in parts:  # what kernels/quant.c takes
            if p.shape[1] % 32 or (p.fmt != "bf16" and (p.group < 16 or p.group & (p.group - 1))):
                raise ValueError(f"{p.fmt} weight {p.shape}: K must be a multiple of 32 and the group a power of two "
                                 f">= 16 (group {p.group})")
        self.parts = [tile(p) if kernels.tiles(p) else p for p in concat(parts)]
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in self.parts)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.kernels = kernels

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty((rows.shape[0], self.out_features), dtype=x.dtype)
        at = 0
        for p in self.parts:
            bias = None if self.bias is None else self.bias[at:at + p.shape[0]]
            self.kernels.linear(rows, p, bias, y[:, at:])
            at += p.shape[0]
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, " + ", ".join(
            f"{p.fmt}/{p.group}x{p.shape[0]}" for p in self.parts)


def kernels_of(model: nn.Module) -> QuantKernels | None:
    """The kernels a model's quantized linears multiply with; None where it has none."""
    return next((m.kernels for m in model.modules() if isinstance(m, QuantLinear)), None)


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized: looked-up rows are expanded to float32, then cast."""

    def __init__(self, weight: QWeight, kernels: QuantKernels, dtype: torch.dtype):
        super().__init__()
        self.qweight, self.kernels, self.dtype = weight, kernels, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.gather(self.qweight, ids.reshape(-1)).to(self.dtype).view(*ids.shape, -1)

