"""Where one decode step's time goes: the model forward alone, at S streams, on the CPU (or CUDA).

    python -m bench.profile_step --model smollm2-135m --streams 1,32 --context 111 --steps 20
    python -m bench.profile_step --model random-135m --streams 32 --threads 1 --no-pack

Per stream count: S sequences of ``--context`` cached tokens each (random ids; the
cache is filled by one prefill), then ``--steps`` decode forwards of one token per
sequence, timed (median ms per forward), then the same steps under the torch
profiler. Printed: the ops that take the time (self CPU time per step, calls per
step) and a per-part breakdown (attention, MLP, norms, lm_head, the rest of the
forward), from profiler ranges around each module.

The model is the engine's: bf16 linears packed once on a CPU (``--no-pack``: plain), for the
fused kernels' AMX matmul where the CPU has AMX (else, and with ``--no-kernels``, for oneDNN), and
the fused CPU kernels for everything else (``--no-kernels``: the eager ops; in the profile each
kernel call is its op ``tandem::<name>``, the matmul's ``tandem::linear``).
``--compare-matmul`` alternates the kernels' matmul with oneDNN's (both packed, the same fused
kernels around them).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _part_ranges(model):
    """Profiler ranges around the modules, named by part (attention, mlp, norm, lm_head)."""
    import torch

    from gpu_worker.model import MLP, Attention, RMSNorm

    handles = []

    def wrap(module, name):
        def pre(mod, args):
            mod._range = torch.profiler.record_function(f"part::{name}")
            mod._range.__enter__()

        def post(mod, args, out):
            mod._range.__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    for m in model.modules():
        if isinstance(m, Attention):
            wrap(m, "attention")
        elif isinstance(m, MLP):
            wrap(m, "mlp")
        elif isinstance(m, RMSNorm):
            wrap(m, "norm")
    wrap(model.lm_head, "lm_head")
    return handles


class _OneByOne:
    """The fused CPU kernels without ``layers``, their one-call loop: the model runs its Python loop
    over them, so that the profile splits a step by kernel (each call is its op ``tandem::<name>``)."""

    def __init__(self, kernels):
        self._kernels = kernels

    def __getattr__(self, name):
        if name == "layers":
            raise AttributeError(name)
        return getattr(self._kernels, name)


def compare(a: tuple, b: tuple, step, prefill, steps: int) -> None:
    """Wall and CPU ms of a decode step and of the prefill, variant ``a`` vs ``b`` (each (name, model)),
    alternating call by call (so a noisy neighbour hits both alike)."""
    import torch

    wall = {a[0]: [], b[0]: []}
    cpu = {a[0]: [], b[0]: []}
    fill = {a[0]: [], b[0]: []}
    with torch.inference_mode():
        for i in range(steps):
            for name, m in (a, b)[::1 if i % 2 else -1]:
                t0, c0 = time.perf_counter(), time.process_time()
                step(i, m)
                wall[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name].append((time.process_time() - c0) * 1e3)
                if i < 4:
                    t0 = time.perf_counter()
                    prefill(m)
                    fill[name].append((time.perf_counter() - t0) * 1e3)
    (x, y) = (a[0], b[0])
    med = {k: {n: statistics.median(v[n]) for n in v} for k, v in (("wall", wall), ("cpu", cpu), ("fill", fill))}
    print(f"{x} vs {y} (median ms): decode wall {med['wall'][x]:.2f} vs {med['wall'][y]:.2f} "
          f"({med['wall'][y] / med['wall'][x]:.2f}x), CPU {med['cpu'][x]:.2f} vs {med['cpu'][y]:.2f} "
          f"({med['cpu'][y] / med['cpu'][x]:.2f}x); prefill wall {med['fill'][x]:.2f} vs {med['fill'][y]:.2f} "
          f"({med['fill'][y] / med['fill'][x]:.2f}x); load {os.getloadavg()[0]:.2f}")


class _WithKernels:
    """The model with the fused kernels attached (or not) for each call: one model, two variants."""

    def __init__(self, model, kernels):
        self.model, self.kernels = model, kernels

    def __call__(self, *args):
        self.model.cpu_kernels = self.kernels
        return self.model(*args)


def profile(args) -> None:
    import numpy as np
    import torch

    from bench.decode import load_model
    from gpu_worker.batch import Batch
    from gpu_worker.kv_cache import PagedKVCache
    from gpu_worker.cpu_backend import PackedLinear, pack_linears

    torch.set_num_threads(args.threads or torch.get_num_threads())
    loaded = load_model(args.model, args.device, args.dtype, 0, 2048, quantization="none")  # float linears
    model, dev = loaded.llama, loaded.torch_device
    if args.kernels and dev == "cpu" and loaded.dtype == torch.bfloat16:
        from gpu_worker import cpu_kernels

        model.cpu_kernels = cpu_kernels.load()
    kernels_loaded = model.cpu_kernels
    plain = onednn = None
    if args.compare_pack:  # a second, unpacked copy of the weights
        plain = load_model(args.model, args.device, args.dtype, 0, 2048, quantization="none").llama
    if args.compare_matmul and kernels_loaded is not None:  # a second copy, packed for oneDNN
        onednn = load_model(args.model, args.device, args.dtype, 0, 2048, quantization="none").llama
        pack_linears(onednn)
        onednn.cpu_kernels = kernels_loaded
    if args.pack:
        pack_linears(model, kernels_loaded)
    page = 16
    print(f"model {args.model} dtype {loaded.dtype} threads {torch.get_num_threads()} "
          f"packed linears {any(isinstance(m, PackedLinear) for m in model.modules())} "
          f"(for the kernels' matmul {any(getattr(m, 'kernels', None) for m in model.modules())}) "
          f"fused kernels {model.cpu_kernels is not None} "
          f"load {os.getloadavg()[0]:.2f}")
    for streams in args.streams:
        pages_per_seq = -(-(args.context + args.steps + 1) // page)
        kv = PagedKVCache.from_config(model.config, streams * pages_per_seq + 1, page, loaded.dtype, dev)
        tables = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(streams)]
        rng = np.random.default_rng(0)
        with torch.inference_mode():
            prompt = torch.from_numpy(rng.integers(3, model.config.vocab_size, streams * args.context)).to(dev)
            prefill = Batch.build([(0, args.context, t) for t in tables], page, device=dev)
            prefill_rows = torch.arange(streams, device=dev) * args.context + args.context - 1
            model(prompt, prefill, kv, prefill_rows)
        ids = torch.from_numpy(rng.integers(3, model.config.vocab_size, streams)).to(dev)

        def step(i, m=model, tables=tables, pages_per_seq=pages_per_seq, ids=ids, kv=kv, streams=streams):
            batch = Batch.build([(args.context + i, 1, t) for t in tables], page, device=dev,
                                num_pages_per_seq=pages_per_seq)
            return m(ids, batch, kv, torch.arange(streams, device=dev))

        t0 = time.perf_counter()
        with torch.inference_mode():
            step(0)
        first_s = time.perf_counter() - t0
        def prefill_step(m, prompt=prompt, prefill=prefill, kv=kv, rows=prefill_rows):
            return m(prompt, prefill, kv, rows)
        if plain is not None:
            plain.cpu_kernels = kernels_loaded
            compare(("packed", model), ("plain", plain), step, prefill_step, args.steps)
        if onednn is not None:
            compare(("kernels' matmul", model), ("oneDNN's", onednn), step, prefill_step, args.steps)
        if args.compare_kernels and model.cpu_kernels is not None:
            compare(("fused", _WithKernels(model, model.cpu_kernels)), ("eager", _WithKernels(model, None)), step,
                    prefill_step, args.steps)
            model.cpu_kernels = kernels_loaded
        times, cpu = [], []
        with torch.inference_mode():
            for i in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                step(i)
                if dev != "cpu":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
                cpu.append((time.process_time() - c0) * 1e3)
        # CPU time (all threads of this process) is what a loaded machine disturbs least.
        print(f"\n== {streams} streams, context {args.context}, "
              f"{statistics.median(times):.2f} ms per forward (median of {args.steps}; min {min(times):.2f}), "
              f"CPU {statistics.median(cpu):.2f} ms; "
              f"first call {first_s:.1f} s; load {os.getloadavg()[0]:.2f}")
        handles = _part_ranges(model)
        kernels = model.cpu_kernels
        if kernels is not None:
            model.cpu_kernels = _OneByOne(kernels)
        acts = [torch.profiler.ProfilerActivity.CPU]
        on_gpu = dev != "cpu"
        if on_gpu:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.inference_mode(), torch.profiler.profile(activities=acts) as prof:
            for i in range(args.steps):
                step(i)
            if on_gpu:
                torch.cuda.synchronize()
        for h in handles:
            h.remove()
        model.cpu_kernels = kernels
        events = prof.key_averages()
        # On a GPU an op's time is its kernels' (self device time); on a CPU its self CPU time.
        own = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
        ops = [e for e in events if not e.key.startswith("part::")]
        total = sum(own(e) for e in ops) or 1
        print(f"{'op':<48} {'share':>6} {'ms/step':>8} {'calls/step':>10}")
        for e in sorted(ops, key=lambda e: -own(e))[:args.top]:
            ms, calls = own(e) / 1e3 / args.steps, e.count / args.steps
            print(f"{e.key[:48]:<48} {own(e) / total:6.1%} {ms:8.2f} {calls:10.0f}")
        parts = defaultdict(float)
        for e in events:
            if e.key.startswith("part::"):
                parts[e.key[6:]] += e.cpu_time_total
        if parts:
            whole = total / 1e3 / args.steps
            each = ", ".join(f"{k} {v / 1e3 / args.steps:.2f}" for k, v in parts.items())
            print(f"parts (CPU ms/step, profiled): {each}; all ops {whole:.2f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--context", default=111, type=int, help="cached tokens per sequence (47 prompt + 64 answer)")
    ap.add_argument("--steps", default=20, type=int)
    ap.add_argument("--threads", default=0, type=int, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--no-pack", dest="pack", action="store_false", help="plain linears (no oneDNN prepacking)")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false",
                    help="the eager forward (no fused CPU kernels, gpu_worker/kernels/)")
    ap.add_argument("--compare-pack", action="store_true",
                    help="also time packed vs plain linears, alternating (decode and prefill)")
    ap.add_argument("--compare-matmul", action="store_true",
                    help="also time the kernels' AMX matmul vs oneDNN's, alternating (decode and prefill)")
    ap.add_argument("--compare-kernels", action="store_true",
                    help="also time the fused kernels vs the eager ops, alternating (decode and prefill)")
    ap.add_argument("--top", default=14, type=int)
    profile(ap.parse_args(argv))


if __name__ == "__main__":
    main()
