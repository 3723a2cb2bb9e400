"""The Llama-family model's CPU backend: what a CPU needs beyond the model's math (``model.py``).

- bf16 linears packed once for a matmul (:class:`PackedLinear`, :func:`pack_linears`): the fused
  kernels' AMX matmul where they take the weight, else oneDNN's where this CPU has its bf16 prepack
  (:func:`onednn_packs_bf16`); fp32 and CUDA keep aten's matmul;
- the decoder layers through the fused CPU kernels (:func:`fused_layers`): five kernel calls and four
  matmuls per layer from Python, or every layer in one C call from a table of the weights' addresses
  (:func:`layer_table`) when every linear is one the kernels run (packed for their AMX matmul, or
  weight-only quantized: ``gpu_worker/quant.py``).

Invariants: the fused layers compute the eager layers' math (tests/kernels/test_cpu_kernels.py); a
linear neither matmul takes stays a plain ``nn.Linear`` (a path the CPU cannot run is never chosen).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn

from gpu_worker.batch import Batch
from gpu_worker.cpu_kernels import CpuKernels
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.quant import QuantLinear

log = logging.getLogger(__name__)


class PackedLinear(nn.Linear):
    """``nn.Linear`` whose bf16 CPU matmul reads a copy of the weight packed once for it: the fused
    kernels' AMX matmul where they can (``CpuKernels.linear``), else oneDNN's (where this CPU has
    it: :func:`onednn_packs_bf16`).

    oneDNN reorders a plain weight into its blocked (AVX512-BF16 / AMX) layout on
    every call; packed once, a call only multiplies (BENCHMARKS.md "The CPU
    forward"). The kernels' AMX matmul reads the weight at about twice oneDNN's rate
    at 1 and 32 rows, and computes each row the same whatever the batch around it
    (BENCHMARKS.md "The AMX matmul and the layers in one C call"). ``weight`` stays the
    plain parameter (tied embeddings, LoRA and checkpoint code read it); the packed copy
    costs the weights' size once more.
    """

    packed: torch.Tensor
    kernels: CpuKernels | None  # set: ``packed`` is the kernels' tile layout

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels: CpuKernels | None = None) -> "PackedLinear":
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias
        packed.kernels = kernels if kernels is not None and kernels.can_matmul(linear.weight) else None
        if packed.kernels is not None:
            packed.packed = packed.kernels.pack_linear(linear.weight)
        elif not onednn_packs_bf16():
            raise RuntimeError("no bf16 prepack for this linear: the CPU kernels' matmul does not take it and "
                               "oneDNN refuses bf16 on this CPU (see onednn_packs_bf16)")
        else:
            # The batch-size hint picks oneDNN's blocking: 64 was as fast as 1 or faster at 1, 32
            # and 512 rows (BENCHMARKS.md "The CPU forward").
            packed.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 64)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward_gelu_tanh(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(self(x), approximate="tanh")`` in one pass: the gelu runs on the float32 sum, so
        the result is rounded to bf16 once (closer to float32's than the eager pair, which rounds
        twice) and skips a round trip through memory (half the pair's time on Moondream's vision
        fc1, BENCHMARKS.md "Moondream 2")."""
        if self.kernels is not None:
            return self.kernels.linear(x, self.packed, self.bias, self.out_features, gelu=True)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu", [], "tanh")


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN's bf16 prepack (``_reorder_linear_weight``) runs on this CPU: it needs
    avx512bw, avx512vl and avx512dq, or avx_ne_convert, and raises without them (an AVX2-only CPU,
    e.g. AMD Zen 2/3). Logged once where it does not."""
    ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if not ok:
        log.info("bf16 linears stay nn.Linear unless the CPU kernels' matmul takes them: oneDNN has no bf16 "
                 "prepack on this CPU (it needs avx512bw/vl/dq or avx_ne_convert)")
    return ok


def pack_linears(model: nn.Module, kernels: CpuKernels | None = None) -> int:
    """Replace, in place, every bf16 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`
    (for ``kernels``' matmul where it applies, else oneDNN's where this CPU has it); returns how
    many. fp32 keeps aten's matmul (the float32 reference tests match it exactly), CUDA has no use
    for it, and a linear neither packs stays a plain ``nn.Linear``."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            w = child.weight if type(child) is nn.Linear else None
            if w is None or w.device.type != "cpu" or w.dtype != torch.bfloat16:
                continue
            if (kernels is not None and kernels.can_matmul(w)) or onednn_packs_bf16():
                setattr(parent, name, PackedLinear.from_linear(child, kernels))
                count += 1
    return count


def fused_layers(model: nn.Module, x: torch.Tensor, batch: Batch, kv: PagedKVCache, kernels: CpuKernels) -> torch.Tensor:
    """The decoder layers and the final norm through the fused CPU kernels (``kernels/fused.c``): the
    eager layers' math, with the four matmuls between five kernel calls per layer. ``x`` is updated
    in place (the residual stream); returns norm(x) for every row."""
    cfg = model.config
    H, Hkv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    # Every token's attention is the kernel's, prompt chunks' too: a token's numerics then depend
    # neither on its batch nor on how its prompt was chunked (SDPA for long chunks and the kernel
    # for decode rows gave different tokens for the same request under different schedules).
    seq_of_token = batch.token_to_padded // batch.max_query_len
    weights = layer_table(model, kernels)
    if weights is not None:  # every layer in one C call: the same kernels, no Python between them
        return kernels.layers(x, weights, kv.k, kv.v, model.rope_cos, model.rope_sin, batch.positions,
                              batch.kv_index, batch.block_tables, seq_of_token, H, Hkv, D,
                              cfg.intermediate_size, eps)
    h = kernels.add_rmsnorm(x, None, model.layers[0].input_layernorm.weight, eps)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        k_cache, v_cache = kv.k[i], kv.v[i]
        q = kernels.rope_kv(attn.qkv_proj(h), model.rope_cos, model.rope_sin, batch.positions, batch.kv_index,
                            k_cache, v_cache, H, Hkv, D)
        o = kernels.attention(q, k_cache, v_cache, batch.block_tables, seq_of_token, batch.positions, Hkv)
        h = kernels.add_rmsnorm(x, attn.o_proj(o), layer.post_attention_layernorm.weight, eps)
        after = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm
        h = kernels.add_rmsnorm(x, mlp.down_proj(kernels.silu_mul(mlp.gate_up_proj(h))), after.weight, eps)
    return h


# kernels/layers.c's table: per layer 3 norm weights, then 4 linears of LINEAR_WIDTH int64 each: a
# parts' count and MAX_PARTS records of (format, data, scale, offset, group, rows, bias).
FMT_AMX = 3  # a weight packed for the AMX matmul (quant.FORMATS are the others)
MAX_PARTS, PART_WIDTH = 3, 7
LINEAR_WIDTH = 1 + MAX_PARTS * PART_WIDTH


def _linear_record(linear: nn.Module, kernels: CpuKernels) -> list[int] | None:
    """One linear's entry in the table, or None where ``layers.c`` cannot run it (a plain or LoRA-
    wrapped ``nn.Linear``, a matmul of other kernels, more parts than the table holds)."""
    if type(linear) is PackedLinear and linear.kernels is kernels:
        parts = [[FMT_AMX, linear.packed.data_ptr(), 0, 0, 0, linear.out_features, _address(linear.bias)]]
    elif type(linear) is QuantLinear and linear.kernels.source is kernels and len(linear.parts) <= MAX_PARTS:
        parts, at = [], 0
        for p in linear.parts:
            bias = 0 if linear.bias is None else linear.bias.data_ptr() + 4 * at  # float32 columns at..
            parts.append([p.code, p.data.data_ptr(), _address(p.scale), _address(p.offset), p.group,
                          p.shape[0], bias])
            at += p.shape[0]
    else:
        return None
    record = [len(parts), *(v for part in parts for v in part)]
    return record + [0] * (LINEAR_WIDTH - len(record))


# Submodules and parameters registered anywhere in the process (nn.Module's global registration hooks),
# counted: a kept layer table is checked again only after one. The check reads every layer's modules,
# ~40 µs warm but ~0.3 ms a forward after the weights have streamed through the caches. A hook runs
# before its module is set, so a model's linears are replaced on the thread of its forwards (LoRA's
# are, on the compute stream), never beside one.
_registrations = [0]


def _count_registration(*_args) -> None:
    _registrations[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def layer_table(model: nn.Module, kernels: CpuKernels) -> torch.Tensor | None:
    """The table ``CpuKernels.layers`` reads (see ``kernels/layers.c``); None unless every layer's
    linears are ones it runs: packed for ``kernels``' AMX matmul or weight-only quantized
    (:class:`~gpu_worker.quant.QuantLinear`) over them. Built once and kept while the layers' linears
    and norm weights stay the same objects (checked after any module or parameter was registered;
    building it takes ~1 ms)."""
    if getattr(kernels, "layers", None) is None:
        return None
    cached = model._layer_table
    if cached is not None and cached[0] is kernels and cached[3] == _registrations[0]:
        return cached[2]
    registrations = _registrations[0]
    # Per layer: its two norm weights and four linears, then the final norm's weight. Read through
    # _modules and _parameters: nn.Module.__getattr__ would cost ~1 µs a lookup.
    parts = []
    for layer in model.layers:
        sub = layer._modules
        attn, mlp = sub["self_attn"]._modules, sub["mlp"]._modules
        norms = sub["input_layernorm"]._parameters, sub["post_attention_layernorm"]._parameters
        parts += (norms[0]["weight"], norms[1]["weight"], attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"],
                  mlp["down_proj"])
    parts = (*parts, model.norm._parameters["weight"])
    if cached is not None and cached[0] is kernels and len(cached[1]) == len(parts) \
            and all(a is b for a, b in zip(cached[1], parts)):
        model._layer_table = (*cached[:3], registrations)
        return cached[2]
    rows = []
    for i in range(len(model.layers)):
        norm_in, norm_post, qkv, o, gate_up, down, after = parts[6 * i:6 * i + 7]
        linears = [_linear_record(m, kernels) for m in (qkv, o, gate_up, down)]
        if any(r is None for r in linears):
            rows = None
            break
        rows.append([norm_in.data_ptr(), norm_post.data_ptr(), after.data_ptr(), *(v for r in linears for v in r)])
    table = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    model._layer_table = (kernels, parts, table, registrations)
    return table
