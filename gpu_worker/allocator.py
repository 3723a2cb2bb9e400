"""What a running sequence holds: KV pages and a batch row (free lists for both).

Both are handed out at admission and taken back exactly once, when a sequence
is finalized and no launched step references it any more. Freeing something
twice, or something never handed out, raises: that is a bookkeeping bug, and
hiding it would corrupt another request's cache.
"""
from __future__ import annotations


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
    """Hands out, at admission, a sequence's KV pages (page 0 is a scratch page for padded
    rows, never handed out) and its batch row; takes both back at release."""

    def __init__(self, num_pages: int, page_size: int, max_rows: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages")
        self.page_size = page_size
        self.pages = FreeList("kv pages", range(1, num_pages))
        self.rows = FreeList("batch rows", range(max_rows))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_admit(self, num_tokens: int) -> bool:
        return self.rows.can_allocate(1) and self.pages.can_allocate(self.pages_for(num_tokens))

    def admit(self, num_tokens: int) -> tuple[int, list[int]]:
        pages = self.pages.allocate(self.pages_for(num_tokens))
        return self.rows.allocate(1)[0], pages

    def release(self, row: int, pages: list[int]) -> None:
        self.pages.free(pages)
        self.rows.free([row])

    @property
    def idle(self) -> bool:
        return self.pages.num_free == self.pages.capacity and self.rows.num_free == self.rows.capacity
