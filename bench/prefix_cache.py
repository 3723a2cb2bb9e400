"""What the prefix cache saves: TTFT and prefill tokens with the cache on and off.

    python -m bench.prefix_cache --model smollm2-135m --system-tokens 1500 --questions 8

1. A shared system prompt of about ``--system-tokens`` tokens followed by short
   questions, one request at a time (the first one fills the cache): TTFT and
   prompt tokens computed per request, cache on vs off, side by side.
2. A multi-turn chat: ``--users`` conversations of ``--turns`` turns, each turn's
   prompt the whole conversation so far (the chat template renders the earlier
   answers back): the hit rate (prompt tokens mapped / prompt tokens).

In-process engine (torch, transformers and numpy only), greedy decoding.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from gpu_worker.engine import Engine, EngineConfig
from shared.models.registry import DEFAULT_MODEL, load_tokenizer
from shared.sampling import SamplingParams

WORDS = ("river stone light garden paper window cloud market teacher bridge music winter ocean "
         "forest engine letter basket silver mountain village").split()


def system_prompt(tok, target_tokens: int, rng: random.Random) -> str:
    text = "You are a helpful assistant. Background notes follow. "
    while len(tok.encode(text)) < target_tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(40)) + ". "
    return text


def chat_ids(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def shared_system_prompt(engine: Engine, tok, system: str, questions: list[str], max_tokens: int) -> dict:
    ttft, computed = [], []
    for q in questions:
        ids = chat_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        seq = engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0]
        ttft.append(seq.t_first_token - seq.t_submit)
        computed.append(seq.prompt_len - seq.cached_tokens)
        print(f"  {len(ttft)}/{len(questions)} ttft {1e3 * ttft[-1]:.0f} ms, "
              f"{computed[-1]} of {seq.prompt_len} prompt tokens computed", file=sys.stderr)
    return {"prompt_tokens": seq.prompt_len, "first_ttft_ms": 1e3 * ttft[0],
            "later_ttft_ms_p50": 1e3 * statistics.median(ttft[1:]), "later_computed_tokens_p50":
            statistics.median(computed[1:]), "ttft_ms": [round(1e3 * t, 1) for t in ttft]}


def multi_turn(engine: Engine, tok, users: int, turns: int, max_tokens: int, rng: random.Random) -> dict:
    engine.reset_stats()
    convs = [[{"role": "system", "content": f"You are assistant number {u}."}] for u in range(users)]
    for turn in range(turns):
        for conv in convs:  # users interleave, as on a real server
            conv.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(12)) + "?"})
            seq = engine.generate([chat_ids(tok, conv)], SamplingParams(max_tokens=max_tokens))[0]
            conv.append({"role": "assistant", "content": tok.decode(seq.output_ids, skip_special_tokens=True)})
        print(f"  turn {turn + 1}/{turns}", file=sys.stderr)
    s = engine.stats()
    return {"hit_tokens": s["prefix_hit_tokens"], "query_tokens": s["prefix_query_tokens"],
            "hit_rate": s["prefix_hit_tokens"] / max(s["prefix_query_tokens"], 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.model)
    rng = random.Random(0)
    system = system_prompt(tok, args.system_tokens, rng)
    questions = [f"Question {i}: which word appears most often above?" for i in range(args.questions)]
    out = {}
    for on in (False, True):
        name = "cache_on" if on else "cache_off"
        print(f"{name}: shared system prompt", file=sys.stderr)
        engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_batch=8,
                                     max_model_len=4096, prefix_cache=on))
        try:
            out[name] = shared_system_prompt(engine, tok, system, questions, args.max_tokens)
            if on:
                print(f"{name}: multi-turn chat", file=sys.stderr)
                out["multi_turn"] = multi_turn(engine, tok, args.users, args.turns, 48, random.Random(1))
        finally:
            engine.close()
    out["ttft_speedup_on_hit"] = out["cache_off"]["later_ttft_ms_p50"] / out["cache_on"]["later_ttft_ms_p50"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
