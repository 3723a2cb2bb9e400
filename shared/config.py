"""Engine configuration: one definition for the worker, the frontend that spawns it, and the CLI.

Pure Python, so the frontend can carry it to the worker (as JSON on the
command line) without importing torch. Each field's default is *the* default:
the command line's options take theirs, and their help, from here
(``frontend.cli.options.engine_option``).
"""
from __future__ import annotations

from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any

from shared.models.registry import DEFAULT_MODEL


def _about(default: Any, help: str) -> Any:
    """A field with its default and one line of help (the command line's)."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"help": help})
    return field(default=default, metadata={"help": help})


QUANTIZATIONS = ("auto", "none", "int8", "int4")  # --quantization (gpu_worker/quant.py)
ATTENTIONS = ("auto", "gather")  # --attention (gpu_worker/flex_paged.py)
INT4_GROUPS = (32, 64, 128)


@dataclass
class EngineConfig:
    model: str = _about(DEFAULT_MODEL, "A built-in model or a path to a Hugging Face directory.")
    device: str = _about("auto", "auto | cpu | cuda | sim:MS (a simulated device, MS per decode step).")
    pipeline: bool = _about(True, "Blocking decode (the baseline) instead of pipelined.")  # the flag says off
    max_batch: int = _about(64, "Batch rows (concurrent sequences).")
    max_model_len: int | None = _about(None, "Context length (prompt + generated tokens); default: the model's own "
                                              "limit (max_position_embeddings), bounded by what the KV cache holds.")
    page_size: int = 16
    kv_pages: int | None = _about(None, "KV cache pages (default: sized to memory).")
    kv_memory_fraction: float = _about(0.5, "Fraction of free GPU memory for the KV cache (CUDA, without "
                                            "--kv-pages).")
    prefill_budget: int = _about(512, "Prompt tokens per launch (chunked prefill; vLLM's --max-num-batched-tokens). "
                                      "Lower bounds a launch's time, also one that encodes images, at the price of "
                                      "more launches.")
    prefix_cache: bool = _about(True, "Compute every prompt in full (no KV pages shared between requests; for "
                                      "A/B runs).")  # the flag says off
    dtype: str | None = _about(None, "Weights and KV cache (auto: bfloat16 on CUDA, and on a CPU where Tandem's "
                                     "CPU kernels build or the CPU has native bf16; else float32).")
    quantization: str = _about("auto", "Weights on a CPU: auto serves a checkpoint in its own format (a GGUF file "
                                       "as its Q4/Q8 blocks, bf16/fp32 as they are); int8 (per channel) or int4 "
                                       "(groups of --quantization-group) quantize a float checkpoint at load; none "
                                       "dequantizes a GGUF file.")
    quantization_group: int = _about(32, "int4's group along K (32, 64 or 128).")
    generation_config: str = _about("auto", "Where the model's generation_config.json is read from: auto (the model's "
                                             "directory; its temperature, top_p, top_k, min_p, repetition_penalty and "
                                             "max_new_tokens are the "
                                             "defaults of requests that leave them out), vllm (Tandem's defaults; its "
                                             "EOS ids still apply) or a folder holding one.")
    cuda_graphs: bool = True
    attention: str = _about("auto", "How a CUDA decode graph reads the KV pages: auto (in place, FlexAttention over "
                                    "the cache, where it matches the gather path when the graph is captured) or "
                                    "gather (each sequence's pages copied out, then SDPA). Elsewhere: gather.")
    prepack: bool = True  # bf16 on a CPU: matmul weights packed once (gpu_worker.cpu_backend.PackedLinear)
    cpu_kernels: bool = True  # bf16 on a CPU: norms, rope, attention, silu fused, AMX matmul (gpu_worker/kernels/)
    encoder_cache_mb: float = _about(256.0, "Vision models: device memory for image features kept for reuse "
                                            "(unreferenced ones, LRU).")
    debug: bool = False
    loras: dict[str, str] = _about({}, "Serve a LoRA adapter (PEFT directory) under NAME (repeatable).")
    max_loras: int = _about(4, "Device slots for adapters; more adapters are loaded on demand (LRU).")
    lora_kernel: str = _about("gather", "How each row applies its adapter: gather its own A and B, or multiply "
                                        "by every slot's and mask the others (see BENCHMARKS.md).")

    def engine_fields(self) -> dict:
        """Just the EngineConfig fields (also of a subclass such as the frontend's ServiceConfig)."""
        names = {f.name for f in fields(EngineConfig)}
        return {k: v for k, v in asdict(self).items() if k in names}


def config_field(name: str, config: type = EngineConfig) -> Field:
    """The dataclass field ``name`` of ``config``: its default and ``metadata["help"]``."""
    return {f.name: f for f in fields(config)}[name]
