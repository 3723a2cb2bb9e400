"""Tandem's weight-only linears (``kernels/quant.c``) against PyTorch's own CPU kernels for the
same job, on SmolLM2-135M's shapes, alternated in one process (median of ``--repeats``).

    python -m bench.wlinear                 # every level's own choice, all cores
    python -m bench.wlinear --rows 1,32 --repeats 15

Per shape and row count (1: a decode step at one stream; 32: at 32 streams), microseconds per call:

- ``tandem q4/32``, ``tandem q8/32``: ``QuantLinear`` (int4 and int8 in groups of 32, as a Q4_1 /
  Q8_0 file's weights);
- ``torch int4/32``: ``aten._weight_int4pack_mm_for_cpu`` (int4 in groups of 32, its own packing);
- ``torch int8/ch``: ``aten._weight_int8pack_mm`` (int8, a scale per output channel);
- ``torch f32``, ``torch bf16``: ``F.linear`` on dense weights (bf16 activations for bf16).

Every weight is used from a set of copies larger than the last-level cache, as a model's
weights are (a decode step reads each once), unless ``--hot``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from gpu_worker import cpu_kernels, quant

# SmolLM2-135M's linears [N, K]: qkv, o, gate_up, down, the tied head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
LLC_BYTES = 64 << 20  # copies of each weight until they exceed this (a last-level cache's size, rounded up)


def candidates(w: torch.Tensor, kernels: quant.QuantKernels) -> dict:
    """name -> (prepared weight, fn(x, prepared) -> y) for one float32 weight [N, K]."""
    N, K = w.shape
    q4, q8 = quant.quantize(w, "int4", 32), quant.quantize(w, "int8", 32)
    ch_scale = w.abs().amax(dim=1) / 127
    int8 = (w / ch_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 1)
    scales_zeros = torch.rand(K // 32, N, 2)
    return {
        "tandem q4/32": (quant.QuantLinear([q4], None, kernels), lambda x, m: m(x)),
        "tandem q8/32": (quant.QuantLinear([q8], None, kernels), lambda x, m: m(x)),
        "torch int4/32": ((int4, scales_zeros), lambda x, p: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, p[0], 32, p[1])),
        "torch int8/ch": ((int8, ch_scale), lambda x, p: torch.ops.aten._weight_int8pack_mm(x, p[0], p[1])),
        "torch f32": (w, lambda x, p: F.linear(x, p)),
        "torch bf16": (w.bfloat16(), lambda x, p: F.linear(x.bfloat16(), p)),
    }


def weight_bytes(prepared) -> int:
    if isinstance(prepared, quant.QuantLinear):
        return prepared.nbytes
    parts = prepared if isinstance(prepared, tuple) else (prepared,)
    return sum(t.numel() * t.element_size() for t in parts)


def run(rows: list[int], repeats: int, hot: bool) -> list[dict]:
    kernels = quant.QuantKernels(cpu_kernels.load())
    out = []
    for N, K in SHAPES:
        copies = 1 if hot else max(1, LLC_BYTES // (N * K * 4) + 1)
        sets = [candidates(torch.randn(N, K, generator=torch.Generator().manual_seed(i)) * 0.05, kernels)
                for i in range(copies)]
        for M in rows:
            x = torch.randn(M, K)
            times: dict[str, list[float]] = {name: [] for name in sets[0]}
            for _ in range(repeats):
                for name in times:  # alternated: a drift in the machine's speed touches every candidate
                    fn = sets[0][name][1]
                    t0 = time.perf_counter()
                    for s in sets:
                        fn(x, s[name][0])
                    times[name].append((time.perf_counter() - t0) / copies)
            row = {"N": N, "K": K, "rows": M, "level": kernels.level, "threads": torch.get_num_threads()}
            for name, ts in times.items():
                us = statistics.median(ts) * 1e6
                row[name] = {"us": round(us, 1), "GB/s": round(weight_bytes(sets[0][name][0]) / us / 1e3, 1)}
            out.append(row)
            print(f"{N}x{K} rows {M}: " + " | ".join(f"{n} {v['us']} us ({v['GB/s']} GB/s)"
                                                      for n, v in row.items() if isinstance(v, dict)), flush=True)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,32", help="comma-separated row counts")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--hot", action="store_true", help="one copy of each weight (cache-resident)")
    ap.add_argument("--json", action="store_true", help="the rows as JSON on stdout at the end")
    args = ap.parse_args(argv)
    rows = run([int(r) for r in args.rows.split(",")], args.repeats, args.hot)
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
