"""One request's state inside the worker.

Counters, and why there are three:
- ``num_prefilled``: prompt tokens already launched (chunked prefill).
- ``num_dispatched``: tokens that launched steps will produce (committed or
  not). Length caps are checked against it, so a sequence is never launched
  past ``max_tokens``: length caps make no zombie.
- ``len(output_ids)``: tokens committed.

Images: a request's ``<image>`` prompt positions take rows of its images'
features (``images``, in prompt order; ``image_positions``); what each image
holds, and when it lets go, is ``image_prefill.py``'s. A prefill chunk never
ends inside one of ``whole_spans`` (``chunk_end``).

Zombies: ``finalized`` is set the moment the end is known (EOS, stop, cancel);
``inflight_refs`` counts launched-but-uncommitted steps that include the
sequence. Commit skips finalized sequences, and the batch row and KV pages are
released when ``finalized and inflight_refs == 0``, exactly once.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from shared.finish import FinishReason
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from .image_prefill import SeqImage


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens clamped to the context window
    seed: int
    constrained: bool = False
    logprobs: bool = False
    top_logprobs: bool = False  # also the most likely tokens' logprobs (published, not kept here)
    images: list[SeqImage] = field(default_factory=list)
    image_positions: np.ndarray | None = None  # sorted prompt positions of the <image> tokens
    whole_spans: list[tuple[int, int]] = field(default_factory=list)  # prompt spans no chunk ends inside
    adapter: str | None = None  # a LoRA adapter's name, None for the base model
    task: object = None  # Moondream: its moondream_skills.SkillTask (None: plain text rules)

    row: int = -1
    lora_slot: int = 0  # its adapter's device slot from admission to release (0: none)
    pages: list[int] = field(default_factory=list)
    # Prefix cache: names of the full pages whose tokens are known (a chain, page_pool.py),
    # how many of them are registered, the prompt tokens mapped or copied from the cache at
    # admission, and how many positions have KV written by committed launches.
    page_names: list[bytes] = field(default_factory=list)
    pages_registered: int = 0
    cached_tokens: int = 0
    kv_copy: tuple[int, int, int] | None = None  # admission: (named page, its page, rows) to copy before prefill
    kv_committed: int = 0
    num_prefilled: int = 0
    num_dispatched: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_values: list = field(default_factory=list)  # Moondream: (coord, w, h) float32 per output token

    admitted: bool = False
    finalized: bool = False
    finish_reason: FinishReason = FinishReason.NONE
    error: str | None = None  # "code: message" when finish_reason is ERROR
    inflight_refs: int = 0
    released: bool = False
    zombie_rows: int = 0

    t_submit: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_done: float | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def page_salt(self) -> bytes:
        """What besides the tokens decides its KV, for the prefix cache's page names: the adapter,
        and the values of a Moondream prompt's spatial refs."""
        salt = b"" if self.adapter is None else b"lora:" + self.adapter.encode()
        if self.task is not None and self.task.prompt_coord is not None:
            salt += b"refs:" + self.task.prompt_coord.tobytes() + self.task.prompt_size.tobytes()
        return salt

    @property
    def cacheable_len(self) -> int:
        """Tokens whose KV the prefix cache may name: a Moondream output's coord/size tokens carry
        values the token ids do not show, so such a sequence shares its prompt only."""
        n = self.prompt_len + len(self.output_ids)
        if self.task is not None and self.task.values_in_output:
            n = self.prompt_len
        return n

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def image_salts(self, first: int, end: int, page_size: int) -> list[bytes]:
        """For full pages first..end-1: the hashes of the images whose first ``<image>`` token
        is in that page. Prefix-cache names need them (every placeholder has the same token id);
        a later page inherits them through its parent's name."""
        salts = [b""] * max(0, end - first)
        for image in self.images:
            page = int(self.image_positions[image.row_start]) // page_size
            if first <= page < end:
                salts[page - first] += image.input.hash.encode()
        return salts

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk from ``start`` that would end at ``end`` ends: before a whole span
        it would split, or after it when the span begins at ``start`` (over the budget)."""
        for a, b in self.whole_spans:
            if a < end < b:
                return a if a > start else b
        return end

    @property
    def image_tokens(self) -> int:
        return 0 if self.image_positions is None else len(self.image_positions)

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled == self.prompt_len

    @property
    def wants_decode(self) -> bool:
        return self.admitted and self.prefill_done and not self.finalized and self.num_dispatched < self.max_tokens

    @property
    def next_position(self) -> int:
        """Position of the next decode input token (the last sampled one)."""
        return self.prompt_len + self.num_dispatched - 1

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finalize(self, reason: FinishReason, error: str | None = None) -> bool:
        """Mark the end; returns False if it had already ended (first reason wins)."""
        if self.finalized:
            return False
        self.finalized = True
        self.finish_reason = FinishReason(reason)
        self.error = error
        self.t_done = time.perf_counter()
        self._done.set()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
