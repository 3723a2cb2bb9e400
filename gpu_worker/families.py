"""The worker's side of the model families (``shared/families``): how each one's model is built.

``load(path, ...)`` reads the directory's family once and calls its :class:`WorkerFamily`'s
``load``, which returns the text model the runner drives (``Llama`` or ``Moondream``: the same
forward signature) and, for a family that takes images, its image encoder (an
``image_prefill.ImageFamily``) and processor parameters. ``llama_config`` parses a config.json into
the ``LlamaConfig`` of a Llama-like family (its ``llama_fields``: Qwen3's q/k norm).

A new family adds one entry to :data:`WORKER_FAMILIES`, under its ``shared.families`` name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from shared.families import family_of, read_config
from shared.vision_config import ImageProcessorParams

from .gguf_weights import load_gguf
from .model import Llama, LlamaConfig
from .moondream import Moondream
from .quant import QuantKernels
from .vision import VisionEncoder


@dataclass
class Loaded:
    model: Any  # Llama or Moondream
    vision: Any = None  # the image encoder (image_prefill.ImageFamily); None: a text-only model
    image_params: ImageProcessorParams | None = None


@dataclass(frozen=True)
class Load:
    """What every loader gets besides the directory."""
    dtype: torch.dtype
    device: torch.device
    max_model_len: int | None  # None: the model's own context
    gguf: bool  # serve the directory's GGUF file as it is (quant_kernels set) or dequantized
    quant_kernels: QuantKernels | None
    quantize: tuple[str, int] | None = None  # --quantization int8|int4: (method, group), for a loader that quantizes as it reads


def _llama(path: Path, how: Load) -> Loaded:
    limit = LlamaConfig.from_pretrained(path).max_position_embeddings  # rope tables for the usable positions
    max_model_len = min(how.max_model_len or limit, limit)
    if how.gguf or not any(path.glob("*.safetensors")):  # a GGUF file alone: dequantized
        return Loaded(load_gguf(path, how.quant_kernels, how.dtype, how.device, max_model_len))
    return Loaded(Llama.from_pretrained(path, dtype=how.dtype, device=how.device, max_model_len=max_model_len))


def _idefics3(path: Path, how: Load) -> Loaded:
    text = _llama(path, how).model  # the text backbone, under model.text_model.
    return Loaded(text, VisionEncoder.from_pretrained(path, dtype=how.dtype, device=how.device),
                  ImageProcessorParams.from_model_dir(path))


def _moondream(path: Path, how: Load) -> Loaded:
    quantize = None if how.quantize is None else (*how.quantize, how.quant_kernels)  # the experts, as they are read
    model = Moondream.from_pretrained(path, dtype=how.dtype, device=how.device, max_model_len=how.max_model_len,
                                      quantize=quantize)
    return Loaded(model, vision=model)  # it encodes its own crops


@dataclass(frozen=True)
class WorkerFamily:
    load: Callable[[Path, Load], Loaded]
    llama_fields: dict = field(default_factory=dict)  # LlamaConfig fields the family sets (a Llama-like one)


WORKER_FAMILIES = {
    "llama": WorkerFamily(_llama),
    "qwen3": WorkerFamily(_llama, llama_fields={"qk_norm": True}),
    "idefics3": WorkerFamily(_idefics3),
    "moondream": WorkerFamily(_moondream),
    "moondream3": WorkerFamily(_moondream),
}


def worker_family(path: Path) -> WorkerFamily:
    return WORKER_FAMILIES[family_of(read_config(path)).name]


def llama_config(config: dict) -> LlamaConfig:
    """The LlamaConfig of a Llama-like family's config.json (its text model's, with the family's fields)."""
    family = family_of(config)
    return LlamaConfig.from_hf_config(family.text_config(config), **WORKER_FAMILIES[family.name].llama_fields)


def load(path: Path, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
         quant_kernels: QuantKernels | None = None, gguf: bool = False,
         quantize: tuple[str, int] | None = None) -> Loaded:
    """The model (and image encoder) of directory ``path``, as its family builds it."""
    how = Load(dtype, device, max_model_len, gguf, quant_kernels, quantize)
    return worker_family(path).load(path, how)
