"""Integer arithmetic both processes use, written once."""
from __future__ import annotations


def ceil_div(a, b):
    """``a / b`` rounded up, for non-negative ints (or numpy integer arrays): pages for tokens,
    words for bits, tile blocks for tiles."""
    return -(-a // b)
