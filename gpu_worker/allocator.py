"""What a running sequence holds: KV pages (``page_pool.PagePool``) and a batch row.

Both are handed out at admission and taken back exactly once, when a sequence
is finalized and no launched step references it any more. Freeing something
twice, or something never handed out, raises: that is a bookkeeping bug, and
hiding it would corrupt another request's cache.
"""
from __future__ import annotations

from .page_pool import PagePool


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
        return -(-num_tokens // self.page_size)

    def can_admit(self, num_tokens: int, hits: list[int] = ()) -> bool:
        return self.rows.can_allocate(1) and self.pages.can_allocate(self.pages_for(num_tokens) - len(hits), hits)

    def admit(self, num_tokens: int, hits: list[int] = ()) -> tuple[int, list[int]]:
        """A batch row and the pages for ``num_tokens``: the cached ``hits`` first, then fresh ones."""
        pages = self.pages.acquire(hits, self.pages_for(num_tokens) - len(hits))
        return self.rows.allocate(1)[0], pages

    def release(self, row: int, pages: list[int]) -> None:
        self.pages.release(pages)
        self.rows.free([row])

    @property
    def idle(self) -> bool:
        """Every page free or cached and unreferenced, every row free."""
        return self.pages.idle and self.rows.num_free == self.rows.capacity
