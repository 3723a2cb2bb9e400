"""The cluster's direct token path: the ingress talks to a same-node replica's ``tandem serve`` itself.

Ray Serve keeps the replicas (placement, health checks, replacement) and
makes the choice (``router.AffinityRouter``, asked with ``choose_replica(...,
_reserve=False)``: the router alone, no call to any replica's actor); the
request and its tokens then go over ZeroMQ between the ingress and the chosen
replica's ``tandem serve``, at the ``ipc://`` endpoint the replica reports with
its node and its child's pid (``TandemReplica.record_replica_metadata``), when
that node is the ingress's own. A replica on another node, or one that
reported no endpoint, is still called through its Ray handle
(``ingress.ClusterBridge``). Why: on a few cores the Ray processes every token
crossed (the replica's actor, Serve's gRPC both ways) took more CPU than the
worker (BENCHMARKS.md, the hop).

One ``Bridge`` per replica (``link``), opened by the first request routed
there, and one pidfd on its ``tandem serve``: ZeroMQ reconnects silently to a
peer that died, so the process's exit is what closes the link (killed, or
taken along by its actor's death: ``replica.py``). Then every request on it
ends at once with one ``worker_failed`` error (the ingress sends one that had
received nothing to another replica, as the Ray path's ``NOT_STARTED``), and
the replica is in ``dead()`` (the ingress's ``avoid``) until Serve has
replaced it. A process already gone when the link opens gives a closed link
(the same outcome); one this process cannot see (another PID namespace) or an
endpoint it cannot reach leaves that replica to Ray.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from typing import Any, Mapping

from ..http.bridge import Bridge

log = logging.getLogger("tandem.cluster")

DEAD_REMEMBERED = 64  # replicas whose tandem serve exited, kept to be avoided (Serve drops them within seconds)


def endpoint_here(metadata: Mapping[str, Any], node: str) -> str | None:
    """The replica's ``tandem serve`` endpoint if it runs on ``node`` (its reported metadata), else None."""
    endpoint = metadata.get("endpoint")
    return endpoint if endpoint and metadata.get("pid") and metadata.get("node") == node else None


class DirectPath:
    """The ingress's links to the replicas on its node (``node``: Ray's id of it), on the ingress's loop."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._links: dict[str, Bridge | None] = {}  # replica -> its link, or None: through Ray
        self._exits: dict[str, int] = {}  # replica -> the pidfd of its tandem serve, while watched
        self._dead: OrderedDict[str, None] = OrderedDict()

    def dead(self) -> tuple[str, ...]:
        """The replicas whose ``tandem serve`` exited."""
        return tuple(self._dead)

    async def link(self, replica: str, metadata: Mapping[str, Any]) -> Bridge | None:
        """The bridge to ``replica``'s ``tandem serve`` (closed once it exited), or None: through Ray."""
        if replica not in self._links:
            endpoint = endpoint_here(metadata, self.node)
            self._links[replica] = None
            if endpoint is not None:
                await self._open(replica, endpoint, int(metadata["pid"]))
        return self._links[replica]

    async def close(self) -> None:
        """Close every link (the ingress is shutting down): what is in flight on one gets its error."""
        for replica in list(self._exits):
            self._unwatch(replica)
        for bridge in self._links.values():
            if bridge is not None:
                await bridge.close("worker_failed", "the cluster's ingress is shutting down")

    async def _open(self, replica: str, endpoint: str, pid: int) -> None:
        """``replica``'s link in ``_links`` (left None: through Ray)."""
        if not os.path.exists(endpoint.removeprefix("ipc://")):  # (another mount namespace, or its child exited)
            log.warning("replica %s: %s is not reachable from here: reached through Ray", replica, endpoint)
            return
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: a closed link, as if it had exited just now
            pidfd = None
        except OSError as e:  # (not ours to see)
            log.warning("replica %s: cannot watch its tandem serve (pid %d: %s): reached through Ray", replica, pid, e)
            return
        bridge = self._links[replica] = Bridge(endpoint)
        await bridge.start()
        if pidfd is None:
            await self._exited(replica, bridge)
            return

        def on_exit() -> None:
            self._unwatch(replica)
            asyncio.ensure_future(self._exited(replica, bridge))

        self._exits[replica] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, on_exit)  # readable once the process has exited

    async def _exited(self, replica: str, bridge: Bridge) -> None:
        self._dead[replica] = None
        while len(self._dead) > DEAD_REMEMBERED:
            gone, _ = self._dead.popitem(last=False)
            self._links.pop(gone, None)
        log.warning("replica %s: its tandem serve exited", replica)
        await bridge.close("worker_failed", f"replica {replica}: its tandem serve exited")

    def _unwatch(self, replica: str) -> None:
        pidfd = self._exits.pop(replica, None)
        if pidfd is not None:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)
