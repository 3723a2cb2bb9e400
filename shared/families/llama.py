"""Llama and the decoders that share its layer: SmolLM2, Mistral, Qwen2 (q/k/v bias).

Served by ``gpu_worker.model.Llama``; ``LlamaConfig.from_hf_config`` parses the rest of the config
(rope scaling, biases, head_dim) and refuses what it cannot run (an activation, a rope type).
"""
from .family import Family

LLAMA = Family(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    model_types=("llama", "mistral", "qwen2"),
)
