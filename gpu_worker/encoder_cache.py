"""Image features on the device, keyed by image hash, shared by the requests that use them.

An entry is created when a request is admitted and its image is not cached (a
miss); the features themselves are computed later, on the compute stream,
inside the prefill launch that first needs them (``enqueued``), and are valid
once that launch has committed (``ready``). A request holds one reference per
image from admission until its prefill has been committed (or it is released,
whichever comes first), so features never vanish under a launched prefill.

Unreferenced entries stay cached, least recently used first out, while the
total of their bytes exceeds ``capacity_bytes``; referenced entries are never
evicted (the cache may exceed its bound while they are in use). Torch-free: the
features are an opaque ``holder`` (the model runner fills ``holder.features``
on the compute stream).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class FeatureHolder:
    """Filled on the compute stream; read by later work on the same stream."""
    features: object = None


@dataclass(eq=False)
class CacheEntry:
    hash: str
    nbytes: int
    holder: FeatureHolder = field(default_factory=FeatureHolder)
    refs: int = 0
    enqueued: bool = False  # an encode of it is on the compute stream
    ready: bool = False  # that encode's launch has committed
    cached: bool = True  # still in the cache's map (False: evicted or invalidated)


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: dict[str, CacheEntry] = {}
        self.unreferenced: OrderedDict[str, CacheEntry] = OrderedDict()  # LRU order, oldest first
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def acquire(self, image_hash: str, nbytes: int) -> tuple[CacheEntry, bool]:
        """A reference to the entry for ``image_hash`` (created on a miss); (entry, hit)."""
        entry = self.entries.get(image_hash)
        hit = entry is not None
        if hit:
            self.hits += 1
            self.unreferenced.pop(image_hash, None)
        else:
            self.misses += 1
            entry = self.entries[image_hash] = CacheEntry(image_hash, nbytes)
            self.bytes += nbytes
        entry.refs += 1
        self._evict()
        return entry, hit

    def release(self, entry: CacheEntry) -> None:
        """Drop one reference (exactly once per acquire)."""
        assert entry.refs > 0, "encoder cache reference underflow"
        entry.refs -= 1
        if entry.refs == 0 and entry.cached:
            if entry.enqueued:
                self.unreferenced[entry.hash] = entry
            else:  # nobody ever encoded it (its requests ended before their prefill)
                self._remove(entry)
            self._evict()

    def invalidate(self, entry: CacheEntry) -> None:
        """Forget an entry whose features were never completed (a failed launch)."""
        if entry.cached:
            self._remove(entry)

    def _remove(self, entry: CacheEntry) -> None:
        entry.cached = False
        del self.entries[entry.hash]
        self.unreferenced.pop(entry.hash, None)
        self.bytes -= entry.nbytes
        entry.holder.features = None  # its last reader has committed (or it was never computed)

    def _evict(self) -> None:
        while self.bytes > self.capacity_bytes and self.unreferenced:
            _, entry = self.unreferenced.popitem(last=False)
            self._remove(entry)

    @property
    def referenced(self) -> int:
        return sum(e.refs for e in self.entries.values())

    def stats(self) -> dict:
        return {"encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses,
                "encoder_cache_entries": len(self.entries), "encoder_cache_bytes": self.bytes,
                "encoder_cache_refs": self.referenced}
