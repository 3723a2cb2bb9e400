"""LoRA benchmark: decode ms/step of one batch with 0, 1, 4, 8 distinct adapters vs the base model.

    python -m bench.lora --model random-135m --device cpu --streams 32 --tokens 32 --repeats 3

Random PEFT-format adapters (every linear layer, rank ``--rank``) are written to
a temporary directory and served from ``--max-loras`` slots (as many as the most
distinct adapters, so no case reloads a slot while it is timed). Rows pick
their adapter round-robin. Cases, each timed like ``bench.decode`` (prefill
untimed, then the decode phase to idle; one warm-up pass, then ``--repeats``
passes interleaved over the cases; the median is reported):
- ``base``: an engine without adapters (no LoRA layers at all);
- ``0``: the LoRA engine, no row with an adapter (the forward skips the LoRA math);
- ``1``, ``4``, ``8``: that many distinct adapters among the rows, with each
  LoRA kernel of ``gpu_worker.lora.KERNELS`` (``--kernels``): every row
  applies its own slot's A/B in every wrapped layer.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.decode import _csv, load_model, machine_info, make_prompts, timed_pass

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: Path, config, rank: int, seed: int, b_std: float = 0.02) -> None:
    """A PEFT adapter directory with random A and B on every linear layer of ``config``
    (B's standard deviation ``b_std``: large enough, the adapter changes the greedy tokens)."""
    import torch
    from safetensors.torch import save_file

    from shared.lora_config import module_shapes

    shapes = module_shapes(asdict(config))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for m in MODULES:
            fan_in, fan_out = shapes[m]
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if m in MODULES[4:] else 'self_attn'}.{m}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[prefix + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_std
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES)}))


def run(args) -> dict:
    import torch

    from gpu_worker.engine import Engine, EngineConfig
    from shared.sampling import SamplingParams

    counts = _csv(args.adapters, int)
    loaded = load_model(args.model, args.device, args.dtype, args.seed, 2048, quantization="none")  # LoRA: float
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-lora-"))
    loras = {}
    for i in range(max(counts)):
        write_random_adapter(tmp / f"a{i}", loaded.llama.config, args.rank, args.seed + i)
        loras[f"a{i}"] = str(tmp / f"a{i}")

    def engine(llama, with_loras: bool):
        cfg = EngineConfig(model=loaded.name, device=args.device, max_batch=args.streams, page_size=16,
                           kv_pages=args.streams * 8 + 1, prefill_budget=2048,
                           dtype=str(loaded.dtype).replace("torch.", ""),
                           loras=loras if with_loras else {}, max_loras=max(counts))
        return Engine(cfg, llama=llama)

    # The LoRA engine wraps the model's layers in place: the base engine gets its own copy.
    base = engine(copy.deepcopy(loaded.llama), False)
    lora = engine(loaded.llama, True)
    prompts = make_prompts(args.streams, args.prompt_len, loaded.llama.config.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)
    cases = {"base": (base, None, None)}
    for n in counts:
        for kernel in (_csv(args.kernels) if n else ["gather"]):  # no adapter row: no LoRA math either way
            name = f"{n} {kernel}" if n else "0"
            cases[name] = (lora, [f"a{i % n}" for i in range(args.streams)] if n else None, kernel)
    ms: dict[str, list[float]] = {c: [] for c in cases}
    for repeat in range(args.repeats + 1):
        order = list(cases) if repeat % 2 == 0 else list(reversed(cases))
        for c in order:
            eng, adapters, kernel = cases[c]
            if kernel is not None:
                eng.runner.lora.kernel = kernel
            p = timed_pass(eng, prompts, params, adapters)
            if repeat:  # the first pass warms up
                ms[c].append(p.ms_per_step)
            print(f"[bench lora {time.strftime('%H:%M:%S')}] {c}: {p.ms_per_step:.2f} ms/step", file=sys.stderr)
    base_ms = statistics.median(ms["base"])
    rows = [{"adapters": c, "ms_per_step": statistics.median(v), "spread": [min(v), max(v)],
             "vs_base": statistics.median(v) / base_ms} for c, v in ms.items()]
    for eng in (base, lora):
        eng.close()
    shutil.rmtree(tmp)
    return {"model": args.model, "device": args.device, "streams": args.streams, "tokens": args.tokens,
            "rank": args.rank, "dtype": str(loaded.dtype), "torch_threads": torch.get_num_threads(),
            "machine": machine_info(args.device), "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="bench.lora", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="0,1,4,8", help="distinct adapter counts, comma-separated")
    ap.add_argument("--kernels", default="gather,masked", help="LoRA kernels to time (gpu_worker.lora.KERNELS)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    result = run(args)
    print(json.dumps(result))
    print(f"{'adapters':>10} {'ms/step':>9} {'min-max':>15} {'vs base':>8}", file=sys.stderr)
    for r in result["rows"]:
        print(f"{r['adapters']:>10} {r['ms_per_step']:9.2f} {r['spread'][0]:7.2f}-{r['spread'][1]:<7.2f} "
              f"{r['vs_base']:8.2f}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
