"""The names of full KV pages: what the worker's prefix cache keys its pages by and the cluster's
router keys a prompt's affinity by (``gpu_worker/page_pool.py``, ``frontend/cluster/ingress.py``).

A full page is named by a chained hash: the hash of its parent page's name, its token ids and a
salt (what else decides its KV: an adapter, image hashes). Two prompts that begin with the same
tokens therefore name the same leading pages, and a page's name covers everything before it.
"""
from __future__ import annotations

import hashlib

import numpy as np

ROOT = b"tandem-prefix-v1"


def page_hash(parent: bytes, tokens, salt: bytes = b"") -> bytes:
    """The name of a full page: its parent's name, its token ids and the salt."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    h.update(salt)
    return h.digest()


def chain(tokens, page_size: int, num_pages: int, salt: bytes = b"", parent: bytes = ROOT,
          page_salts: list[bytes] | None = None) -> list[bytes]:
    """Names of the first ``num_pages`` full pages of ``tokens``; ``page_salts[i]`` is
    added to page i's salt (the hashes of the images that begin in it)."""
    out = []
    for i in range(num_pages):
        extra = page_salts[i] if page_salts else b""
        parent = page_hash(parent, tokens[i * page_size:(i + 1) * page_size], salt + extra)
        out.append(parent)
    return out
