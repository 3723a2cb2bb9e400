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
    """K and V pools of shape ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.

    Page 0 is reserved by the engine as a scratch page that padded rows write
    to; nothing here treats it specially.
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
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # Zero-initialised so never-written places hold finite values: masked
        # attention weights are exactly 0, but 0 * NaN would still be NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def from_config(cls, config, num_pages: int, page_size: int, dtype: torch.dtype, device) -> "PagedKVCache":
        """Cache shaped for a model config (anything with num_hidden_layers,
        num_key_value_heads and head_dim attributes, e.g. ``LlamaConfig``)."""
        return cls(config.num_hidden_layers, num_pages, page_size, config.num_key_value_heads,
                   config.head_dim, dtype, device)

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page costs across all layers, K and V together."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
