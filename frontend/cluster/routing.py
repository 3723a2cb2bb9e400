"""Which replica a request goes to: bounded-load affinity over what this router has sent (pure, no Ray).

A request's *preference* is the order in which it would like the replicas:

- with a session (its ``X-Session-Id`` header, else the OpenAI ``user``
  field): the session's rendezvous order (each replica scores
  ``hash(session, replica)``, highest first), so a replica's death, or a new
  one, moves only the sessions it was first for;
- without one, if the longest prefix of its prompt's whole KV pages that this
  router has sent before covers at least half of those pages: the replica that
  prefix was last sent to (its prefix cache likely holds it), then that
  prefix's rendezvous order. A shorter shared prefix (one system prompt under
  many different questions) is not worth following: such a request, like one
  shorter than a page, has no preference.

The *load* of a replica is the number of requests it holds: those this router
sent it and has not yet seen end (exact, now), plus the others' in its last
report: what it reported less this router's requests it held when it took
the report (``taken``, by its clock; the same host's, or one kept within
milliseconds of it). A report is a moment old (``ROUTING_STATS_PERIOD_S``
and Serve's delivery): read alone, it shows a replica that has just finished
a request as still holding it, which took sessions off their idle replica.
``choose`` takes the first replica of the preference whose load is below the
*bound* ``ceil((1 + max_overload) * (total + 1) / replicas)``, where total
is the load of all of them (consistent hashing with bounded loads); without a
preference, the least loaded (ties in turn). A replica whose queue is full is
passed over while another is not.

Invariants (tests/cluster/test_routing.py proves them):
- the replica chosen holds at most the bound once it has the request (while no
  queue is full), so a burst puts no more than ``(1 + max_overload)`` times
  the average on any one;
- below the bound, a session always goes to its first replica;
- removing a replica (the others idle) changes the choice only for the
  requests that chose it;
- ``Router``'s count of a replica is the requests routed to it that have not
  ended: each is counted once, at routing, and uncounted once, at its end;
- a report never counts this router's requests twice, nor those that had
  ended when it was taken: one request after another, each goes to the
  replica its session or prefix prefers.

Failure: a replica whose ``tandem serve`` has exited reports ``failed`` until
Serve replaces it, and a request it refused (``NOT_STARTED``) is sent again
with that replica in its ``avoid`` list; ``usable`` leaves both out (all of
them only when nothing else is left).
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from . import MAX_OVERLOAD

NOT_STARTED = "not_started"  # a replica's answer to a request it never began (its tandem serve had exited)
REMEMBERED_PAGES = 1 << 16  # page hashes a router remembers (its guess at what the replicas' caches hold)
WORTH_FOLLOWING = 0.5  # the share of a prompt's pages a sent prefix must cover to pull the request after it
FORGET_ENDED_S = 60.0  # ends kept for reports taken before them: far longer than a report can take to arrive


@dataclass(frozen=True)
class Load:
    running: int = 0  # reported by the replica
    waiting: int = 0  # reported by the replica
    queue_full: bool = False
    failed: bool = False  # its tandem serve exited: Serve is replacing it
    taken: float | None = None  # when the replica took the report (time.time() there); None: no report
    sent: int = 0  # this router's requests to it that have not ended
    own: int = 0  # of those reported, this router's (the requests it had in flight there at `taken`)

    @property
    def held(self) -> int:
        return self.sent + max(0, self.running + self.waiting - self.own)

    @staticmethod
    def from_stats(stats: Mapping[str, Any] | None) -> "Load":
        """A replica's routing stats (``TandemReplica.record_routing_stats``; none yet: idle)."""
        s = stats or {}
        return Load(int(s.get("running", 0)), int(s.get("waiting", 0)), bool(s.get("queue_full", False)),
                    bool(s.get("failed", False)), s.get("taken"))


def usable(loads: Mapping[str, Load], avoid: Sequence[str] = ()) -> dict[str, Load]:
    """``loads`` less the failed replicas and those in ``avoid`` (all of ``loads`` if none is left)."""
    return {r: load for r, load in loads.items() if not load.failed and r not in avoid} or dict(loads)


def rendezvous(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` in ``key``'s rendezvous (highest random weight) order: its owner first."""
    return sorted(replicas, reverse=True,
                  key=lambda r: hashlib.blake2b(f"{key}\0{r}".encode(), digest_size=8).digest())


def checked_overload(max_overload: float) -> float:
    if not max_overload >= 0:  # (NaN too)
        raise ValueError(f"max_overload must be >= 0 (how far above the average load a replica may go), "
                         f"not {max_overload!r}")
    return float(max_overload)


def bound(loads: Mapping[str, Load], max_overload: float) -> int:
    """The most requests a replica may hold once it takes the next one."""
    total = sum(load.held for load in loads.values()) + 1
    return math.ceil((1 + max_overload) * total / len(loads))


def choose(preference: Sequence[str], loads: Mapping[str, Load], max_overload: float = MAX_OVERLOAD,
           turn: int = 0) -> str:
    """The first replica of ``preference`` below the bound; with no preference, the least loaded
    (``turn`` picks among equals)."""
    if not loads:
        raise ValueError("no replicas to choose from")
    names = sorted(loads)
    room = [r for r in names if not loads[r].queue_full] or names
    limit = bound(loads, max_overload)
    for r in preference:
        if r in room and loads[r].held < limit:
            return r
    least = min(loads[r].held for r in room)  # below the bound: total < len(loads) * limit
    equals = [r for r in room if loads[r].held == least]
    return equals[turn % len(equals)]


class Router:
    """One router's state: what it has in flight on each replica (and what it had, for the reports of a
    moment ago), and where it sent which prompt pages. ``now``: ``time.time()``, the reports' clock."""

    def __init__(self, max_overload: float = MAX_OVERLOAD, remembered_pages: int = REMEMBERED_PAGES) -> None:
        self.max_overload = checked_overload(max_overload)
        self._remembered = remembered_pages
        self._routed: dict[str, tuple[str, float]] = {}  # request id -> (its replica, when) until it ends
        self._sent: dict[str, int] = {}  # replica -> requests routed to it that have not ended
        # replica -> (routed, ended) times of its requests that ended after its last report was taken
        self._ended: dict[str, deque[tuple[float, float]]] = {}
        self._own: dict[str, tuple[float, int]] = {}  # replica -> (its last report's taken, Load.own for it)
        self._pages: OrderedDict[bytes, str] = OrderedDict()  # page hash -> the replica it was last sent to (LRU)
        self._turns = 0

    def sent(self, replica: str) -> int:
        return self._sent.get(replica, 0)

    def route(self, request_id: str, session: str | None, pages: Sequence[bytes],
              loads: Mapping[str, Load], now: float) -> str:
        """Choose a replica among ``loads`` (its reports; this router's counts are added here) for a
        request with ``session`` (or None) and its prompt's page hashes (``prefix_pages``), and count
        it there. Routing a request again (Serve retries one) moves it."""
        self.ended(request_id, now=now)
        loads = {r: self.counted(r, load) for r, load in loads.items()}
        chosen = choose(self.preference(session, pages, loads), loads, self.max_overload, self._turns)
        self._turns += 1
        self._routed[request_id] = (chosen, now)
        self._sent[chosen] = self.sent(chosen) + 1
        if self._own.get(chosen, (-math.inf,))[0] >= now:  # a report taken at this moment (or a skewed clock's)
            del self._own[chosen]
        for page in pages:
            self._pages[page] = chosen
            self._pages.move_to_end(page)
        while len(self._pages) > self._remembered:
            self._pages.popitem(last=False)
        return chosen

    def preference(self, session: str | None, pages: Sequence[bytes], replicas: Mapping[str, Any]) -> list[str]:
        if session:
            return rendezvous("s:" + session, list(replicas))
        shared = 0
        while shared < len(pages) and pages[shared] in self._pages:
            shared += 1
        if not shared or shared < WORTH_FOLLOWING * len(pages):
            return []
        last = pages[shared - 1]
        order = rendezvous("p:" + last.hex(), list(replicas))
        home = self._pages[last]
        return [home, *(r for r in order if r != home)] if home in replicas else order

    def ended(self, request_id: str, replica: str | None = None, *, now: float) -> None:
        """``request_id`` ended (a no-op if it is not counted, or counted on another replica than
        ``replica``: the end of an earlier attempt, rejected there, of a request routed again)."""
        where, since = self._routed.get(request_id, (None, 0.0))
        if where is None or replica not in (None, where):
            return
        del self._routed[request_id]
        self._sent[where] -= 1
        if not self._sent[where]:
            del self._sent[where]
        ended = self._ended.setdefault(where, deque())
        ended.append((since, now))
        while ended and ended[0][1] < now - FORGET_ENDED_S:  # (a replica that never reports)
            ended.popleft()

    def counted(self, replica: str, report: Load) -> Load:
        """``replica``'s ``report`` with this router's count of it: its requests there now, and then."""
        return replace(report, sent=self.sent(replica), own=self._own_at(replica, report.taken))

    def _own_at(self, replica: str, taken: float | None) -> int:
        """How many of this router's requests ``replica`` held at ``taken`` (computed once a report)."""
        if taken is None:
            return 0
        last = self._own.get(replica)
        if last is not None and last[0] == taken:
            return last[1]
        ended = self._ended.get(replica, deque())
        while ended and ended[0][1] <= taken:  # ended before this report (so before any later one)
            ended.popleft()
        own = sum(since <= taken for since, _ in ended)
        own += sum(where == replica and since <= taken for where, since in self._routed.values())
        self._own[replica] = (taken, own)
        return own
