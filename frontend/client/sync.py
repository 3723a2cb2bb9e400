"""The blocking transport: :class:`Client` (thread-safe, a background I/O thread) and :class:`Stream`."""
from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from typing import Any

import zmq

from frontend.client.core import (
    DEFAULT_ENDPOINT,
    Chunk,
    ClientBase,
    Query,
    Result,
    StreamBase,
    cancel_message,
    dealer_socket,
    decode_reply,
    new_id,
)
from frontend.client.errors import ConnectionClosed, TandemError
from frontend.protocol.encode import encode_message as _encode


def _get(q: queue.Queue, timeout: float | None) -> dict | None:
    """The next reply in ``q``, or None once ``timeout`` seconds have passed."""
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None


class Stream(StreamBase):
    """Iterator of :class:`Chunk` for one streamed request.

    When iteration ends normally, ``.result`` holds the final :class:`Result`
    (whose ``text`` equals the chunk texts concatenated).  A server ``error``
    is raised from the iteration as a :class:`TandemError`.  ``close()`` (or
    leaving a ``with`` block, or garbage collection) before the end cancels
    the request on the server.
    """

    def __init__(self, client: Client, msg: dict, timeout: float | None) -> None:
        super().__init__(client, msg, timeout)
        self._q: queue.Queue = queue.Queue()
        self._call.open(client._demux, self._q)
        try:
            client._send(msg)
        except BaseException:
            self._call.finish()
            raise

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        while not self._call.finished:
            reply = _get(self._q, self._call.remaining())
            if reply is None:
                self.close()
                raise self._call.timed_out()
            chunk = self._call.feed(reply)
            if chunk is not None:
                return chunk
        raise StopIteration

    def cancel(self) -> None:
        """Ask the server to end the request; keep iterating to get its ``done``."""
        if self._call.live:
            self._client.cancel(self.id)

    def close(self) -> None:
        """Stop waiting; cancels the request on the server if it has not ended."""
        if self._call.finish():
            with contextlib.suppress(TandemError):
                self._client.cancel(self.id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Garbage collection may run in the middle of a send on this thread: never
        # send from here, hand the cancel to the client to send when it safely can.
        try:
            if self._call.finish():
                self._client._cancel_soon(self.id)
        except Exception:
            pass


class Client(ClientBase):
    """Synchronous, thread-safe client over one ZeroMQ DEALER connection."""

    _stream_type = Stream

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout: float | None = None, curve: Any = None) -> None:
        super().__init__(endpoint, timeout, curve)
        self._ctx = zmq.Context()
        try:
            # Created here, then used only by the I/O thread (thread start is a memory barrier).
            self._dealer = dealer_socket(self._ctx, endpoint, curve)
        except zmq.ZMQError:
            self._ctx.term()
            raise
        self._send_lock = threading.Lock()
        self._deferred_cancels: deque[str] = deque()
        # Callers hand frames to the I/O thread through PUSH -> PULL (serialised by _send_lock).
        wake = f"inproc://tandem-client-{new_id()}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(wake)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(wake)
        self._thread = threading.Thread(target=self._io_loop, name="tandem-client-io", daemon=True)
        self._thread.start()

    # -- plumbing

    def _io_loop(self) -> None:
        dealer, pull = self._dealer, self._pull
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if pull in events:
                    while True:
                        try:
                            frames = pull.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if frames[0] == b"X":
                            return
                        dealer.send_multipart(frames[1:])
                if dealer in events:
                    while True:
                        try:
                            frames = dealer.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        msg = decode_reply(frames)
                        if msg is not None:
                            self._demux.dispatch(msg)
        except zmq.ZMQError:
            pass
        finally:
            self._demux.close_all()
            pull.close(0)
            dealer.close()

    def _send(self, msg: dict) -> None:
        frames = _encode(msg)
        with self._send_lock:
            if self._closed:
                raise ConnectionClosed("the client is closed", id=msg.get("id"))
            self._push.send_multipart([b"S", *frames])
            self._flush_deferred()

    def _flush_deferred(self) -> None:  # with _send_lock held
        while self._deferred_cancels:
            self._push.send_multipart([b"S", *_encode(cancel_message(self._deferred_cancels.popleft()))])

    def _cancel_soon(self, rid: str) -> None:
        """Cancel from a finaliser: send now if no send is in progress, else after it."""
        self._deferred_cancels.append(rid)
        if self._send_lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._flush_deferred()
            finally:
                self._send_lock.release()

    def _query(self, query: Query, timeout: float | None) -> Any:
        q: queue.Queue = queue.Queue()
        self._demux.add_query(query, q)
        try:
            self._send(query.msg)
            reply = _get(q, self._timeout(timeout))
        finally:
            self._demux.remove_query(query, q)
        return query.answer(reply)

    def _finish(self, s: Stream) -> Result:
        """Read a ``stream: false`` call to its end."""
        try:
            for _ in s:  # a server may still send chunks; they are not needed
                pass
        finally:
            s.close()  # no-op once finished; cancels on KeyboardInterrupt etc.
        assert s.result is not None
        return s.result

    def _all(self, streams: list[Stream]) -> list[Result]:
        """Read calls sent together to their ends; on an error, the others are cancelled."""
        try:
            return [self._finish(s) for s in streams]
        finally:
            for s in streams:
                s.close()  # no-op once finished

    @staticmethod
    def _then(value: Any, f) -> Any:
        return f(value)

    def close(self) -> None:
        """Close the connection; calls still waiting raise :class:`ConnectionClosed`."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._push.send_multipart([b"X"])
        self._thread.join()
        self._push.close(0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
