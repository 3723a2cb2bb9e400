"""Why a request ended: one definition, carried unchanged from the engine to the client.

The worker's engine sets it on the sequence, the token ring carries it in the
low bits of a row's flags (``shared.shm.TokenFlag``), the ack ring carries the
frontend's own ends (stop strings, grammar complete, cancel) back to the
worker, and the protocol sends ``reason.wire`` to the client.
"""
from __future__ import annotations

from enum import IntEnum


class FinishReason(IntEnum):
    NONE = 0       # still running
    STOP = 1       # EOS, a stop token id, a stop string or a complete grammar
    LENGTH = 2     # max_tokens, or the context window is full
    CANCELLED = 3  # the client cancelled or went away
    ERROR = 4      # failed: the client gets an ``error`` message, not ``done``

    @property
    def wire(self) -> str:
        """The protocol's ``finish_reason`` string ("stop", "length", "cancelled")."""
        return self.name.lower()
