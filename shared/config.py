"""Engine configuration: one definition for the worker, the frontend that spawns it, and the CLI.

Pure Python, so the frontend can carry it to the worker (as JSON on the
command line) without importing torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class EngineConfig:
    model: str = "tiny-random"
    device: str = "cpu"  # auto | cpu | cuda | sim:MS
    pipeline: bool = True
    max_batch: int = 64
    max_model_len: int = 2048
    page_size: int = 16
    kv_pages: int | None = None
    kv_memory_fraction: float = 0.5
    prefill_budget: int = 512
    prefix_cache: bool = True  # map the cached KV pages of a prompt's shared beginning
    dtype: str | None = None  # float32 | bfloat16 | float16; default bf16 on CUDA, fp32 on CPU
    cuda_graphs: bool = True
    prepack: bool = True  # bf16 on a CPU: matmul weights prepacked for oneDNN (gpu_worker.model.PackedLinear)
    encoder_cache_mb: float = 256.0  # image features kept on the device for reuse (unreferenced ones, LRU)
    debug: bool = False
    loras: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> PEFT directory
    max_loras: int = 4  # device slots for adapters (more adapters are loaded on demand, LRU)
    lora_kernel: str = "gather"  # how each row meets its slot: gather | masked (gpu_worker.lora.KERNELS)

    def engine_fields(self) -> dict:
        """Just the EngineConfig fields (also of a subclass such as the frontend's ServiceConfig)."""
        names = {f.name for f in fields(EngineConfig)}
        return {k: v for k, v in asdict(self).items() if k in names}
