"""The engine's counters, kept apart from its gauges.

``EngineStats`` only grows between two ``Engine.reset_stats`` calls; ``Engine.stats()`` adds the
gauges its parts hold now (free pages and rows, queue lengths, the device's bubble meter).
"""
from __future__ import annotations

from dataclasses import dataclass


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
