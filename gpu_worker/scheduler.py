"""Chooses what the next launch computes: decode rows plus prefill chunks.

Every running sequence whose prefill is complete and whose dispatched tokens
are below its cap decodes in every launch (it joins as soon as its first token
is sampled on the device, before the host has seen it). Prompts prefill in
chunks bounded by a per-launch token budget, oldest first; a chunk never ends
inside a span the request keeps whole (``Sequence.whole_spans``: it ends before
the span, or, when the span begins the chunk, after it, over the budget). Admission is FIFO
and reserves a request's whole KV (prompt + max_tokens) up front, so a running
sequence never runs out of pages; a request that does not fit waits. The
leading full pages of a prompt that the prefix cache holds are mapped, not
computed: prefill starts after them (always recomputing at least the last
prompt token, whose logits sample the first output token); past them, the
first tokens a named page shares with the prompt are copied into the
request's own next page (``PagePool.partial``; not for prompts with images). A request naming a
LoRA adapter also takes a reference to its adapter's slot at admission
(``lora_slots.py``); while every slot is referenced by running requests of
other adapters it waits at the head of the queue (FIFO is kept: no request
overtakes another).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.page_names import ROOT, chain

from .allocator import Allocator
from .lora_slots import LoraSlots
from .sequence import Sequence


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    length: int

    @property
    def final(self) -> bool:
        return self.start + self.length == self.seq.prompt_len


@dataclass
class Plan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, alloc: Allocator, prefill_budget: int, lora: LoraSlots | None = None) -> None:
        self.alloc = alloc
        self.lora = lora
        self.prefill_budget = prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, not yet released, in admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting:
            seq = self.waiting[0]
            if seq.finalized:  # cancelled while queued
                self.waiting.popleft()
                continue
            need = seq.prompt_len + seq.max_tokens
            hits = self._cached_prefix(seq)
            if not self.alloc.can_admit(need, hits):
                break
            if seq.adapter is not None:
                slot = self.lora.acquire(seq.adapter)
                if slot is None:  # every slot is referenced: wait for one to be released
                    break
                seq.lora_slot = slot
            copied_from, rows = self._cached_rows(seq, hits)
            seq.row, seq.pages = self.alloc.admit(need, hits)
            if rows:
                seq.kv_copy = (copied_from, seq.pages[len(hits)], rows)
            seq.num_prefilled = seq.kv_committed = seq.cached_tokens = len(hits) * self.alloc.page_size + rows
            seq.admitted = True
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached pages for the longest prefix of the prompt's full pages (the last token excluded)."""
        pool = self.alloc.pages
        if not pool.caching:
            return []
        size = self.alloc.page_size
        if not seq.page_names:
            n = (seq.prompt_len - 1) // size
            seq.page_names = chain(seq.prompt_ids, size, n, seq.page_salt, page_salts=seq.image_salts(0, n, size))
        return pool.lookup(seq.page_names)

    def _cached_rows(self, seq: Sequence, hits: list[int]) -> tuple[int, int]:
        """A named page whose first rows hold the prompt's next tokens after ``hits`` (the last
        prompt token excluded), and how many: (0, 0) if none."""
        if not self.alloc.pages.caching or seq.images:
            return 0, 0
        start = len(hits) * self.alloc.page_size
        parent = seq.page_names[len(hits) - 1] if hits else ROOT
        return self.alloc.pages.partial(parent, seq.page_salt, seq.prompt_ids[start:seq.prompt_len - 1])

    def plan(self) -> tuple[Plan, list[Sequence]]:
        """The next launch, and the sequences admitted for it."""
        admitted = self._admit()
        plan = Plan()
        budget = self.prefill_budget
        for seq in self.running:
            if seq.wants_decode:
                plan.decode.append(seq)
            elif budget > 0 and not seq.finalized and not seq.prefill_done:
                start = seq.num_prefilled
                n = seq.chunk_end(start, start + min(budget, seq.prompt_len - start)) - start
                plan.prefill.append(PrefillChunk(seq, start, n))
                budget -= n
        return plan, admitted

    def remove(self, seq: Sequence) -> None:
        self.running.remove(seq)

    def drop_waiting(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
