"""Random Moondream 2 and 3 checkpoints in the real layout, built deterministically (torch-free).

Used by the built-ins ``tiny-random-moondream`` and ``tiny-random-moondream3`` (``shared/models/registry.py``)
and by the tests, whose "dev" and "md3dev" variants must match the reference's fixtures bit for bit.

The recipe (one for both versions): every tensor of the layout is drawn from its own numpy
PCG64 generator seeded with the first 8 bytes (little-endian) of sha256(b"<variant>:" + key), key
without the ``model.`` prefix, then scaled by its kind. The weights therefore depend on nothing but
the key, the shape and the variant; ``tests/data/moondream_dev_expected.json`` and
``moondream3_dev_expected.json`` hold the sha256 of the resulting files and what the reference
implementations answered for them. A config whose text has a ``moe`` section gets Moondream 3's
layout (MOONDREAM3.md §5): tau attention on every layer, MoE layers from ``start_layer`` (3-D expert
stacks without biases, a router with one), single-Linear region decoders and ``region.ln``.

Also the deterministic test images (integer hashing, no RNG).
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

# The "dev" variant's config, in the reference's override format (the tests' fixture model).
DEV_CONFIG = {
    "text": {"dim": 128, "ff_dim": 256, "n_layers": 2, "vocab_size": 51200, "max_context": 2048,
             "n_heads": 2, "n_kv_heads": 2, "prefix_attn": 730},
    "vision": {"enc_dim": 64, "enc_patch_size": 14, "enc_n_layers": 27, "enc_ff_dim": 128, "enc_n_heads": 4,
               "proj_out_dim": 128, "crop_size": 378, "in_channels": 3, "max_crops": 12, "overlap_margin": 4,
               "proj_inner_dim": 256},
    "region": {"dim": 128, "coord_feat_dim": 32, "coord_out_dim": 1024, "size_feat_dim": 64,
               "size_out_dim": 2048, "inner_dim": 256},
}

# tiny-random-moondream: smaller still (4 vision layers would break the reference, whose pooling
# size is enc_n_layers; this engine pools to the patch grid, so the shape stays servable).
TINY_CONFIG = {
    "text": dict(DEV_CONFIG["text"], dim=64, ff_dim=128),
    "vision": dict(DEV_CONFIG["vision"], enc_dim=32, enc_n_layers=2, enc_ff_dim=64, enc_n_heads=2,
                   proj_out_dim=64, proj_inner_dim=128),
    "region": dict(DEV_CONFIG["region"], dim=64, coord_feat_dim=16, size_feat_dim=32, inner_dim=128),
}

# Moondream 3's "md3dev" variant (its reference fixture's model): 4 text layers, the last 2 MoE.
MD3_DEV_CONFIG = {
    "text": dict(DEV_CONFIG["text"], n_layers=4, max_context=4096,
                 moe={"num_experts": 8, "start_layer": 2, "experts_per_token": 4, "expert_inner_dim": 64}),
    "vision": DEV_CONFIG["vision"],
    "region": {k: v for k, v in DEV_CONFIG["region"].items() if k != "inner_dim"},
}

# tiny-random-moondream3: TINY_CONFIG's shapes with MD3's text and region.
MD3_TINY_CONFIG = {
    "text": dict(TINY_CONFIG["text"], n_layers=3, max_context=4096,
                 moe={"num_experts": 8, "start_layer": 1, "experts_per_token": 2, "expert_inner_dim": 32}),
    "vision": TINY_CONFIG["vision"],
    "region": {k: v for k, v in TINY_CONFIG["region"].items() if k != "inner_dim"},
}

NORMS = ("ln", "ln1", "ln2", "post_ln")


def tensor_shapes(config: dict, region_ln: bool = True) -> dict[str, tuple[int, ...]]:
    """Key (without ``model.``) -> shape, for every tensor of the moondream2 layout, or of moondream3's
    (``text.moe`` set; ``region_ln``: with ``region.ln``, as the "modelv2" weights)."""
    t, v, r = config["text"], config["vision"], config["region"]
    moe = t.get("moe")
    dim, enc = t["dim"], v["enc_dim"]
    qkv = dim + 2 * t["n_kv_heads"] * (dim // t["n_heads"])
    patches = (v["crop_size"] // v["enc_patch_size"]) ** 2
    out: dict[str, tuple[int, ...]] = {}

    def linear(name: str, fan_in: int, fan_out: int) -> None:
        out[name + ".weight"], out[name + ".bias"] = (fan_out, fan_in), (fan_out,)

    def norm(name: str, width: int) -> None:
        out[name + ".weight"], out[name + ".bias"] = (width,), (width,)

    out["vision.pos_emb"] = (1, patches, enc)
    linear("vision.patch_emb", v["enc_patch_size"] ** 2 * v["in_channels"], enc)
    for i in range(v["enc_n_layers"]):
        b = f"vision.blocks.{i}."
        norm(b + "ln1", enc)
        linear(b + "attn.qkv", enc, 3 * enc)
        linear(b + "attn.proj", enc, enc)
        norm(b + "ln2", enc)
        linear(b + "mlp.fc1", enc, v["enc_ff_dim"])
        linear(b + "mlp.fc2", v["enc_ff_dim"], enc)
    norm("vision.post_ln", enc)
    linear("vision.proj_mlp.fc1", 2 * enc, v["proj_inner_dim"])
    linear("vision.proj_mlp.fc2", v["proj_inner_dim"], v["proj_out_dim"])
    out["text.wte"] = (t["vocab_size"], dim)
    for i in range(t["n_layers"]):
        b = f"text.blocks.{i}."
        norm(b + "ln", dim)
        linear(b + "attn.qkv", dim, qkv)
        linear(b + "attn.proj", dim, dim)
        if moe is not None:
            out[b + "attn.tau.wq"] = out[b + "attn.tau.wv"] = (t["n_heads"], qkv)
            out[b + "attn.tau.alpha"] = (t["n_heads"],)
        if moe is not None and i >= moe["start_layer"]:
            n, inner = moe["num_experts"], moe["expert_inner_dim"]
            linear(b + "mlp.router", dim, n)
            out[b + "mlp.fc1.weight"], out[b + "mlp.fc2.weight"] = (n, 2 * inner, dim), (n, dim, inner)
        else:
            linear(b + "mlp.fc1", dim, t["ff_dim"])
            linear(b + "mlp.fc2", t["ff_dim"], dim)
    norm("text.post_ln", dim)
    linear("text.lm_head", dim, t["vocab_size"])
    out["region.coord_features"] = (1, r["coord_feat_dim"] // 2)
    out["region.size_features"] = (2, r["size_feat_dim"] // 2)
    linear("region.coord_encoder", r["coord_feat_dim"], r["dim"])
    linear("region.size_encoder", r["size_feat_dim"], r["dim"])
    if moe is None:
        linear("region.coord_decoder.fc1", r["dim"], r["inner_dim"])
        linear("region.coord_decoder.fc2", r["inner_dim"], r["coord_out_dim"])
        linear("region.size_decoder.fc1", r["dim"], r["inner_dim"])
        linear("region.size_decoder.fc2", r["inner_dim"], r["size_out_dim"])
        return out
    linear("region.coord_decoder", r["dim"], r["coord_out_dim"])
    linear("region.size_decoder", r["dim"], r["size_out_dim"])
    if region_ln:
        norm("region.ln", r["dim"])
    return out


def draw(variant: str, key: str, shape: tuple[int, ...]) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{variant}:{key}".encode()).digest()[:8], "little")
    return scaled(key, shape, np.random.Generator(np.random.PCG64(seed)).standard_normal(shape, dtype=np.float32))


def scaled(key: str, shape: tuple[int, ...], n):
    """The recipe's scale for this tensor's kind, applied to a standard normal draw ``n`` (a float32
    numpy array, or a torch tensor: ``Moondream.random`` draws moondream2's shapes on the device)."""
    parts = key.split(".")
    if parts[-1] == "weight" and parts[-2] in NORMS:
        return 1.0 + 0.1 * n
    if key in ("region.coord_features", "region.size_features"):
        return 2.0 * n
    if key == "text.wte" or parts[-1] == "alpha":  # alpha: moondream3's tau attention
        return n
    if parts[-1] == "bias":
        return 0.02 * n
    scale = 2.0 if key.endswith("attn.qkv.weight") else 1.0
    return scale * n / math.sqrt(shape[-1])  # a weak Python float: float32 division, as np.float32 was


def byte_tokenizer():
    """A byte-level stand-in for starmie-v1: 16 specials at ids 0-15, then the 256 byte symbols."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<|endoftext|>"] + [f"<|md_reserved_{i}|>" for i in range(15)]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({ch: 16 + j for j, ch in enumerate(sorted(ByteLevel.alphabet()))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def write_checkpoint(out: str | Path, config: dict = DEV_CONFIG, variant: str = "dev", eos_bias: float = 0.0,
                     dtype=np.float32, region_ln: bool = True) -> Path:
    """model.safetensors + config.json (override format) + tokenizer.json in ``out``."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, shape in tensor_shapes(config, region_ln).items():
        t = draw(variant, key, shape)
        if key == "text.lm_head.bias":
            t[0] += np.float32(eos_bias)
        tensors["model." + key] = np.ascontiguousarray(t, dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    byte_tokenizer().save(str(out / "tokenizer.json"))
    return out


def make_image(h: int, w: int, salt: int) -> np.ndarray:
    """A deterministic RGB uint8 image [h, w, 3]: smooth bands plus texture, so crops differ."""
    y, x = np.mgrid[0:h, 0:w].astype(np.uint64)
    out = np.empty((h, w, 3), np.uint8)
    u = np.uint64
    for c in range(3):
        v = (x * u(2654435761) + y * u(40503) + u(c * 97 + salt * 7919)) % u(4294967291)
        band = ((x * u(c + 1) + y * u(3 - c)) // u(17)) % u(256)
        out[..., c] = ((v >> u(7)) % u(96) + band // u(2)).astype(np.uint8)
    return out


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
