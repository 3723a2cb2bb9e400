"""The replicas' Serve request router: ``routing.Router`` over the replicas Serve says are running.

Serve calls ``choose_replicas`` for each request and sends it to the first
replica of the first rank that has room, so there is one rank: the chosen
replica alone. Serve also passes over a replica that does not answer its
queue-length probe within ``RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S``
(0.1 s; the probe is made when its cached queue length is over 10 s old), and a
busy host misses that deadline now and then: a second rank of the other
replicas would then take a session away from its replica below the bound (it
once took twelve sequential sessions to one replica). With one rank, a missed
probe or a full replica makes Serve wait (backing off) and call
``choose_replicas`` again, with the loads of then; a replica that stays
unresponsive fails its health check and leaves the candidates. Without
``FIFOMixin``: the choice made for a request's session and prompt is given to
that request, not to the oldest one waiting. The session, the prompt's page
hashes and the replicas to avoid are the ``session``, ``prefix_pages`` and
``avoid`` arguments the ingress passes to ``TandemReplica.generate``; the
loads are each replica's last ``record_routing_stats`` and what this router
has in flight there (``routing.Load``), over the ``routing.usable`` replicas.

Counting: a request is counted where it is routed (``choose_replicas``, so
the next choice sees it at once; a choice made again moves it), and
uncounted when Serve reports it completed (its stream ended, failed or was
cancelled: ``on_request_completed``) or when it is cancelled before it was
sent. Serve calls all of these on its router loop; their times are
``time.time()``, the clock the replicas' reports are taken by. A request the
ingress only asks the choice for (``choose_replica(..., _reserve=False)``) and
then sends itself (``direct.py``: Serve never sees it end) carries a
``Counted`` in its ``counted`` argument: the router binds it to the request's
count, and the ingress's ``Counted.end()`` uncounts it (on the router's loop).
"""
from __future__ import annotations

import asyncio
import functools
import time
from typing import Callable, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from . import MAX_OVERLOAD
from .routing import Load, Router, choose, usable


class Counted:
    """The router's count of one request whose end Serve will not report: ``end()`` uncounts it
    (once; a no-op before the router counted it)."""

    def __init__(self) -> None:
        self._end: Callable[[], None] | None = None

    def bind(self, end: Callable[[], None]) -> None:
        self._end = end  # (a choice made again moved the count: its end is the last one's)

    def end(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            end()


class AffinityRouter(RequestRouter):
    def initialize_state(self, max_overload: float = MAX_OVERLOAD) -> None:
        self.routing = Router(max_overload)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        loads = usable({name: Load.from_stats(r.routing_stats) for name, r in by_name.items()},
                       kwargs.get("avoid") or ())
        if pending_request is None:  # (Serve always passes the request) nothing to count
            chosen = choose([], loads, self.routing.max_overload)
        else:
            rid = pending_request.metadata.internal_request_id
            chosen = self.routing.route(rid, kwargs.get("session"), kwargs.get("prefix_pages") or (), loads,
                                        time.time())
            pending_request.future.add_done_callback(
                lambda f: f.cancelled() and self.routing.ended(rid, now=time.time()))
            counted = kwargs.get("counted")
            if counted is not None:
                counted.bind(functools.partial(self._end_soon, asyncio.get_running_loop(), rid, chosen))
            pending_request.routing_context.should_backoff = True  # no room there yet: wait before choosing again
        return [[by_name[chosen]]]

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.routing.ended(internal_request_id, replica_id.unique_id, now=time.time())

    def _end_soon(self, loop: asyncio.AbstractEventLoop, rid: str, replica: str) -> None:
        """``Counted.end``: uncount on the router's loop (the ingress's own, unless Serve runs it apart)."""
        end = functools.partial(self.routing.ended, rid, replica, now=time.time())
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            end()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(end)
