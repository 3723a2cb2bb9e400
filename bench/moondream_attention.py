"""Moondream's attention on a CPU: the AMX kernels (``CpuKernels.full_attention`` in the vision
encoder, ``CpuKernels.paged_attention`` in the text model) against torch's SDPA (after the pages'
gather, under a mask), alternated in one process (this VM's speed drifts; only side-by-side
ratios mean anything). Medians of:

- one vision block's attention: ``--crops`` crops x moondream2's 16 heads x 729 tokens x 72;
- the whole image encode (``Moondream.image_prefix``) of moondream2's vision model (random
  weights), on a ``--crops`` crop image;
- the text model's prefill of an image prompt (the 730-position block and 5 tokens) and one
  decode row after it, through ``--text-layers`` of moondream2's text layers (random weights).

    python -m bench.moondream_attention --repeats 7 --json
    python -m bench.moondream_attention --model tiny --repeats 1     (the tiny model's shapes: a smoke run)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.nn.functional as F

from frontend.moondream.images import overlap_crops
from gpu_worker import cpu_kernels, moondream
from gpu_worker.batch import Batch
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.cpu_backend import pack_linears
from gpu_worker.moondream import Moondream
from shared.moondream_config import MoondreamConfig
from shared.moondream_random import TINY_CONFIG, make_image

IMAGES = {2: (378, 378), 10: (644, 644), 13: (910, 1176)}  # crops -> an image size that tiles to them


def sdpa(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """What ``VisionBlock`` computes without the kernel, in ``full_attention``'s signature."""
    B, T, width = qkv.shape
    q, k, v = (t.view(B, T, heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, width // 3)


def alternated(variants: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each variant, run in alternating order after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats + 1):
        for name in (list(variants) if r % 2 else list(variants)[::-1]):
            t0 = time.perf_counter()
            variants[name]()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def text_steps(model: Moondream, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of the text model's image-prompt prefill and of one decode row after it, with the
    kernels (``partial_rope_kv``, ``paged_attention``) and with the eager rotary, the gather and
    SDPA (``TextAttention`` given no kernels)."""
    t = model.spec.text
    prompt = model.prefix_len + 5
    pages = -(-(prompt + 1) // 16)
    kv = PagedKVCache(t.n_layers, pages + 1, 16, t.n_kv_heads, t.dim // t.n_heads, torch.bfloat16)
    table = list(range(1, pages + 1))
    prefill_batch, decode_batch = Batch.build([(0, prompt, table)], 16), Batch.build([(prompt, 1, table)], 16)
    x = torch.randn(prompt + 1, t.dim, dtype=torch.bfloat16)
    block = torch.arange(model.prefix_len)
    with_kernels = moondream.TextAttention.__init__

    def without_kernels(self, model, batch, kv, last, kernels):
        with_kernels(self, model, batch, kv, last, None)

    def step(init, batch, rows, prefix):
        moondream.TextAttention.__init__ = init
        try:
            return model.hidden_states(rows, batch, kv, prefix)
        finally:
            moondream.TextAttention.__init__ = with_kernels

    prefill = alternated({"kernel": lambda: step(with_kernels, prefill_batch, x[:prompt], block),
                          "sdpa": lambda: step(without_kernels, prefill_batch, x[:prompt], block)}, repeats)
    decode = alternated({"kernel": lambda: step(with_kernels, decode_batch, x[prompt:], None),
                         "sdpa": lambda: step(without_kernels, decode_batch, x[prompt:], None)}, 4 * repeats)
    return prefill, decode


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crops", type=int, choices=sorted(IMAGES), default=2)
    ap.add_argument("--model", choices=("moondream2", "tiny"), default="moondream2")
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.has_matmul:
        raise SystemExit("the attention kernel needs the fused CPU kernels on a CPU with AMX")
    config = MoondreamConfig() if a.model == "moondream2" else MoondreamConfig.from_dict(TINY_CONFIG)
    config = dataclasses.replace(config, text=dataclasses.replace(config.text, n_layers=a.text_layers))
    v = config.vision
    qkv = torch.randn(a.crops, config.patches_per_crop, 3 * v.enc_dim, dtype=torch.bfloat16)
    heads = v.enc_n_heads
    block = alternated({"kernel": lambda: kernels.full_attention(qkv, heads),
                        "sdpa": lambda: sdpa(None, qkv, heads)}, 4 * a.repeats)

    model = Moondream.random(config, dtype=torch.bfloat16)
    pack_linears(model, kernels)
    crops, tiling = overlap_crops(make_image(*IMAGES[a.crops], 1))
    pixels = torch.from_numpy(crops)
    kernel = cpu_kernels.CpuKernels.full_attention

    def encode(attention):
        cpu_kernels.CpuKernels.full_attention = attention
        try:
            return model.image_prefix(pixels, tiling)
        finally:
            cpu_kernels.CpuKernels.full_attention = kernel

    encodes = alternated({"kernel": lambda: encode(kernel), "sdpa": lambda: encode(sdpa)}, a.repeats)
    prefill, decode = text_steps(model, a.repeats)
    figures = {"block_attention_ms": {n: 1e3 * t for n, t in block.items()}, "encode_s": encodes,
               "text_prefill_s": prefill, "text_decode_ms": {n: 1e3 * t for n, t in decode.items()}}
    out = {"model": a.model, "crops": a.crops, "text_layers": a.text_layers, "threads": torch.get_num_threads(),
           **figures, "speedup": {name: f["sdpa"] / f["kernel"] for name, f in figures.items()}}
    print(json.dumps(out, indent=None if a.json else 1))
    return out


if __name__ == "__main__":
    main()
