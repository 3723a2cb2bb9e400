"""LoRA adapters in the PEFT format: read and check one against the base model (no torch).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
whose tensors are named ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}
.lora_{A|B}.weight``, ``A`` being [r, in] and ``B`` [out, r]. Tandem applies
``x @ A.T @ B.T * scaling`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``), as PEFT does.

Everything is checked before a worker starts (the frontend calls
:func:`read_adapters` on ``--lora NAME=DIR``), from ``config.json`` and the
safetensors header alone: a target module the Llama has not, a shape that does
not match the base model, a rank over :data:`MAX_LORA_RANK` or a PEFT feature
Tandem does not implement (DoRA, LoRA biases, rank/alpha patterns, modules to
save) is a clear error at start-up, never a wrong answer later.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAX_LORA_RANK = 64
# How a row's delta is computed (same result; the cost differs, see BENCHMARKS.md):
# - "gather": per row, gather its slot's A and B ([T, R, in] and [T, R, out]) and two batched matvecs;
#   cost grows with T * R, independent of the number of slots;
# - "masked": x @ every slot's A (one matmul), zero all but the row's own slot, @ every slot's B;
#   no weight copies, cost grows with T * slots * R.
KERNELS = ("gather", "masked")
# The Llama linear layers an adapter may target, and the fused projection each belongs to.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT options that change the math; Tandem refuses an adapter that sets any of them.
_UNSUPPORTED = {"use_dora": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
                "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None, "fan_in_fan_out": False,
                "trainable_token_indices": None, "target_parameters": None}


class AdapterError(ValueError):
    """An adapter directory Tandem cannot serve; the message names the adapter and the problem."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: Path
    rank: int
    scaling: float
    modules: frozenset[str]  # the LORA_MODULES it targets
    tensors: dict[tuple[int, str], str] = field(default_factory=dict, compare=False, repr=False)
    # (layer, module) -> the safetensors name prefix of its lora_A / lora_B pair


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Llama linear layer, from a HF config.json dict."""
    cfg = config.get("text_config", config)
    hid, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hid // heads
    return {"q_proj": (hid, heads * head_dim), "k_proj": (hid, kv_heads * head_dim),
            "v_proj": (hid, kv_heads * head_dim), "o_proj": (heads * head_dim, hid),
            "gate_proj": (hid, inter), "up_proj": (hid, inter), "down_proj": (inter, hid)}


def parse_lora_option(values) -> dict[str, str]:
    """``NAME=DIR`` strings (the CLI's repeatable ``--lora``) -> {name: dir}."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise AdapterError(f"--lora expects NAME=DIR, got {v!r}")
        if name in out:
            raise AdapterError(f"--lora: adapter name {name!r} is given twice")
        out[name] = path
    return out


def read_adapter(name: str, path: str | Path, base_config: dict) -> AdapterSpec:
    """Read and check one adapter directory against the base model's config.json dict."""
    path = Path(path)
    where = f"adapter {name!r} ({path})"
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
        header = _safetensors_header(path / "adapter_model.safetensors")
    except (OSError, ValueError) as e:
        raise AdapterError(f"{where}: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, plain in _UNSUPPORTED.items():
        if cfg.get(key, plain) not in (plain, None, {}, [], False):
            raise AdapterError(f"{where}: {key}={cfg[key]!r} is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{where}: adapter_config.json needs an integer r >= 1 and a number lora_alpha")
    if rank > MAX_LORA_RANK:
        raise AdapterError(f"{where}: rank {rank} is over the limit of {MAX_LORA_RANK}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    shapes = module_shapes(base_config)
    layers = (base_config.get("text_config", base_config))["num_hidden_layers"]
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA weight of a Llama linear layer "
                               f"(targets may be {', '.join(LORA_MODULES)})")
        layer, parent, module, ab = int(m[1]), m[2], m[3], m[4]
        if _PARENT.get(module) != parent:
            raise AdapterError(f"{where}: unknown target module {parent}.{module} "
                               f"(targets may be {', '.join(LORA_MODULES)})")
        if layer >= layers:
            raise AdapterError(f"{where}: {key} is for layer {layer}; the base model has {layers} layers")
        pairs.setdefault((layer, module), {})[ab] = list(meta["shape"])
    if not pairs:
        raise AdapterError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    for (layer, module), ab in pairs.items():
        fan_in, fan_out = shapes[module]
        want = {"A": [rank, fan_in], "B": [fan_out, rank]}
        for part in "AB":
            if ab.get(part) != want[part]:
                got = "missing" if part not in ab else f"shape {ab[part]}"
                raise AdapterError(f"{where}: layers.{layer}.{module}.lora_{part} is {got}; the base model "
                                   f"needs {want[part]} (r={rank}, {module} is {fan_in} -> {fan_out})")
    tensors = {(layer, module): f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
               for layer, module in pairs}
    return AdapterSpec(name, path, rank, float(scaling), frozenset(m for _, m in pairs), tensors)


def read_adapters(loras: dict[str, str], base_config: dict) -> dict[str, AdapterSpec]:
    return {name: read_adapter(name, path, base_config) for name, path in loras.items()}


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path.name} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError(f"{path.name} has an implausible header of {size} bytes")
        return json.loads(f.read(size))
