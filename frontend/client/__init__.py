"""Python client for the Tandem protocol (``docs/PROTOCOL.md``).

Needs only ``pyzmq``, ``msgpack`` and ``msgspec`` (no torch). Of Tandem it imports only
pure-Python modules: ``frontend.protocol.wire`` (the wire constants and generate's
field names) and ``shared.sampling`` (the sampling fields).

    from frontend.client import Client
    with Client("tcp://127.0.0.1:5557") as c:
        print(c.generate("The capital of France is", max_tokens=16).text)
        for chunk in (s := c.stream("Once upon a time", max_tokens=64)):
            print(chunk.text, end="", flush=True)
        print(s.result.finish_reason)

Layout
------
What a call means is written once, without I/O (the "core" section): the
messages a call sends (``generate_message``, ...), how replies are routed to the
calls waiting for them (``Demux``), and what the replies of one request
(``Call``) or one ping/info (``Query``) mean: chunks, the result, typed
errors, timeouts.  The API is written once (``ClientBase``); two thin
transports drive it: :class:`Client` (blocking queues and a background I/O
thread) and :class:`AsyncClient` (asyncio queues, ``zmq.asyncio``; each API
method a coroutine).  The HTTP frontend's bridge (``frontend/http/bridge.py``)
is a third transport of the same core.  Both open their connection with ``dealer_socket``, the one
place the socket is configured.

Thread-safety
-------------
:class:`Client` is thread-safe: any number of threads may call its methods at
once and share its one connection.  A background I/O thread owns the DEALER
socket; it sends what the callers queue and routes every reply to the call
waiting for its ``id`` (pongs by nonce, ``info`` replies first-come
first-served).  A :class:`Stream` should be consumed by one thread.

:class:`AsyncClient` does the same with ``zmq.asyncio`` inside one event loop
(use it from that loop only); a reader task routes the replies.

Timeouts
--------
``timeout`` (seconds, None = wait forever) bounds a whole call, from sending
the request to its terminal message (for a stream: to the end of the stream).
On expiry the client sends ``cancel`` for the request and raises
:class:`RequestTimeout`, which is both a :class:`TandemError` (code
``"timeout"``) and a built-in :class:`TimeoutError`.
"""
from __future__ import annotations

from frontend.client.aio import AsyncClient, AsyncStream
from frontend.client.core import DEFAULT_ENDPOINT, GENERATE_OPTIONS, VERSION_FRAME, Chunk, Result, generate_message
from frontend.client.errors import (
                                    BadRequest,
                                    ConnectionClosed,
                                    ContextLengthExceeded,
                                    DuplicateId,
                                    InternalError,
                                    Overloaded,
                                    RequestTimeout,
                                    TandemError,
                                    TooLong,
                                    UnsupportedVersion,
                                    WorkerFailed,
)
from frontend.client.sync import Client, Stream

__all__ = [
    "VERSION_FRAME",
    "generate_message",
    "DEFAULT_ENDPOINT",
    "GENERATE_OPTIONS",
    "TandemError",
    "BadRequest",
    "UnsupportedVersion",
    "DuplicateId",
    "TooLong",
    "ContextLengthExceeded",
    "Overloaded",
    "WorkerFailed",
    "InternalError",
    "RequestTimeout",
    "ConnectionClosed",
    "Chunk",
    "Result",
    "Stream",
    "AsyncStream",
    "Client",
    "AsyncClient",
]
