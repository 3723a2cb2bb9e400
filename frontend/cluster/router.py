"""The replicas' Serve request router: ``routing.Router`` over the replicas Serve says are running.

Serve calls ``choose_replicas`` for each request and sends it to the first
replica of the first rank that has room, so the ranks are: the chosen
replica, then the others (a fallback only when the chosen one is at
``max_ongoing_requests``). Without ``FIFOMixin``: the choice made for a
request's session and prompt is given to that request, not to the oldest one
waiting. The session, the prompt's page hashes and the replicas to avoid are
the ``session``, ``prefix_pages`` and ``avoid`` arguments the ingress passes
to ``TandemReplica.generate``; the loads are each replica's last
``record_routing_stats`` plus what this router has in flight there. Only
``routing.usable`` replicas are ranked: Serve falls back to the second rank
when the first does not answer its queue-length probe in time, and that must
never be a replica known to be dead.

Counting: a request is counted where it is routed (``choose_replicas``, so
the next choice sees it at once), moved if Serve sends it to another rank
(``on_request_routed``), and uncounted when Serve reports it completed (its
stream ended, failed or was cancelled: ``on_request_completed``) or when it
is cancelled before it was sent. Serve calls all of these on its router loop.
"""
from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from . import MAX_OVERLOAD
from .routing import Load, Router, choose, usable


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
            chosen = self.routing.route(rid, kwargs.get("session"), kwargs.get("prefix_pages") or (), loads)
            pending_request.future.add_done_callback(lambda f: f.cancelled() and self.routing.ended(rid))
        return [[by_name[chosen]], [by_name[name] for name in loads if name != chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self.routing.moved(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.routing.ended(internal_request_id, replica_id.unique_id)
