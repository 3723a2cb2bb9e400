"""The errors raised by the shared-memory arena and its rings."""
from __future__ import annotations


class ArenaError(RuntimeError):
    """Base class of every error raised by this package."""


class LayoutMismatch(ArenaError, ValueError):
    """The fd handed to ``Arena.attach`` is not an arena of the expected layout."""


class RingCorrupt(ArenaError):
    """Published data failed validation for too long: never returned as data."""


class RingTimeout(ArenaError, TimeoutError):
    """A blocking call ran out of time."""


class RingAborted(ArenaError):
    """A blocking call was interrupted by its abort callback (shutdown)."""


class AckRingFull(ArenaError):
    """The ack ring stayed full: the worker is not draining events."""


class MaskNotReady(ArenaError):
    """``read_rows`` was asked for rows not stamped with the requested step."""
