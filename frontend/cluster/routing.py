"""Which replica a request goes to: session affinity with a load escape valve (pure, no Ray).

A request's *session key* is its ``X-Session-Id`` header, else the OpenAI
``user`` field, else a hash of its rendered prompt's first full KV page (so
the turns of one chat and prompts sharing a system prompt meet the replica
whose prefix cache holds them). The key's *owner* is chosen by rendezvous
hashing: each replica scores ``hash(key, replica)`` and the highest wins, so
a replica's death (or a new one) moves only the sessions it owned.

The escape valve: a replica's *load* is ``waiting * 4 + running`` (a waiting
request costs a whole prefill plus a queue slot; from the routing stats each
replica reports). A keyed request leaves its owner for the least-loaded
replica when the owner's queue is full or the owner is clearly hotter than
the rest (load above ``2 * least + OVERFLOW_SLACK``): affinity is worth a
prefix cache hit, not an unbounded queue. Requests without a key go to the
less loaded of two replicas drawn at random (two choices spread a burst even
when the reported loads are a moment old).

Failure: a replica whose ``tandem serve`` has exited reports ``failed`` until
Serve replaces it, and a request it refused (``NOT_STARTED``) is sent again
with that replica in its ``avoid`` list; ``usable`` leaves both out (all of
them only when nothing else is left).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

WAITING_WEIGHT = 4
OVERFLOW_SLACK = 8  # two waiting requests: below this gap affinity always wins
NOT_STARTED = "not_started"  # a replica's answer to a request it never began (its tandem serve had exited)


@dataclass(frozen=True)
class Load:
    running: int = 0
    waiting: int = 0
    queue_full: bool = False
    failed: bool = False  # its tandem serve exited: Serve is replacing it

    @property
    def score(self) -> int:
        return self.waiting * WAITING_WEIGHT + self.running

    @staticmethod
    def from_stats(stats: Mapping[str, Any] | None) -> "Load":
        """A replica's routing stats (``TandemReplica.record_routing_stats``); none yet: idle."""
        s = stats or {}
        return Load(int(s.get("running", 0)), int(s.get("waiting", 0)), bool(s.get("queue_full", False)),
                    bool(s.get("failed", False)))


def usable(loads: Mapping[str, Load], avoid: Sequence[str] = ()) -> dict[str, Load]:
    """``loads`` less the failed replicas and those in ``avoid`` (all of ``loads`` if none is left)."""
    return {r: load for r, load in loads.items() if not load.failed and r not in avoid} or dict(loads)


def owner(key: str, replicas: Sequence[str]) -> str:
    """The replica that owns ``key`` by rendezvous (highest random weight) hashing."""
    return max(replicas, key=lambda r: hashlib.blake2b(f"{key}\0{r}".encode(), digest_size=8).digest())


def choose(key: str | None, loads: Mapping[str, Load], rng: random.Random = random._inst) -> str:
    """The replica for a request with session ``key`` (None: no key) among ``loads``' replicas."""
    if not loads:
        raise ValueError("no replicas to choose from")
    names = sorted(loads)
    if key is None:
        pair = rng.sample(names, 2) if len(names) > 1 else names
        return min(pair, key=lambda r: loads[r].score)
    own = owner(key, names)
    room = [r for r in names if not loads[r].queue_full] or names
    least = min(room, key=lambda r: (loads[r].score, r != own))  # on a tie, the owner
    hot = loads[own].score > 2 * loads[least].score + OVERFLOW_SLACK
    return least if loads[own].queue_full or hot else own


def session_key(session: str | None, first_page: Sequence[int] | None) -> str | None:
    """The key a request is routed by: the client's session (header or ``user``), else its
    prompt's first full KV page (``first_page``: those token ids, None when the prompt is
    shorter than a page)."""
    if session:
        return "s:" + session
    if first_page:
        return "p:" + hashlib.blake2b(repr(list(first_page)).encode(), digest_size=16).hexdigest()
    return None
