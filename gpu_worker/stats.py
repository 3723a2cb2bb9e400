"""The engine's counters, kept apart from its gauges.

``EngineStats`` only grows between two ``Engine.reset_stats`` calls; ``Engine.stats()`` adds the
gauges its parts hold now (free pages and rows, queue lengths, the device's bubble meter).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class EngineStats:
    steps: int = 0  # committed launches
    decode_steps: int = 0
    prefill_steps: int = 0
    sample_rows: int = 0  # logits rows sampled (useful + zombie)
    zombie_rows: int = 0
    prefill_tokens: int = 0
    committed_tokens: int = 0
    host_s: float = 0.0  # host time inside tick(), excluding waits on the device
    wait_s: float = 0.0
    finished: int = 0
    failed: int = 0
    prefix_query_tokens: int = 0  # prompt tokens of admitted requests
    prefix_hit_tokens: int = 0  # ... of which mapped from the prefix cache

    def committed(self, prefill: bool, live: np.ndarray) -> None:
        """One committed launch; ``live`` per sampled row (False: a zombie row, its token dropped)."""
        self.steps += 1
        if prefill:
            self.prefill_steps += 1
        else:
            self.decode_steps += 1
        rows, useful = len(live), int(live.sum())
        self.sample_rows += rows
        self.zombie_rows += rows - useful
        self.committed_tokens += useful
