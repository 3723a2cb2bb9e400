"""The replicas' Serve request router: ``routing.choose`` over the replicas Serve says are running.

Serve calls ``choose_replicas`` for each request (FIFO order, ``FIFOMixin``)
and sends it to the first replica of the first rank that has room, so the
ranks are: the chosen replica, then the others (a fallback only when the
chosen one is at ``max_ongoing_requests``). The session key is the
``session_key`` argument the ingress passes to ``TandemReplica.generate``;
the loads are each replica's last ``record_routing_stats``.
"""
from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from .routing import Load, choose


class AffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = pending_request.kwargs.get("session_key") if pending_request is not None else None
        chosen = by_name[choose(key, {name: Load.from_stats(r.routing_stats) for name, r in by_name.items()})]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]
