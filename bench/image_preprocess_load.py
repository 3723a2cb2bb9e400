"""What image preprocessing costs the other streams: inter-token latency of text
streams while large images arrive.

8 text streams decode (``ignore_eos``) on a ``Service`` (two processes); in one run
20 large images (2048 × 1536 PNG, each its own request) are submitted meanwhile, in
the other none. The text streams' inter-token gaps are measured on the frontend's
clock over the same window (from the first image's submit until every image
request has ended; the same length without images). A third run only decodes and
tiles the images in the frontend's image pool (no image request reaches the
worker): what preprocessing alone costs the service loop and the worker.

    python -m bench.image_preprocess_load --model tiny-random-vlm --device cpu [--image-workers N]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench.image_ttft import noise_png


def run(svc, images: list[bytes], streams: int, window_s: float | None, preprocess_only: bool = False) -> dict:
    from frontend.images.idefics3 import image_prompt_ids
    from shared.sampling import SamplingParams

    arrivals: dict[int, list[float]] = {}

    def on_text(req, kind, payload):
        if kind == "chunk":
            arrivals.setdefault(req.seq_id, []).append(time.perf_counter())

    long = SamplingParams(max_tokens=100_000 // 64, temperature=0.0, ignore_eos=True)
    text = [svc.submit(list(range(200, 232)), long, on_event=on_text) for _ in range(streams)]
    svc.run_until(lambda: all(len(arrivals.get(r.seq_id, ())) > 20 for r in text), 120)
    t0 = time.perf_counter()
    ended = []
    prompt = "<|im_start|>User:<image>Describe this image.<end_of_utterance>\nAssistant:"
    for data in images:
        if preprocess_only:  # the frontend's decode and tiling alone, on the same pool: no worker work
            svc.images.pool.submit([data], lambda result: ended.append("done" if isinstance(result, list) else
                                                                       "error"))
            continue
        svc.submit_images([data], lambda p: image_prompt_ids(svc.tokenizer, prompt, p, svc.image_params),
                          SamplingParams(max_tokens=4), on_event=lambda r, k, p: ended.append(k) if k != "chunk" else None)
    if images:
        svc.run_until(lambda: len(ended) == len(images), 600)
    else:
        svc.run_until(lambda: time.perf_counter() - t0 > window_s, window_s + 60)
    t1 = time.perf_counter()
    for r in text:
        svc.cancel(r)
    svc.run_until(svc.idle, 60)
    gaps = [b - a for r in text for a, b in zip(arrivals[r.seq_id], arrivals[r.seq_id][1:]) if t0 <= a and b <= t1]
    ms = np.asarray(gaps) * 1e3
    return {"window_s": round(t1 - t0, 2), "gaps": len(gaps), "itl_ms_p50": round(float(np.percentile(ms, 50)), 2),
            "itl_ms_p99": round(float(np.percentile(ms, 99)), 2), "itl_ms_max": round(float(ms.max()), 2),
            "image_requests_ok": ended.count("done")}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.image_preprocess_load", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random-smolvlm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--image-size", default="2048x1536")
    ap.add_argument("--image-workers", type=int, default=None, help="image pool processes (default: the server's)")
    args = ap.parse_args(argv)
    from frontend.server.service import Service, ServiceConfig

    width, height = (int(x) for x in args.image_size.split("x"))
    images = [noise_png(width, height, i) for i in range(args.images)]
    svc = Service(ServiceConfig(model=args.model, device=args.device, max_batch=args.streams + args.images,
                                tile_blocks=args.images * 17, image_workers=args.image_workers))
    try:
        with_images = run(svc, images, args.streams, None)
        preprocess_only = run(svc, images, args.streams, None, preprocess_only=True)
        without = run(svc, [], args.streams, with_images["window_s"])
    finally:
        svc.close()
    result = {"model": args.model, "device": args.device, "streams": args.streams, "images": args.images,
              "image_size": args.image_size, "image_workers": svc.images.pool.workers,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "load_average": [round(x, 2) for x in os.getloadavg()],
              "with_images": with_images, "preprocessing_only": preprocess_only, "without_images": without,
              "p99_ratio": round(with_images["itl_ms_p99"] / without["itl_ms_p99"], 2),
              "p99_ratio_preprocessing_only": round(preprocess_only["itl_ms_p99"] / without["itl_ms_p99"], 2)}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
