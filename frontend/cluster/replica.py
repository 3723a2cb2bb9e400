"""One replica of a Tandem cluster: a whole ``tandem serve`` as a child process of a Serve replica.

The child runs with ``--http none`` on a private ``ipc://`` endpoint (a 0700
directory named after the replica, so ``ps`` and ``tandem info --connect``
find it) and everything Tandem guarantees on one GPU holds per replica. The
replica reports that endpoint, the child's pid and its Ray node
(``record_replica_metadata``):
an ingress on the same node sends its requests to the child itself
(``direct.py``), the tokens never passing through this actor. For an ingress
elsewhere the replica speaks the protocol to the child with the HTTP
frontend's own async client (``frontend.http.bridge.Bridge``) and streams each
request's messages back in arrival batches (lists of protocol messages, the
last one terminal), the first paired with its own name (the ingress's
``x-tandem-replica`` header): one streamed item per batch, none more.

Failure: the child is started with ``PR_SET_PDEATHSIG`` (SIGKILL), so a
replica whose actor is killed (``kill -9``, or Serve after a failed health
check) takes its ``tandem serve`` with it at once: the child must not keep
serving the ingress's direct requests for a replica Serve has given up
(those in flight end with one ``worker_failed`` error when its connection
closes; its worker exits once its parent is gone). When the child exits,
every request in flight here gets one ``worker_failed`` error at once, a
request that arrives later gets ``NOT_STARTED`` (the ingress sends it to
another replica), the routing stats say ``failed`` and ``check_health``
fails, so Serve replaces the replica; ``check_health`` also fails once the
child's worker has not been ready for ``not_ready_grace_s`` (a worker that
cannot come back).
Shutdown: SIGTERM to the child, which drains for its ``--drain-timeout``;
Serve's graceful shutdown timeout is set longer (``app.py``). A replica whose actor
was killed leaves its directory behind; the next replica started on the node
removes it (the directory names its actor's pid).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

import ray
from ray import serve

from ..http.bridge import Bridge
from .routing import NOT_STARTED

log = logging.getLogger("tandem.cluster")

PR_SET_PDEATHSIG = 1
INFO_TIMEOUT_S = 2.0
OWNER_FILE = "replica.pid"  # in a replica's private directory: its actor's pid


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _sweep_dead_replicas_dirs() -> None:
    """Remove the private directories of this node's replicas whose actor is gone: one killed
    with SIGKILL never ran its cleanup (its tandem serve exits with it, leaving the directory)."""
    for d in Path(tempfile.gettempdir()).glob("tandem-*-*"):
        try:
            pid = int((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not a replica's directory
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # its actor is gone
            shutil.rmtree(d, ignore_errors=True)
        except OSError:  # alive (another user's process)
            pass


def serve_command(endpoint: str, serve_argv: list[str]) -> list[str]:
    """``tandem serve`` (the console script beside this Python if installed, else the module)."""
    script = shutil.which("tandem", path=os.path.dirname(sys.executable))
    head = [sys.executable, script] if script else [sys.executable, "-m", "frontend.cli.main"]
    return [*head, "serve", "--http", "none", "--bind", endpoint, *serve_argv]


class TandemReplica:
    async def __init__(self, serve_argv: list[str], max_queue: int, not_ready_grace_s: float) -> None:
        self.name = serve.get_replica_context().replica_id.unique_id
        self._max_queue = max_queue
        self._grace_s = not_ready_grace_s
        _sweep_dead_replicas_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"tandem-{self.name}-")  # mode 0700: ipc needs no auth
        Path(self._dir, OWNER_FILE).write_text(str(os.getpid()))
        self.endpoint = f"ipc://{self._dir}/serve.sock"
        self._child = await asyncio.create_subprocess_exec(*serve_command(self.endpoint, serve_argv),
                                                           preexec_fn=_die_with_parent)
        self._bridge = Bridge(self.endpoint)
        await self._bridge.start()
        self._exit_code: int | None = None
        self._not_ready_since: float | None = None
        while await self._info() is None:  # the child binds its endpoint once its worker is warm
            if self._child.returncode is not None:
                await self._bridge.close()
                shutil.rmtree(self._dir, ignore_errors=True)
                raise RuntimeError(f"tandem serve exited with code {self._child.returncode} while starting")
        self._watcher = asyncio.create_task(self._watch_child())
        log.info("replica %s: tandem serve pid %d on %s", self.name, self._child.pid, self.endpoint)

    async def _watch_child(self) -> None:
        self._exit_code = await self._child.wait()
        shutil.rmtree(self._dir, ignore_errors=True)  # its socket: nothing will listen there again
        log.error("%s", self._exited())
        await self._bridge.close("worker_failed", self._exited())

    def _exited(self) -> str:
        return f"replica {self.name}: tandem serve exited (code {self._exit_code})"

    async def _info(self) -> dict[str, Any] | None:
        try:
            return await self._bridge.info(timeout=INFO_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            return None

    # ------------------------------------------------------------------ requests (from the ingress)
    async def generate(self, fields: dict[str, Any], session: str | None = None, prefix_pages: tuple = (),
                       avoid: tuple[str, ...] = ()) -> AsyncIterator[Any]:
        """The request's protocol messages in arrival batches, the first as ``(this replica's name,
        batch)``; or ``(name, {NOT_STARTED: why})`` if its child has exited. (``session``,
        ``prefix_pages`` and ``avoid`` are the router's; a cancelled stream cancels the request in
        the child.)"""
        if self._exit_code is not None:  # the ingress sends it to another replica (Serve replaces this one soon)
            yield self.name, {NOT_STARTED: self._exited()}
            return
        first = True
        async for batch in self._bridge.generate(fields).batches():
            yield (self.name, batch) if first else batch
            first = False

    async def info(self) -> dict[str, Any]:
        """The child's ``info`` answer and this replica's name and endpoint."""
        info = await self._info()
        if info is None:
            raise RuntimeError(f"replica {self.name}: tandem serve does not answer")
        return {**info, "replica": self.name, "endpoint": self.endpoint}

    # ------------------------------------------------------------------ Serve's calls
    async def record_replica_metadata(self) -> dict[str, Any]:
        """Where the child listens and its pid, for an ingress on this node (``direct.py``; Serve reads it once)."""
        return {"endpoint": self.endpoint, "node": ray.get_runtime_context().get_node_id(), "pid": self._child.pid}

    async def check_health(self) -> None:
        if self._exit_code is not None:
            raise RuntimeError(self._exited())
        info = await self._info()
        if info is None:
            raise RuntimeError("tandem serve does not answer info")
        if info.get("worker_ready"):
            self._not_ready_since = None
            return
        now = time.monotonic()
        self._not_ready_since = self._not_ready_since or now
        if now - self._not_ready_since > self._grace_s:
            raise RuntimeError(f"the worker has not been ready for {now - self._not_ready_since:.0f} s")

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router balances on (``routing.Load``), from the child's ``info``."""
        if self._exit_code is not None:
            return {"failed": True}
        info = await self._info() or {}
        total = info.get("kv_pages_total") or 0
        return {"taken": time.time(),  # (routing.Load: which of the router's own requests this counts)
                "running": info.get("running", 0), "waiting": info.get("waiting", 0) + info.get("unsent", 0),
                "kv_usage": (total - info.get("kv_pages_free", 0)) / total if total else 0.0,
                "queue_full": info.get("live_requests", 0) >= self._max_queue}

    async def __del__(self) -> None:
        """Serve's graceful shutdown: the child drains (its --drain-timeout) and exits."""
        try:
            if self._child.returncode is None:
                self._child.send_signal(signal.SIGTERM)
                await self._child.wait()
            self._watcher.cancel()
            await self._bridge.close()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
