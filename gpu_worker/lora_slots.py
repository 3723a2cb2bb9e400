"""Which adapter sits in which device slot, and who references it (no torch).

Slot 0 is the zero adapter (rows without one); slots 1..num_slots hold
adapters. A sequence takes a reference at admission (``acquire``) and gives it
back when it is released (``release``), exactly once, and a sequence is only
released when no launched step includes it: so a slot with references is never
reloaded under a step that reads it. A loaded slot whose references drop to
zero stays loaded (a later request for the same adapter is a hit) until a
request for another adapter needs it: the least recently used unreferenced
slot is evicted. When every slot is referenced, ``acquire`` returns None and
the request waits.

The same rule as the KV pages, checked the same way: ``launched``/``committed``
count the in-flight steps reading each slot, and evicting or freeing a slot a
launched step reads raises, as a double free of a KV page does.

``token_lora_slots``: the slot each token of a launch reads (what the forward's LoRA kernel indexes).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from .scheduler import Plan


class LoraSlots:
    def __init__(self, num_slots: int, load: Callable[[int, str], None]) -> None:
        """``load(slot, name)`` writes an adapter's weights into a device slot (enqueued in stream order)."""
        self.num_slots = num_slots
        self._load = load
        self.slot_of: dict[str, int] = {}  # loaded adapters
        self.name_of: dict[int, str] = {}
        self.refs = [0] * (num_slots + 1)  # per slot: admitted, unreleased sequences using it
        self.inflight = [0] * (num_slots + 1)  # per slot: launched, uncommitted steps reading it
        self._unreferenced: OrderedDict[int, None] = OrderedDict()  # loaded, refs == 0, oldest first
        self._free = list(range(num_slots, 0, -1))  # never loaded; pop() gives slot 1 first
        self.loads = 0
        self.evictions = 0
        self.hits = 0

    def acquire(self, name: str) -> int | None:
        """A reference to ``name``'s slot, loading it if needed; None if every slot is referenced."""
        slot = self.slot_of.get(name)
        if slot is not None:
            self.hits += 1
            self._unreferenced.pop(slot, None)
        else:
            if self._free:
                slot = self._free.pop()
            elif self._unreferenced:
                slot, _ = self._unreferenced.popitem(last=False)
                self._evict(slot)
            else:
                return None
            self._load(slot, name)
            self.loads += 1
            self.slot_of[name], self.name_of[slot] = slot, name
        self.refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        if slot <= 0 or self.refs[slot] <= 0:
            raise RuntimeError(f"lora slots: release of slot {slot}, which holds no reference")
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._unreferenced[slot] = None  # most recently used last

    def _evict(self, slot: int) -> None:
        if self.refs[slot] or self.inflight[slot]:
            raise RuntimeError(f"lora slots: evicting slot {slot} with {self.refs[slot]} references and "
                               f"{self.inflight[slot]} launched steps reading it")
        del self.slot_of[self.name_of.pop(slot)]
        self.evictions += 1

    # -- in-flight steps (the check that no launched step reads an evicted slot) --
    def launched(self, slots) -> None:
        for s in set(slots):
            if s and not self.refs[s]:
                raise RuntimeError(f"lora slots: a step launched with slot {s}, which no sequence references")
            self.inflight[s] += 1

    def committed(self, slots) -> None:
        for s in set(slots):
            self.inflight[s] -= 1

    @property
    def total_refs(self) -> int:
        return sum(self.refs)

    @property
    def idle(self) -> bool:
        return self.total_refs == 0 and not any(self.inflight)

    def stats(self) -> dict:
        return {"lora_slots_total": self.num_slots, "lora_slots_loaded": len(self.slot_of),
                "lora_refs": self.total_refs, "lora_loads": self.loads, "lora_evictions": self.evictions,
                "lora_hits": self.hits}


def token_lora_slots(plan: Plan) -> np.ndarray | None:
    """The LoRA slot of each token of a launch (decode rows, then prefill chunks); None if no adapter."""
    seq_slots = [s.lora_slot for s in plan.decode] + [c.seq.lora_slot for c in plan.prefill]
    if not any(seq_slots):
        return None
    return np.repeat(np.asarray(seq_slots, dtype=np.int64), [1] * len(plan.decode) + [c.length for c in plan.prefill])
