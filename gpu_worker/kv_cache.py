"""Paged KV cache: a pool of fixed-size pages.

A sequence owns a list of pages (its *block table*); the token at position
``p`` of a sequence lives in page ``block_table[p // page_size]`` at offset
``p % page_size``. Pages of one sequence need not be contiguous, so memory is
allocated page by page with no fragmentation and no copying when a sequence
grows. ``batch.py`` builds the index tensors that address it.
"""
from __future__ import annotations

import torch


class PagedKVCache:
    """K and V pools of shape ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]``: a kv
    head's rows in a page are contiguous, as an attention item reads them (one kv head of one
    sequence; ``kernels/kv_cache.h``). A token's *slot* is ``page * page_size + offset``
    (``Batch.kv_index``).

    Page 0 is reserved by the engine as a scratch page that padded rows write
    to; nothing here treats it specially.

    ``heads_major``: the memory holds each kv head's pages together, ``[num_layers, num_kv_heads,
    num_pages, page_size, head_dim]``, and ``k``/``v`` are that memory seen in the shape above; so
    one layer's keys are also one sequence per kv head (``by_head``), which FlexAttention reads in
    place (``flex_paged.py``). The CPU kernels read the default layout.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        heads_major: bool = False,
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.heads_major = heads_major
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim) if heads_major else \
            (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        # Zero-initialised so never-written places hold finite values: masked
        # attention weights are exactly 0, but 0 * NaN would still be NaN.
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        if heads_major:
            self.k, self.v = self.k.transpose(1, 2), self.v.transpose(1, 2)

    @classmethod
    def from_config(cls, config, num_pages: int, page_size: int, dtype: torch.dtype, device,
                    heads_major: bool = False) -> "PagedKVCache":
        """Cache shaped for a model config (anything with num_hidden_layers,
        num_key_value_heads and head_dim attributes, e.g. ``LlamaConfig``)."""
        return cls(config.num_hidden_layers, num_pages, page_size, config.num_key_value_heads,
                   config.head_dim, dtype, device, heads_major)

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page costs across all layers, K and V together."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, Hkv, D] into ``layer`` at their slots."""
        pages, offsets = slots // self.page_size, slots % self.page_size
        for cache, rows in ((self.k[layer], k), (self.v[layer], v)):
            by_slot(cache)[pages, offsets] = rows.to(cache.dtype)

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the sequences whose pages are ``tables`` [S, P], each contiguous:
        [S, Hkv, P * page_size, D], key j at position j of its sequence. ``index_select`` copies
        whole pages (4x faster than ``cache[tables]`` on a CPU, BENCHMARKS.md "The CPU forward")."""
        S, P = tables.shape
        return tuple(cache.index_select(0, tables.reshape(-1)).view(S, P, self.num_kv_heads, self.page_size, -1)
                     .transpose(1, 2).reshape(S, self.num_kv_heads, P * self.page_size, -1)
                     for cache in (self.k[layer], self.v[layer]))

    def by_head(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``heads_major`` cache's keys and values of ``layer`` as [1, Hkv, num_pages * page_size, D]
        (views): slot ``page * page_size + offset`` of each kv head."""
        if not self.heads_major:
            raise ValueError("by_head needs a heads_major cache (its kv heads' pages are apart otherwise)")
        return tuple(cache[layer].transpose(0, 1).reshape(1, self.num_kv_heads, -1, self.head_dim)
                     for cache in (self.k, self.v))

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def by_slot(cache: torch.Tensor) -> torch.Tensor:
    """One layer's cache [pages, Hkv, page_size, D] as a view [pages, page_size, Hkv, D]: indexed
    by (page, offset), a token's kv heads."""
    return cache.transpose(1, 2)
