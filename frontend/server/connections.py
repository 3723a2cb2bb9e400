"""Which client connections are closed, for a ZeroMQ ROUTER socket.

A ROUTER learns that a peer is gone only when a send to it fails, so a
``stream: false`` request of a client that closed its socket would run to its
end for nobody. ``Connections`` closes that gap: each received message names
the socket fd it came through (``ZMQ_SRCFD``), and the socket monitor reports
every accepted and every closed connection, by fd, in order.

Fds are reused, so a connection is ``(fd, k)``: the k-th connection accepted on
that fd. The monitor's events for one fd arrive in order (accepted 1, closed 1,
accepted 2, ...), and a connection's "accepted" event is queued before any of
its messages can be read; so, after reading a message and draining the monitor,
the message came through the newest connection on its fd, or that connection is
already closed. (If a client closes and a new one is accepted on the same fd in
between, the old identity is attributed to the new connection: it is then
noticed when that one closes, never wrongly cancelled early.)
"""
from __future__ import annotations

import logging
from collections import Counter

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("tandem.server")


class Connections:
    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor: zmq.Socket | None = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._sock = sock
        self._accepted: Counter[int] = Counter()  # fd -> connections accepted on it so far
        self._closed: Counter[int] = Counter()  # fd -> connections closed on it so far
        self._identity: dict[tuple[int, int], bytes] = {}  # (fd, k) -> the identity speaking through it
        self._connection: dict[bytes, tuple[int, int]] = {}  # identity -> (fd, k)

    def message_from(self, identity: bytes, frame: zmq.Frame) -> list[bytes]:
        """Note that ``identity`` sent ``frame`` (its first frame). Returns the identities
        whose connection is now known to be closed."""
        gone = self.poll()
        try:
            fd = int(frame.get(zmq.SRCFD))
        except zmq.ZMQError:  # a libzmq without ZMQ_SRCFD: closures are noticed by failed sends only
            return gone
        if fd < 0:  # inproc: no fd
            return gone
        k = self._accepted[fd]
        if self._closed[fd] >= k:  # closed already: left to failed sends, never cancelled on a guess
            return gone
        if self._connection.get(identity) != (fd, k):
            self._forget(identity)
            self._connection[identity] = (fd, k)
            self._identity[(fd, k)] = identity
        return gone

    def poll(self) -> list[bytes]:
        """Drain the monitor; the identities whose connection closed."""
        gone = []
        while self.monitor is not None and self.monitor.poll(0):
            ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._accepted[fd] += 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self._closed[fd] += 1
                identity = self._identity.pop((fd, self._closed[fd]), None)
                if identity is not None:
                    self._connection.pop(identity, None)
                    gone.append(identity)
        return gone

    def _forget(self, identity: bytes) -> None:
        conn = self._connection.pop(identity, None)
        if conn is not None:
            self._identity.pop(conn, None)

    def close(self) -> None:
        if self.monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
            self.monitor = None
