"""The random-weight built-ins: a model's architecture and shapes with random weights and SmolLM2's
tokenizer (``gguf_files.smollm2_tokenizer``), for tests (``tiny-random-*``) and for memory and timing
(``random-*``).

The vision-language directories are laid out as transformers saves an
``Idefics3ForConditionalGeneration`` with its ``Idefics3Processor`` (config.json
with text_config/vision_config, ``processor_config.json``, tokenizer files,
``chat_template.jinja``), so transformers loads them as they are. Moondream's are
``shared/moondream_random.py``'s.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from shared.models.cache import progress
from shared.models.gguf_files import smollm2_tokenizer

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


def build_random_llama(c: dict, out: Path, quiet: bool, qk_norm: bool = False) -> None:
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
            progress("building random weights", i + 1, c["num_hidden_layers"], t0)
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2))
    smollm2_tokenizer(out)  # a real tokenizer, without converting the whole default model


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

    smollm2_tokenizer(out)
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


def build_random_vlm(name: str, out: Path, quiet: bool) -> None:
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
            progress(f"building {name}", i + 1, len(todo), t0)
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


def build_random_moondream(out: Path, version: int = 2) -> None:
    from shared.moondream_random import MD3_TINY_CONFIG, TINY_CONFIG, write_checkpoint
    if version == 3:
        write_checkpoint(out, MD3_TINY_CONFIG, variant="tiny3")
    else:
        write_checkpoint(out, TINY_CONFIG, variant="tiny")
