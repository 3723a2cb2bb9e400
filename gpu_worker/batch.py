"""The per-forward batch metadata that addresses the paged KV cache.

A forward pass processes a *packed* list of T tokens: the concatenation of one
chunk of new tokens per sequence (a whole prompt, part of a prompt, or a single
decode token). :class:`Batch` holds the index tensors the model needs to
scatter the new K/V into the cache (``kv_cache.py``) and to gather each
sequence's keys back.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from shared.arith import ceil_div


# Field order of Batch, also the order copy_from walks.
_FIELDS = ("positions", "kv_index", "block_tables", "query_index", "query_pos", "token_to_padded")


@dataclass
class Batch:
    """Index tensors (all int64, on the model's device) for one packed forward.

    T = total new tokens, S = sequences, P = pages per block table,
    Qmax = the most new tokens any sequence has in this forward.
    Decode is the special case Qmax == 1 and T == S.
    """

    positions: torch.Tensor  # [T] absolute position of each token
    kv_index: torch.Tensor  # [T] page * page_size + offset, where the token's K/V goes
    block_tables: torch.Tensor  # [S, P] page ids per sequence, unused entries 0
    query_index: torch.Tensor  # [S, Qmax] index into T of each query token (padding -> 0)
    query_pos: torch.Tensor  # [S, Qmax] position of each query token (padding -> 0); key j visible iff j <= pos
    token_to_padded: torch.Tensor  # [T] index of each token in the flattened [S * Qmax] layout

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_query_len(self) -> int:
        return self.query_index.shape[1]

    @classmethod
    def build(
        cls,
        chunks: Sequence[tuple[int, int, Sequence[int]]],
        page_size: int,
        device: torch.device | str = "cpu",
        num_pages_per_seq: int | None = None,
        pad_sequences_to: int | None = None,
        out: "Batch | None" = None,
    ) -> "Batch":
        """Build the metadata for ``chunks`` = [(start_pos, num_tokens, block_table), ...].

        The forward's T tokens are the concatenation of the chunks' tokens, chunk
        i covering positions start_pos .. start_pos + num_tokens - 1 of its sequence.

        num_pages_per_seq: fixes P (CUDA graphs need fixed shapes); default is the
            most pages any chunk needs. Longer block tables are truncated to P.
        pad_sequences_to: appends dummy one-token sequences (position 0, page 0)
            until S reaches this size, for CUDA-graph batch-size buckets. Each
            dummy adds one token, so for decode T == S still holds; the caller
            feeds any token id for them and ignores their outputs.
        out: if given, fill this preallocated Batch in place (shapes must match)
            instead of allocating new device tensors; returns ``out``.
        """
        chunks = list(chunks)
        if pad_sequences_to is not None:
            if pad_sequences_to < len(chunks):
                raise ValueError(f"pad_sequences_to={pad_sequences_to} < {len(chunks)} sequences")
            chunks += [(0, 1, (0,))] * (pad_sequences_to - len(chunks))
        if not chunks:
            raise ValueError("Batch.build needs at least one chunk")
        num_seqs = len(chunks)

        # Everything below is vectorised over tokens/sequences with numpy; the
        # only per-sequence Python work is unpacking the ragged input lists.
        starts = np.fromiter((c[0] for c in chunks), dtype=np.int64, count=num_seqs)
        lens = np.fromiter((c[1] for c in chunks), dtype=np.int64, count=num_seqs)
        if (lens < 1).any() or (starts < 0).any():
            raise ValueError("every chunk needs num_tokens >= 1 and start_pos >= 0")
        table_lens = np.fromiter((len(c[2]) for c in chunks), dtype=np.int64, count=num_seqs)
        flat_tables = np.fromiter(itertools.chain.from_iterable(c[2] for c in chunks), dtype=np.int64,
                                  count=int(table_lens.sum()))

        pages_needed = ceil_div(starts + lens, page_size)
        if (table_lens < pages_needed).any():
            bad = int(np.argmax(table_lens < pages_needed))
            raise ValueError(f"chunk {bad} needs {pages_needed[bad]} pages, block table has {table_lens[bad]}")
        max_pages = int(pages_needed.max())
        num_pages = max_pages if num_pages_per_seq is None else num_pages_per_seq
        if num_pages < max_pages:
            raise ValueError(f"num_pages_per_seq={num_pages} < {max_pages} pages needed")

        # Scatter the ragged block tables into a zero-padded [S, P] array.
        table_starts = np.cumsum(table_lens) - table_lens
        row = np.repeat(np.arange(num_seqs), table_lens)
        col = np.arange(len(flat_tables)) - np.repeat(table_starts, table_lens)
        keep = col < num_pages
        block_tables = np.zeros((num_seqs, num_pages), dtype=np.int64)
        block_tables[row[keep], col[keep]] = flat_tables[keep]

        # Per-token: which sequence, offset within its chunk, absolute position.
        total = int(lens.sum())
        tok_starts = np.cumsum(lens) - lens  # first token index of each chunk
        seq_of_tok = np.repeat(np.arange(num_seqs), lens)
        offset = np.arange(total) - tok_starts[seq_of_tok]
        positions = starts[seq_of_tok] + offset
        kv_index = block_tables[seq_of_tok, positions // page_size] * page_size + positions % page_size

        # Padded [S, Qmax] query layout; padding points at token 0 / position 0
        # so it stays finite (key 0 is always visible).
        qmax = int(lens.max())
        q = np.arange(qmax)[None, :]
        valid = q < lens[:, None]
        query_index = np.where(valid, tok_starts[:, None] + q, 0)
        query_pos = np.where(valid, starts[:, None] + q, 0)
        token_to_padded = seq_of_tok * qmax + offset

        host = dict(positions=positions, kv_index=kv_index, block_tables=block_tables,
                    query_index=query_index, query_pos=query_pos, token_to_padded=token_to_padded)
        if out is None:
            return cls(**{k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in host.items()})
        for name in _FIELDS:
            dst = getattr(out, name)
            if tuple(dst.shape) != host[name].shape:
                raise ValueError(f"Batch.{name}: shape {tuple(dst.shape)} != {host[name].shape}")
            dst.copy_(torch.from_numpy(np.ascontiguousarray(host[name])))
        return out

    def copy_from(self, other: "Batch") -> "Batch":
        """Overwrite this batch's tensors in place (for CUDA-graph replay)."""
        for f in fields(self):
            dst, src = getattr(self, f.name), getattr(other, f.name)
            if dst.shape != src.shape:
                raise ValueError(f"Batch.{f.name}: shape {tuple(dst.shape)} != {tuple(src.shape)}")
            dst.copy_(src)
        return self
