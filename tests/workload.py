"""Shared test workloads: the mixed request set and a constraint that depends on the last token."""
from __future__ import annotations

import random

import numpy as np

VOCAB = 49152
WORDS = (VOCAB + 31) // 32


def banned_mask(last_token: int | None) -> np.ndarray:
    """int32 bitmask words: tokens congruent to ``last_token`` mod 5 are banned."""
    bits = np.ones(WORDS * 32, dtype=bool)
    bits[VOCAB:] = False
    if last_token is not None:
        bits[np.arange(last_token % 5, VOCAB, 5)] = False
    return np.packbits(bits, bitorder="little").view("<i4")


class BannedMatcher:
    """The same constraint as a frontend matcher (fill_mask / accept / output)."""

    def __init__(self):
        self.last = None

    def fill_mask(self, out):
        out[:] = banned_mask(self.last)

    def accept(self, token):
        if self.last is not None and token % 5 == self.last % 5:
            return False
        self.last = token
        return True

    def output(self, text):
        return None


class BannedByLastToken:
    """A constraint that depends on the last committed token: tokens congruent to
    it mod 5 are banned. A mask built before that commit would be detectably stale."""

    def __init__(self):
        self.calls = 0

    def __call__(self, seqs, step):
        words = np.empty((len(seqs), WORDS), dtype=np.int32)
        for i, seq in enumerate(seqs):
            # Never stale: every token before the one being sampled is committed.
            assert len(seq.output_ids) == seq.num_dispatched - 1, (seq.seq_id, step)
            words[i] = banned_mask(seq.output_ids[-1] if seq.output_ids else None)
        self.calls += 1
        return words, None


def workload(seed=0, n=64):
    """Mixed requests: prompt lengths 1..200, max_tokens 1..64, greedy and seeded
    temperature/top-p/top-k, stop token ids, a constrained subset."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.choice([1, 2, 7, 31, 64, 97, 150, 200, rng.randint(1, 200)])
        prompt = [rng.randrange(3, VOCAB) for _ in range(plen)]
        kind = i % 4
        kw = dict(max_tokens=rng.randint(1, 64))
        if kind == 1:
            kw |= dict(temperature=1.0, seed=rng.randrange(2**40))
        elif kind == 2:
            kw |= dict(temperature=0.8, top_p=0.9, top_k=rng.choice([0, 20, 200]), seed=rng.randrange(2**40))
        reqs.append(dict(prompt=prompt, params=kw, constrained=(i % 5 == 0)))
    return reqs


