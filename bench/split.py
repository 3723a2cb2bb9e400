"""What the two-process split costs: in-process engine vs frontend + worker.

    python -m bench.split --model smollm2-135m --streams 32 --tokens 64 --repeats 3

Same prompts, same sampling (greedy, ignore_eos, fixed length), interleaved
repetitions; reports decode tokens/s of each and the ratio. The service
number includes everything a client would wait for: ring transport,
detokenization and the frontend commit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from frontend.server.service import Service, ServiceConfig
from gpu_worker.engine import Engine, EngineConfig
from shared.models.registry import DEFAULT_MODEL
from shared.sampling import SamplingParams


def run_engine(engine: Engine, prompts, params) -> float:
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - t0


def run_service(svc: Service, prompts, params) -> float:
    t0 = time.perf_counter()
    reqs = [svc.submit(p, params) for p in prompts]
    svc.run_until(lambda: all(r.ended for r in reqs), 600)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = dict(model=args.model, device=args.device, max_batch=max(args.streams, 1), max_model_len=1024)
    prompts = [[100 + (7 * i + j) % 1000 for j in range(args.prompt_len)] for i in range(args.streams)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    print(f"loading {args.model} in-process and as a two-process service ...", file=sys.stderr)
    engine = Engine(EngineConfig(**sizes))
    svc = Service(ServiceConfig(**sizes))
    times = {"in_process": [], "two_process": []}
    run_engine(engine, prompts, params)  # warm-up, excluded
    run_service(svc, prompts, params)
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}", file=sys.stderr)
        times["in_process"].append(run_engine(engine, prompts, params))
        times["two_process"].append(run_service(svc, prompts, params))
    engine.close()
    svc.close()
    tokens = args.streams * args.tokens
    result = {"model": args.model, "device": args.device, "streams": args.streams, "tokens": args.tokens,
              **{f"{k}_tokens_per_s": tokens / statistics.median(v) for k, v in times.items()},
              "times_s": times}
    result["two_process_over_in_process"] = result["two_process_tokens_per_s"] / result["in_process_tokens_per_s"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} {args.device} streams={args.streams} tokens={args.tokens}: "
              f"in-process {result['in_process_tokens_per_s']:.0f} tok/s, "
              f"two-process {result['two_process_tokens_per_s']:.0f} tok/s, "
              f"ratio {result['two_process_over_in_process']:.3f}")


if __name__ == "__main__":
    main()
