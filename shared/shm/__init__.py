"""The shared-memory arena between the frontend and one GPU worker.

One arena per worker. The frontend creates it (``Arena.create``) as a memfd plus
three non-blocking eventfds and hands all four to the worker at spawn::

    arena = Arena.create(Layout(vocab_size=49152))
    proc = subprocess.Popen([sys.executable, "-m", "gpu_worker", "--arena", arena.fd_spec()],
                            pass_fds=arena.pass_fds)      # (arena fd, tokens, space, masks)
    # in the worker:  arena = Arena.attach_spec(args.arena)

Nothing is named in /dev/shm, so nothing needs unlinking and nothing leaks when
either process is killed: the memory lives exactly as long as some process
holds the fd or the mapping. (multiprocessing.shared_memory is deliberately not
used: its resource tracker unlinks segments behind our back.)

Regions (every one 64-byte aligned; each cache line has exactly one writer):

* header      static layout words (written once by the creator before the
              worker exists), one heartbeat line per side, one control line per
              side (frontend: ``consumed`` token entries; worker: ``ack_consumed``).
* token ring  worker -> frontend. ``ring_entries`` entries, one per committed step:
              a meta line (step, kind, row count) and a (47, max_rows) block of
              row columns (sequence id uint32, token id int32, flags uint32,
              optional float32 logprob, Moondream's 3 region values, the 20 most
              likely token ids and their logprobs; an entry writes the columns up
              to the last it uses), plus an int32 token staging row.
* ack ring    frontend -> worker. (seq, FinishReason) events: the frontend ended it.
* mask rows   frontend -> worker. ``max_batch`` xgrammar-layout token bitmasks
              (bit j of word i allows token 32*i+j), each with a step stamp; the
              frontend lends one to each constrained request (its ``mask_row``,
              not its batch row in the engine).

Memory-ordering invariant (no fences are available from Python, and ARM may
reorder both stores and loads): every 64-bit word a reader relies on carries
the tag of the entry it belongs to, ``word = (tag << 32) | payload32``, where
``tag = (position + 1) mod 2**32`` (so zeroed memory is never valid). Aligned
8-byte words are written and read whole (numpy and memoryview copy aligned
words with single loads/stores on x86-64 and AArch64), so a word is either
entirely old or entirely new. Writers fill payload words first and the
header/commit word last; readers copy the words and accept a copy only if the
commit word and every payload word carry the expected tag. A copy that mixes
tags is "not yet visible" and is retried; if the commit word has been visible
for longer than ``corrupt_after_s`` while payload words still carry the wrong
tag, or a commit word carries a tag that is neither the expected one nor the
entry's previous occupant's, the reader raises ``RingCorrupt``. It never
returns data it could not validate.

Back-pressure: the token writer never reuses an entry the frontend has not
consumed (``consumed`` word); it spins briefly, then sleeps on the ``space``
eventfd that the reader signals after each ``consume``. The reader spins
briefly, then sleeps on the ``tokens`` eventfd that the writer signals after
each publish (that fd can sit in a zmq.Poller: call ``clear_wakeup`` then
``poll``). Eventfds are counters, so a signal sent before the waiter sleeps is
never lost; waiters drain the fd and re-check the shared words.

Device copies: the worker may page-lock the whole mapping once (e.g.
``cudaHostRegister`` on the address of ``arena.buffer``, ``layout.total_bytes``
long) and let the GPU write sampled token ids straight into a reserved entry:
``p = writer.reserve()``; ``torch.from_numpy(p.token_ids[:n]).copy_(dev_ids,
non_blocking=True)``; record an event; later, once the event has completed,
``writer.stamp(p, step, kind, seq_ids, flags)`` stamps the tagged words (from
the staging row) and the commit word. Reservations are stamped in order.

Each ring has exactly one writer object and one reader object, each used from
a single thread.

Modules: ``errors``; ``layout`` (header words, enums, ``Layout``); ``tags``
(the tagged-word helpers of the invariant above); ``wake`` (eventfds and the
spin-then-sleep waiter); ``arena`` (``Arena``); ``token_ring``, ``ack_ring``,
``masks`` and ``images`` (the endpoints). Everything public is re-exported here.
"""
from __future__ import annotations

from .ack_ring import AckEvent, AckReader, AckWriter
from .arena import Arena
from .images import TileBlockReader, TileBlockWriter
from .errors import (
    AckRingFull, ArenaError, LayoutMismatch, MaskNotReady, RingAborted, RingCorrupt, RingTimeout,
)
from .layout import CACHED_SHIFT, Kind, Layout, Side, TokenFlag
from .masks import MaskReader, MaskWriter, mask_stamp
from .token_ring import Entry, PendingEntry, TokenRingReader, TokenRingWriter
from .wake import WakeFds

# Not in __all__, but reachable as shared.shm.<name> as before (the tests use
# shm.LAYOUT_VERSION).
from .layout import CACHE_LINE, LAYOUT_VERSION, MAGIC  # noqa: F401
from .wake import AbortFn  # noqa: F401

__all__ = [
    "ArenaError", "LayoutMismatch", "RingCorrupt", "RingTimeout", "RingAborted",
    "AckRingFull", "MaskNotReady",
    "Side", "Kind", "TokenFlag", "CACHED_SHIFT",
    "Layout", "WakeFds", "Arena",
    "Entry", "PendingEntry", "TokenRingWriter", "TokenRingReader",
    "AckEvent", "AckWriter", "AckReader", "MaskWriter", "MaskReader", "mask_stamp",
    "TileBlockWriter", "TileBlockReader",
]
