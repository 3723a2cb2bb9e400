"""LoRA adapters on the device: slot buffers and the per-row delta in the linear layers.

Every fused projection that some configured adapter targets (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``) is wrapped by a :class:`LoraLinear`
holding, per device slot, the A matrices of its parts stacked along the rank
([slots + 1, parts * R, in]) and each part's B transposed, pre-multiplied by
the adapter's scaling ([slots + 1, R, out_part]). R is the largest rank of the
configured adapters; smaller ranks are zero-padded, which adds exact zeros.
Slot 0 stays all zeros: the "adapter" of rows without one.

A forward reads ``pool.token_slots`` (the slot of each token row, int64 [T],
set by the model runner around the forward) and adds each row's own
``B[slot] @ (A[slot] @ x)`` to the base output (:data:`KERNELS`: by a per-row
gather of A and B, or by masking a product with every slot). So rows with
different adapters, and rows without one, share one batch and one CUDA graph
(the graph keeps a static ``token_slots`` buffer); no weights are merged.
``token_slots = None`` (an eager launch whose rows have no adapter) skips the
LoRA math altogether.

Which adapter is in which slot, and when a slot may be reloaded, is
``lora_slots.py``'s business; :meth:`LoraPool.write` only copies weights in
(on the compute stream, after every step launched before it).
"""
from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn as nn

from shared.lora_config import KERNELS, AdapterSpec, module_shapes, read_adapters

# The parts of each fused projection of gpu_worker.model, in its output order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoraLinear(nn.Module):
    """A fused linear layer plus a per-row LoRA delta on the parts some adapter targets."""

    def __init__(self, base: nn.Linear, pool: "LoraPool", parts: list[tuple[str, int, int]], rank: int) -> None:
        """``parts``: (module name, first output column, number of columns) of each targeted part."""
        super().__init__()
        self.base, self.pool, self.rank = base, pool, rank
        self.parts = parts
        slots, w = pool.num_slots + 1, base.weight
        self.lora_a = torch.zeros(slots, len(parts) * rank, w.shape[1], dtype=w.dtype, device=w.device)
        self.lora_b = [torch.zeros(slots, rank, n, dtype=w.dtype, device=w.device) for _, _, n in parts]  # B.T
        self.slot_ids = torch.arange(slots, device=w.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.pool.token_slots
        if slots is None:
            return y
        R, T = self.rank, x.shape[0]
        if self.pool.kernel == "gather":  # each row gathers its slot's A and B
            h = torch.bmm(x.unsqueeze(1), self.lora_a[slots].transpose(1, 2))  # [T, 1, parts * R]
            for i, (_, start, n) in enumerate(self.parts):
                y[:, start:start + n] += torch.bmm(h[:, :, i * R:(i + 1) * R], self.lora_b[i][slots]).squeeze(1)
            return y
        # "masked": one matmul against every slot's A, keep each row's own slot, one matmul against every B.
        S1, P = self.lora_a.shape[0], len(self.parts)
        own = (slots[:, None] == self.slot_ids).to(x.dtype)  # [T, S1] one-hot
        h = (x @ self.lora_a.view(S1 * P * R, -1).T).view(T, S1, P, R) * own[:, :, None, None]
        for i, (_, start, n) in enumerate(self.parts):
            y[:, start:start + n] += h[:, :, i].reshape(T, S1 * R) @ self.lora_b[i].view(S1 * R, n)
        return y


class LoraPool:
    """The device slots of every adapter-carrying layer of one model, and the adapters' host weights."""

    def __init__(self, model: nn.Module, loras: dict[str, str], num_slots: int, kernel: str = "gather") -> None:
        """``kernel``: how a row meets its slot, see :data:`KERNELS`."""
        if kernel not in KERNELS:
            raise ValueError(f"lora kernel must be one of {', '.join(KERNELS)}")
        if num_slots < 1:
            raise ValueError("max_loras must be >= 1 when adapters are given")
        self.num_slots = num_slots
        self.kernel = kernel
        base_config = asdict(model.config)
        self.specs: dict[str, AdapterSpec] = read_adapters(loras, base_config)
        shapes = module_shapes(base_config)
        self.rank = max(s.rank for s in self.specs.values())
        self.token_slots: torch.Tensor | None = None
        self.host = {name: _load_host(spec) for name, spec in self.specs.items()}  # checked and cached once
        targeted = set().union(*(s.modules for s in self.specs.values()))
        self.layers: dict[tuple[int, str], LoraLinear] = {}
        for i, layer in enumerate(model.layers):
            for owner in (layer.self_attn, layer.mlp):
                for fused, names in FUSED_PARTS.items():
                    base = getattr(owner, fused, None)
                    if base is None or not targeted & set(names):
                        continue
                    widths = [shapes[n][1] for n in names]
                    starts = [sum(widths[:k]) for k in range(len(names))]
                    parts = [(n, s, w) for n, s, w in zip(names, starts, widths) if n in targeted]
                    wrapped = LoraLinear(base, self, parts, self.rank)
                    setattr(owner, fused, wrapped)
                    self.layers[(i, fused)] = wrapped

    def write(self, slot: int, name: str) -> None:
        """Copy adapter ``name`` into ``slot`` of every wrapped layer (zeros where it has no weights)."""
        weights, R = self.host[name], self.rank
        with torch.inference_mode():
            for (i, _), layer in self.layers.items():
                layer.lora_a[slot].zero_()
                for p, (module, _, _) in enumerate(layer.parts):
                    layer.lora_b[p][slot].zero_()
                    ab = weights.get((i, module))
                    if ab is not None:
                        a, b = ab
                        r = a.shape[0]
                        layer.lora_a[slot, p * R:p * R + r].copy_(a)
                        layer.lora_b[p][slot, :r].copy_(b.T)


def _load_host(spec: AdapterSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B * scaling [out, r]) in float32 on the host."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(spec.path / "adapter_model.safetensors"), framework="pt", device="cpu") as f:
        for key, prefix in spec.tensors.items():
            a = f.get_tensor(prefix + ".lora_A.weight").float()
            b = f.get_tensor(prefix + ".lora_B.weight").float() * spec.scaling
            out[key] = (a, b)
    return out
