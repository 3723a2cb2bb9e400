"""A tiny stand-in for the engine (paged KV cache, packed batches, greedy steps) that the model tests
drive a forward with, the way the engine does: ``Harness.run_standard_schedule``."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from gpu_worker.batch import Batch
from gpu_worker.kv_cache import PagedKVCache
from gpu_worker.model import Llama

PAGE_SIZE = 4


@dataclass
class Seq:
    tokens: list[int]
    pages: list[int]
    computed: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)


class Harness:
    """Tiny stand-in for the engine: owns the sequences and runs forwards."""

    def __init__(self, model: Llama, prompts: list[list[int]], max_new: int, num_pages: int, seed: int = 0,
                 kv_dtype: torch.dtype = torch.float32):
        cfg = model.config
        self.model = model
        self.kv = PagedKVCache(cfg.num_hidden_layers, num_pages, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                               kv_dtype, "cpu")
        free = list(range(1, num_pages))  # page 0 is the engine's scratch page
        random.Random(seed).shuffle(free)  # non-contiguous, out-of-order pages
        self.seqs = []
        for p in prompts:
            n = -(-(len(p) + max_new) // PAGE_SIZE)
            self.seqs.append(Seq(list(p), [free.pop() for _ in range(n)]))
        self.max_pages = max(len(s.pages) for s in self.seqs)

    def step(self, plan: list[tuple[int, int]], **build_kwargs) -> torch.Tensor:
        """plan: [(seq index, new tokens)]; records per-position logits, appends greedy tokens."""
        chunks, ids = [], []
        for i, n in plan:
            s = self.seqs[i]
            chunks.append((s.computed, n, s.pages))
            ids += s.tokens[s.computed:s.computed + n]
        batch = Batch.build(chunks, PAGE_SIZE, "cpu", **build_kwargs)
        real = len(ids)
        ids += [0] * (batch.num_tokens - real)  # dummy tokens of padding sequences
        logits = self.model(torch.tensor(ids), batch, self.kv, torch.arange(real))
        assert logits.shape == (real, self.model.config.vocab_size) and logits.dtype == torch.float32
        off = 0
        for i, n in plan:
            s = self.seqs[i]
            for j in range(n):
                s.logits[s.computed + j] = logits[off + j]
            s.computed += n
            off += n
            if s.computed == len(s.tokens):  # caught up: sample the next token greedily
                s.tokens.append(int(logits[off - 1].argmax()))
        return logits

    def run_standard_schedule(self, decode_steps: int = 8) -> None:
        assert len(self.seqs) >= 4
        a, b, c, d = (len(self.seqs[i].tokens) for i in range(4))
        # 1) one packed prefill: the first part of prompt 0 plus prompts 1 and 2 whole.
        self.step([(0, a // 2), (1, b), (2, c)])
        # 2) the rest of prompt 0 (chunked prefill), prompt 3, and the first decode
        #    tokens of sequences 1 and 2 in the same forward.
        self.step([(0, a - a // 2), (3, d), (2, 1), (1, 1)])
        # 3) decode the whole batch, one token per sequence per step, in varying
        #    order; some steps padded to a CUDA-graph-style bucket and filled in place.
        n = len(self.seqs)
        bucket = dict(num_pages_per_seq=self.max_pages + 1, pad_sequences_to=n + 2)
        static = Batch.build([(0, 1, [0])] * n, PAGE_SIZE, "cpu", **bucket)
        order = list(range(n))
        for t in range(decode_steps):
            random.Random(t).shuffle(order)
            plan = [(i, 1) for i in order]
            if t % 3 == 0:
                self.step(plan)
            elif t % 3 == 1:
                self.step(plan, **bucket)
            else:
                self.step(plan, out=static, **bucket)

    def check_against(self, hf) -> float:
        worst = 0.0
        for s in self.seqs:
            with torch.no_grad():
                ref = hf(torch.tensor([s.tokens[:s.computed]])).logits[0].double()
            ours = torch.stack([s.logits[p] for p in range(s.computed)]).double()
            worst = max(worst, (ours - ref).abs().max().item())
        return worst
