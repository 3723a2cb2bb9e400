"""TTFT of an image request: encoder-cache miss, encoder-cache hit, prefix-cache hit.

Through the two processes (a ``Service`` and its worker), one request at a time:

- miss: a new image (decode + tile in the frontend, vision encoder + prefill in the worker);
- encoder hit: an image seen before, with different text before it (so no
  prefix-cache page covers it): its features come from the encoder cache;
- prefix hit: the same request again: the prefix cache maps the KV pages of the
  whole prompt, image included (what a repeated question about a picture gets).

    python -m bench.image_ttft --model random-smolvlm-256m --device cpu --requests 3
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import time

import numpy as np
from PIL import Image


def noise_png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buf, format="PNG", compress_level=1)
    return buf.getvalue()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.image_ttft", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-smolvlm-256m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--image-size", default="512x384", help="WxH")
    ap.add_argument("--requests", type=int, default=3, help="timed requests per case")
    args = ap.parse_args(argv)

    from frontend.images.idefics3 import image_prompt_ids
    from frontend.server.service import Service, ServiceConfig
    from shared.sampling import SamplingParams

    width, height = (int(x) for x in args.image_size.split("x"))
    svc = Service(ServiceConfig(model=args.model, device=args.device, dtype=args.dtype, max_batch=8))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(image: bytes, before: str) -> tuple[float, dict]:
        text = f"<|im_start|>User:{before}<image>Describe this image.<end_of_utterance>\nAssistant:"
        done = {}
        svc.submit_images([image], lambda p: image_prompt_ids(svc.tokenizer, text, p, svc.image_params), params,
                          on_event=lambda r, kind, payload: done.update({kind: payload}) if kind != "chunk" else None)
        svc.run_until(lambda: done, 600)
        if "done" not in done:
            raise RuntimeError(done)
        return done["done"]["metrics"]["ttft_ms"], done["done"]["usage"]

    try:
        ttft(noise_png(width, height, 10_000), " warm-up")
        cases: dict[str, list[float]] = {"miss": [], "encoder hit": [], "prefix hit": []}
        usage = None
        for i in range(args.requests):
            image = noise_png(width, height, i)
            t, usage = ttft(image, f" {i}")
            cases["miss"].append(t)
            cases["encoder hit"].append(ttft(image, f" {i} again")[0])
            cases["prefix hit"].append(ttft(image, f" {i} again")[0])
        stats = svc.stats()
    finally:
        svc.close()
    result = {
        "model": args.model, "device": args.device, "image_size": args.image_size, "requests": args.requests,
        "usage": usage, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "ttft_ms_median": {k: round(statistics.median(v), 1) for k, v in cases.items()},
        "ttft_ms": {k: [round(x, 1) for x in v] for k, v in cases.items()},
        "encoder_launches": stats["encoder_launches"], "encoder_cache_hits": stats["encoder_cache_hits"],
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
