"""Does constrained decoding bring the bubble back? Device idle with every stream constrained.

    python -m bench.grammar_pipeline --device sim:2.6 --streams 32 --tokens 48
    python -m bench.grammar_pipeline --model smollm2-135m --device cpu --streams 32

Runs the two-process service (frontend builds each mask after committing the
previous token; the worker launches the next forward first and waits for the
stamped rows only before sampling) in pipelined and blocking mode, all streams
constrained to the ``point`` grammar, and reports the compute stream's idle
fraction during the timed phase (warm-up excluded), plus ms per step.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from frontend.grammars import GrammarCompiler
from frontend.server.service import Service, ServiceConfig
from shared.sampling import SamplingParams


def run(model: str, device: str, pipeline: bool, streams: int, tokens: int, repeats: int,
        dtype: str | None = None) -> dict:
    svc = Service(ServiceConfig(model=model, device=device, pipeline=pipeline, max_batch=streams,
                                max_model_len=512, prefill_budget=512, dtype=dtype))
    try:
        compiler = GrammarCompiler(svc.tokenizer, svc.vocab_size, svc.model.eos_token_ids)
        spec = {"kind": "point", "max_objects": max(1, tokens // 12)}

        def batch(seed: int) -> float:
            reqs = [svc.submit([100 + i, 200 + i, 300], SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                         seed=seed * 1000 + i),
                               constraint=compiler.compile(spec).matcher()) for i in range(streams)]
            t0 = time.perf_counter()
            svc.run_until(lambda: all(r.ended for r in reqs), 600)
            bad = [r for r in reqs if r.error]
            if bad:
                raise RuntimeError(f"{len(bad)} requests failed: {bad[0].error}")
            return time.perf_counter() - t0

        batch(0)  # warm-up
        before = svc.stats()
        wall = sum(batch(r + 1) for r in range(repeats))
        after = svc.stats()
    finally:
        svc.close()
    idle = after["bubble_idle_s"] - before["bubble_idle_s"]
    busy = after["bubble_busy_s"] - before["bubble_busy_s"]
    steps = after["steps"] - before["steps"]
    return {"model": model, "device": device, "mode": "pipelined" if pipeline else "blocking",
            "streams": streams, "steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1),
            "device_idle_fraction": idle / (idle + busy) if idle + busy else 0.0,
            "host_ms_per_step": 1e3 * (after["host_s"] - before["host_s"]) / max(steps, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--device", default="sim:2.6")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the engine's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for pipeline in (False, True):
        print(f"{args.model} {args.device} {'pipelined' if pipeline else 'blocking'} ...", file=sys.stderr)
        rows.append(run(args.model, args.device, pipeline, args.streams, args.tokens, args.repeats, args.dtype))
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'model':14s} {'device':9s} {'mode':10s} {'streams':>7s} {'ms/step':>8s} {'idle':>7s} {'host ms':>8s}")
    for r in rows:
        print(f"{r['model']:14s} {r['device']:9s} {r['mode']:10s} {r['streams']:7d} {r['ms_per_step']:8.2f} "
              f"{100 * r['device_idle_fraction']:6.2f}% {r['host_ms_per_step']:8.3f}")


if __name__ == "__main__":
    main()
