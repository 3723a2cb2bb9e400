"""Helpers of bench/gpu.sh: a correctness pre-check on the GPU, and the final summary table.

    python -m bench.gpu_check precheck [MODEL [DEVICE]]  # pipelined == blocking tokens on CUDA (exit 1 otherwise)
    python -m bench.gpu_check summary A.json ...  # the decode table, then a line per other bench JSON

Needs only torch, numpy (and transformers through the model code's imports);
no pyzmq, msgspec or grammar libraries.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import sys
import time
import traceback
import warnings

import numpy as np


def precheck(model: str = "random-135m", device: str = "cuda") -> int:
    import torch

    from bench.decode import load_model, make_engine
    from shared.sampling import SamplingParams

    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("PRECHECK FAILED: torch sees no CUDA device", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    where = torch.cuda.get_device_name() if cuda else device
    print(f"precheck: {where}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    loaded = load_model(model, device, "bfloat16" if cuda else None, seed=1, max_model_len=512)
    vocab = loaded.llama.config.vocab_size
    rng = random.Random(0)
    # Mixed prompts and lengths, greedy and seeded sampling. Length caps only (ignore_eos):
    # then both modes launch identical batches, so bf16 kernels see identical shapes and the
    # tokens must be bit-identical (an EOS zombie changes the batch, hence the bf16 rounding).
    reqs = []
    for i in range(24):
        plen = rng.choice([1, 3, 17, 33, 64, 100, rng.randint(1, 120)])
        kw = dict(max_tokens=rng.randint(1, 48), ignore_eos=True)
        if i % 3 == 1:
            kw |= dict(temperature=0.8, top_p=0.9, top_k=rng.choice([0, 50]), seed=rng.randrange(2**40))
        reqs.append(([rng.randrange(3, vocab) for _ in range(plen)], SamplingParams(**kw)))
    # And a 32-stream lockstep batch like the benchmark's.
    reqs32 = [([rng.randrange(3, vocab) for _ in range(32)], SamplingParams(max_tokens=40, ignore_eos=True))
              for _ in range(32)]
    outs, stats, syncs = {}, {}, []
    for mode in ("blocking", "pipelined"):
        engine = make_engine(loaded, device, mode == "pipelined", max_batch=32, max_model_len=512, kv_pages=600,
                             prefill_budget=256, cuda_graphs=True)
        sink = _RingSink(engine)  # sampled ids DMA'd into a page-locked shared-memory arena
        try:
            got = []
            with _sync_watch(cuda, syncs, mode):
                for batch in (reqs, reqs32):
                    seqs = [engine.submit(p, sp) for p, sp in batch]
                    sink.run_until_idle()
                    got += [(s.output_ids, s.finish_reason, s.error) for s in seqs]
            if not engine.idle:
                print(f"PRECHECK FAILED: {mode} engine not idle after the run (leaked rows or pages)")
                return 1
            if sink.mismatches:
                print(f"PRECHECK FAILED: {mode}: ids copied into the arena differ from the committed ids "
                      f"at {sink.mismatches} of {sink.checked} steps")
                return 1
            outs[mode], stats[mode] = got, engine.stats()
            stats[mode]["sink"] = f"{sink.checked} steps via {'page-locked' if sink.locked else 'pageable'} arena"
        finally:
            engine.close()
            sink.close()
    bad = [i for i, (a, b) in enumerate(zip(outs["blocking"], outs["pipelined"])) if a != b]
    errors = [o for o in outs["blocking"] + outs["pipelined"] if o[2]]
    ntok = sum(len(o[0]) for o in outs["blocking"])
    if errors:
        print(f"PRECHECK FAILED: request errors {errors[:3]}")
        return 1
    if bad:
        i = bad[0]
        a, b = outs["blocking"][i][0], outs["pipelined"][i][0]
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        print(f"PRECHECK FAILED: pipelined != blocking for {len(bad)}/{len(outs['blocking'])} requests; "
              f"first: request {i}, token {k}: blocking {a[k:k + 5]} pipelined {b[k:k + 5]}")
        return 1
    for mode, st in stats.items():
        if not (st["bubble_busy_s"] > 0 and 0 <= st["device_idle_fraction"] <= 1):
            print(f"PRECHECK FAILED: the CUDA-event bubble meter reads nothing in {mode} mode: {st}")
            return 1
    failure = _launch_failure_check(loaded, device)
    if failure:
        print(f"PRECHECK FAILED: after a failed launch: {failure}")
        return 1
    print(f"precheck OK: {len(outs['blocking'])} requests, {ntok} tokens identical in blocking and pipelined "
          f"({'bf16, CUDA graphs' if cuda else str(loaded.dtype)}); zombie rows {stats['pipelined']['zombie_rows']}; "
          f"ring sink {stats['pipelined']['sink']}; a failed launch fails only its steps; "
          f"{time.perf_counter() - t0:.0f} s")
    if syncs:  # correct but slow: report loudly, keep benchmarking
        print(f"!!!! {len(syncs)} synchronizing CUDA calls inside the engine loop (outside graph capture); first:")
        for where in list(dict.fromkeys(syncs))[:5]:
            print(f"     {where}")
    elif cuda:
        print("no synchronizing CUDA call inside the engine loop (torch.cuda.set_sync_debug_mode)")
    return 0


def _launch_failure_check(loaded, device: str) -> str | None:
    """A launch that raises (as an out-of-memory would) fails the requests in flight,
    and the engine keeps serving. None when that holds, else what went wrong."""
    from bench.decode import make_engine
    from shared.finish import FinishReason
    from shared.sampling import SamplingParams

    engine = make_engine(loaded, device, True, max_batch=8, max_model_len=512, kv_pages=200, prefill_budget=256,
                         cuda_graphs=True)
    real, armed = engine.runner.model.forward, [True]

    def flaky(*args, **kw):  # the next eager forward (a prefill) raises
        if armed:
            armed.clear()
            raise RuntimeError("injected launch failure")
        return real(*args, **kw)

    try:
        engine.runner.model.forward = flaky
        victims = [engine.submit([5, 6, 7], SamplingParams(max_tokens=8)) for _ in range(2)]
        engine.run_until_idle()
        if [v.finish_reason for v in victims] != [FinishReason.ERROR] * 2:
            return f"the requests in flight ended with {[(v.finish_reason, v.error) for v in victims]}"
        after = engine.generate([[4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        if len(after.output_ids) != 3 or after.error or not engine.idle:
            return f"the next request got {after.output_ids} ({after.error}); engine idle: {engine.idle}"
        return None
    finally:
        engine.close()


class _RingSink:
    """The worker's direct path, without the worker: the engine's copy stream writes
    each step's sampled ids into a shared-memory arena (page-locked on CUDA), passed
    as ``step(copy_into=...)``, and every commit checks them against the committed ids."""

    def __init__(self, engine) -> None:
        from shared.shm import Arena, Layout

        self.engine = engine
        self.arena = Arena.create(Layout(vocab_size=engine.vocab_size, ring_entries=8,
                                         max_rows=engine.config.max_batch))
        self.locked = engine.device.page_lock(self.arena.buffer, self.arena.layout.total_bytes)
        self.stage = self.arena.region("ring_stage")
        self.next = 0  # the next staging row handed out; at most two steps hold one, out of 8
        self.views: dict = {}
        self.checked = self.mismatches = 0

    def run_until_idle(self) -> None:
        n = self.stage.shape[0]
        while self.engine.has_work:
            views = [self.stage[(self.next + k) % n] for k in range(2)]
            for v in views:
                v[:] = -1
            tick = self.engine.tick(copy_into=self._copy_targets(views))
            for step, view in zip(tick.copied_steps, views):
                self.views[step] = view
                self.next += 1
            c = tick.committed
            view = self.views.pop(c.step, None) if c is not None else None
            if view is not None and c.rows:
                self.checked += 1
                self.mismatches += not np.array_equal(view[:c.rows], c.tokens)

    def _copy_targets(self, views: list) -> list:
        return views  # the arena rows themselves (the test redirects them to prove the check bites)

    def close(self) -> None:
        import torch

        if self.locked:
            torch.cuda.cudart().cudaHostUnregister(ctypes.addressof(ctypes.c_char.from_buffer(self.arena.buffer)))
        self.views.clear()
        self.stage = None
        self.arena.close()


@contextlib.contextmanager
def _sync_watch(cuda: bool, found: list, mode: str):
    """Collect every synchronizing CUDA call (``torch.cuda.set_sync_debug_mode``)
    made inside the block, except during CUDA-graph capture, which may sync."""
    if not cuda:
        yield
        return
    import torch

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        stack = traceback.extract_stack()[:-1]
        if any(f.name == "__init__" and f.filename.endswith("model_runner.py") for f in stack):
            return  # _DecodeGraph capture
        ours = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in stack
                if "/gpu_worker/" in f.filename or "/bench/" in f.filename]
        found.append(f"{mode}: " + " <- ".join(reversed(ours[-4:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        saved, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved


def summary(paths: list[str]) -> int:
    """The decode table from bench.decode's JSON files, bench.moondream's streams table, then one
    line per other bench JSON file (bench.split, bench.prefix_cache, bench.image_ttft, bench.lora)."""
    results = []
    for p in paths:
        try:
            with open(p) as f:
                results.append((os.path.basename(p), json.load(f)))
        except (OSError, ValueError) as e:
            print(f"(skipping {p}: {e})")
    decode = [r for _, r in results if "speedup" in r]
    if decode:
        _decode_table(decode)
    for _, r in results:
        if "detect_streams" in r:
            _moondream_table(r)
    for name, r in results:
        if "speedup" not in r and "detect_streams" not in r:
            print(f"{name}: {_feature_line(r)}")
    return 0 if results else 1


def _moondream_table(r: dict) -> None:
    print(f"\n=== Moondream {r['model']} ({r['params'] / 1e9:.2f} B parameters, {r['dtype']}, {r['device']}) ===")
    print("image encode ms: " + ", ".join(f"{k} {v:.1f}" for k, v in r["encode_ms"].items())
          + f"; caption TTFT {r['caption_ttft_ms']:.1f} ms; detect "
          + (f"{r['detect_ms_per_object']:.2f} ms per object" if r["detect_ms_per_object"] else "found no object"))
    print("| streams | rows | blocking ms/step | pipelined ms/step | gain | idle blocking | idle pipelined "
          "| tok/s pipelined |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("text_streams", "detect_streams"):
        for n, by in r[kind].items():
            b, p = by["blocking"], by["pipelined"]
            print(f"| {kind.split('_')[0]} | {n} | {b['ms_per_step']:.2f} | {p['ms_per_step']:.2f} | "
                  f"{100 * (b['ms_per_step'] / p['ms_per_step'] - 1):+.1f}% | {100 * b['device_idle']:.1f}% | "
                  f"{100 * p['device_idle']:.1f}% | {p['tokens_per_s']:.0f} |")


def _decode_table(results: list[dict]) -> None:
    gpu = next((r["machine"].get("gpu") for r in results if r["machine"].get("gpu")), results[0]["device"])
    r0 = results[0]
    kind = f"{r0['dtype']}{', CUDA graphs' if r0['cuda_graphs'] else ''}"
    print(f"\n=== Tandem decode on {gpu} ({kind}; ms per decode step, median of {r0['repeats']} repeats, "
          f"{r0['tokens']} steps) ===")
    print("| model | streams | blocking | pipelined | gain | idle blocking | idle pipelined | host ms/step pip. "
          "| transformers | pipelined vs transformers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for r in results:
        by = {(x["streams"], x["mode"]): x for x in r["rows"]}
        for s in sorted({x["streams"] for x in r["rows"]}):
            b, p, t = by.get((s, "blocking")), by.get((s, "pipelined")), by.get((s, "transformers"))
            if not (b and p):
                continue
            ok &= p["device_idle_fraction"] < 0.03
            tr = f"{t['ms_per_step']:.2f}" if t else "-"
            ratio = f"{p['tokens_per_s'] / t['tokens_per_s']:.2f}x" if t else "-"
            print(f"| {r['model']}{' (partial)' if r.get('partial') else ''} | {s} | {b['ms_per_step']:.2f} | "
                  f"{p['ms_per_step']:.2f} | {100 * (b['ms_per_step'] / p['ms_per_step'] - 1):+.1f}% | "
                  f"{100 * b['device_idle_fraction']:.1f}% | {100 * p['device_idle_fraction']:.1f}% | "
                  f"{p['host_ms_per_step']:.3f} | {tr} | {ratio} |")
        for m, g in r.get("graphs", {}).items():
            if g["count"]:
                print(f"  CUDA graphs {r['model']} {m}: {g['count']} captured in {g['capture_s'] * 1e3:.0f} ms "
                      f"({g['capture_s'] * 1e3 / g['count']:.0f} ms each), {g.get('in_place', 0)} reading the KV "
                      "pages in place")
        for z in r.get("zombie", []):
            print(f"  zombie case {r['model']} {z['mode']}: {z['zombie_rows_per_request']:.0f} zombie rows per "
                  f"{z['answer_tokens']}-token answer (tax {z['zombie_tax']:.4f})")
    print(f"target pipelined idle < 3%: {'met' if ok else 'NOT met'}")
    _attention_lines(results)


def _attention_lines(results: list[dict]) -> None:
    """The pipelined step with the KV pages read in place against gathered (``--attention gather``)."""
    for gathered in (r for r in results if r.get("attention") == "gather"):
        in_place = next((r for r in results if r["model"] == gathered["model"] and r.get("attention") != "gather"), None)
        if in_place is None:
            continue
        ms = {r.get("attention"): {x["streams"]: x["ms_per_step"] for x in r["rows"] if x["mode"] == "pipelined"}
              for r in (in_place, gathered)}
        graphs = in_place.get("graphs", {}).get("pipelined", {})
        how = f"--attention {in_place.get('attention')} ({graphs.get('in_place', 0)} of {graphs.get('count', 0)} " \
              "graphs in place)"
        for s in sorted(set(ms["gather"]) & set(ms[in_place.get("attention")])):
            a, b = ms[in_place.get("attention")][s], ms["gather"][s]
            print(f"  attention {gathered['model']}, {s} streams, pipelined: {a:.2f} ms/step with {how}, {b:.2f} "
                  f"with the pages gathered ({b / a:.2f}x)")


def _feature_line(r: dict) -> str:
    if "two_process_over_in_process" in r:
        return (f"{r['model']} {r['streams']} streams: in-process {r['in_process_tokens_per_s']:.0f} tok/s, "
                f"two-process {r['two_process_tokens_per_s']:.0f} tok/s (ratio {r['two_process_over_in_process']:.3f})")
    if "ttft_speedup_on_hit" in r:
        off, on = r["cache_off"], r["cache_on"]
        return (f"prefix cache, {on['prompt_tokens']}-token prompt: TTFT {off['later_ttft_ms_p50']:.1f} ms on a miss, "
                f"{on['later_ttft_ms_p50']:.1f} ms on a hit ({r['ttft_speedup_on_hit']:.1f}x); multi-turn hit rate "
                f"{100 * r['multi_turn']['hit_rate']:.0f}%")
    if "ttft_ms_median" in r:
        return "image TTFT ms (median): " + ", ".join(f"{k} {v:.1f}" for k, v in r["ttft_ms_median"].items())
    if "rank" in r:
        return (f"LoRA on {r['model']}, {r['streams']} streams, rank {r['rank']} (ms/step, x base): "
                + ", ".join(f"{x['adapters']} {x['ms_per_step']:.2f} ({x['vs_base']:.2f}x)" for x in r["rows"]))
    return "(not a bench result)"


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "precheck"
    if cmd == "precheck":
        sys.exit(precheck(*sys.argv[2:4]))
    if cmd == "summary":
        sys.exit(summary(sys.argv[2:]))
    sys.exit("usage: python -m bench.gpu_check precheck [MODEL [DEVICE]] | summary FILE.json ...")
