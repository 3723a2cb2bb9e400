"""The control channel between the frontend and a worker: typed messages over a socketpair.

Control traffic (submit, cancel, shutdown, stats, ready, released, failures) is
small and rare next to the token ring, so it rides a Unix socketpair created by
the frontend and inherited by the worker (``pass_fds``): like the memfd arena,
there is nothing on the filesystem to leak or unlink when a process dies, and
the fd sits in a poller next to the ring's eventfd.

Neither side ever blocks on a send: what the socket cannot take now waits in
a send buffer that ``flush`` (called by both processes' loops and waits) pushes
on. Two processes that block on sending to each other while neither reads
would deadlock; with non-blocking sends that cannot happen.

Framing: 4-byte little-endian length, then one msgspec-msgpack message
(``shared.messages``; never pickle). A frame whose payload does not decode is
rejected (counted in ``rejected``, the error kept in ``last_error``) and the
channel keeps going; a length over the limit cannot be resynchronised, so the
buffered bytes are dropped and the channel keeps going from the next read.
"""
from __future__ import annotations

import errno
import socket
import struct

from .messages import MAX_MESSAGE_BYTES, Message, MessageError, decode, encode

_LEN = struct.Struct("<I")


class ChannelClosed(ConnectionError):
    pass


class ControlChannel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._buf = bytearray()
        self._out = bytearray()  # bytes the socket has not taken yet, in order
        self.rejected = 0
        self.last_error: str | None = None

    @classmethod
    def pair(cls) -> tuple["ControlChannel", socket.socket]:
        """(frontend end, worker end to pass to the child)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        b.set_inheritable(True)
        return cls(a), b

    @classmethod
    def from_fd(cls, fd: int) -> "ControlChannel":
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Message) -> None:
        self.send_raw(encode(msg))

    def send_raw(self, payload: bytes) -> None:
        """Queue one frame and send what the socket takes now. Never blocks and never
        raises: a peer that is gone is reported by the owner's loop, at its next
        ``flush()`` or ``receive()``, not to whoever happened to send (a client's
        submit must not fail because the worker died a moment ago)."""
        self._out += _LEN.pack(len(payload)) + payload
        try:
            self.flush()
        except ChannelClosed:
            pass

    def flush(self) -> bool:
        """Send queued bytes until the socket is full; True when none are left."""
        while self._out:
            try:
                n = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                raise ChannelClosed(f"control channel closed: {e}") from None
            del self._out[:n]
        return True

    @property
    def unsent_bytes(self) -> int:
        return len(self._out)

    def receive(self) -> list[Message]:
        """Every complete message available now (non-blocking)."""
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break
                raise ChannelClosed(f"control channel closed: {e}") from None
            if not chunk:
                if not self._buf:
                    raise ChannelClosed("control channel closed by the peer")
                break
            self._buf += chunk
            if len(chunk) < (1 << 20):
                break
        out: list[Message] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_MESSAGE_BYTES:
                self._reject(f"frame of {n} bytes exceeds {MAX_MESSAGE_BYTES}; dropped buffered bytes")
                self._buf.clear()
                break
            if len(self._buf) < _LEN.size + n:
                break
            payload = bytes(self._buf[_LEN.size:_LEN.size + n])
            del self._buf[:_LEN.size + n]
            try:
                out.append(decode(payload))
            except MessageError as e:
                self._reject(str(e))
        return out

    def _reject(self, error: str) -> None:
        self.rejected += 1
        self.last_error = error

    def close(self) -> None:
        self.sock.close()
