"""Python client for the Tandem protocol (``docs/PROTOCOL.md``).

Self-contained: needs only ``pyzmq`` and ``msgpack`` (no torch, no other Tandem
module), so this file can also be copied into another project.

    from frontend.client import Client
    with Client("tcp://127.0.0.1:5557") as c:
        print(c.generate("The capital of France is", max_tokens=16).text)
        for chunk in (s := c.stream("Once upon a time", max_tokens=64)):
            print(chunk.text, end="", flush=True)
        print(s.result.finish_reason)

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

import asyncio
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import zmq
import zmq.asyncio

__all__ = [
    "VERSION_FRAME",
    "DEFAULT_ENDPOINT",
    "TandemError",
    "BadRequest",
    "UnsupportedVersion",
    "DuplicateId",
    "TooLong",
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

VERSION_FRAME = b"TANDEM1"  # same as frontend.protocol.VERSION_FRAME
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
MAX_ID_CHARS = 128
_LINGER_MS = 200  # how long close() may wait to flush unsent messages (e.g. a last cancel)


# --------------------------------------------------------------------------- errors


class TandemError(Exception):
    """An ``error`` from the server (or a client-side failure); see ``.code``.

    ``code`` is one of the protocol's codes (``bad_request``, ``unsupported_version``,
    ``duplicate_id``, ``too_long``, ``overloaded``, ``worker_failed``, ``internal``)
    or, for client-side failures, ``timeout`` / ``closed``.  ``id`` is the
    request id, when there is one.  Each code has a subclass; catch
    ``TandemError`` and check ``.code``, or catch the subclass.
    """

    code = "internal"

    def __init__(self, message: str, code: str | None = None, id: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.id = id

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    @staticmethod
    def from_code(code: object, message: object, id: str | None = None) -> TandemError:
        code = code if isinstance(code, str) else "internal"
        message = message if isinstance(message, str) else repr(message)
        cls = _ERROR_CLASSES.get(code, TandemError)
        return cls(message, code, id)


class BadRequest(TandemError):
    code = "bad_request"


class UnsupportedVersion(TandemError):
    code = "unsupported_version"


class DuplicateId(TandemError):
    code = "duplicate_id"


class TooLong(TandemError):
    code = "too_long"


class Overloaded(TandemError):
    code = "overloaded"


class WorkerFailed(TandemError):
    code = "worker_failed"


class InternalError(TandemError):
    code = "internal"


class RequestTimeout(TandemError, TimeoutError):
    """The call did not finish within its timeout (the request was cancelled)."""

    code = "timeout"


class ConnectionClosed(TandemError):
    """The client was closed while the call was waiting (or before it started)."""

    code = "closed"


_ERROR_CLASSES: dict[str, type[TandemError]] = {
    c.code: c
    for c in (BadRequest, UnsupportedVersion, DuplicateId, TooLong, Overloaded, WorkerFailed, InternalError)
}


# --------------------------------------------------------------------------- results


@dataclass
class Chunk:
    """One ``chunk``: the text and token ids new since the previous chunk."""

    id: str
    seq: int
    text: str
    token_ids: list[int]


@dataclass
class Result:
    """The ``done`` message of a request."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: dict[str, Any] = field(default_factory=dict)  # {prompt_tokens, completion_tokens}
    metrics: dict[str, Any] = field(default_factory=dict)  # {ttft_ms, total_ms}
    output: Any = None  # only with a grammar (point/box: the Moondream-shaped dict)
    logprobs: Any = None  # only with logprobs=True
    id: str = ""

    @classmethod
    def _from_msg(cls, msg: dict) -> Result:
        return cls(
            id=msg.get("id"),
            text=msg.get("text", ""),
            token_ids=list(msg.get("token_ids") or []),
            finish_reason=msg.get("finish_reason", ""),
            usage=dict(msg.get("usage") or {}),
            metrics=dict(msg.get("metrics") or {}),
            output=msg.get("output"),
            logprobs=msg.get("logprobs"),
        )


def _chunk(msg: dict) -> Chunk:
    return Chunk(msg.get("id"), msg.get("seq", 0), msg.get("text", ""), list(msg.get("token_ids") or []))


# --------------------------------------------------------------------------- shared plumbing

_CLOSED = {"type": "_closed"}  # put into every waiting queue when the client closes


def _new_id() -> str:
    return uuid.uuid4().hex


# Sampling and output options of ``generate`` (PROTOCOL.md); None = the server's default.
GENERATE_OPTIONS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                              "ignore_eos", "logprobs", "grammar"})


def _generate_msg(
    request_id: str | None,
    prompt: str | None,
    messages: Sequence[dict] | None,
    prompt_token_ids: Sequence[int] | None,
    stream: bool,
    options: dict[str, Any],
) -> dict[str, Any]:
    unknown = sorted(set(options) - GENERATE_OPTIONS)
    if unknown:
        raise TypeError(f"unknown generate option(s): {', '.join(unknown)}; known: {', '.join(sorted(GENERATE_OPTIONS))}")
    given = [n for n, v in (("prompt", prompt), ("messages", messages), ("prompt_token_ids", prompt_token_ids)) if v is not None]
    if len(given) != 1:
        raise ValueError(
            "exactly one of prompt, messages, prompt_token_ids is required, got "
            + (" and ".join(given) or "none")
        )
    rid = _new_id() if request_id is None else request_id
    if not isinstance(rid, str) or not 1 <= len(rid) <= MAX_ID_CHARS:
        raise ValueError(f"request_id must be a string of 1 to {MAX_ID_CHARS} characters")
    msg: dict[str, Any] = {"type": "generate", "id": rid}
    if prompt is not None:
        msg["prompt"] = prompt
    elif messages is not None:
        msg["messages"] = [dict(m) for m in messages]
    else:
        msg["prompt_token_ids"] = [int(t) for t in prompt_token_ids]  # type: ignore[union-attr]
    msg["stream"] = stream
    for k, v in options.items():
        if v is None:
            continue
        msg[k] = list(v) if isinstance(v, tuple) else v
    return msg


def _decode(frames: list[bytes]) -> dict | None:
    """A server message as a dict, or None if it is not one (ignored)."""
    if len(frames) < 2 or frames[0] != VERSION_FRAME:
        return None
    try:
        msg = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except Exception:
        return None
    return msg if isinstance(msg, dict) else None


class _Demux:
    """Routes server messages to waiting calls (queue.Queue or asyncio.Queue)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Any] = {}
        self._by_nonce: dict[str, Any] = {}
        self._infos: deque = deque()

    def add_request(self, rid: str, q: Any) -> None:
        with self._lock:
            if rid in self._by_id:
                raise DuplicateId(f"request id {rid!r} is already in flight on this client", id=rid)
            self._by_id[rid] = q

    def remove_request(self, rid: str) -> None:
        with self._lock:
            self._by_id.pop(rid, None)

    def add_ping(self, nonce: str, q: Any) -> None:
        with self._lock:
            self._by_nonce[nonce] = q

    def remove_ping(self, nonce: str) -> None:
        with self._lock:
            self._by_nonce.pop(nonce, None)

    def add_info(self, q: Any) -> None:
        with self._lock:
            self._infos.append(q)

    def remove_info(self, q: Any) -> None:
        with self._lock:
            try:
                self._infos.remove(q)
            except ValueError:
                pass

    def dispatch(self, msg: dict) -> bool:
        t = msg.get("type")
        q = None
        with self._lock:
            if t == "pong":
                nonce = msg.get("nonce")
                if isinstance(nonce, str):
                    q = self._by_nonce.pop(nonce, None)
            elif t == "info":
                if self._infos:
                    q = self._infos.popleft()
            else:
                rid = msg.get("id")
                if isinstance(rid, str):
                    q = self._by_id.get(rid)
                elif t == "error" and rid is None:
                    # Not attributable by the server. If exactly one call is
                    # waiting, it can only be that call's; otherwise drop it.
                    waiting = list(self._by_id.values()) + list(self._by_nonce.values()) + list(self._infos)
                    if len(waiting) == 1:
                        q = waiting[0]
                        self._by_nonce = {k: v for k, v in self._by_nonce.items() if v is not q}
                        if self._infos and self._infos[0] is q:
                            self._infos.popleft()
        if q is None:
            return False
        q.put_nowait(msg)
        return True

    def close_all(self) -> None:
        with self._lock:
            qs = list(self._by_id.values()) + list(self._by_nonce.values()) + list(self._infos)
            self._by_id.clear()
            self._by_nonce.clear()
            self._infos.clear()
        for q in qs:
            q.put_nowait(_CLOSED)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _error_from(msg: dict, rid: str | None) -> TandemError:
    if msg is _CLOSED:
        return ConnectionClosed("the client was closed", id=rid)
    return TandemError.from_code(msg.get("code"), msg.get("message", ""), msg.get("id") if msg.get("id") is not None else rid)


# --------------------------------------------------------------------------- sync client


class Stream:
    """Iterator of :class:`Chunk` for one streamed request.

    When iteration ends normally, ``.result`` holds the final :class:`Result`
    (whose ``text`` equals the chunk texts concatenated).  A server ``error``
    is raised from the iteration as a :class:`TandemError`.  ``close()`` (or
    leaving a ``with`` block, or garbage collection) before the end cancels
    the request on the server.
    """

    def __init__(self, client: Client, msg: dict, timeout: float | None) -> None:
        self._client = client
        self.id: str = msg["id"]
        self.result: Result | None = None
        self._finished = True  # until registered: __del__ must not unregister another's id
        self._q: Any = queue.Queue()
        self._deadline = _deadline(timeout)
        client._demux.add_request(self.id, self._q)
        self._finished = False
        try:
            client._send(msg)
        except BaseException:
            self._finish()
            raise

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        while not self._finished:
            try:
                msg = self._q.get(timeout=_remaining(self._deadline))
            except queue.Empty:
                self.close()
                raise RequestTimeout(f"request {self.id} timed out", id=self.id) from None
            t = msg.get("type")
            if t == "chunk":
                return _chunk(msg)
            if t == "done":
                self.result = Result._from_msg(msg)
                self._finish()
                break
            if t == "error" or msg is _CLOSED:
                self._finish()
                raise _error_from(msg, self.id)
        raise StopIteration

    def cancel(self) -> None:
        """Ask the server to end the request; keep iterating to get its ``done``."""
        if not self._finished:
            self._client.cancel(self.id)

    def close(self) -> None:
        """Stop waiting; cancels the request on the server if it has not ended."""
        if not self._finished:
            self._finish()
            try:
                self._client.cancel(self.id)
            except TandemError:
                pass

    def _finish(self) -> None:
        self._finished = True
        self._client._demux.remove_request(self.id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Garbage collection may run in the middle of a send on this thread: never
        # send from here, hand the cancel to the client to send when it safely can.
        try:
            if not self._finished:
                self._finished = True
                self._client._demux.remove_request(self.id)
                self._client._cancel_soon(self.id)
        except Exception:
            pass


class Client:
    """Synchronous, thread-safe client over one ZeroMQ DEALER connection."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout: float | None = None, curve=None) -> None:
        """``curve``: a ``frontend.curve.CurveClient`` for a server that requires CURVE."""
        self.endpoint = endpoint
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._demux = _Demux()
        self._send_lock = threading.Lock()
        self._deferred_cancels: deque[str] = deque()
        self._closed = False
        wake = f"inproc://tandem-client-{_new_id()}"
        # Created here, then used only by the I/O thread (thread start is a memory barrier).
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.SNDHWM, 0)
        self._dealer.setsockopt(zmq.RCVHWM, 0)
        self._dealer.setsockopt(zmq.LINGER, _LINGER_MS)
        if curve is not None:
            curve.apply(self._dealer)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(wake)
        # Used by callers, serialised by _send_lock.
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(wake)
        try:
            self._dealer.connect(endpoint)
        except zmq.ZMQError:
            for s in (self._dealer, self._pull, self._push):
                s.close(0)
            self._ctx.term()
            raise
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
                        msg = _decode(frames)
                        if msg is not None:
                            self._demux.dispatch(msg)
        except zmq.ZMQError:
            pass
        finally:
            self._demux.close_all()
            pull.close(0)
            dealer.close()

    def _send(self, msg: dict) -> None:
        payload = msgpack.packb(msg, use_bin_type=True)
        with self._send_lock:
            if self._closed:
                raise ConnectionClosed("the client is closed", id=msg.get("id"))
            self._push.send_multipart([b"S", VERSION_FRAME, payload])
            self._flush_deferred()

    def _flush_deferred(self) -> None:  # with _send_lock held
        while self._deferred_cancels:
            rid = self._deferred_cancels.popleft()
            payload = msgpack.packb({"type": "cancel", "id": rid}, use_bin_type=True)
            self._push.send_multipart([b"S", VERSION_FRAME, payload])

    def _cancel_soon(self, rid: str) -> None:
        """Cancel from a finaliser: send now if no send is in progress, else after it."""
        self._deferred_cancels.append(rid)
        if self._send_lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._flush_deferred()
            finally:
                self._send_lock.release()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    # -- API

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> Result:
        """Run one request to completion (``stream: false``); returns its :class:`Result`.

        ``options``: max_tokens, temperature, top_p, top_k, seed, stop,
        stop_token_ids, ignore_eos, logprobs, grammar (PROTOCOL.md). Options left as None are not sent (the server's defaults apply:
        max_tokens 256, temperature 0 = greedy, top_p 1, top_k 0 = off).
        Raises :class:`TandemError` (subclass per code) for a server ``error``.
        """
        msg = _generate_msg(request_id, prompt, messages, prompt_token_ids, False, options)
        s = Stream(self, msg, self._timeout(timeout))
        try:
            for _ in s:  # a server may still send chunks; they are not needed
                pass
        finally:
            s.close()  # no-op once finished; cancels on KeyboardInterrupt etc.
        assert s.result is not None
        return s.result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> Stream:
        """Send a streamed request now; iterate the returned :class:`Stream` for chunks.

        After the iteration ends, ``stream.result`` is the final :class:`Result`.
        """
        msg = _generate_msg(request_id, prompt, messages, prompt_token_ids, True, options)
        return Stream(self, msg, self._timeout(timeout))

    def cancel(self, request_id: str) -> None:
        """Ask the server to end a request (its call then returns ``finish_reason="cancelled"``).

        Fire-and-forget: the server sends no reply, and ignores unknown ids.
        """
        self._send({"type": "cancel", "id": request_id})

    def ping(self, timeout: float | None = None) -> float:
        """Round trip to the server; returns the round-trip time in seconds."""
        nonce = _new_id()
        q: Any = queue.Queue()
        self._demux.add_ping(nonce, q)
        t0 = time.monotonic()
        try:
            self._send({"type": "ping", "nonce": nonce})
            try:
                msg = q.get(timeout=self._timeout(timeout))
            except queue.Empty:
                raise RequestTimeout("ping timed out") from None
        finally:
            self._demux.remove_ping(nonce)
        if msg.get("type") != "pong":
            raise _error_from(msg, None)
        return time.monotonic() - t0

    def info(self, timeout: float | None = None) -> dict[str, Any]:
        """The server's ``info``: protocol, model, max_batch, max_model_len, pipeline, device."""
        q: Any = queue.Queue()
        self._demux.add_info(q)
        try:
            self._send({"type": "info"})
            try:
                msg = q.get(timeout=self._timeout(timeout))
            except queue.Empty:
                raise RequestTimeout("info timed out") from None
        finally:
            self._demux.remove_info(q)
        if msg.get("type") != "info":
            raise _error_from(msg, None)
        return {k: v for k, v in msg.items() if k != "type"}

    def point(self, prompt: str, max_objects: int = 16, **kw: Any) -> Any:
        """Generate with ``grammar={"kind": "point", "max_objects": n}``; returns
        ``result.output``: ``{"points": [{"x": .., "y": ..}, ...]}`` (coordinates in [0, 1])."""
        return self.generate(prompt, grammar={"kind": "point", "max_objects": max_objects}, **kw).output

    def detect(self, prompt: str, max_objects: int = 16, **kw: Any) -> Any:
        """Generate with ``grammar={"kind": "box", "max_objects": n}``; returns ``result.output``:
        ``{"objects": [{"x_min": .., "y_min": .., "x_max": .., "y_max": ..}, ...]}``."""
        return self.generate(prompt, grammar={"kind": "box", "max_objects": max_objects}, **kw).output

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

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- async client


class AsyncStream:
    """Async iterator of :class:`Chunk` for one streamed request.

    The request is sent by ``async with`` or by the first ``__anext__``.  When
    iteration ends normally, ``.result`` holds the final :class:`Result`.
    ``aclose()`` (or leaving ``async with``) before the end cancels the request.
    """

    def __init__(self, client: AsyncClient, msg: dict, timeout: float | None) -> None:
        self._client = client
        self._msg = msg
        self.id: str = msg["id"]
        self.result: Result | None = None
        self._timeout = timeout
        self._q: asyncio.Queue | None = None
        self._deadline: float | None = None
        self._finished = False

    async def _start(self) -> None:
        if self._q is not None or self._finished:
            return
        await self._client._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._client._demux.add_request(self.id, q)
        self._q = q
        self._deadline = _deadline(self._timeout)
        try:
            await self._client._send(self._msg)
        except BaseException:
            self._finish()
            raise

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        await self._start()
        while not self._finished:
            assert self._q is not None
            try:
                msg = await asyncio.wait_for(self._q.get(), _remaining(self._deadline))
            except asyncio.TimeoutError:
                await self.aclose()
                raise RequestTimeout(f"request {self.id} timed out", id=self.id) from None
            t = msg.get("type")
            if t == "chunk":
                return _chunk(msg)
            if t == "done":
                self.result = Result._from_msg(msg)
                self._finish()
                break
            if t == "error" or msg is _CLOSED:
                self._finish()
                raise _error_from(msg, self.id)
        raise StopAsyncIteration

    async def cancel(self) -> None:
        """Ask the server to end the request; keep iterating to get its ``done``."""
        if self._q is not None and not self._finished:
            await self._client.cancel(self.id)

    async def aclose(self) -> None:
        """Stop waiting; cancels the request on the server if it has not ended."""
        if self._finished:
            return
        started = self._q is not None
        self._finish()
        if started:
            try:
                await self._client.cancel(self.id)
            except TandemError:
                pass

    def _finish(self) -> None:
        self._finished = True
        if self._q is not None:
            self._client._demux.remove_request(self.id)

    async def __aenter__(self) -> AsyncStream:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient:
    """asyncio client (``zmq.asyncio``); use it from one event loop.

    The socket is opened on first use; a reader task routes replies by id, so
    any number of coroutines may run requests concurrently.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout: float | None = None, curve=None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._curve = curve  # a frontend.curve.CurveClient, or None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._demux = _Demux()
        self._closed = False

    async def _ensure(self) -> None:
        if self._closed:
            raise ConnectionClosed("the client is closed")
        if self._sock is None:
            self._ctx = zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, _LINGER_MS)
            if self._curve is not None:
                self._curve.apply(sock)
            sock.connect(self.endpoint)
            self._sock = sock
            self._reader = asyncio.ensure_future(self._read_loop())

    async def _read_loop(self) -> None:
        assert self._sock is not None
        try:
            while True:
                frames = await self._sock.recv_multipart()
                msg = _decode(frames)
                if msg is not None:
                    self._demux.dispatch(msg)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            self._demux.close_all()

    async def _send(self, msg: dict) -> None:
        await self._ensure()
        assert self._sock is not None
        await self._sock.send_multipart([VERSION_FRAME, msgpack.packb(msg, use_bin_type=True)])

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> Result:
        """As :meth:`Client.generate`."""
        msg = _generate_msg(request_id, prompt, messages, prompt_token_ids, False, options)
        s = AsyncStream(self, msg, self._timeout(timeout))
        try:
            async for _ in s:
                pass
        finally:
            await s.aclose()  # no-op once finished; cancels if this task was cancelled
        assert s.result is not None
        return s.result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **options: Any,
    ) -> AsyncStream:
        """A streamed request: ``async for chunk in client.stream(...)`` (or ``async with``).

        Not a coroutine: the request is sent when iteration (or ``async with``) starts.
        """
        msg = _generate_msg(request_id, prompt, messages, prompt_token_ids, True, options)
        return AsyncStream(self, msg, self._timeout(timeout))

    async def cancel(self, request_id: str) -> None:
        """As :meth:`Client.cancel`."""
        await self._send({"type": "cancel", "id": request_id})

    async def ping(self, timeout: float | None = None) -> float:
        """Round trip to the server; returns the round-trip time in seconds."""
        await self._ensure()
        nonce = _new_id()
        q: asyncio.Queue = asyncio.Queue()
        self._demux.add_ping(nonce, q)
        t0 = time.monotonic()
        try:
            await self._send({"type": "ping", "nonce": nonce})
            try:
                msg = await asyncio.wait_for(q.get(), self._timeout(timeout))
            except asyncio.TimeoutError:
                raise RequestTimeout("ping timed out") from None
        finally:
            self._demux.remove_ping(nonce)
        if msg.get("type") != "pong":
            raise _error_from(msg, None)
        return time.monotonic() - t0

    async def info(self, timeout: float | None = None) -> dict[str, Any]:
        """As :meth:`Client.info`."""
        await self._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._demux.add_info(q)
        try:
            await self._send({"type": "info"})
            try:
                msg = await asyncio.wait_for(q.get(), self._timeout(timeout))
            except asyncio.TimeoutError:
                raise RequestTimeout("info timed out") from None
        finally:
            self._demux.remove_info(q)
        if msg.get("type") != "info":
            raise _error_from(msg, None)
        return {k: v for k, v in msg.items() if k != "type"}

    async def point(self, prompt: str, max_objects: int = 16, **kw: Any) -> Any:
        """As :meth:`Client.point`."""
        r = await self.generate(prompt, grammar={"kind": "point", "max_objects": max_objects}, **kw)
        return r.output

    async def detect(self, prompt: str, max_objects: int = 16, **kw: Any) -> Any:
        """As :meth:`Client.detect`."""
        r = await self.generate(prompt, grammar={"kind": "box", "max_objects": max_objects}, **kw)
        return r.output

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

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
