"""The HTTP frontend's way into the server: one ZeroMQ client on the HTTP event loop.

The HTTP frontend is one more client of the server's request path: it speaks
the ZeroMQ protocol (``TANDEM1`` + msgpack) over the server's
``inproc_endpoint``, so validation, limits, error codes, cancellation and the
request table are the server's own. One ``zmq.asyncio`` DEALER per loop
carries every HTTP request; a reader task routes each reply by request id to
that request's queue, and a writer task sends (so a cancel can be queued from
anywhere, even from a ``finally`` of a cancelled task, without awaiting). The
routing and the messages are the Python client's I/O-free core
(``frontend/client/core.py``: ``Demux``, ``decode_reply``, the info query): only the
transport and the raw-message API the HTTP routes need are this module's.

Fields are passed through as the HTTP layer mapped them: the server checks
types and ranges and answers ``bad_request`` naming the field. A value that
msgpack cannot carry at all (JSON allows integers beyond 64 bits and strings
with lone surrogates) never reaches the server: ``generate`` raises
``Unencodable`` naming the field.

Connection loss: once ``close`` ran, every call in flight and every later one
ends with exactly one ``error`` (``close``'s code and message; ``Call.lost``
says it was the bridge's, not the server's), never a hang. ZeroMQ says nothing
when a server's process dies (it reconnects silently), so the owner of a
bridge to a server that can die closes it when it does (the cluster's replica
when its child exits; the ingress's direct path, ``frontend/cluster/direct.py``,
when a replica's ``tandem serve`` exits).
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from frontend.client.core import CLOSED, Demux, cancel_message, decode_reply, info_query
from ..protocol.encode import encode_message

TERMINAL = ("done", "error")


class Bridge:
    def __init__(self, endpoint: str, context: zmq.Context | None = None) -> None:
        # inproc endpoints live in one context: shadow the server's
        self._ctx = zmq.asyncio.Context(shadow=context or zmq.Context.instance())
        self._endpoint = endpoint
        self._ids = itertools.count(1)
        self._demux = Demux()
        self._closed_with = ("internal", "the server connection is closed")
        self._to_send: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._sock: zmq.asyncio.Socket | None = None
        self._closed = False

    async def start(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 0)  # unbounded: the server must never fail a send to us
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        self._sock = sock
        self._to_send = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._write())]

    async def close(self, code: str = "internal", message: str = "the server connection is closed") -> None:
        """Every request still waiting, and every later one, gets one ``error`` with ``code`` and ``message``."""
        if self._closed:
            return
        self._closed = True  # (first: a generate from here on ends at once)
        self._closed_with = (code, message)  # what each waiting call's error says
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
        self._demux.close_all()  # each waiting call gets the closed mark

    def forget(self, rid: str) -> None:
        """A call ended (or was abandoned): a late message for it is dropped."""
        self._demux.remove_request(rid)

    def gone(self) -> dict[str, Any]:
        """The error a call gets when the connection closed under it (``close``'s code and message)."""
        code, message = self._closed_with
        return {"type": "error", "id": None, "code": code, "message": message}

    # ------------------------------------------------------------------ requests
    def generate(self, fields: dict[str, Any], session: str | None = None, rid: str | None = None) -> "Call":
        """``session``: the client's session (``common.session_of``); a cluster's ingress routes by
        it (``frontend/cluster``), one server has nothing to route. ``rid``: the request's id (unique:
        the id its HTTP answer carries, so the server's log line names it); default ``h<n>``."""
        rid = rid or f"h{next(self._ids)}"
        frames = encode_message({"type": "generate", "id": rid, **fields})
        q: asyncio.Queue = asyncio.Queue()
        if self._closed:  # nothing will answer it
            q.put_nowait(CLOSED)
        else:
            self._demux.add_request(rid, q)
            self._to_send.put_nowait(frames)
        return Call(self, rid, q)

    async def info(self, timeout: float = 5.0) -> dict[str, Any]:
        """The server's info (``TimeoutError`` if it does not answer in time)."""
        query, q = info_query(), asyncio.Queue()
        self._demux.add_query(query, q)
        try:
            self._send(query.msg)
            reply = await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            reply = None
        finally:
            self._demux.remove_query(query, q)
        return query.answer(reply)

    def cancel(self, rid: str) -> None:
        """Ask the server to end a request (its terminal ``done`` still arrives)."""
        if not self._closed:
            self._send(cancel_message(rid))

    def _send(self, msg: dict) -> None:
        self._to_send.put_nowait(encode_message(msg))

    # ------------------------------------------------------------------ tasks
    async def _write(self) -> None:
        while True:
            frames = await self._to_send.get()
            await self._sock.send_multipart(frames)

    async def _read(self) -> None:
        # After each awaited receive, what else is queued is taken without awaiting (a plain
        # socket over the same one): zmq.asyncio's per-receive future machinery was most of the
        # HTTP frontend's cost per streamed token.
        now = zmq.Socket.shadow(self._sock.underlying)
        while True:
            self._route(await self._sock.recv_multipart())
            for _ in range(4096):  # bounded: the loop's other tasks must run too
                try:
                    frames = now.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._route(frames)

    def _route(self, frames: list[bytes]) -> None:
        msg = decode_reply(frames)
        if msg is not None:
            self._demux.dispatch(msg)  # (a late reply to a request already finished here is dropped)


class Call:
    """One generate in flight: its messages in order, exactly one terminal last.

    Leaving ``events()`` (or ``result()``) before the terminal message cancels
    the request in the server: an HTTP client that went away costs no more steps.
    """

    def __init__(self, bridge: Bridge, rid: str, queue: asyncio.Queue) -> None:
        self._bridge, self.id, self._queue = bridge, rid, queue
        self.ended = False
        self.lost = False  # its terminal message is the bridge's: the connection closed under it

    async def batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The messages in arrival batches: each batch is what had arrived when the previous one
        was taken (at least one message), so a slow reader writes fewer, larger pieces. The
        connection's closed mark ends the call as its terminal ``error``."""
        q = self._queue
        try:
            while True:
                batch = [await q.get()]
                while batch[-1] is not CLOSED and batch[-1]["type"] not in TERMINAL and not q.empty():
                    batch.append(q.get_nowait())
                if batch[-1] is CLOSED:
                    batch[-1] = self._bridge.gone()
                    self.lost = True
                if batch[-1]["type"] in TERMINAL:
                    self._finish()
                yield batch
                if self.ended:
                    return
        finally:
            self.abandon()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for batch in self.batches():
                for msg in batch:
                    yield msg
        finally:
            self.abandon()

    async def result(self) -> dict[str, Any]:
        """The terminal message (chunks skipped)."""
        async for msg in self.events():
            if msg["type"] in TERMINAL:
                return msg
        raise AssertionError("unreachable: events() ends with a terminal message")

    def abandon(self) -> None:
        if not self.ended:
            self._finish()
            self._bridge.cancel(self.id)

    def _finish(self) -> None:
        self.ended = True
        self._bridge.forget(self.id)
