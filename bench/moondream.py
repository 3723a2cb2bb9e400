"""Moondream benchmark: image encode per crop count, caption TTFT, ms per detected object, and
text (caption) and detect streams at 1 and N rows, pipelined vs blocking (ms/step, device idle).

    python -m bench.moondream --model tiny-random-moondream --device cpu
    python -m bench.moondream --model random-moondream2 --device cuda --dtype bfloat16 --json
    python -m bench.moondream --model ./moondream2 --device cuda --dtype bfloat16 --json
    python -m bench.moondream --device sim:20 --detect-streams 32     (the host falling behind)

``random-moondream2`` (moondream2's 1.93 B-parameter shapes, random weights) is drawn in memory
on the device (``Moondream.random``), with the byte-level stand-in tokenizer; a directory or
another built-in is loaded by the engine.

What is timed (medians of ``--repeats``; engines are built once per mode):
- encode: ``Moondream.image_prefix`` (normalise, vision encoder, stitch, pool, project) on crops
  of a tiling of 1×1, 3×3 and 3×4 (2, 10 and 13 crops), after one warm-up.
- caption TTFT: submit to the first token of a short caption of a fresh image (encode + 730+5
  prefill + the first sample), one stream, encoder and prefix caches cold (a new image each time).
- ms per object: a detect stream forced to ``--objects`` objects (eos suppressed by greedy on
  a random model is not guaranteed, so the count is what the model returned), decode wall time
  divided by the objects found (three steps each).
- text streams: 1 and ``--streams`` caption rows (``max_tokens`` = ``--tokens``, the same
  image, so one encode): committed tokens/s over the decode wall time, ms per decode step and
  the engine's device idle fraction (bubble meter), pipelined and blocking.
- detect streams: 1 and ``--detect-streams`` detect rows at once: ms per step, device idle and
  overruns (``sim:MS`` steps whose real work did not fit), pipelined and blocking.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from tokenizers import Tokenizer

from frontend.moondream import prompts
from frontend.moondream.images import overlap_crops
from gpu_worker.device import Device
from gpu_worker.engine import Engine
from gpu_worker.image_prefill import ImageInput
from gpu_worker.moondream import Moondream
from gpu_worker.moondream_skills import ANSWER_FIRST, DECIDE, SkillTask
from shared.config import EngineConfig
from shared.models.registry import builtin, resolve_model
from shared.moondream_config import MoondreamConfig, moondream_version
from shared.moondream_random import byte_tokenizer, make_image
from shared.sampling import SamplingParams

PREFIX = 730
MAX_MODEL_LEN = 2048
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


def progress(msg: str) -> None:
    print(f"[bench moondream {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def in_memory_model(name: str, device: str, dtype: str) -> Moondream | None:
    """A random Moondream built-in drawn on the device (None: the engine loads ``name``)."""
    model = builtin(name)
    if model is None or model.random_config is None or moondream_version(model.random_config) is None:
        return None
    if moondream_version(model.random_config) == 3 and device == "cpu":
        raise SystemExit(f"{name} does not fit a CPU in float: `{model.bench} --model {name}` quantizes its experts")
    return Moondream.random(MoondreamConfig.from_dict(model.random_config), dtype=getattr(torch, dtype),
                            device=Device(device).torch_device, max_model_len=MAX_MODEL_LEN)


def streams_rows(engines, make_requests, counts, repeats) -> dict:
    """{rows: {mode: tokens/s, ms per decode step, device idle, overruns}} (medians; modes alternate)."""
    out = {}
    for n in counts:
        runs = {mode: [] for mode in engines}
        for r in range(repeats):
            for mode in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                seqs, wall, st = decode_phase(engines[mode], make_requests(n))
                runs[mode].append((sum(len(s.output_ids) - 1 for s in seqs) / wall,
                                   1e3 * wall / max(st["decode_steps"], 1), st["device_idle_fraction"],
                                   st["device_overruns"]))
        out[str(n)] = {mode: {"tokens_per_s": statistics.median(x[0] for x in rows),
                              "ms_per_step": statistics.median(x[1] for x in rows),
                              "device_idle": statistics.median(x[2] for x in rows),
                              "overruns": max(x[3] for x in rows)} for mode, rows in runs.items()}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random-moondream")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=8, help="text (caption) rows of the second text row count")
    ap.add_argument("--detect-streams", type=int, default=32, help="detect rows of the second detect row count")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--objects", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    shared = in_memory_model(a.model, a.device, a.dtype)
    if shared is not None:
        progress(f"{a.model}: {shared.num_params() / 1e9:.2f} B random parameters drawn on {a.device} "
                 f"in {time.perf_counter() - t0:.1f} s")
    engines = {mode: Engine(EngineConfig(model=a.model, device=a.device, dtype=a.dtype, pipeline=mode == "pipelined",
                                         max_batch=max(a.streams, a.detect_streams), max_model_len=MAX_MODEL_LEN,
                                         prefill_budget=1024), llama=shared)
               for mode in ("pipelined", "blocking")}
    tok = byte_tokenizer() if shared is not None else Tokenizer.from_file(str(resolve_model(a.model) / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    eng = engines["pipelined"]
    model = eng.runner.moondream
    dev = eng.runner.device.torch_device
    out: dict = {"model": a.model, "device": a.device, "dtype": a.dtype, "params": model.num_params()}
    progress(f"engines ready in {time.perf_counter() - t0:.1f} s; timing the image encode")

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

    progress("caption TTFT")
    ttft = []
    for r in range(a.repeats + 1):
        (seq,), _ = run(eng, [caption_request(1000 + r, 2)])
        if r:  # the first is a warm-up
            ttft.append(seq.t_first_token - seq.t_submit)
    out["caption_ttft_ms"] = 1e3 * statistics.median(ttft)

    progress("detect, ms per object")
    per_object = []
    for r in range(a.repeats):
        (seq,), wall, _ = decode_phase(eng, [detect_request(2000 + r, a.objects, encode)])
        found = len(prompts.parse_objects(seq.output_ids, seq.output_values, detect=True))
        if found:
            per_object.append(1e3 * wall / found)
    out["detect_ms_per_object"] = statistics.median(per_object) if per_object else None

    progress(f"text streams (1 and {a.streams})")
    out["text_streams"] = streams_rows(engines, lambda n: [caption_request(7, a.tokens + 1) for _ in range(n)],
                                       sorted({1, a.streams}), a.repeats)
    progress(f"detect streams (1 and {a.detect_streams})")
    out["detect_streams"] = streams_rows(
        engines, lambda n: [detect_request(3000 + i, a.objects, encode) for i in range(n)],
        sorted({1, a.detect_streams}), a.repeats)
    for engine in engines.values():
        engine.close()
    print(json.dumps(out, indent=None if a.json else 1))
    return out


if __name__ == "__main__":
    main()
