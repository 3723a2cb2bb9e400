"""What a running sequence holds: KV pages (``page_pool.PagePool``) and a batch row.

Both are handed out at admission and taken back exactly once, when a sequence
is finalized and no launched step references it any more. Freeing something
twice, or something never handed out, raises: that is a bookkeeping bug, and
hiding it would corrupt another request's cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from shared.arith import ceil_div
from shared.page_names import ROOT, chain

from .page_pool import PagePool

if TYPE_CHECKING:
    import numpy as np

    from .scheduler import PrefillChunk
    from .sequence import Sequence


class FreeList:
    def __init__(self, name: str, ids: range) -> None:
        self.name = name
        self.capacity = len(ids)
        self._free = list(reversed(ids))  # pop() hands out the lowest id first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{self.name}: {n} wanted, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"{self.name}: double free of {i}")
            self._used.remove(i)
            self._free.append(i)


class Allocator:
    """Hands out, at admission, a sequence's KV pages (``PagePool``: shared by refcount with
    the prefix cache) and its batch row; takes both back at release."""

    def __init__(self, num_pages: int, page_size: int, max_rows: int, prefix_cache: bool = True) -> None:
        self.page_size = page_size
        self.pages = PagePool(num_pages, caching=prefix_cache)
        self.rows = FreeList("batch rows", range(max_rows))

    def pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size)

    def can_admit(self, num_tokens: int, hits: list[int] = ()) -> bool:
        return self.rows.can_allocate(1) and self.pages.can_allocate(self.pages_for(num_tokens) - len(hits), hits)

    def admit(self, num_tokens: int, hits: list[int] = ()) -> tuple[int, list[int]]:
        """A batch row and the pages for ``num_tokens``: the cached ``hits`` first, then fresh ones."""
        pages = self.pages.acquire(hits, self.pages_for(num_tokens) - len(hits))
        return self.rows.allocate(1)[0], pages

    def release(self, row: int, pages: list[int]) -> None:
        self.pages.release(pages)
        self.rows.free([row])

    def stats(self) -> dict:
        return {
            "kv_pages_free": self.pages.num_free,  # free or cached: what an allocation can take
            "kv_pages_total": self.pages.capacity,
            "kv_pages_cached": self.pages.num_cached,
            "prefix_cache_evictions": self.pages.evictions,
            "rows_free": self.rows.num_free,
            "rows_total": self.rows.capacity,
        }

    @property
    def idle(self) -> bool:
        """Every page free or cached and unreferenced, every row free."""
        return self.pages.idle and self.rows.num_free == self.rows.capacity

    def name_full_pages(self, seq: Sequence) -> None:
        """Name the sequence's pages whose KV is complete and committed (prompt and generated
        tokens alike, so a follow-up turn hits): from now on other requests may map them. A page in
        which no image begins is also a child ``PagePool.partial`` finds (the image's hash is in the
        name, not in the tokens)."""
        size = self.page_size
        full = min(seq.kv_committed, seq.cacheable_len) // size
        if seq.pages_registered >= full:
            return
        names = seq.page_names
        tokens = seq.prompt_ids + seq.output_ids
        if len(names) < full:
            names += chain(tokens[len(names) * size:], size, full - len(names), seq.page_salt,
                           parent=names[-1] if names else ROOT, page_salts=seq.image_salts(len(names), full, size))
        first = seq.pages_registered
        for i, image_salt in enumerate(seq.image_salts(first, full, size), first):
            self.pages.register(seq.pages[i], names[i], names[i - 1] if i else ROOT, seq.page_salt,
                                tokens[i * size:(i + 1) * size] if not image_salt else ())
        seq.pages_registered = full

    def check_exclusive(self, seqs: list[Sequence], decode_pos: np.ndarray, prefill: list[PrefillChunk]) -> None:
        """Debug: a launch (its decode rows, then its prefill chunks) writes KV only into pages no
        other request reads (never a cached page)."""
        size = self.page_size
        spans = [(int(p), int(p) + 1) for p in decode_pos] + [(c.start, c.start + c.length) for c in prefill]
        for seq, (start, end) in zip(seqs, spans):
            for page in seq.pages[start // size:ceil_div(end, size)]:
                if not self.pages.exclusive(page):
                    raise AssertionError(f"request {seq.seq_id} would write shared or cached kv page {page}")
