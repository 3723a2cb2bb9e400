"""Qwen3 (dense): Llama's layer plus a per-head RMSNorm on q and k before the rotary embedding, no
attention bias, ``head_dim`` from the config (not hidden / heads), as transformers' ``Qwen3Attention``.

Served by ``gpu_worker.model.Llama`` with ``LlamaConfig.qk_norm``; the fused CPU kernels do not
cover the q/k norm, so its decoder layers run eagerly (the matmuls still use the kernels).
"""
from .family import Family

QWEN3 = Family(name="qwen3", architectures=("Qwen3ForCausalLM",), model_types=("qwen3",))
