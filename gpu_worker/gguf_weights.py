"""Llama-family models from a GGUF file's weights as they are (``--model FILE.gguf``, and the
embedded default model): each linear a :class:`~gpu_worker.quant.QuantLinear` over the file's
blocks repacked once, the embedding table kept quantized, norms in float32. Only on a CPU (the
kernels are ``kernels/quant.c``); elsewhere, or with ``--quantization none``, the directory's
dequantized checkpoint (or the file dequantized) loads as before.

And :func:`quantize_linears`, the same modules for a float checkpoint quantized at load
(``--quantization int8|int4``).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from gpu_worker.model import Llama, LlamaConfig
from gpu_worker.quant import QuantEmbedding, QuantKernels, QuantLinear, QWeight, from_gguf, quantize
from shared.models.gguf_files import GGUF_FILE, gguf_tensor_name, unpermute_rope_rows

log = logging.getLogger(__name__)


def load_gguf(path: Path, kernels: QuantKernels | None, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", max_model_len: int | None = None) -> Llama:
    """The model of directory ``path`` from its ``model.gguf``, activations in ``dtype``; without
    ``kernels``, every weight dequantized to ``dtype`` on ``device`` (a GPU, ``--quantization none``)."""
    import gguf

    config = LlamaConfig.from_pretrained(path)
    reader = gguf.GGUFReader(str(path / GGUF_FILE))
    tensors = {gguf_tensor_name(t.name): t for t in reader.tensors}
    model = Llama(config, dtype=dtype, device="meta", max_model_len=max_model_len)

    def weight(name: str):
        if name not in tensors:
            raise KeyError(f"{path / GGUF_FILE} has no tensor for {name}")
        w = from_gguf(tensors[name])
        kind = name.rsplit(".", 2)[-2]
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(kind)
        if heads is not None:  # llama.cpp stores q and k rows in its rope order
            order = torch.from_numpy(unpermute_rope_rows(np.arange(w.shape[0]), heads))
            w = w.rows(order) if isinstance(w, QWeight) else w[order]
        return w

    def linear(names: list[str]) -> nn.Module:
        parts = [weight(n) for n in names]
        if kernels is not None and all(isinstance(p, QWeight) for p in parts):
            return QuantLinear(parts, None, kernels)
        dense = dense_of(torch.cat([p.dequantize() if isinstance(p, QWeight) else p for p in parts]))
        out = nn.Linear(dense.shape[1], dense.shape[0], bias=False, dtype=dtype, device="meta")
        out.weight = dense
        return out

    def dense_of(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

    def norm(module: nn.Module, name: str) -> None:
        module.weight = dense_of(weight(name))

    embed = weight("model.embed_tokens.weight")
    if kernels is not None and isinstance(embed, QWeight):
        model.embed_tokens = QuantEmbedding(embed, kernels, dtype)
    else:
        model.embed_tokens.weight = dense_of(embed.dequantize() if isinstance(embed, QWeight) else embed)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        norm(layer.input_layernorm, p + "input_layernorm.weight")
        norm(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
        layer.self_attn.qkv_proj = linear([p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        layer.self_attn.o_proj = linear([p + "self_attn.o_proj.weight"])
        layer.mlp.gate_up_proj = linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        layer.mlp.down_proj = linear([p + "mlp.down_proj.weight"])
    norm(model.norm, "model.norm.weight")
    if "lm_head.weight" in tensors:
        model.lm_head = linear(["lm_head.weight"])
    elif isinstance(model.embed_tokens, QuantEmbedding):  # tied: the head multiplies by the same blocks
        model.lm_head = QuantLinear([model.embed_tokens.qweight], None, kernels)
    else:
        model.lm_head.weight = model.embed_tokens.weight
    model._init_rope(device)
    if kernels is not None:
        log.info("%s: served from %s as it is (%s)", path.name, GGUF_FILE, _formats(model))
    else:
        log.info("%s: %s dequantized to %s", path.name, GGUF_FILE, dtype)
    return model.eval()


def holds_only_bf16(path: Path) -> bool:
    """Whether directory ``path``'s GGUF file holds every matrix in BF16 (no quantized blocks): their
    float expansion is then exact, so the float path serves the very same weights."""
    import gguf

    reader = gguf.GGUFReader(str(path / GGUF_FILE))
    return all(t.tensor_type == gguf.GGMLQuantizationType.BF16 for t in reader.tensors if len(t.shape) > 1)


def quantize_linears(model: nn.Module, method: str, group: int, kernels: QuantKernels) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`QuantLinear` of its weight quantized
    with ``method`` (int8, int4) in groups of ``group``, the output head (``lm_head``) at 8 bits
    symmetric in groups of 32 (see ``quant.py``); returns how many. A linear whose in-features the
    group does not divide stays float (the log names it)."""
    count, unfit = 0, []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if child.in_features % group:
                unfit.append(f"{parent_name}.{name}".lstrip(".") + f" ({child.in_features} in)")
                continue
            head = child is getattr(model, "lm_head", None)
            w = quantize(child.weight, "int8", 32, symmetric=True) if head else quantize(child.weight, method, group)
            setattr(parent, name, QuantLinear([w], child.bias, kernels))
            count += 1
    log.info("quantized %d linears to %s (%s)", count, method, _formats(model))
    if unfit:
        log.info("%d linears stay float: group %d does not divide their in-features: %s", len(unfit), group,
                 ", ".join(unfit[:4]) + (", ..." if len(unfit) > 4 else ""))
    return count


def _formats(model: nn.Module) -> str:
    """What the linears hold, for the log: formats with their share of the weight bytes."""
    sizes: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for p in m.parts:
                key = f"{p.fmt}/{p.group}"
                sizes[key] = sizes.get(key, 0) + p.nbytes
    total = sum(sizes.values())
    return ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])) + \
        f"; {total / 2**20:.0f} MiB of linear weights"
