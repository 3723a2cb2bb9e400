"""The KV page pool: pages shared by refcount, with the prefix cache of full pages (docs/DESIGN.md §4.8).

A full page is named by a chained hash (``shared/page_names.py``): the hash
of its parent page's hash, its token ids and a salt (what else decides its KV:
an adapter, image hashes). Two requests whose prompts begin with the same
tokens therefore name the same leading pages, and the second maps them
instead of computing them.

Past its last full hit a prompt may still share tokens with a named page: the
page after its parent's (an identical prompt whose tail page the earlier
request filled with its answer, or one that differs mid-page). ``partial``
finds the named child of that parent whose first tokens match longest; the
engine copies those KV rows into the request's own page (a shared page would
be written past them), so only the rest is computed.

Every page is in exactly one state:
- free: on the free list, holds nothing;
- referenced: ``refs[page] > 0``, mapped by that many sequences;
- cached: hashed, unreferenced, in the LRU; it keeps its KV and is handed out
  again by a hit, or evicted (unhashed) when an allocation needs its memory.

Invariants (checked here, proved by tests/engine/test_prefix_cache.py):
- a referenced page is never evicted or handed out as a fresh page;
- a page is hashed only after the launch that wrote its last token was
  committed, so a hit never reads KV still being written (the engine calls
  ``register`` from its commit);
- every reference is dropped exactly once: at idle every page is free or
  cached (``idle``);
- a page is a child (``partial``) exactly while it is named.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

Family = tuple[bytes, bytes, int]  # a named page's parent's name, salt and first token: where ``partial`` looks


class PagePool:
    """KV pages 1..num_pages-1 (page 0 is a scratch page for padded rows, never handed out)."""

    def __init__(self, num_pages: int, caching: bool = True) -> None:
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages")
        self.capacity = num_pages - 1
        self.caching = caching
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out the lowest page first
        self.refs = np.zeros(num_pages, dtype=np.int32)
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self.children: dict[Family, dict[int, tuple[int, ...]]] = {}  # named pages by family -> their tokens
        self.family_of: dict[int, Family] = {}
        self.evictions = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free or cached (evictable)."""
        return len(self._free) + len(self.lru)

    @property
    def num_cached(self) -> int:
        return len(self.lru)

    @property
    def idle(self) -> bool:
        return self.num_free == self.capacity

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached pages for the longest prefix of ``hashes`` (consecutive hits from the start)."""
        pages = []
        if self.caching:
            for h in hashes:
                page = self.page_of.get(h)
                if page is None:
                    break
                pages.append(page)
        return pages

    def partial(self, parent: bytes, salt: bytes, tokens: Sequence[int]) -> tuple[int, int]:
        """The named child of ``parent`` (with ``salt``) whose first tokens match ``tokens`` longest:
        (its page, how many match), or (0, 0) if none does. A cached one becomes the most recent in
        the LRU (its rows are about to be copied)."""
        best, most = 0, 0
        if self.caching and len(tokens):
            for page, own in self.children.get((parent, salt, int(tokens[0])), {}).items():
                n = 1
                while n < len(tokens) and n < len(own) and own[n] == tokens[n]:
                    n += 1
                if n > most:
                    best, most = page, n
            if best in self.lru:
                self.lru.move_to_end(best)
        return best, most

    def can_allocate(self, n: int, hits: list[int] = ()) -> bool:
        """Room for ``n`` fresh pages once ``hits`` (which leave the LRU when mapped) are taken."""
        return n <= self.num_free - sum(1 for p in hits if p in self.lru)

    # -- transitions -----------------------------------------------------------------------
    def acquire(self, hits: list[int], n: int) -> list[int]:
        """Map the ``hits`` (one more reference each), then ``n`` fresh pages; returns all of them."""
        for p in hits:
            self.lru.pop(p, None)
            self.refs[p] += 1
        fresh = [self._take() for _ in range(n)]
        return list(hits) + fresh

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        elif self.lru:
            page, _ = self.lru.popitem(last=False)  # evict the least recently used cached page
            del self.page_of[self.hash_of.pop(page)]
            family = self.family_of.pop(page, None)
            if family is not None:
                del self.children[family][page]
                if not self.children[family]:
                    del self.children[family]
            self.evictions += 1
        else:
            raise MemoryError("kv pages: none free or cached")
        assert self.refs[page] == 0, f"kv page {page} handed out while referenced"
        self.refs[page] = 1
        return page

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; an unreferenced page is cached if hashed, else freed."""
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"kv pages: double free of {p}")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.hash_of:
                    self.lru[p] = None
                else:
                    self._free.append(p)

    def register(self, page: int, name: bytes, parent: bytes | None = None, salt: bytes = b"",
                 tokens: Sequence[int] = ()) -> None:
        """Name a referenced page whose KV is complete; with its ``parent``'s name, ``salt`` and
        ``tokens`` it is also a child ``partial`` finds. If another page already has the name (the
        same prefix computed twice at once), this one stays unnamed and is freed at release."""
        if not self.caching or name in self.page_of or page in self.hash_of:
            return
        assert self.refs[page] > 0, f"kv page {page} registered while unreferenced"
        self.hash_of[page] = name
        self.page_of[name] = page
        if parent is not None and len(tokens):
            family = self.family_of[page] = (parent, salt, int(tokens[0]))
            self.children.setdefault(family, {})[page] = tuple(int(t) for t in tokens)

    def exclusive(self, page: int) -> bool:
        """True if writing the page cannot change KV another request reads (one owner, unnamed)."""
        return self.refs[page] == 1 and page not in self.hash_of
