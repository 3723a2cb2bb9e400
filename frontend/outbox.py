"""Messages to clients, for a ZeroMQ ROUTER socket that must never block nor lose a terminal message.

The server sends with ``NOBLOCK`` and ``ROUTER_MANDATORY``. A send to a client
whose queue is full (it reads more slowly than its requests produce) fails
with ``EAGAIN``; dropping that message could drop a request's only terminal
message, and a client would wait for it forever. So from its first failed
send, a client's messages are held here, in order, and retried on every loop
iteration until it reads again. The server cancels the requests of a client
it has to hold messages for, which bounds what is held to about two messages
per request; a client holding more than ``max_held`` (it keeps sending and
never reads) is treated as gone and its held messages dropped.

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
    GONE = "gone"  # no such client (any more), or it held too much: dropped


class Outbox:
    def __init__(self, sock: zmq.Socket, max_held: int) -> None:
        self._sock = sock
        self.max_held = max_held
        self._held: dict[bytes, deque[list[bytes]]] = {}

    def send(self, identity: bytes, frames: list[bytes]) -> Sent:
        held = self._held.get(identity)
        if held is not None:  # behind what waits already: a client's messages stay in order
            if len(held) >= self.max_held:
                log.warning("client %s holds %d unread messages: treated as gone", identity.hex(), len(held))
                del self._held[identity]
                return Sent.GONE
            held.append(frames)
            return Sent.HELD
        try:
            self._sock.send_multipart([identity, *frames], zmq.NOBLOCK)
            return Sent.SENT
        except zmq.Again:
            log.info("client %s reads too slowly: holding its messages", identity.hex())
            self._held[identity] = deque([frames])
            return Sent.HELD
        except zmq.ZMQError as e:
            log.info("client %s cannot take messages (%s)", identity.hex(), e)
            return Sent.GONE

    def flush(self) -> list[bytes]:
        """Send what is held while the clients take it. Returns the clients found gone."""
        gone = []
        for identity, held in list(self._held.items()):
            try:
                while held:
                    self._sock.send_multipart([identity, *held[0]], zmq.NOBLOCK)
                    held.popleft()
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
        return sum(len(h) for h in self._held.values())
