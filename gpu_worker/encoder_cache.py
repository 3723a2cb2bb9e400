"""Image features on the device, keyed by image hash, shared by the requests that use them.

An entry is created when a request is admitted and its image is not cached (a
miss); the features themselves are computed later on the compute stream, one
*encode unit* at a time (``image_prefill.py``; Idefics3: a tile): each
prefill launch encodes the units its chunks reach that no launch has enqueued
yet (``enqueued``, one flag per unit; a unit's rows do not depend on which
launch computed them). Units enqueued but not yet committed are ``pending``;
a device failure makes such an entry garbage (``invalidate``). A request holds
one reference per image from admission until its prefill has been committed
(or it is released, whichever comes first), so features never vanish under a
launched prefill.

Unreferenced entries stay cached, least recently used first out, while the
total of their bytes exceeds ``capacity_bytes``; referenced entries are never
evicted (the cache may exceed its bound while they are in use). Torch-free: the
features are an opaque ``holder`` (the model runner fills ``holder.features``
on the compute stream).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class FeatureHolder:
    """Filled on the compute stream, an encode unit's rows at a time; read by later work on the same stream."""
    features: object = None  # [image rows, hidden], allocated by the first encode


@dataclass(eq=False)
class CacheEntry:
    hash: str
    nbytes: int
    num_units: int
    holder: FeatureHolder = field(default_factory=FeatureHolder)
    refs: int = 0
    enqueued: np.ndarray = None  # [num_units] bool: the unit's encode is on the compute stream
    pending: int = 0  # units enqueued by launches not committed yet
    cached: bool = True  # still in the cache's map (False: evicted or invalidated)

    def __post_init__(self) -> None:
        if self.enqueued is None:
            self.enqueued = np.zeros(self.num_units, dtype=bool)

    def missing(self, first: int, end: int) -> np.ndarray:
        """Units of ``first .. end - 1`` that no launch has enqueued yet (sorted)."""
        return np.flatnonzero(~self.enqueued[first:end]) + first

    def complete(self, first: int = 0) -> bool:
        """Units ``first ..`` are all enqueued (nobody needs host tiles for them again)."""
        return bool(self.enqueued[first:].all())


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: dict[str, CacheEntry] = {}
        self.unreferenced: OrderedDict[str, CacheEntry] = OrderedDict()  # LRU order, oldest first
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def acquire(self, image_hash: str, nbytes: int, num_units: int) -> tuple[CacheEntry, bool]:
        """A reference to the entry for ``image_hash`` (created on a miss); (entry, hit)."""
        entry = self.entries.get(image_hash)
        hit = entry is not None
        if hit:
            self.hits += 1
            self.unreferenced.pop(image_hash, None)
        else:
            self.misses += 1
            entry = self.entries[image_hash] = CacheEntry(image_hash, nbytes, num_units)
            self.bytes += nbytes
        entry.refs += 1
        self._evict()
        return entry, hit

    def release(self, entry: CacheEntry) -> None:
        """Drop one reference (exactly once per acquire)."""
        assert entry.refs > 0, "encoder cache reference underflow"
        entry.refs -= 1
        if entry.refs == 0 and entry.cached:
            if entry.enqueued.any():  # kept (partly encoded: a later request encodes the rest)
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
