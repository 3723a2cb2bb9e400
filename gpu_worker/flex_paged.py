"""Paged attention read in place: PyTorch's FlexAttention over the KV cache's own pages.

``model.attend_pages`` (the gather path) copies each sequence's pages into a
contiguous [S, Hkv, L, D] tensor per layer and runs SDPA with a materialised
mask; on a GPU that copy costs more than the bubble Tandem removes. Here
nothing is copied: a ``heads_major`` cache (``kv_cache.py``) is, per layer and
kv head, one key sequence of ``num_pages * page_size`` slots, and the
``BlockMask`` (one block per page, shared by the heads) lists each sequence's
own pages, so FlexAttention's compiled kernels (Triton on CUDA, inductor's
template on a CPU) read only those. ``mask_mod`` states the rule for every
slot, so FlexAttention's eager (dense) evaluation gives the same answer: query
(s, q) sees a slot iff its page is in s's table, at logical index j
(``page_owner``), and ``j * page_size + offset`` is at most the query's
position.

A mask's tensors have fixed shapes per (sequences, query length, pages per
table, cache pages): what a CUDA graph bucket fixes. FlexAttention needs the
block list padded to every page of the cache (its kernels assert the mask
covers the key length), so a mask costs 2 x S x num_pages int32 per forward.
The gather path stays the reference (``tests/engine/test_flex_paged.py``) and
the fallback (``model_runner``: chosen per decode graph at capture).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .batch import Batch
from .kv_cache import PagedKVCache


@dataclass
class InPlace:
    """What ``model.paged_attention`` takes in place of a dense mask: the forward's ``BlockMask`` and
    the attention that reads it (``flex_attention``, or a compiled one)."""

    mask: BlockMask
    attention: Callable


Q_BLOCK = 128  # the BlockMask's query block (FlexAttention's default): a multiple of every kernel's query tile


def page_owner(tables: torch.Tensor, used: torch.Tensor, num_pages: int) -> torch.Tensor:
    """[S, num_pages + 1] int32: each cache page's logical index in sequence s's table (its first
    ``used[s]`` entries), -1 where s does not hold it (the last column takes the unused entries)."""
    S, P = tables.shape
    logical = torch.arange(P, device=tables.device).expand(S, P)
    where = torch.where(logical < used[:, None], tables, num_pages)
    owner = torch.full((S, num_pages + 1), -1, dtype=torch.int32, device=tables.device)
    return owner.scatter_(1, where, logical.to(torch.int32))


def block_mask(batch: Batch, num_pages: int, page_size: int) -> BlockMask:
    """The ``BlockMask`` of one forward over a cache of ``num_pages`` pages (see the module docstring)."""
    tables, query_pos = batch.block_tables, batch.query_pos
    S, P = tables.shape
    Qmax = query_pos.shape[1]
    used = torch.div(query_pos.amax(dim=1), page_size, rounding_mode="floor") + 1  # [S] pages its queries see
    indices = torch.zeros(S, 1, 1, num_pages, dtype=torch.int32, device=tables.device)
    indices[:, 0, 0, :P] = tables.to(torch.int32)  # (entries past `used` are not read)
    owner = page_owner(tables, used, num_pages)

    def visible(b, h, q_idx, kv_idx):
        logical = owner[b, kv_idx // page_size]
        return (logical >= 0) & (logical * page_size + kv_idx % page_size <= query_pos[b, q_idx])

    q_block = -(-Qmax // Q_BLOCK) * Q_BLOCK  # one row of blocks; the kernels tile it by 16 query rows or more
    return BlockMask.from_kv_blocks(used.to(torch.int32)[:, None, None], indices, BLOCK_SIZE=(q_block, page_size),
                                    mask_mod=visible, seq_lengths=(Qmax, num_pages * page_size),
                                    compute_q_blocks=False)  # (the backward's transpose: never needed here)


def attend_pages_in_place(q: torch.Tensor, layer: int, batch: Batch, kv: PagedKVCache, mask: BlockMask,
                          attention=flex_attention) -> torch.Tensor:
    """``model.attend_pages`` without the copy: q [T, H, D] over ``layer`` of a ``heads_major`` cache
    (this forward's keys written) -> [T, H * D]. ``attention``: ``flex_attention`` or a compiled one."""
    H, D = q.shape[1], q.shape[2]
    S, Qmax = batch.query_index.shape
    keys, values = kv.by_head(layer)
    qp = q[batch.query_index].permute(0, 2, 1, 3).to(keys.dtype)  # [S, H, Qmax, D]
    out = attention(qp, keys, values, block_mask=mask, enable_gqa=True)
    return out.permute(0, 2, 1, 3).reshape(S * Qmax, H * D)[batch.token_to_padded].to(q.dtype)


RECOMPILES = 64  # dynamo's default limit is 8; past it a call would silently run the dense eager form


@functools.cache
def compiled_flex_attention() -> Callable:
    """FlexAttention compiled (its eager form is a dense reference: every slot of the cache), with
    static shapes: FlexAttention's decoding kernel (split over the keys, a kv head's query heads in
    one block) needs a static batch. Only the batch size varies between decode graphs (the cache's
    length is fixed, the table width stays outside), so there is one compile per batch bucket."""
    limit = torch._dynamo.config
    limit.recompile_limit = max(limit.recompile_limit, RECOMPILES)
    return torch.compile(flex_attention, dynamic=False)
