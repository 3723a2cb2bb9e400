"""The cluster's direct token path: the ingress talks to a same-node replica's ``tandem serve`` itself.

Ray Serve keeps the replicas (placement, health checks, replacement) and
makes the choice (``router.AffinityRouter``, asked with ``choose_replica(...,
_reserve=False)``: the router alone, no call to any replica's actor); the
request and its tokens then go over ZeroMQ between the ingress and the chosen
replica's ``tandem serve``, at the ``ipc://`` endpoint the replica reports with
its node (``TandemReplica.record_replica_metadata``), when that node is the
ingress's own. A replica on another node, or one that reported no endpoint, is
still called through its Ray handle (``ingress.ClusterBridge``). Why: on a few
cores the Ray processes every token crossed (the replica's actor, Serve's gRPC
both ways) took more CPU than the worker (BENCHMARKS.md, the hop).

One ``Bridge`` per replica (``link``), opened by the first request routed
there (which waits at most ``CONNECT_TIMEOUT_S`` for the connection, else that
replica is reached through Ray), and watched: when the replica's ``tandem
serve`` exits (killed, or taken along by its actor's death: ``replica.py``),
the connection closes, every request on it ends at once with one
``worker_failed`` error (the ingress sends one that had received nothing to
another replica, as the Ray path's ``NOT_STARTED``), and the replica is in
``dead()`` (the ingress's ``avoid``) until Serve has replaced it.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Mapping

from ..http.bridge import Bridge

log = logging.getLogger("tandem.cluster")

CONNECT_TIMEOUT_S = 2.0  # an ipc:// connection to a live tandem serve is made in microseconds
DEAD_REMEMBERED = 64  # replicas whose tandem serve exited, kept to be avoided (Serve drops them within seconds)


def endpoint_here(metadata: Mapping[str, Any], node: str) -> str | None:
    """The replica's ``tandem serve`` endpoint if it runs on ``node`` (its reported metadata), else None."""
    endpoint = metadata.get("endpoint")
    return endpoint if endpoint and metadata.get("node") == node else None


class DirectPath:
    """The ingress's links to the replicas on its node (``node``: Ray's id of it), on the ingress's loop."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._links: dict[str, asyncio.Task] = {}  # replica -> its link being opened: the Bridge, or None (via Ray)
        self._watchers: dict[str, asyncio.Task] = {}
        self._dead: OrderedDict[str, None] = OrderedDict()

    def dead(self) -> tuple[str, ...]:
        """The replicas whose ``tandem serve`` closed its connection (exited)."""
        return tuple(self._dead)

    async def link(self, replica: str, metadata: Mapping[str, Any]) -> Bridge | None:
        """The bridge to ``replica``'s ``tandem serve`` (closed once it exited), or None: through Ray."""
        endpoint = endpoint_here(metadata, self.node)
        if endpoint is None:
            return None
        opening = self._links.get(replica)
        if opening is None:
            opening = self._links[replica] = asyncio.create_task(self._open(replica, endpoint))
        return await asyncio.shield(opening)  # (a cancelled request leaves the opening to the others)

    async def _open(self, replica: str, endpoint: str) -> Bridge | None:
        bridge = Bridge(endpoint)
        await bridge.start(watch=True)
        if not await bridge.connected(CONNECT_TIMEOUT_S):
            await bridge.close()
            log.warning("replica %s: no connection to %s within %.0f s: reached through Ray", replica, endpoint,
                        CONNECT_TIMEOUT_S)
            return None
        self._watchers[replica] = asyncio.create_task(self._watch(replica, bridge))
        return bridge

    async def _watch(self, replica: str, bridge: Bridge) -> None:
        await bridge.disconnected()
        self._dead[replica] = None
        while len(self._dead) > DEAD_REMEMBERED:
            gone, _ = self._dead.popitem(last=False)
            self._links.pop(gone, None)
            self._watchers.pop(gone, None)
        log.warning("replica %s: its tandem serve closed the connection", replica)
        await bridge.close("worker_failed", f"replica {replica}: its tandem serve exited")
