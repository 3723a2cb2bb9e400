"""Moondream 3 on a CPU, quantized: caption, point and detect end to end, with TTFT and tokens/s.

    python -m bench.moondream3_cpu                                   (random-moondream3, int4)
    python -m bench.moondream3_cpu --quantization int8 --group 64 --json
    python -m bench.moondream3_cpu --model ./moondream3-preview
    python -m bench.moondream3_cpu --quality          (int8 and int4 against the float32 fixture)
    python -m bench.moondream3_cpu --moe-layer        (one MoE layer at the real shape: routing's share)

``random-moondream3`` (moondream3-preview's 9.27 B-parameter shapes) is drawn in memory and its
expert stacks quantized one at a time as they are drawn (``Moondream.random(quantize=...)``:
9.27 B float32 values would not fit); the engine then quantizes the text blocks' other linears
(``Moondream.quantize_weights``). A directory is loaded by the engine with ``--quantization``.

What is timed (one stream, the byte-level stand-in tokenizer, a 378 × 378 image: one crop plus the
global one):
- caption TTFT: submit to the first token (encode + the 730 + 5 prefill + the first sample);
- caption decode: ``--tokens`` tokens (eos ignored), committed tokens per second after the first;
- point and detect: up to ``--objects`` objects (what the random model answers), their wall time.
Memory: the process's peak resident set (``ru_maxrss``).

``--quality``: every point and detect case of the reference's fixture on its four dev checkpoints
(``tests/data/moondream3_dev_expected.json``: the float32 answers), through the engine at int8 and
int4: per case, whether it has the same number of objects and the largest coordinate difference.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

from bench.moondream import detect_request, image_input, progress
from frontend.moondream import prompts
from gpu_worker import cpu_kernels
from gpu_worker.engine import Engine
from gpu_worker.moondream import Moondream
from gpu_worker.moondream_skills import ANSWER_FIRST, DECIDE, SkillTask
from gpu_worker.quant import QuantKernels, QuantLinear
from shared.config import EngineConfig
from shared.models.registry import builtin
from shared.moondream_config import MoondreamConfig
from shared.moondream_random import byte_tokenizer
from shared.sampling import SamplingParams

PREFIX = 730


def first_token_s(engine, request) -> tuple[object, float]:
    """Submit and tick until the first token: (sequence, seconds)."""
    prompt, params, images, task = request
    t0 = time.perf_counter()
    seq = engine.submit(prompt, params, images=images, task=task)
    while not seq.output_ids and not seq.finalized:
        engine.tick()
    return seq, time.perf_counter() - t0


def moe_layer(method: str, group: int, tokens=(1, 32, 735), repeats: int = 5) -> dict:
    """One MoE layer at moondream3's shape (2048 → 64 experts, top-8, inner 1024), experts in
    ``method``: {tokens: {"layer_ms", "routing_ms", "routing_share"}} (medians). Routing is the
    router, top-k, softmax, the sort of the (token, expert) pairs and the counts to the host."""
    import statistics

    from gpu_worker.moondream import MoeMlp
    from shared.moondream_config import MoeConfig
    moe, dim = MoeConfig(), 2048
    layer = MoeMlp(dim, moe)
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
    layer.requires_grad_(False)
    if method != "float32":
        kernels = QuantKernels(cpu_kernels.load())
        for experts in (layer.fc1, layer.fc2):
            experts.quantize(method, group, kernels)

    def routing(x):
        top_logits, experts = torch.topk(layer.router(x), moe.experts_per_token, dim=-1)
        torch.nn.functional.softmax(top_logits, dim=-1, dtype=torch.float32)
        torch.argsort(experts.flatten(), stable=True)
        return torch.bincount(experts.flatten(), minlength=moe.num_experts).tolist()

    out = {}
    for n in tokens:
        x = torch.randn(n, dim, generator=g)
        alone = torch.full((n,), n == 1)
        times = {"layer": [], "routing": []}
        for i in range(repeats + 1):  # the first is a warm-up
            for name, fn, args in (("layer", layer, (x, alone)), ("routing", routing, (x,))):
                t0 = time.perf_counter()
                fn(*args)
                if i:
                    times[name].append(time.perf_counter() - t0)
        layer_ms, routing_ms = (1e3 * statistics.median(times[k]) for k in ("layer", "routing"))
        out[str(n)] = {"layer_ms": layer_ms, "routing_ms": routing_ms, "routing_share": routing_ms / layer_ms}
        progress(f"{n} tokens: {layer_ms:.1f} ms per MoE layer, routing {routing_ms:.2f} ms ({routing_ms / layer_ms:.0%})")
    return out


def quality(methods=("int8", "int4"), group: int = 32) -> dict:
    """{method: {checkpoint/case: [objects, float32's objects, largest |difference|]}} (see the docstring)."""
    import tempfile
    from pathlib import Path

    from bench.moondream_fixture import case_id, encoder, engine_answer, engine_request, md3_checkpoints
    from shared.moondream_config import MOONDREAM3_RULES
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="tandem-md3-quality-") as tmp:
        checkpoints = md3_checkpoints(Path(tmp))
        encode = encoder(checkpoints["plain"][0])
        for method in methods:
            rows = out[method] = {}
            for name, (path, cases) in checkpoints.items():
                cases = [c for c in cases if c["skill"] in ("point", "detect")]
                engine = Engine(EngineConfig(model=str(path), device="cpu", quantization=method, quantization_group=group,
                                             max_batch=8, max_model_len=1024))
                seqs = [engine.submit(p, sp, images=im, task=t)
                        for p, sp, im, t in (engine_request(c, encode, rules=MOONDREAM3_RULES) for c in cases)]
                engine.run_until_idle()
                engine.close()
                for case, seq in zip(cases, seqs):
                    key = "points" if case["skill"] == "point" else "objects"
                    got, want = engine_answer(case, seq)[key], case[key]
                    diff = max((abs(a[k] - b[k]) for a, b in zip(got, want) for k in a), default=0.0)
                    rows[f"{name}/{case_id(case)}"] = [len(got), len(want), diff]
            within = sum(g == w and d <= 1 / 512 for g, w, d in rows.values())
            progress(f"{method}: {within} of {len(rows)} cases within 1/512 of float32")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-moondream3")
    ap.add_argument("--quantization", default="int4", choices=["int8", "int4"])
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--objects", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quality", action="store_true", help="int8 and int4 against the dev checkpoints' float32 answers")
    ap.add_argument("--moe-layer", action="store_true", help="one MoE layer at the real shape: routing's share")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quality or a.moe_layer:
        out = quality(group=a.group) if a.quality else {
            "quantization": f"{a.quantization}/{a.group}", "threads": torch.get_num_threads(),
            "tokens": moe_layer(a.quantization, a.group), "load_average": os.getloadavg()}
        print(json.dumps(out, indent=1) if a.json else out)
        return out
    t0 = time.perf_counter()
    model = None
    spec = builtin(a.model)
    if spec is not None and spec.random_config is not None:
        kernels = QuantKernels(cpu_kernels.load())
        model = Moondream.random(MoondreamConfig.from_dict(spec.random_config), max_model_len=1024,
                                 quantize=(a.quantization, a.group, kernels))
        progress(f"{a.model}: drawn with its experts in {a.quantization} in {time.perf_counter() - t0:.0f} s")
    engine = Engine(EngineConfig(model=a.model, device="cpu", quantization=a.quantization,
                                 quantization_group=a.group, max_batch=4, max_model_len=1024, prefill_budget=1024),
                    llama=model)
    model = engine.runner.moondream
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    out: dict = {"model": a.model, "quantization": f"{a.quantization}/{a.group}", "threads": torch.get_num_threads(),
                 "params": model.num_params() + sum(m.in_features * m.out_features + (0 if m.bias is None else
                                                                                      m.bias.numel()) for m in quantized),
                 "quantized_gib": sum(m.nbytes for m in quantized) / 2**30, "ready_s": time.perf_counter() - t0}
    progress(f"engine ready in {out['ready_s']:.0f} s; caption")
    tok = byte_tokenizer()
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731

    caption = ([0] * PREFIX + prompts.caption_ids("short"),
               SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True), [image_input((1, 1), 1)],
               SkillTask(ANSWER_FIRST, limit=a.tokens))
    seq, ttft = first_token_s(engine, caption)
    t1 = time.perf_counter()
    engine.run_until_idle()
    decode_s = time.perf_counter() - t1
    out["caption"] = {"ttft_s": ttft, "tokens": len(seq.output_ids),
                      "decode_tokens_per_s": (len(seq.output_ids) - 1) / decode_s, "token_ids": seq.output_ids}
    progress(f"caption: TTFT {ttft:.1f} s, {out['caption']['decode_tokens_per_s']:.2f} tokens/s; point, detect")
    for skill in ("point", "detect"):  # the same image: its block's KV pages from the prefix cache
        if skill == "detect":
            request = detect_request(1, a.objects, encode)
        else:
            request = ([0] * PREFIX + prompts.point_ids(encode, "cat"),
                       SamplingParams(temperature=0.0, max_tokens=2 * a.objects + 1), [image_input((1, 1), 1)],
                       SkillTask(DECIDE, limit=a.objects))
        t1 = time.perf_counter()
        seq = engine.submit(request[0], request[1], images=request[2], task=request[3])
        engine.run_until_idle()
        found = prompts.parse_objects(seq.output_ids, seq.output_values, skill == "detect")
        out[skill] = {"wall_s": time.perf_counter() - t1, "objects": found, "steps": len(seq.output_ids)}
        progress(f"{skill}: {len(found)} objects in {out[skill]['wall_s']:.1f} s")
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out["load_average"] = os.getloadavg()  # this machine's other tenants: the figures scale with it
    engine.close()
    print(json.dumps(out, indent=1) if a.json else out)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
