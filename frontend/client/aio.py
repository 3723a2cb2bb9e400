"""The asyncio transport: :class:`AsyncClient` (one event loop) and :class:`AsyncStream`."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Any

import zmq
import zmq.asyncio

from frontend.client.core import (
    DEFAULT_ENDPOINT,
    Chunk,
    ClientBase,
    Query,
    Result,
    StreamBase,
    dealer_socket,
    decode_reply,
)
from frontend.client.errors import ConnectionClosed, TandemError
from frontend.protocol.encode import encode_message as _encode


async def _aget(q: asyncio.Queue, timeout: float | None) -> dict | None:
    """The next reply in ``q``, or None once ``timeout`` seconds have passed."""
    try:
        return await asyncio.wait_for(q.get(), timeout)
    except asyncio.TimeoutError:
        return None


class AsyncStream(StreamBase):
    """Async iterator of :class:`Chunk` for one streamed request.

    The request is sent by ``async with`` or by the first ``__anext__``.  When
    iteration ends normally, ``.result`` holds the final :class:`Result`.
    ``aclose()`` (or leaving ``async with``) before the end cancels the request.
    """

    _q: asyncio.Queue

    async def _start(self) -> None:
        if self._call.opened or self._call.finished:
            return
        await self._client._ensure()
        self._q = asyncio.Queue()
        self._call.open(self._client._demux, self._q)
        try:
            await self._client._send(self._call.msg)
        except BaseException:
            self._call.finish()
            raise

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        await self._start()
        while not self._call.finished:
            reply = await _aget(self._q, self._call.remaining())
            if reply is None:
                await self.aclose()
                raise self._call.timed_out()
            chunk = self._call.feed(reply)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def cancel(self) -> None:
        """Ask the server to end the request; keep iterating to get its ``done``."""
        if self._call.live:
            await self._client.cancel(self.id)

    async def aclose(self) -> None:
        """Stop waiting; cancels the request on the server if it has not ended."""
        if self._call.finish():
            with contextlib.suppress(TandemError):
                await self._client.cancel(self.id)

    async def __aenter__(self) -> AsyncStream:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient(ClientBase):
    """asyncio client (``zmq.asyncio``); use it from one event loop.

    The API is :class:`Client`'s, each method a coroutine (``stream()`` excepted).
    The socket is opened on first use; a reader task routes replies by id, so
    any number of coroutines may run requests concurrently.
    """

    _stream_type = AsyncStream

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout: float | None = None, curve: Any = None) -> None:
        super().__init__(endpoint, timeout, curve)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None

    async def _ensure(self) -> None:
        if self._closed:
            raise ConnectionClosed("the client is closed")
        if self._sock is None:
            ctx = zmq.asyncio.Context()
            try:
                self._sock = dealer_socket(ctx, self.endpoint, self.curve)
            except zmq.ZMQError:
                ctx.term()
                raise
            self._ctx = ctx
            self._reader = asyncio.ensure_future(self._read_loop())

    async def _read_loop(self) -> None:
        assert self._sock is not None
        try:
            while True:
                msg = decode_reply(await self._sock.recv_multipart())
                if msg is not None:
                    self._demux.dispatch(msg)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            self._demux.close_all()

    async def _send(self, msg: dict) -> None:
        await self._ensure()
        assert self._sock is not None
        await self._sock.send_multipart(_encode(msg))

    async def _query(self, query: Query, timeout: float | None) -> Any:
        await self._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._demux.add_query(query, q)
        try:
            await self._send(query.msg)
            reply = await _aget(q, self._timeout(timeout))
        finally:
            self._demux.remove_query(query, q)
        return query.answer(reply)

    async def _finish(self, s: AsyncStream) -> Result:
        """Read a ``stream: false`` call to its end."""
        try:
            async for _ in s:
                pass
        finally:
            await s.aclose()  # no-op once finished; cancels if this task was cancelled
        assert s.result is not None
        return s.result

    async def _all(self, streams: list[AsyncStream]) -> list[Result]:
        """Read calls to their ends, together; on an error, the others are cancelled."""
        tasks = [asyncio.ensure_future(self._finish(s)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()  # no-op once done; else its stream closes, which cancels its request

    @staticmethod
    async def _then(value: Any, f) -> Any:
        out = f(await value)
        return await out if inspect.isawaitable(out) else out  # f may chain another call (a coroutine here)

    async def close(self) -> None:
        """Close the connection; calls still waiting raise :class:`ConnectionClosed`."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except BaseException:
                pass
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()
        self._demux.close_all()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
