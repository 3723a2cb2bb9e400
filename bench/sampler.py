"""The sampler's cost per call on this machine: one ``sample`` over a batch of logits, with the
token counting a penalized batch adds (``RowParams.count``), for a plain greedy batch and for
batches with penalties, a logit bias, min_tokens or temperature sampling.

    python -m bench.sampler [--rows 32] [--vocab 49152] [--calls 50] [--device cpu]

Prints the median and the least milliseconds per call of each case (after a warm-up): the
sampler's alone, no forward. Each row's prompt has ``--prompt-len`` random tokens, and the calls
sample its next positions (the bound on the tokens a row has seen is its position, as the engine
passes it).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker.sampler import RowParams, sample
from shared.sampling import SamplingParams

CASES = {
    "greedy": dict(temperature=0.0),
    "penalties (presence, frequency, repetition)": dict(temperature=0.0, presence_penalty=0.5,
                                                        frequency_penalty=0.5, repetition_penalty=1.2),
    "repetition_penalty only": dict(temperature=0.0, repetition_penalty=1.2),
    "logit_bias (10 tokens)": dict(temperature=0.0, logit_bias={t: 5.0 for t in range(10)}),
    "min_tokens": dict(temperature=0.0, min_tokens=1000, max_tokens=2000),
    "temperature 0.8, top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "temperature 0.8, top_p 0.9, penalties": dict(temperature=0.8, top_p=0.9, presence_penalty=0.5,
                                                  frequency_penalty=0.5, repetition_penalty=1.2),
}


def time_case(kw: dict, rows: int, vocab: int, calls: int, device: torch.device,
              prompt_len: int) -> tuple[float, float]:
    p = SamplingParams(**kw)
    params = RowParams(rows, vocab, device, max_len=2048)  # the engine's: its context
    gen = torch.Generator().manual_seed(0)
    for r in range(rows):
        params.set_row(r, p, seed=r, eos_ids=(2,),
                       prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=gen).tolist())
    idx = torch.arange(rows, device=device)
    logits = torch.randn(rows, vocab, generator=gen).to(device)
    flags = dict(any_random=p.temperature > 0, any_filter=p.temperature > 0 and p.top_p < 1.0,
                 want_logprobs=False, any_bias=bool(p.logit_bias), any_penalty=p.penalized,
                 any_min_tokens=p.min_tokens > 0)
    times = []
    for step in range(calls + 5):
        pos = torch.full((rows,), prompt_len + step, dtype=torch.int64, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            # the engine's bound on the tokens a row has seen: the position it samples
            tokens, *_ = sample(logits, idx, pos, params, **flags, seen_width=prompt_len + step)
            if p.penalized:
                params.count(idx, tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= 5:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"rows {args.rows}, vocab {args.vocab}, prompt {args.prompt_len} tokens, {args.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, kw in CASES.items():
        median, least = time_case(kw, args.rows, args.vocab, args.calls, device, args.prompt_len)
        print(f"{name:48s} {median:8.2f} ms per call (median), {least:8.2f} (min)")


if __name__ == "__main__":
    main()
