"""Moondream benchmark: image encode per crop count, caption TTFT, ms per detected object,
tokens/s at 1 and N streams, and N detect streams pipelined vs blocking (device idle).

    python -m bench.moondream --model tiny-random-moondream --device cpu
    python -m bench.moondream --model ./moondream2 --device cuda --dtype bfloat16 --json
    python -m bench.moondream --device sim:20 --detect-streams 32     (the host falling behind)

What is timed (medians of ``--repeats``; engines are built once per mode):
- encode: ``Moondream.image_prefix`` (normalise, vision encoder, stitch, pool, project) on crops
  of a tiling of 1×1, 3×3 and 3×4 (2, 10 and 13 crops), after one warm-up.
- caption TTFT: submit to the first token of a short caption of a fresh image (encode + 730+5
  prefill + the first sample), one stream, encoder and prefix caches cold (a new image each time).
- ms per object: a detect stream forced to ``--objects`` objects (eos suppressed by greedy on
  a random model is not guaranteed, so the count is what the model returned), decode wall time
  divided by the objects found (three steps each).
- tokens/s: caption streams (``max_tokens`` = ``--tokens``, the same image, so one encode),
  committed tokens over the decode wall time, pipelined and blocking.
- detect streams: ``--detect-streams`` detect rows at once; the engine's device idle fraction
  (bubble meter) and ms per step, pipelined vs blocking.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from tokenizers import Tokenizer

from frontend import moondream_prompts as prompts
from frontend.moondream_images import overlap_crops
from gpu_worker.engine import Engine
from gpu_worker.moondream_skills import ANSWER_FIRST, DECIDE, SkillTask
from gpu_worker.image_prefill import ImageInput
from shared.config import EngineConfig
from shared.models import resolve_model
from shared.moondream_random import make_image
from shared.sampling import SamplingParams

PREFIX = 730
SIZES = {(1, 1): (378, 378), (3, 3): (644, 644), (3, 4): (910, 1176)}


def image_input(tiling, salt):
    h, w = SIZES[tiling]
    crops, got = overlap_crops(make_image(h, w, salt))
    assert got == tiling, (got, tiling)
    return ImageInput(hash=f"bench-{tiling}-{salt}", tiles=crops, tiling=got)


def caption_request(salt, max_tokens, tiling=(1, 1)):
    ids = [0] * PREFIX + prompts.caption_ids("short")
    return ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), \
        [image_input(tiling, salt)], SkillTask(ANSWER_FIRST)


def detect_request(salt, objects, encode):
    ids = [0] * PREFIX + prompts.detect_ids(encode, "cat")
    return ids, SamplingParams(temperature=0.0, max_tokens=3 * objects + 1), [image_input((1, 1), salt)], \
        SkillTask(DECIDE, detect=True, limit=objects)


def encode_image(model, crops, tiling):
    with torch.inference_mode():
        model.image_prefix(crops, tiling)


def run(engine, requests):
    seqs = [engine.submit(p, sp, images=im, task=t) for p, sp, im, t in requests]
    t0 = time.perf_counter()
    engine.run_until_idle()
    return seqs, time.perf_counter() - t0


def decode_phase(engine, requests):
    """Run until every stream has its first token, then time the rest: (seqs, wall s, stats)."""
    seqs = [engine.submit(p, sp, images=im, task=t) for p, sp, im, t in requests]
    while any(not s.output_ids and not s.finalized for s in seqs):
        engine.tick()
    engine.reset_stats()
    t0 = time.perf_counter()
    engine.run_until_idle()
    return seqs, time.perf_counter() - t0, engine.stats()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random-moondream")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--detect-streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--objects", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    engines = {mode: Engine(EngineConfig(model=a.model, device=a.device, dtype=a.dtype, pipeline=mode == "pipelined",
                                         max_batch=max(a.streams, a.detect_streams), max_model_len=2048,
                                         prefill_budget=1024))
               for mode in ("pipelined", "blocking")}
    tok = Tokenizer.from_file(str(resolve_model(a.model) / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    eng = engines["pipelined"]
    model = eng.runner.moondream
    dev = eng.runner.device.torch_device
    out: dict = {"model": a.model, "device": a.device, "dtype": a.dtype, "params": model.num_params()}

    encode_ms = {}
    device = eng.runner.device
    for tiling in SIZES:  # on the compute stream, where the engine encodes (its thread, its settings)
        crops = torch.from_numpy(np.concatenate(image_input(tiling, 0).tiles)).to(dev)
        times = []
        for i in range(a.repeats + 1):  # the first is a warm-up
            device.synchronize()
            t0 = time.perf_counter()
            device.compute.submit(lambda c=crops, t=tiling: encode_image(model, c, t))  # bound now
            device.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        encode_ms[f"{tiling[0]}x{tiling[1]} ({1 + tiling[0] * tiling[1]} crops)"] = 1e3 * statistics.median(times)
    out["encode_ms"] = encode_ms

    ttft = []
    for r in range(a.repeats + 1):
        (seq,), _ = run(eng, [caption_request(1000 + r, 2)])
        if r:  # the first is a warm-up
            ttft.append(seq.t_first_token - seq.t_submit)
    out["caption_ttft_ms"] = 1e3 * statistics.median(ttft)

    per_object = []
    for r in range(a.repeats):
        (seq,), wall, _ = decode_phase(eng, [detect_request(2000 + r, a.objects, encode)])
        found = len(prompts.parse_objects(seq.output_ids, seq.output_values, detect=True))
        if found:
            per_object.append(1e3 * wall / found)
    out["detect_ms_per_object"] = statistics.median(per_object) if per_object else None

    tps = {}
    for n in (1, a.streams):
        for mode, engine in engines.items():
            rates = []
            for _ in range(a.repeats):
                seqs, wall, _ = decode_phase(engine, [caption_request(7, a.tokens + 1) for _ in range(n)])
                rates.append(sum(len(s.output_ids) - 1 for s in seqs) / wall)
            tps[f"{n} streams {mode}"] = statistics.median(rates)
    out["caption_tokens_per_s"] = tps

    detect = {}
    for mode, engine in engines.items():
        rows = []
        for _ in range(a.repeats):
            reqs = [detect_request(3000 + i, a.objects, encode) for i in range(a.detect_streams)]
            _, wall, st = decode_phase(engine, reqs)
            rows.append((st["device_idle_fraction"], 1e3 * wall / max(st["decode_steps"], 1), st["device_overruns"]))
        detect[mode] = {"device_idle": statistics.median(r[0] for r in rows),
                        "ms_per_step": statistics.median(r[1] for r in rows),
                        "overruns": max(r[2] for r in rows)}
    out[f"{a.detect_streams}_detect_streams"] = detect
    for engine in engines.values():
        engine.close()
    print(json.dumps(out, indent=None if a.json else 1))
    return out


if __name__ == "__main__":
    main()
