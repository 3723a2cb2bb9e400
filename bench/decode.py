"""Decode benchmark: blocking vs pipelined decoding, side by side in one process.

    python -m bench.decode --model tiny-random-llama-vocab4k --device sim:2.6 --streams 1,32 --tokens 128 --repeats 5
    python -m bench.decode --model smollm2-135m --device cpu --streams 1,32 --baseline transformers
    python -m bench.decode --model random-llama-3.2-1b --device cuda --json
    tandem bench decode ...        (the same options, once registered in frontend/cli/main.py)

What is timed (BENCHMARKS.md has the full methodology):
- Per (streams, mode) one engine per mode, built once on shared weights; every
  pass submits the same prompts (``--streams`` prompts of ``--prompt-len``
  random token ids, from ``--seed``), greedy, ``ignore_eos`` and
  ``max_tokens = tokens + 1``: the first token comes from prefill, then every
  stream decodes exactly ``--tokens`` steps in lockstep.
- The prefill is run first and not timed (step until every stream committed
  its first token); then the engine's counters are reset and the decode phase
  is timed with a wall clock until the engine is idle.
  ms per step = decode wall time / decode steps committed.
- One untimed warm-up pass per (streams, mode) (CUDA graphs, allocator, caches),
  then ``--repeats`` timed passes, interleaved: each repeat runs every mode,
  alternating the order, so drift and noise hit all modes alike. The row
  reports the median and the min-max spread over the repeats.
- Device idle fraction: the engine's bubble meter (compute-stream gaps between
  consecutive steps, CUDA events on a GPU, stream timestamps on cpu/sim).
- Host ms per step: ``host_s / steps`` from the engine (host time in
  ``Engine.tick`` minus its waits on the device).
- Overruns (``sim:MS``): steps whose real CPU work did not fit in the simulated
  MS (the engine's ``device_overruns``); a row with overruns measured the CPU.
- Zombie tax: zombie rows / useful (committed) rows.

``--baseline transformers`` times Hugging Face ``generate`` (greedy, batched,
left padding, ``min_new_tokens = max_new_tokens``) on the same weights and
prompts; its decode time is ``T(tokens + 1 new) - T(1 new)`` (prefill removed).

``--zombie-case``: one stream whose answer ends, at about token 110, on a stop
token the device detects (it stands in for EOS: the host cannot predict it),
so the pipelined engine has already launched one more step: one zombie row.

Imports only torch, numpy (transformers for the baseline,
click for the command object): no pyzmq, msgspec or grammar libraries.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from shared.arith import ceil_div
from shared.config import ATTENTIONS, QUANTIZATIONS
from shared.models.registry import DEFAULT_MODEL, REGISTRY, builtin
from shared.moondream_config import moondream_version

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("blocking", "pipelined")
ZOMBIE_TARGET = 110  # answer length of the zombie-tax case (the published single-stream figure)

# One definition of the options, used to build both the argparse parser and the click command.
# (flags, kwargs); kwargs: default, help, type (int/float/str), flag (bool switch), choices.
OPTIONS = [
    (("--model",), dict(default=DEFAULT_MODEL,
                        help=f"a built-in model ({', '.join(REGISTRY)}; `tandem models` says what each is; "
                             "random models are built in memory) or a Hugging Face directory")),
    (("--device",), dict(default="auto", help="auto | cpu | cuda | sim:MS (simulated device: MS per decode step)")),
    (("--streams",), dict(default="1,32", help="comma-separated concurrent streams, e.g. 1,32")),
    (("--tokens",), dict(default=128, type=int, help="decode tokens (= decode steps) per stream")),
    (("--prompt-len",), dict(default=32, type=int, help="prompt tokens per stream")),
    (("--mode",), dict(default="blocking,pipelined", help="comma-separated: blocking, pipelined")),
    (("--repeats",), dict(default=3, type=int, help="timed repetitions (interleaved across modes)")),
    (("--warmup",), dict(default=1, type=int, help="untimed passes per (streams, mode) before timing")),
    (("--seed",), dict(default=0, type=int, help="prompt and random-weight seed")),
    (("--dtype",), dict(default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="model dtype; auto: the engine's (model_runner.default_dtype)")),
    (("--quantization",), dict(default="auto", choices=list(QUANTIZATIONS),
                               help="as `tandem serve --quantization`: auto serves a model's GGUF file as it is "
                                    "on a CPU; none its float weights; int8 / int4 quantizes them at load")),
    (("--no-cuda-graphs",), dict(flag=True, help="disable CUDA graphs (CUDA only)")),
    (("--attention",), dict(default="auto", choices=list(ATTENTIONS),
                            help="as `tandem serve --attention`: how CUDA decode graphs read the KV pages")),
    (("--baseline",), dict(default=None, choices=["transformers"],
                           help="also time transformers generate on the same weights and prompts")),
    (("--baseline-dtype",), dict(default=None, help="dtype of the baseline (default: Tandem's --dtype); e.g. "
                                                 "float32 to compare with what transformers loads by default")),
    (("--zombie-case",), dict(flag=True, help="also run the zombie-tax case (1 stream, ~110-token answers)")),
    (("--no-throughput",), dict(flag=True, help="skip the throughput rows (e.g. with --zombie-case)")),
    (("--json",), dict(flag=True, help="print one JSON object on stdout (the table goes to stderr)")),
    (("--json-out",), dict(default=None, help="also write the JSON object to this file")),
    (("--quiet",), dict(flag=True, help="no progress lines on stderr")),
]


def progress(args, msg: str) -> None:
    if not args.quiet:
        print(f"[bench decode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _csv(text, kind=str) -> list:
    if isinstance(text, (list, tuple)):
        return [kind(x) for x in text]
    return [kind(x.strip()) for x in str(text).split(",") if x.strip()]


# ----------------------------------------------------------------------------- model and engines


@dataclass
class Loaded:
    name: str
    llama: object  # gpu_worker.model.Llama
    path: str | None  # HF directory for file models, None for random-*
    dtype: object  # torch.dtype
    torch_device: str
    eos: tuple[int, ...] = ()  # the model's EOS ids (shared.models.info.ModelInfo's, or a built-in config's)
    weights: str = "float"  # how the weights are held: "float" (in dtype), "gguf" (a GGUF file's blocks), ...


def resolve_device(spec: str) -> str:
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return spec


def load_model(name: str, device: str, dtype_name: str | None, seed: int, max_model_len: int,
               quantization: str = "auto") -> Loaded:
    """A built-in random model, or a model's files as `tandem serve` holds them (``quantization`` as
    its option: ``auto`` serves a GGUF file's blocks on a CPU; ``none`` its float weights)."""
    import torch

    from gpu_worker.model import Llama, LlamaConfig

    torch_device = "cuda" if device.startswith("cuda") else "cpu"
    if device.startswith("cuda:"):
        torch_device = device
    from gpu_worker.engine import EngineConfig
    from gpu_worker.model_runner import default_dtype, model_eos_ids

    auto = dtype_name in (None, "auto")
    dtype = default_dtype(torch_device != "cpu") if auto else getattr(torch, dtype_name)
    model = builtin(name)
    if model is not None and model.random_config is not None:  # random weights, in memory (no files)
        if moondream_version(model.random_config) is not None:
            raise SystemExit(f"{name} is not a Llama: `{model.bench} --model {name}` benchmarks it")
        cfg = LlamaConfig.from_hf_config(model.random_config)
        llama = Llama.random(cfg, seed=seed, dtype=dtype, device=torch_device, max_model_len=max_model_len)
        return Loaded(name, llama, None, dtype, torch_device, model_eos_ids(EngineConfig(model=name)))
    from gpu_worker.device import Device
    from gpu_worker.model_runner import load_model as load_served
    from shared.models.registry import resolve_model

    # as `tandem serve` holds it: its own format (a GGUF file's blocks on a CPU), dtype and kernels
    path = resolve_model(name)
    cfg = LlamaConfig.from_pretrained(path)
    served = load_served(EngineConfig(model=str(path), dtype=None if auto else dtype_name, quantization=quantization,
                                      max_model_len=min(max_model_len, cfg.max_position_embeddings)),
                         Device(torch_device))
    eos = model_eos_ids(EngineConfig(model=str(path)))
    return Loaded(name, served.model, str(path), served.dtype, torch_device, eos, served.quantized or "float")


def on_compute(shared, fn):
    """fn() on ``shared``'s compute thread (a CPU's Device the engines share: the process's one OpenMP
    pool), its result returned; without one, fn() here."""
    if shared is None:
        return fn()
    result = []
    shared.compute.submit(lambda: result.append(fn()))
    shared.compute.record().synchronize()
    return result[0]


def make_engine(loaded: Loaded, device: str, pipelined: bool, max_batch: int, max_model_len: int,
                kv_pages: int, prefill_budget: int, cuda_graphs: bool, shared=None, attention: str = "auto"):
    """An engine on ``loaded``'s weights; ``shared``: the Device a CPU run's engines share (see run)."""
    from gpu_worker.engine import Engine, EngineConfig

    dtype_name = str(loaded.dtype).replace("torch.", "")
    cfg = EngineConfig(model=loaded.name, device=device, pipeline=pipelined, max_batch=max_batch,
                       max_model_len=max_model_len, page_size=16, kv_pages=kv_pages,
                       prefill_budget=prefill_budget, dtype=dtype_name, cuda_graphs=cuda_graphs, attention=attention)
    return Engine(cfg, llama=loaded.llama, device=shared)


def make_prompts(n: int, length: int, vocab: int, seed: int, avoid=()) -> list[list[int]]:
    """n random prompts of ``length`` token ids in [3, vocab), never one of ``avoid`` (EOS ids)."""
    rng = np.random.default_rng(seed)
    hi = min(vocab, 32000)  # ordinary-token range of every supported vocabulary
    prompts = rng.integers(3, hi, size=(n, length))
    for t in avoid:
        prompts[prompts == t] = 3
    return prompts.tolist()


# ----------------------------------------------------------------------------- one timed pass


@dataclass
class Pass:
    wall_s: float
    decode_steps: int
    steps: int
    committed_tokens: int
    host_s: float
    wait_s: float
    idle_fraction: float
    idle_s: float
    busy_s: float
    sample_rows: int
    zombie_rows: int
    outputs: list
    overruns: int = 0  # sim:MS steps whose real work did not fit in MS

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.wall_s / max(self.decode_steps, 1)


def timed_pass(engine, prompts, params, adapters=None) -> Pass:
    """Prefill untimed, then time the decode phase to idle (the engine's counters cover only it).
    ``adapters``: a LoRA adapter name (or None) per prompt."""
    seqs = [engine.submit(p, params, adapter=a) for p, a in zip(prompts, adapters or [None] * len(prompts))]
    while engine.has_work and not all(s.output_ids or s.finalized for s in seqs):
        engine.tick()
    engine.reset_stats()
    t0 = time.perf_counter()
    engine.run_until_idle()
    wall = time.perf_counter() - t0
    st = engine.stats()
    for s in seqs:
        if s.error:
            raise RuntimeError(f"request failed: {s.error}")
    return Pass(wall, st["decode_steps"], st["steps"], st["committed_tokens"], st["host_s"], st["wait_s"],
                st["device_idle_fraction"], st["bubble_idle_s"], st["bubble_busy_s"], st["sample_rows"],
                st["zombie_rows"], [list(s.output_ids) for s in seqs], st["device_overruns"])


def _spread(values: list[float]) -> tuple[list[float], list[float]]:
    lo, hi = min(values), max(values)
    if len(values) >= 4:
        q = statistics.quantiles(values, n=4)
        iqr = [q[0], q[2]]
    else:
        iqr = [lo, hi]
    return [lo, hi], iqr


def summarize(passes: list[Pass], streams: int, mode: str, case: str) -> dict:
    ms = [p.ms_per_step for p in passes]
    spread, iqr = _spread(ms)
    steps = sum(p.steps for p in passes)
    useful = sum(p.committed_tokens for p in passes)
    busy = sum(p.busy_s for p in passes)
    idle = sum(p.idle_s for p in passes)
    return {
        "case": case,
        "streams": streams,
        "mode": mode,
        "ms_per_step": statistics.median(ms),
        "ms_per_step_spread": spread,
        "ms_per_step_iqr": iqr,
        "ms_per_step_all": ms,
        "device_idle_fraction": idle / (busy + idle) if busy + idle > 0 else 0.0,
        "device_idle_fraction_all": [p.idle_fraction for p in passes],
        "device_idle_ms_per_step": 1e3 * idle / max(steps, 1),
        "device_busy_ms_per_step": 1e3 * busy / max(steps, 1),
        "device_overruns": sum(p.overruns for p in passes),
        "timed_steps": steps,  # committed launches over all repeats: the overruns' denominator
        "device_overrun_fraction": sum(p.overruns for p in passes) / max(steps, 1),
        "host_ms_per_step": 1e3 * sum(p.host_s for p in passes) / max(steps, 1),
        "wait_ms_per_step": 1e3 * sum(p.wait_s for p in passes) / max(steps, 1),
        "zombie_rows": sum(p.zombie_rows for p in passes),
        "useful_rows": useful,
        "zombie_tax": sum(p.zombie_rows for p in passes) / max(useful, 1),
        "tokens_per_s": statistics.median([p.committed_tokens / p.wall_s for p in passes if p.wall_s > 0] or [0.0]),
        "decode_steps": passes[0].decode_steps,
        "repeats": len(passes),
    }


# ----------------------------------------------------------------------------- transformers baseline


def build_hf_model(loaded: Loaded, dtype=None):
    """A transformers LlamaForCausalLM holding exactly our weights (files: from_pretrained)."""
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    dtype = dtype or loaded.dtype
    if loaded.path is not None:
        hf = LlamaForCausalLM.from_pretrained(loaded.path, **_dtype_kw(dtype))
        return _check_dtype(hf, dtype).to(loaded.torch_device).eval()
    c = loaded.llama.config
    # rope_theta / rope_scaling: the transformers 4.x names, which 5.x converts to rope_parameters.
    hcfg = HFConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                    max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                    rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None,
                    tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
                    mlp_bias=c.mlp_bias, bos_token_id=c.bos_token_id,
                    eos_token_id=list(loaded.eos) or None, pad_token_id=0)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    # _from_config(dtype=...) keeps the rotary inv_freq buffer in fp32 (a .to(bf16) would round it).
    with no_init_weights(), torch.device(loaded.torch_device):
        hf = _check_dtype(LlamaForCausalLM._from_config(hcfg, **_dtype_kw(dtype)), dtype)
    m = loaded.llama
    H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    sd = {"model.embed_tokens.weight": m.embed_tokens.weight, "model.norm.weight": m.norm.weight}
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = m.lm_head.weight
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        q, k, v = layer.self_attn.qkv_proj.weight.split([H * D, Hkv * D, Hkv * D])
        sd |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
               p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight}
        if c.attention_bias:
            qb, kb, vb = layer.self_attn.qkv_proj.bias.split([H * D, Hkv * D, Hkv * D])
            sd |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb}
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        sd |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
               p + "mlp.down_proj.weight": layer.mlp.down_proj.weight}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping to transformers failed: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def _dtype_kw(dtype) -> dict:
    """transformers >= 4.56 takes ``dtype=``, older versions ``torch_dtype=``."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _check_dtype(hf, dtype):
    if next(hf.parameters()).dtype != dtype:  # a transformers that ignored the dtype argument
        hf = hf.to(dtype)
    return hf


class HFBaseline:
    def __init__(self, loaded: Loaded, dtype_name: str | None = None, shared=None) -> None:
        import torch

        self.torch = torch
        self.dtype = getattr(torch, dtype_name) if dtype_name else loaded.dtype
        self.model = build_hf_model(loaded, self.dtype)
        self.device = loaded.torch_device
        self.shared = shared  # a CPU's Device the engines share: generate runs on its compute thread too
        self.pad = 0

    def _generate(self, prompts, new_tokens: int):
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)

        def timed() -> tuple[float, list]:
            self._sync()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad,
                                          use_cache=True)
            self._sync()
            return time.perf_counter() - t0, out[:, width:].tolist()

        return on_compute(self.shared, timed)

    def _sync(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def timed_pass(self, prompts, tokens: int) -> tuple[Pass, list]:
        t_prefill, _ = self._generate(prompts, 1)
        t_all, out = self._generate(prompts, tokens + 1)
        wall = max(t_all - t_prefill, 1e-9)
        n = len(prompts)
        p = Pass(wall, tokens, tokens, n * tokens, float("nan"), 0.0, float("nan"), 0.0, 0.0, n * tokens, 0, out)
        return p, out


def summarize_hf(passes: list[Pass], streams: int) -> dict:
    ms = [p.ms_per_step for p in passes]
    spread, iqr = _spread(ms)
    return {
        "case": "throughput", "streams": streams, "mode": "transformers",
        "ms_per_step": statistics.median(ms), "ms_per_step_spread": spread, "ms_per_step_iqr": iqr,
        "ms_per_step_all": ms, "device_idle_fraction": None, "device_overruns": None, "host_ms_per_step": None,
        "zombie_tax": 0.0,
        "tokens_per_s": statistics.median([p.committed_tokens / p.wall_s for p in passes]),
        "decode_steps": passes[0].decode_steps, "repeats": len(passes),
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each stream's tokens before the first difference."""
    fr = []
    for x, y in zip(a, b):
        n = max(len(x), len(y), 1)
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        fr.append(k / n)
    return sum(fr) / max(len(fr), 1)


# ----------------------------------------------------------------------------- the benchmark


def checkpoint(args, result: dict) -> None:
    """Write the figures so far to --json-out (a killed run keeps what it measured)."""
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(result, partial=True), f, indent=1)


def run_throughput(args, loaded, engines, streams_list, modes, hf, result, device) -> None:
    from shared.sampling import SamplingParams

    vocab = loaded.llama.config.vocab_size
    eos = loaded.eos
    params = SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)
    for streams in streams_list:
        prompts = make_prompts(streams, args.prompt_len, vocab, args.seed + streams, avoid=eos)
        order = list(modes) + (["transformers"] if hf else [])
        passes: dict[str, list[Pass]] = {m: [] for m in order}
        outputs: dict[str, list] = {}
        for w in range(args.warmup):
            for m in order:
                progress(args, f"{loaded.name} {device} streams={streams} {m}: warm-up {w + 1}/{args.warmup}")
                if m == "transformers":
                    hf.timed_pass(prompts, args.tokens)
                else:
                    timed_pass(engines[m], prompts, params)
        for r in range(args.repeats):
            seq_order = order if r % 2 == 0 else order[::-1]  # alternate: no mode always runs first
            for m in seq_order:
                if m == "transformers":
                    p, out = hf.timed_pass(prompts, args.tokens)
                else:
                    p = timed_pass(engines[m], prompts, params)
                    out = p.outputs
                outputs.setdefault(m, out)
                passes[m].append(p)
                extra = "" if m == "transformers" else f", idle {100 * p.idle_fraction:.1f}%, {p.overruns} overruns"
                progress(args, f"{loaded.name} {device} streams={streams} {m}: repeat {r + 1}/{args.repeats}: "
                               f"{p.ms_per_step:.3f} ms/step{extra}")
        rows = {}
        for m in modes:
            rows[m] = summarize(passes[m], streams, m, "throughput")
        if hf:
            rows["transformers"] = summarize_hf(passes["transformers"], streams)
        ref = outputs.get("blocking")
        for m in modes:
            if ref is not None and m != "blocking":
                rows[m]["tokens_match_blocking"] = outputs[m] == ref
        if "blocking" in rows and "pipelined" in rows:
            ratio = rows["blocking"]["ms_per_step"] / rows["pipelined"]["ms_per_step"]
            result["speedup"][str(streams)] = ratio
            rows["pipelined"]["speedup_vs_blocking"] = ratio
        if hf:
            base = rows["transformers"]["tokens_per_s"]
            ratios = {m: rows[m]["tokens_per_s"] / base for m in modes}
            for m in modes:
                rows[m]["ratio_vs_transformers"] = ratios[m]
            result["baseline_ratio"][str(streams)] = ratios.get("pipelined", max(ratios.values()))
            result["baseline_ratio_by_mode"][str(streams)] = ratios
            tandem_out = outputs.get("pipelined") or outputs.get("blocking")
            rows["transformers"]["token_agreement_with_tandem"] = agreement(tandem_out, outputs["transformers"])
        for row in rows.values():
            row["device"] = device if row["mode"] != "transformers" else loaded.torch_device
            row["model"] = loaded.name
            result["rows"].append(row)
        checkpoint(args, result)


def _zombie_request(engine, loaded, args):
    """Find a (prompt, params) whose answer ends on a device-detected stop at ~ZOMBIE_TARGET tokens.

    Greedy first, then seeded sampling (deterministic in both modes): the answer is
    generated once with ignore_eos, and the token whose first occurrence is nearest
    to position ZOMBIE_TARGET - 1 becomes the request's stop token id.
    """
    from shared.sampling import SamplingParams

    vocab = loaded.llama.config.vocab_size
    eos = set(loaded.eos)
    cap = ZOMBIE_TARGET + 40
    best = None
    for attempt in range(8):
        prompt = make_prompts(1, args.prompt_len, vocab, args.seed + 7919 + attempt, avoid=eos)[0]
        sampling = {} if attempt < 3 else dict(temperature=0.8, seed=args.seed + attempt)
        seq = engine.generate([prompt], SamplingParams(max_tokens=cap, ignore_eos=True, **sampling))[0]
        first: dict[int, int] = {}
        for i, t in enumerate(seq.output_ids):
            first.setdefault(t, i)
        for t, i in first.items():
            if t in eos:
                continue
            cand = (abs(i + 1 - ZOMBIE_TARGET), i + 1, t, prompt, sampling)
            if best is None or cand[0] < best[0]:
                best = cand
        if best is not None and best[0] <= 5:
            break
    _, length, stop, prompt, sampling = best
    params = SamplingParams(max_tokens=cap, ignore_eos=True, stop_token_ids=(stop,), **sampling)
    return prompt, params, length, stop


def run_zombie(args, loaded, engines, modes, result, device) -> None:
    prompt, params, length, stop = _zombie_request(engines[modes[0]], loaded, args)
    progress(args, f"zombie case: answer of {length} tokens ending on stop id {stop}")
    passes: dict[str, list[Pass]] = {m: [] for m in modes}
    for _ in range(args.warmup):
        for m in modes:
            timed_pass(engines[m], [prompt], params)
    for r in range(args.repeats):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            p = timed_pass(engines[m], [prompt], params)
            # Whole-request accounting: the prefill row is useful too.
            p.committed_tokens = len(p.outputs[0])
            passes[m].append(p)
            progress(args, f"zombie case {m}: repeat {r + 1}/{args.repeats}: {len(p.outputs[0])} tokens, "
                           f"{p.zombie_rows} zombie rows, {p.ms_per_step:.3f} ms/step")
    for m in modes:
        row = summarize(passes[m], 1, m, "zombie")
        row |= {"device": device, "model": loaded.name, "answer_tokens": length, "stop_token_id": stop,
                "zombie_rows_per_request": row["zombie_rows"] / row["repeats"]}
        result["zombie"].append(row)
    checkpoint(args, result)


def run(args) -> dict:
    streams_list = _csv(args.streams, int)
    modes = _csv(args.mode)
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--mode: unknown mode {m!r} (blocking, pipelined)")
    if not streams_list or min(streams_list) < 1:
        raise SystemExit("--streams: give positive integers, e.g. 1,32")
    if args.tokens < 1 or args.repeats < 1 or args.prompt_len < 1 or args.warmup < 0:
        raise SystemExit("--tokens, --repeats and --prompt-len must be >= 1, --warmup >= 0")
    device = resolve_device(args.device)
    if args.baseline and device.startswith("sim"):
        raise SystemExit("--baseline transformers runs on a real device: use --device cpu or cuda")
    if device != "cpu":
        return _run(args, streams_list, modes, device, None)
    # Every mode's engine (and the baseline) on one compute thread, the host's OpenMP regions on one
    # thread: one libgomp pool in the process, as in the worker (a pool per compute thread stopped
    # libgomp spinning and doubled the step: BENCHMARKS.md "Where a served one-stream step goes")
    from gpu_worker.device import Device, openmp_left_to_the_streams

    with openmp_left_to_the_streams():
        shared = Device("cpu")
        try:
            return _run(args, streams_list, modes, device, shared)
        finally:
            shared.close()


def _run(args, streams_list: list[int], modes: list[str], device: str, shared) -> dict:
    need_len = args.prompt_len + max(args.tokens + 1, ZOMBIE_TARGET + 40 if args.zombie_case else 0) + 16
    max_model_len = max(512, 1 << math.ceil(math.log2(need_len)))
    max_streams = max(streams_list) if not args.no_throughput else 1
    pages_per_seq = ceil_div(need_len, 16)
    kv_pages = max_streams * pages_per_seq + 8
    prefill_budget = max(512, max_streams * args.prompt_len)  # every prompt in one prefill launch

    t_load = time.perf_counter()
    progress(args, f"loading {args.model} on {device}")
    loaded = load_model(args.model, device, args.dtype, args.seed, max_model_len, args.quantization)
    cuda_graphs = not args.no_cuda_graphs
    engines = {m: make_engine(loaded, device, m == "pipelined", max_streams, max_model_len, kv_pages,
                              prefill_budget, cuda_graphs, shared, args.attention) for m in modes}
    hf = None
    if args.baseline == "transformers" and not args.no_throughput:
        progress(args, "building the transformers baseline on the same weights")
        hf = HFBaseline(loaded, args.baseline_dtype, shared)
    progress(args, f"ready in {time.perf_counter() - t_load:.1f} s")

    result = {
        "device": device,
        "model": args.model,
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "params": type(loaded.llama)(loaded.llama.config, device="meta").num_params(),  # quantized ones too
        "weights": loaded.weights,
        "cuda_graphs": cuda_graphs and device.startswith("cuda"),
        "attention": args.attention,
        "tokens": args.tokens,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rows": [],
        "speedup": {},
        "baseline": args.baseline,
        "baseline_dtype": str(hf.dtype).replace("torch.", "") if hf else None,
        "baseline_ratio": {},
        "baseline_ratio_by_mode": {},
        "zombie": [],
        "machine": machine_info(device, shared),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        if not args.no_throughput:
            run_throughput(args, loaded, engines, streams_list, modes, hf, result, device)
        if args.zombie_case:
            run_zombie(args, loaded, engines, modes, result, device)
    finally:
        for m, e in engines.items():
            st = e.stats()
            result.setdefault("graphs", {})[m] = {"count": st["cuda_graphs"], "capture_s": st["graph_capture_s"],
                                                  "in_place": st["graphs_in_place"]}
            e.close()
    result["wall_s"] = time.perf_counter() - t_load
    return result


def machine_info(device: str, shared=None) -> dict:
    """``shared``: the Device the engines share, whose compute thread's count is the forward's."""
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "torch_threads": on_compute(shared, torch.get_num_threads)}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


# ----------------------------------------------------------------------------- output


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _overruns(row: dict) -> str:
    if row.get("device_overruns") is None:
        return "-"
    return f"{row['device_overruns']}/{row['timed_steps']}"


def format_table(result: dict) -> str:
    held = "" if result.get("weights", "float") == "float" else f", weights {result['weights']}"
    lines = [f"Decode benchmark: model {result['model']} ({result['params'] / 1e6:.0f} M params{held}, activations "
             f"{result['dtype']}{', CUDA graphs' if result['cuda_graphs'] else ''}) on {result['device']}; "
             f"{result['tokens']} decode "
             f"steps per stream, prompt {result['prompt_len']} tokens, median of {result['repeats']} interleaved "
             f"repeats"]
    if result.get("baseline_dtype"):
        lines[0] += f"; transformers in {result['baseline_dtype']}"
    if not result["rows"]:
        lines[0] = (f"Decode benchmark: model {result['model']} ({result['params'] / 1e6:.0f} M params{held}, "
                    f"activations {result['dtype']}) on {result['device']}; median of {result['repeats']} interleaved "
                    f"repeats")
    head = ("| streams | mode | ms/step | spread (min-max) | device idle | overruns | host ms/step | zombie tax "
            "| tokens/s | vs blocking | vs transformers |")
    if result["rows"]:
        lines += ["", head, "|" + "---|" * 11]
    for r in result["rows"]:
        lo, hi = r["ms_per_step_spread"]
        idle = r["device_idle_fraction"]
        lines.append(
            f"| {r['streams']} | {r['mode']} | {_f(r['ms_per_step'])} | {lo:.3f}-{hi:.3f} | "
            f"{_f(idle if idle is None else 100 * idle, '{:.1f}%')} | {_overruns(r)} | {_f(r['host_ms_per_step'])} | "
            f"{_f(r['zombie_tax'], '{:.4f}')} | {_f(r['tokens_per_s'], '{:.0f}')} | "
            f"{_f(r.get('speedup_vs_blocking'), '{:.3f}x')} | {_f(r.get('ratio_vs_transformers'), '{:.2f}x')} |")
    late = [r for r in result["rows"] + result["zombie"] if r.get("device_overruns")]
    if late:
        lines += ["", f"WARNING: {sum(r['device_overruns'] for r in late)} simulated steps overran {result['device']} "
                      "(their real CPU work took longer): those rows measure this CPU, not the simulated device."]
    by = {(r["streams"], r["mode"]): r for r in result["rows"]}
    streams = sorted({r["streams"] for r in result["rows"]})
    if any((s, "blocking") in by and (s, "pipelined") in by for s in streams):
        lines += ["", "| hardware | streams | blocking | pipelined | gain | idle blocking | idle pipelined |",
                  "|---|---|---|---|---|---|---|"]
        for s in streams:
            b, p = by.get((s, "blocking")), by.get((s, "pipelined"))
            if b and p:
                gain = b["ms_per_step"] / p["ms_per_step"] - 1
                lines.append(f"| {result['device']} | {s} | {b['ms_per_step']:.2f} | {p['ms_per_step']:.2f} | "
                             f"{100 * gain:+.1f}% | {100 * b['device_idle_fraction']:.1f}% | "
                             f"{100 * p['device_idle_fraction']:.1f}% |")
    if result["zombie"]:
        lines += ["", "Zombie tax (1 stream, answer ends on a device-detected stop token):", "",
                  "| mode | answer tokens | zombie rows / request | zombie tax | ms/step | device idle |",
                  "|---|---|---|---|---|---|"]
        for r in result["zombie"]:
            lines.append(f"| {r['mode']} | {r['answer_tokens']} | {r['zombie_rows_per_request']:.2f} | "
                         f"{r['zombie_tax']:.4f} (1/{1 / r['zombie_tax']:.0f}) | {r['ms_per_step']:.3f} | "
                         f"{100 * r['device_idle_fraction']:.1f}% |" if r["zombie_tax"] else
                         f"| {r['mode']} | {r['answer_tokens']} | {r['zombie_rows_per_request']:.2f} | 0 | "
                         f"{r['ms_per_step']:.3f} | {100 * r['device_idle_fraction']:.1f}% |")
    return "\n".join(lines)


def emit(result: dict, args) -> None:
    table = format_table(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(result))
    else:
        print(table)


# ----------------------------------------------------------------------------- entry points


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench.decode", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flags, kw in OPTIONS:
        kw = dict(kw)
        if kw.pop("flag", False):
            ap.add_argument(*flags, action="store_true", help=kw["help"])
        else:
            ap.add_argument(*flags, **kw)
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    result = run(args)
    emit(result, args)
    return result


def _click_command():
    import click

    def callback(**kw):
        args = argparse.Namespace(**kw)
        try:
            result = run(args)
        except SystemExit as e:  # option errors from run(): one line, like click's own
            raise click.UsageError(str(e.code)) from None
        emit(result, args)

    fn = callback
    for flags, kw in reversed(OPTIONS):
        kw = dict(kw)
        dest = flags[0].lstrip("-").replace("-", "_")
        if kw.pop("flag", False):
            fn = click.option(*flags, dest, is_flag=True, help=kw["help"])(fn)
        else:
            choices = kw.pop("choices", None)
            typ = click.Choice(choices) if choices else kw.get("type", str)
            fn = click.option(*flags, dest, type=typ, default=kw["default"], show_default=True,
                              help=kw["help"])(fn)
    cmd = click.command("decode", help="Blocking vs pipelined decode: ms per step, device idle, host time, "
                                       "zombie tax; optional transformers baseline.\n\n\b\nExamples:\n"
                                       "  tandem bench decode --model tiny-random --device sim:2.6\n"
                                       "  tandem bench decode --device cpu --baseline transformers\n"
                                       "  tandem bench decode --zombie-case --no-throughput")(fn)
    return cmd


def __getattr__(name: str):
    """``decode_command`` (for ``tandem bench decode``) is built on first use: the
    benchmark itself runs without click (GPU images may lack it)."""
    if name == "decode_command":
        globals()[name] = _click_command()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
