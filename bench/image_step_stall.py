"""How long the decode rows wait while image requests arrive: ``Engine.tick`` timed in one process.

``--streams`` text requests decode; then ``--images`` image requests (new images,
``--tiles`` random tiles each: encoder-cache misses) arrive together, and every
``Engine.tick()`` is timed until each of them has its first token. Reported:
the decode-only steps before (median, longest), the steps while the images are
prefilled (median, longest: what every decode row waits for at worst), the
image requests' time to first token, and the encoder's launches.

    python -m bench.image_step_stall --model tiny-random-vlm --images 1 --tiles 13 --prefill-budget 512

Needs only torch, numpy and the model directory (the prompts are built from
token ids directly: text ids around ``tiles * tokens_per_tile`` image tokens).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.image_step_stall", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random-smolvlm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--streams", type=int, default=8, help="text requests decoding throughout")
    ap.add_argument("--images", type=int, default=1, help="image requests arriving together")
    ap.add_argument("--tiles", type=int, default=13, help="tiles per image (SmolVLM: 4 x 3 + the global view)")
    ap.add_argument("--prefill-budget", type=int, default=512)
    ap.add_argument("--blocking", action="store_true", help="the blocking loop instead of the pipelined one")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from gpu_worker.engine import Engine, EngineConfig
    from gpu_worker.image_prefill import ImageInput
    from shared.models.registry import resolve_model
    from shared.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(resolve_model(args.model, quiet=True)), device=args.device,
                                 dtype=args.dtype, pipeline=not args.blocking, prefill_budget=args.prefill_budget,
                                 max_batch=args.streams + args.images))
    rng = np.random.default_rng(args.seed)
    ip, per_tile = engine.runner.image_params, engine.runner.vision.tokens_per_tile
    endless = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)

    def timed_step() -> float:
        t = time.perf_counter()
        engine.tick()
        return (time.perf_counter() - t) * 1e3

    prompt = [1, 2, 3] + [ip.image_token_id] * (args.tiles * per_tile) + list(rng.integers(100, 1000, 20))

    def image_requests(name: str, n: int) -> dict:
        out = {}
        for i in range(n):
            tiles = rng.integers(0, 256, (args.tiles, 3, ip.tile_size, ip.tile_size), dtype=np.uint8)
            seq = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                images=[ImageInput(f"{name}-{args.seed}-{i}", tiles)])
            out[seq.seq_id] = seq
        return out

    try:
        image_requests("warm-up", args.images)  # the same shapes once first (lazy kernel set-up)
        engine.run_until_idle()
        streams = [engine.submit(list(rng.integers(100, 1000, 16)), endless) for _ in range(args.streams)]
        while any(not s.output_ids for s in streams):
            engine.tick()
        decode_ms = [timed_step() for _ in range(40)]
        before = engine.stats()
        t0 = time.perf_counter()
        waiting = image_requests("timed", args.images)
        image_ms, ttft_ms = [], []
        while waiting:
            image_ms.append(timed_step())
            for seq in [s for s in waiting.values() if s.output_ids]:
                ttft_ms.append((time.perf_counter() - t0) * 1e3)
                del waiting[seq.seq_id]
        after = engine.stats()
        for s in streams:
            engine.cancel(s)
        engine.run_until_idle()
    finally:
        engine.close()
    result = {
        "model": args.model, "device": args.device, "pipeline": not args.blocking, "streams": args.streams,
        "images": args.images, "tiles": args.tiles, "prefill_budget": args.prefill_budget,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.gmtime()),
        "decode_step_ms": {"p50": round(statistics.median(decode_ms), 1), "max": round(max(decode_ms), 1)},
        "image_steps": len(image_ms),
        "step_ms_with_images": {"p50": round(statistics.median(image_ms), 1), "max": round(max(image_ms), 1)},
        "image_ttft_ms": [round(t, 1) for t in ttft_ms],
        "encoder_launches": after["encoder_launches"] - before["encoder_launches"],
        "encoded_tiles": after["encoded_tiles"] - before["encoded_tiles"],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
