"""GPU checks of what landed after the decode loop (bench/gpu.sh, stage 3).

    python -m bench.gpu_features [--device cuda] [--only lora,prefix,vision,moondream,service]
    python -m bench.gpu_features --device cpu --llm tiny-random --vlm tiny-random-vlm   # a dry run anywhere

Every check runs one workload on DEVICE and compares the greedy tokens with a reference:

- ``lora``: three random adapters through two slots, base rows in the same
  launches, on DEVICE (float32, CUDA graphs, pipelined) for each LoRA kernel,
  against the CPU (float32, eager, blocking; the CPU path is checked against
  peft in tests/engine/test_lora.py). Then bfloat16 pipelined against bfloat16 blocking.
- ``prefix``: two turns of conversations sharing a system prompt, the prefix
  cache on, on DEVICE (float32, graphs, pipelined), against the CPU with the
  cache off. The second turn must map cached pages.
- ``vision``: two requests with the same 13-tile image (the second one's
  features come from the encoder cache) and a text request, on DEVICE against
  the CPU (whose encoder is checked against transformers in tests/models/test_vision.py);
  then bfloat16 pipelined against blocking; and the encoder's time per image.
- ``moondream``: the Moondream reference's own answers for its dev checkpoint
  (``bench/moondream_fixture.py``: captions, queries, reasoning, spatial refs, point and
  detect, and the eos-biased checkpoint's early stops), every case at once on DEVICE
  (float32, graphs, pipelined; the skill state and region values on the device); then each
  case alone, bfloat16 pipelined against blocking, ids and values identical.
- ``service``: the two processes (worker, token ring, tile blocks, acks) on
  DEVICE: text, image and stop-token requests one at a time through a
  ``Service``, against the same requests one at a time in-process on DEVICE.
- ``attention``: decode graphs that read the KV pages in place (FlexAttention,
  ``gpu_worker/flex_paged.py``), pipelined, against graphs that gather them,
  blocking, on DEVICE (float32, prompts of many lengths sharing a prefix-cached system
  prompt); and how many of the graphs read in place (each falls back to
  gathering if its kernel fails or differs at capture).

The float32 comparisons turn TF32 off (conv and matmul), so both sides compute in
true float32; bfloat16 comparisons keep identical launches (length caps only),
so identical kernels must give identical tokens. Synchronizing CUDA calls in the
engine loop are reported as in bench/gpu_check.py. Exit status 1 if any check failed.

Needs torch, transformers, numpy, and for ``vision``/``service`` Pillow and msgspec.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from bench.gpu_check import _sync_watch

CHECKS = ("lora", "prefix", "vision", "moondream", "service", "attention")  # attention last: it compiles kernels
GREEDY_TOKENS = 12


def _engine(model: str, device: str, dtype: str, pipeline: bool, **kw):
    from gpu_worker.engine import Engine, EngineConfig

    kw = {"cuda_graphs": device.startswith("cuda"), "max_batch": 16, "max_model_len": 4096, "kv_pages": 600,
          "prefill_budget": 512, **kw}
    return Engine(EngineConfig(model=model, device=device, dtype=dtype, pipeline=pipeline, **kw))


SYNCS: list[str] = []  # synchronizing CUDA calls seen inside engine loops on the device


def _run(engine, requests: list[dict]) -> list[list[int]]:
    """Submit every request, run to idle; the tokens of each. The engine must end idle."""
    return [list(s.output_ids) for s in _run_seqs(engine, requests)]


def _run_seqs(engine, requests: list[dict]) -> list:
    """Submit every request, run to idle; the finished sequences. The engine must end idle."""
    seqs = [engine.submit(**r) for r in requests]
    with _sync_watch(engine.config.device.startswith("cuda"), SYNCS, "engine loop"):
        engine.run_until_idle()
    errors = [s.error for s in seqs if s.error]
    if errors:
        raise AssertionError(f"request errors: {errors[:3]}")
    if not engine.idle:
        raise AssertionError("engine not idle after the run (leaked rows or pages)")
    return seqs


def _same(what: str, got: list[list[int]], want: list[list[int]]) -> None:
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    if bad or len(got) != len(want):
        i = bad[0] if bad else min(len(got), len(want))
        a, b = (got[i], want[i]) if bad else ([], [])
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        raise AssertionError(f"{what}: {len(bad)} of {len(want)} requests differ; first: request {i} at token {k}: "
                             f"{a[k:k + 4]} against {b[k:k + 4]}")


def _greedy(n: int = GREEDY_TOKENS):
    from shared.sampling import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _prompts(n: int, rng: np.random.Generator, lo: int = 4, hi: int = 60) -> list[list[int]]:
    return [rng.integers(3, 32000, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _random_adapters(model: str, root: Path) -> dict[str, str]:
    """Three PEFT directories with random A and B on every linear layer, large enough
    to change the greedy tokens."""
    from bench.lora import write_random_adapter
    from gpu_worker.model import LlamaConfig
    from shared.models.registry import resolve_model

    config = LlamaConfig.from_pretrained(resolve_model(model, quiet=True))
    out = {}
    for i, rank in enumerate((8, 16, 4)):
        write_random_adapter(root / f"a{i}", config, rank, seed=10 + i, b_std=0.3)
        out[f"a{i}"] = str(root / f"a{i}")
    return out


# ---------------------------------------------------------------------------------------------- checks


def check_lora(device: str, llm: str) -> str:
    from shared.lora_config import KERNELS

    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory(prefix="tandem-gpu-lora-") as tmp:
        loras = _random_adapters(llm, Path(tmp))
        names = [None, *loras]
        prompts = _prompts(16, rng)
        reqs = [dict(prompt_ids=p, params=_greedy(), adapter=names[i % len(names)]) for i, p in enumerate(prompts)]
        ref_engine = _engine(llm, "cpu", "float32", False, loras=loras, max_loras=2)
        try:
            want = _run(ref_engine, reqs)
            # Request 0 has no adapter; under a0 its tokens must differ.
            under_a0 = _run(ref_engine, [dict(reqs[0], adapter="a0")])[0]
        finally:
            ref_engine.close()
        if want[0] == under_a0:
            raise AssertionError("non-vacuity: adapter a0 does not change the greedy tokens")
        notes = []
        for kernel in KERNELS:
            eng = _engine(llm, device, "float32", True, loras=loras, max_loras=2, lora_kernel=kernel)
            try:
                _same(f"{kernel} kernel on {device} (fp32) against the CPU", _run(eng, reqs), want)
                st = eng.stats()
                if st["lora_evictions"] == 0:
                    raise AssertionError("three adapters through two slots evicted none")
                notes.append(f"{kernel}: {st['lora_loads']} slot loads, {st['cuda_graphs']} graphs")
            finally:
                eng.close()
        notes.append(_bf16_modes_agree(llm, device, reqs, loras=loras, max_loras=2))
    return f"{len(reqs)} requests, 3 adapters in 2 slots + base rows; " + "; ".join(notes)


def _bf16_modes_agree(model: str, device: str, reqs: list[dict], **kw) -> str:
    if not device.startswith("cuda"):
        return "bf16 modes: skipped off CUDA"
    outs = []
    for pipeline in (False, True):
        eng = _engine(model, device, "bfloat16", pipeline, **kw)
        try:
            outs.append(_run(eng, reqs))
        finally:
            eng.close()
    _same("bf16 pipelined against bf16 blocking", outs[1], outs[0])
    return "bf16 pipelined == blocking"


def check_prefix(device: str, llm: str) -> str:
    rng = np.random.default_rng(2)
    system = rng.integers(3, 32000, 150).tolist()
    first = [system + p for p in _prompts(6, rng)]
    answers = _prompts(6, rng, 8, 9)  # stands in for the first turn's answer in the second turn's prompt
    second = [a + b + c for a, b, c in zip(first, answers, _prompts(6, rng))]
    waves = [[dict(prompt_ids=p, params=_greedy()) for p in wave] for wave in (first, second)]
    ref = _engine(llm, "cpu", "float32", False, prefix_cache=False)
    want = [_run(ref, w) for w in waves]
    ref.close()
    eng = _engine(llm, device, "float32", True)
    try:
        for i, w in enumerate(waves):
            _same(f"turn {i + 1} on {device} with the prefix cache against the CPU without it", _run(eng, w), want[i])
        st = eng.stats()
    finally:
        eng.close()
    if st["prefix_hit_tokens"] < 150 * 6:
        raise AssertionError(f"only {st['prefix_hit_tokens']} prompt tokens came from the cache")
    return (f"2 turns x 6 conversations; {st['prefix_hit_tokens']} of {st['prefix_query_tokens']} prompt tokens "
            "from the cache")


def check_attention(device: str, llm: str) -> str:
    rng = np.random.default_rng(4)
    system = rng.integers(3, 32000, 40).tolist()
    waves = [[dict(prompt_ids=system + p, params=_greedy(24)) for p in _prompts(n, rng, 1, 300)] for n in (1, 13)]
    outs, graphs = [], []
    for attention in ("gather", "auto"):  # the reference blocking, as in every check
        eng = _engine(llm, device, "float32", attention == "auto", attention=attention)
        try:
            outs.append([_run(eng, w) for w in waves])
            graphs.append([g.in_place for g in eng.runner.graphs.values()])
        finally:
            eng.close()
    for i, (got, want) in enumerate(zip(*reversed(outs))):
        _same(f"wave {i + 1}: in place against gathered pages", got, want)
    if any(graphs[0]):
        raise AssertionError(f"--attention gather captured {sum(graphs[0])} graphs reading the pages in place")
    in_place = sum(graphs[1])
    if device.startswith("cuda") and not in_place:
        raise AssertionError(f"no decode graph reads the pages in place (of {len(graphs[1])}; the log says why)")
    return f"{in_place} of {len(graphs[1])} decode graphs read the pages in place; tokens as gathered"


IMAGE_TEXTS = [f"<|im_start|>User:{before}<image>Describe this image.<end_of_utterance>\nAssistant:"
               for before in (" A", " B")]  # different beginnings: the second request is no prefix-cache hit


def _image_requests(vlm: str, image: bytes, n_text: int = 1) -> tuple[list[dict], object]:
    """Two requests with ``image`` (IMAGE_TEXTS), then ``n_text`` text requests; and the prepared image."""
    from frontend.images.idefics3 import image_prompt_ids, prepare_images
    from gpu_worker.image_prefill import ImageInput
    from shared.models.registry import load_tokenizer, resolve_model
    from shared.vision_config import ImageProcessorParams

    path = resolve_model(vlm, quiet=True)
    params = ImageProcessorParams.from_model_dir(path)
    tok = load_tokenizer(path)
    prepared = prepare_images([image], params)
    reqs = [dict(prompt_ids=image_prompt_ids(tok, text, prepared, params), params=_greedy(),
                 images=[ImageInput(im.hash, im.tiles) for im in prepared]) for text in IMAGE_TEXTS]
    reqs += [dict(prompt_ids=p, params=_greedy()) for p in _prompts(n_text, np.random.default_rng(3))]
    return reqs, prepared[0]


def check_vision(device: str, vlm: str, image_size: str = "512x384") -> str:
    from bench.image_ttft import noise_png

    width, height = (int(x) for x in image_size.split("x"))
    reqs, image = _image_requests(vlm, noise_png(width, height, 7))
    ref = _engine(vlm, "cpu", "float32", False)
    want = _run(ref, reqs)
    ref.close()
    eng = _engine(vlm, device, "float32", True)
    try:
        _same(f"image requests on {device} (fp32) against the CPU", _run(eng, reqs), want)
        st = eng.stats()
    finally:
        eng.close()
    if (st["encoded_images"], st["encoder_cache_hits"]) != (1, 1):
        raise AssertionError(f"the image was encoded {st['encoded_images']} times, "
                             f"{st['encoder_cache_hits']} encoder-cache hits (want 1 and 1)")
    notes = [f"{len(image.tiles)} tiles, encoded once, one encoder-cache hit", _bf16_modes_agree(vlm, device, reqs)]
    if device.startswith("cuda"):
        notes.append(_encoder_ms(vlm, device, image.tiles))
    return "; ".join(notes)


def _encoder_ms(vlm: str, device: str, tiles: np.ndarray) -> str:
    """The vision encoder alone (bf16), one image's tiles per call, median of 10 after 2 warm-ups."""
    import torch

    eng = _engine(vlm, device, "bfloat16", True)
    try:
        vision, params = eng.runner.vision, eng.runner.image_params
        from gpu_worker.vision import normalize_tiles

        x = torch.from_numpy(tiles).to(device)
        times = []
        with torch.inference_mode():
            for i in range(12):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                vision.encode_images(normalize_tiles(x, params, torch.bfloat16))
                torch.cuda.synchronize()
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
    finally:
        eng.close()
    return f"vision encoder {statistics.median(times):.1f} ms per {len(tiles)}-tile image (bf16)"


def _close(got, want) -> bool:
    """The same structure and ids; floats within 1e-6 relative (8 float32 ulp). A width or height
    is 2^(bin/1023 · 10 - 10), which CUDA's math library may round a few ulp away from the CPU's."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_close, got, want))
    if isinstance(want, float):
        return isinstance(got, float) and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-7)
    return got == want


def check_moondream(device: str) -> str:
    from bench.moondream_fixture import EXPECTED, case_id, encoder, engine_answer, engine_request, write_checkpoints

    with tempfile.TemporaryDirectory(prefix="tandem-moondream-") as tmp:
        paths = write_checkpoints(Path(tmp))
        encode = encoder(paths["plain"])

        def request(case) -> dict:
            return dict(zip(("prompt_ids", "params", "images", "task"), engine_request(case, encode)))

        kw = dict(max_model_len=1024, kv_pages=1200, prefill_budget=1024)
        for name, cases in (("plain", EXPECTED["cases"]), ("eos", EXPECTED["eos_cases"])):
            eng = _engine(str(paths[name]), device, "float32", True, **kw)
            try:
                seqs = _run_seqs(eng, [request(c) for c in cases])
            finally:
                eng.close()
            for case, seq in zip(cases, seqs):
                got = engine_answer(case, seq)
                if not _close(got, {k: case[k] for k in got}):
                    raise AssertionError(f"{name} {case_id(case)} on {device} (fp32, all cases at once): {got} against "
                                         f"the reference's {({k: case[k] for k in got})}")
        engines = {mode: _engine(str(paths["plain"]), device, "bfloat16", mode == "pipelined", **kw)
                   for mode in ("pipelined", "blocking")}
        try:
            for case in EXPECTED["cases"]:  # alone: the same launches in both modes, so the same bits
                (a,), (b,) = (_run_seqs(engines[mode], [request(case)]) for mode in ("pipelined", "blocking"))
                if (a.output_ids, a.output_values) != (b.output_ids, b.output_values):
                    raise AssertionError(f"{case_id(case)} on {device} (bf16): pipelined {a.output_ids} "
                                         f"{a.output_values} against blocking {b.output_ids} {b.output_values}")
        finally:
            for eng in engines.values():
                eng.close()
        n = len(EXPECTED["cases"]) + len(EXPECTED["eos_cases"])
        return (f"{n} reference cases (captions, queries, reasoning, spatial refs, point, detect, early eos) at once "
                f"in fp32 = the reference's answers; bf16 pipelined = blocking, one at a time")


def check_service(device: str, vlm: str) -> str:
    from bench.image_ttft import noise_png
    from frontend.images.idefics3 import image_prompt_ids
    from frontend.server.service import Service, ServiceConfig
    from shared.sampling import SamplingParams

    image = noise_png(384, 256, 11)
    reqs, _ = _image_requests(vlm, image, n_text=3)
    in_process = _engine(vlm, device, "bfloat16", True)
    want = []
    try:
        for r in reqs:
            want.append(_run(in_process, [r])[0])
        # A stop token the text request samples: it ends early and rides one step as a zombie.
        stop_at = want[2][len(want[2]) // 2]
        stopped = dict(reqs[2], params=SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0,
                                                       stop_token_ids=[stop_at]))
        want.append(_run(in_process, [stopped])[0])
    finally:
        in_process.close()
    svc = Service(ServiceConfig(model=vlm, device=device, dtype="bfloat16", max_batch=16, max_model_len=4096,
                                kv_pages=600, prefill_budget=512))
    got = []
    try:
        for i, r in enumerate([*reqs, stopped]):
            done: dict = {}
            on_event = (lambda req, kind, payload, d=done: d.update({kind: payload}) if kind != "chunk" else None)
            if r.get("images"):
                render = (lambda p, t=IMAGE_TEXTS[i]: image_prompt_ids(svc.tokenizer, t, p, svc.image_params))
                req = svc.submit_images([image], render, r["params"], on_event=on_event)
            else:
                req = svc.submit(r["prompt_ids"], r["params"], on_event=on_event)
            svc.run_until(lambda d=done: d, 120)
            if "done" not in done:
                raise AssertionError(f"request {len(got)} did not finish: {done}")
            got.append(list(req.token_ids))
        svc.run_until(svc.idle, 120)  # "done" comes before the worker's release of the last request
        st = svc.stats()
    finally:
        svc.close()
    _same(f"two processes on {device} against in-process", got, want)
    if len(want[-1]) >= GREEDY_TOKENS:
        raise AssertionError("non-vacuity: the stop-token request was not cut short")
    if st["running"] or st["waiting"] or st["kv_pages_free"] != st["kv_pages_total"]:
        raise AssertionError(f"the worker is not idle after the requests: {st}")
    return f"{len(got)} requests (2 with the image, 1 ended by a stop token) identical through the ring"


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_features", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--llm", default="random-smollm2-135m", help="text model of the lora and prefix checks")
    ap.add_argument("--vlm", default="random-smolvlm-256m", help="vision-language model of vision and service")
    args = ap.parse_args(argv)
    import torch

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("gpu_features: torch sees no CUDA device")
        return 1
    if cuda:  # true float32 on both sides of the float32 comparisons
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    checks = {"lora": lambda: check_lora(args.device, args.llm),
              "prefix": lambda: check_prefix(args.device, args.llm),
              "attention": lambda: check_attention(args.device, args.llm),
              "vision": lambda: check_vision(args.device, args.vlm),
              "moondream": lambda: check_moondream(args.device),
              "service": lambda: check_service(args.device, args.vlm)}
    failed = []
    for name in [c for c in args.only.split(",") if c]:
        if name not in checks:
            raise SystemExit(f"--only: unknown check {name!r} ({', '.join(CHECKS)})")
        t0, SYNCS[:] = time.perf_counter(), []
        try:
            note = checks[name]()
            print(f"feature {name}: OK ({note}) [{time.perf_counter() - t0:.0f} s]", flush=True)
        except Exception as e:  # noqa: BLE001 - report every check, then fail
            failed.append(name)
            print(f"feature {name}: FAILED [{time.perf_counter() - t0:.0f} s]: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=6)
        if SYNCS:
            print(f"!!!! {len(SYNCS)} synchronizing CUDA calls in the {name} check's engine loops; first:")
            for where in list(dict.fromkeys(SYNCS))[:5]:
                print(f"     {where}")
    print(f"features: {'all OK' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
