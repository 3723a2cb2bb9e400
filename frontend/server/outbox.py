"""Messages to clients, for a ZeroMQ ROUTER socket that must never block nor lose a terminal message.

The server sends with ``NOBLOCK`` and ``ROUTER_MANDATORY``. A send to a client
whose queue is full (it reads more slowly than its requests produce) fails
with ``EAGAIN``; dropping that message could drop a request's only terminal
message, and a client would wait for it forever. So from its first failed
send, a client's request messages (chunks, ``done``, errors with an id) are
held here, in order, and retried on every loop iteration until it reads again;
replies that belong to no request (``pong``, ``info``) are dropped meanwhile,
as ZeroMQ would. The server cancels the requests of a client it has to hold
messages for, which bounds what is held to about two messages per request; a
client over ``max_held`` messages or ``max_held_bytes`` (it keeps sending and
never reads) is treated as gone and what was held for it dropped.

A send to a client that is gone (``EHOSTUNREACH``) is dropped: it has nobody
to go to.
"""
from __future__ import annotations

import logging
from collections import deque
from enum import Enum

import zmq

log = logging.getLogger("tandem.server")


class Sent(Enum):
    SENT = "sent"
    HELD = "held"  # the client's queue is full: sent when it reads again
    DROPPED = "dropped"  # a reply to no request, for a client whose queue is full
    GONE = "gone"  # no such client (any more), or it held too much: dropped


class _Held:
    def __init__(self) -> None:
        self.messages: deque[list[bytes]] = deque()
        self.bytes = 0


class Outbox:
    def __init__(self, sock: zmq.Socket, max_held: int, max_held_bytes: int = 256 << 20) -> None:
        self._sock = sock
        self.max_held, self.max_held_bytes = max_held, max_held_bytes
        self._held: dict[bytes, _Held] = {}

    def send(self, identity: bytes, frames: list[bytes], keep: bool = True) -> Sent:
        """``keep``: a request's message, held if the client cannot take it now (else dropped)."""
        held = self._held.get(identity)
        if held is None:
            try:
                self._sock.send_multipart([identity, *frames], zmq.NOBLOCK)
                return Sent.SENT
            except zmq.Again:
                if not keep:
                    return Sent.DROPPED
                log.info("client %s reads too slowly: holding its messages", identity.hex())
                held = self._held[identity] = _Held()
            except zmq.ZMQError as e:
                log.info("client %s cannot take messages (%s)", identity.hex(), e)
                return Sent.GONE
        elif not keep:
            return Sent.DROPPED
        elif len(held.messages) >= self.max_held or held.bytes >= self.max_held_bytes:
            log.warning("client %s has %d unread messages (%d bytes): treated as gone", identity.hex(),
                        len(held.messages), held.bytes)
            del self._held[identity]
            return Sent.GONE
        held.messages.append(frames)  # behind what waits already: a client's messages stay in order
        held.bytes += sum(len(f) for f in frames)
        return Sent.HELD

    def flush(self) -> list[bytes]:
        """Send what is held while the clients take it. Returns the clients found gone."""
        gone = []
        for identity, held in list(self._held.items()):
            try:
                while held.messages:
                    self._sock.send_multipart([identity, *held.messages[0]], zmq.NOBLOCK)
                    held.bytes -= sum(len(f) for f in held.messages.popleft())
            except zmq.Again:
                continue  # still full: next time
            except zmq.ZMQError:
                gone.append(identity)
            del self._held[identity]
        return gone

    def drop(self, identities: list[bytes]) -> None:
        """Clients whose connection closed: what they were to get goes nowhere."""
        for identity in identities:
            self._held.pop(identity, None)

    @property
    def held(self) -> int:
        """Messages held, for all clients together."""
        return sum(len(h.messages) for h in self._held.values())
