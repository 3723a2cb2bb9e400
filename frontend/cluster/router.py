"""The replicas' Serve request router: ``routing.choose`` over the replicas Serve says are running.

Serve calls ``choose_replicas`` for each request (FIFO order, ``FIFOMixin``)
and sends it to the first replica of the first rank that has room, so the
ranks are: the chosen replica, then the others (a fallback only when the
chosen one is at ``max_ongoing_requests``). The session key and the replicas to
avoid are the ``session_key`` and ``avoid`` arguments the ingress passes to
``TandemReplica.generate``; the loads are each replica's last
``record_routing_stats``. Only ``routing.usable`` replicas are ranked: Serve
falls back to the second rank when the first does not answer its queue-length
probe in time, and that must never be a replica known to be dead.
"""
from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from .routing import Load, choose, usable


class AffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        loads = usable({name: Load.from_stats(r.routing_stats) for name, r in by_name.items()},
                       kwargs.get("avoid") or ())
        chosen = choose(kwargs.get("session_key"), loads)
        return [[by_name[chosen]], [by_name[name] for name in loads if name != chosen]]
