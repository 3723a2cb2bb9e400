"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Mistral; Qwen3 with ``qk_norm``) over a paged KV cache.

Plain PyTorch in the spirit of gpt-fast. One ``forward`` serves prefill, chunked
prefill, decode and any mix of them: the caller packs the new tokens of all
sequences into one flat ``input_ids[T]`` and describes the layout with a
:class:`~gpu_worker.kv_cache.Batch`.

A vision-language checkpoint (Idefics3 / SmolVLM) loads as its text backbone;
the prefill of an image prompt passes the vision encoder's features for the
``<image>`` placeholder tokens (``gpu_worker/vision.py``).

Qwen3 (``LlamaConfig.qk_norm``) normalises each head of q and k (RMSNorm over ``head_dim``) before
the rotary embedding. The fused CPU kernels do not have that step: such a model never takes them
for its layers (``Llama.cpu_kernels`` stays None, logged), only for its matmuls.

The EOS ids are not the model's business: ``shared.models.info.ModelInfo`` reads them, for both processes.

The forward does no host syncs and allocates only shape-determined tensors, so a
decode step can be captured in a CUDA graph and replayed with new Batch contents.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.families import read_config

from gpu_worker.batch import Batch
from gpu_worker.cpu_backend import fused_layers
from gpu_worker.cpu_kernels import CpuKernels
from gpu_worker.flex_paged import InPlace, attend_pages_in_place, block_mask
from gpu_worker.kv_cache import PagedKVCache

# Default cap on the rope table length when the engine does not pass max_model_len.
MAX_ROPE_LEN = 32768

log = logging.getLogger(__name__)


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "default", ...}
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v (Qwen2); o_proj never has one here
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm per head on q and k before rope
    bos_token_id: int | None = None
    model_type: str = "llama"
    sliding_window: int | None = None  # Mistral/Qwen2: parsed but not applied (full attention)
    torch_dtype: str | None = None  # checkpoint dtype as written in config.json, informational

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def unfused_reason(self) -> str | None:
        """Why the fused CPU kernels cannot run these layers (they would compute them wrong); None: they can."""
        return "the kernels have no per-head q/k norm (Qwen3)" if self.qk_norm else None

    @classmethod
    def from_hf_config(cls, cfg: dict, **overrides) -> "LlamaConfig":
        """Parse a language model's Hugging Face config dict (transformers 4.x or 5.x layout, flat: a
        family's ``text_config``); ``overrides``: fields the family sets (Qwen3's ``qk_norm``)."""
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}")
        heads = cfg["num_attention_heads"]
        # transformers 5 moved rope_theta/rope_scaling into one rope_parameters dict.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise NotImplementedError(f"rope type {rope_type!r} is not supported")
        model_type = cfg.get("model_type", "llama")
        return cls(**(dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(theta),
            rope_scaling=dict(rope, rope_type=rope_type) if rope_type != "default" else None,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            model_type=model_type,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        ) | overrides))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "LlamaConfig":
        """The text model's config of a checkpoint directory, as its family parses it."""
        from .families import llama_config
        return llama_config(read_config(path))


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim // 2], float32, matching transformers."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: slow down low frequencies by `factor`, keep high ones, and
        # interpolate smoothly in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as transformers does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D/2] (the half-split "rotate_half" layout of HF checkpoints)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_mask(batch: Batch, kv: PagedKVCache, group: int, limit: torch.Tensor | None = None) -> torch.Tensor:
    """The [S, 1, group * Qmax, L] mask of :func:`paged_attention`, shared by all layers: query (s, q)
    sees key j iff j <= limit[s, q], by default its position (causal). Rows are tiled
    ``group`` times to match the GQA folding (row g * Qmax + q). Keys past the sequence's length
    are masked out by the same rule, so stale cache contents never leak in."""
    limit = batch.query_pos if limit is None else limit
    key_index = torch.arange(batch.block_tables.shape[1] * kv.page_size, device=limit.device)
    return (key_index <= limit.repeat(1, group)[:, :, None])[:, None]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, batch: Batch,
                    kv: PagedKVCache, mask: "torch.Tensor | InPlace") -> torch.Tensor:
    """Attention of the packed queries q [T, H, D] over their sequences' cached keys, after
    writing this forward's k, v [T, Hkv, D] into the cache -> [T, H * D]. ``mask``: see
    :func:`attention_mask`; or ``flex_paged.InPlace``: read the pages in place."""
    # Write the new K/V at their kv_index first, so the gather below sees
    # the whole sequence (cached prefix + this chunk) in one place.
    kv.write(layer_idx, batch.kv_index, k, v)
    if isinstance(mask, InPlace):
        return attend_pages_in_place(q, layer_idx, batch, kv, mask.mask, mask.attention)
    return attend_pages(q, layer_idx, batch, kv, mask)


def attend_pages(q: torch.Tensor, layer_idx: int, batch: Batch, kv: PagedKVCache, mask: torch.Tensor) -> torch.Tensor:
    """The attention half of :func:`paged_attention`: q [T, H, D] over the cached keys (this
    forward's already written) -> [T, H * D]."""
    H, D, Hkv = q.shape[1], q.shape[2], kv.num_kv_heads
    S = batch.block_tables.shape[0]
    keys, values = (t.to(q.dtype) for t in kv.gather(layer_idx, batch.block_tables))  # [S, Hkv, L, D]

    # Padded queries [S, Qmax, H, D]. For GQA, fold the G = H / Hkv query heads
    # sharing a kv head into the query-length axis: [S, Hkv, G * Qmax, D].
    # Keys are then read once per kv head and no repeat_kv copy is needed,
    # which works with every SDPA backend (enable_gqa does not).
    Qmax = batch.query_index.shape[1]
    G = H // Hkv
    qp = q[batch.query_index].view(S, Qmax, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(S, Hkv, G * Qmax, D)
    out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask)
    # Back to [S * Qmax, H * D] (head h = kv_head * G + g, as in HF), then unpad to [T, H * D].
    out = out.view(S, Hkv, G, Qmax, D).permute(0, 3, 1, 2, 4).reshape(S * Qmax, H * D)
    return out[batch.token_to_padded]


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # q, k and v fused into one matmul: one kernel launch instead of three.
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.attention_bias, dtype=dtype, device=device)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False, dtype=dtype,
                                device=device)
        # Qwen3: each head of q and k RMS-normalised (over head_dim) before rope.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, kv: PagedKVCache,
                mask: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], dim=1)
        # Rope on q and k in one go; they are adjacent in the fused output.
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split([H, Hkv], dim=1)
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)

        return self.o_proj(paged_attention(q, k, v, self.layer_idx, batch, kv, mask))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, dtype=None, device=None):
        super().__init__()
        # gate and up fused into one matmul.
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias,
                                      dtype=dtype, device=device)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias,
                                   dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(self, x, cos, sin, batch, kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_model_len: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_model_len = max_model_len or min(config.max_position_embeddings, MAX_ROPE_LEN)
        # The fused CPU kernels (cpu_kernels.py), attached by the runner for bf16 on a CPU; None: eager.
        self._cpu_kernels: CpuKernels | None = None
        self._layer_table: tuple | None = None  # cpu_backend.layer_table's (kernels, parts, table, registrations)
        # The attention that reads a heads_major cache in place (flex_paged.py; set by the runner for the
        # decode graphs it captures with it); None: the gather path.
        self.attention_in_place: Callable | None = None
        if torch.device(device).type != "meta":
            self._init_rope(device)

    @property
    def cpu_kernels(self) -> CpuKernels | None:
        return self._cpu_kernels

    @cpu_kernels.setter
    def cpu_kernels(self, kernels: CpuKernels | None) -> None:
        """Attach the fused CPU kernels for the layers; refused (logged, eager layers) where they would
        compute these layers wrong (``LlamaConfig.unfused_reason``)."""
        why = self.config.unfused_reason
        if kernels is not None and why is not None:
            log.info("CPU kernels: the decoder layers run eagerly: %s (linears still use the kernels' matmul)", why)
            kernels = None
        self._cpu_kernels = kernels

    def _init_rope(self, device) -> None:
        # cos/sin tables [max_model_len, head_dim / 2], kept in float32 and cast
        # to the activation dtype at use (as transformers does).
        inv_freq = rope_inv_freq(self.config)
        freqs = torch.outer(torch.arange(self.max_model_len, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("rope_sin", freqs.sin().to(device), persistent=False)

    def forward(self, input_ids: torch.Tensor, batch: Batch, kv: PagedKVCache,
                logits_indices: torch.Tensor,
                image_features: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T], logits_indices [R] (indices into T) -> float32 logits [R, vocab].

        image_features: optional (token_index [K] int64 into T, features [K, hidden]):
        the embeddings of those tokens (a prefill's <image> placeholders) are
        replaced by the image encoder's features.
        """
        x = self.embed_tokens(input_ids)
        if image_features is not None:
            index, features = image_features
            x = x.index_copy(0, index, features.to(x.dtype))
        kernels = self.cpu_kernels
        # the kernels run the layers over a cache of the activations' type, or bf16 under float32 ones
        if kernels is not None and kv.k.dtype in (x.dtype, torch.bfloat16):
            return self.lm_head(fused_layers(self, x, batch, kv, kernels)[logits_indices]).float()
        cos = self.rope_cos[batch.positions].to(x.dtype)
        sin = self.rope_sin[batch.positions].to(x.dtype)
        if self.attention_in_place is not None:
            mask = InPlace(block_mask(batch, kv.num_pages, kv.page_size), self.attention_in_place)
        else:
            mask = attention_mask(batch, kv, self.config.num_attention_heads // self.config.num_key_value_heads)

        for layer in self.layers:
            x = layer(x, cos, sin, batch, kv, mask)
        # The final norm and lm_head only for the rows whose logits are wanted:
        # during prefill that is one row per sequence, not every prompt token.
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()

    def num_params(self) -> int:
        """Parameter count, tied embeddings counted once."""
        return sum(p.numel() for p in self.parameters())

    # ---- construction ------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        max_model_len: int | None = None) -> "Llama":
        """Load a Hugging Face checkpoint directory (config.json + *.safetensors)."""
        path = Path(path)
        config = LlamaConfig.from_pretrained(path)
        where = checkpoint_index(path)
        # A vision-language checkpoint (Idefics3) keeps its text backbone under model.text_model.
        prefix = "model.text_model." if "model.text_model.embed_tokens.weight" in where else "model."

        def get(name: str) -> torch.Tensor | None:
            if name.startswith("model."):
                name = prefix + name[len("model."):]
            h = where.get(name)
            return None if h is None else h.get_tensor(name)

        return cls._from_tensors(config, get, dtype, device, max_model_len)

    @classmethod
    def random(cls, config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", max_model_len: int | None = None) -> "Llama":
        """Random weights ~ N(0, 0.02) (norm weights 1), deterministic for a seed.

        Drawn on the CPU, tensor by tensor in checkpoint order, so the same seed
        gives the same weights on every device (and needs no checkpoint file).
        """
        gen = torch.Generator().manual_seed(seed)

        def get(name: str) -> torch.Tensor | None:
            shape = _hf_shape(config, name)
            if shape is None:
                return None
            if name.endswith("norm.weight"):
                return torch.ones(shape)
            return torch.randn(shape, generator=gen) * 0.02

        return cls._from_tensors(config, get, dtype, device, max_model_len)

    @classmethod
    def _from_tensors(cls, config: LlamaConfig, get: Callable[[str], torch.Tensor | None], dtype, device,
                      max_model_len) -> "Llama":
        # Build on the meta device (no memory, no init cost), then assign the
        # real tensors one by one so the peak host memory is a single layer.
        model = cls(config, dtype=dtype, device="meta", max_model_len=max_model_len)

        def need(name: str) -> torch.Tensor:
            t = get(name)
            if t is None:
                raise KeyError(f"checkpoint is missing {name}")
            return t

        def put(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
            setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))

        put(model.embed_tokens, "weight", need("model.embed_tokens.weight"))
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            put(layer.input_layernorm, "weight", need(p + "input_layernorm.weight"))
            put(layer.post_attention_layernorm, "weight", need(p + "post_attention_layernorm.weight"))
            qkv = [p + f"self_attn.{n}_proj." for n in "qkv"]
            put(attn.qkv_proj, "weight", torch.cat([need(n + "weight") for n in qkv]))
            if config.attention_bias:
                put(attn.qkv_proj, "bias", torch.cat([need(n + "bias") for n in qkv]))
            put(attn.o_proj, "weight", need(p + "self_attn.o_proj.weight"))
            if config.qk_norm:
                put(attn.q_norm, "weight", need(p + "self_attn.q_norm.weight"))
                put(attn.k_norm, "weight", need(p + "self_attn.k_norm.weight"))
            put(mlp.gate_up_proj, "weight", torch.cat([need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")]))
            put(mlp.down_proj, "weight", need(p + "mlp.down_proj.weight"))
            if config.mlp_bias:
                put(mlp.gate_up_proj, "bias", torch.cat([need(p + "mlp.gate_proj.bias"), need(p + "mlp.up_proj.bias")]))
                put(mlp.down_proj, "bias", need(p + "mlp.down_proj.bias"))
        put(model.norm, "weight", need("model.norm.weight"))
        lm_head = None if config.tie_word_embeddings else get("lm_head.weight")
        if lm_head is None:
            # Tied (or a checkpoint that stores no separate head): share the embedding.
            model.lm_head.weight = model.embed_tokens.weight
        else:
            put(model.lm_head, "weight", lm_head)
        model._init_rope(device)
        return model.eval()


def checkpoint_index(path: Path) -> dict:
    """Tensor name -> the open safetensors file holding it, over all shards of a checkpoint directory."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    return {name: h for h in handles for name in h.keys()}


def _hf_shape(config: LlamaConfig, name: str) -> tuple[int, ...] | None:
    """Shape of an HF checkpoint tensor for ``config``; None if it does not exist."""
    hid, inter, D = config.hidden_size, config.intermediate_size, config.head_dim
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (config.vocab_size, hid)
    leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    shapes = {
        "model.norm.weight": (hid,),
        "input_layernorm.weight": (hid,),
        "post_attention_layernorm.weight": (hid,),
        "self_attn.q_proj.weight": (H * D, hid),
        "self_attn.k_proj.weight": (Hkv * D, hid),
        "self_attn.v_proj.weight": (Hkv * D, hid),
        "self_attn.o_proj.weight": (hid, H * D),
        "mlp.gate_proj.weight": (inter, hid),
        "mlp.up_proj.weight": (inter, hid),
        "mlp.down_proj.weight": (hid, inter),
    }
    if config.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (H * D,), "self_attn.k_proj.bias": (Hkv * D,),
                       "self_attn.v_proj.bias": (Hkv * D,)})
    if config.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)})
    if config.mlp_bias:
        shapes.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (hid,)})
    return shapes.get(leaf)
