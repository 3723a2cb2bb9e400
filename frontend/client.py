"""Python client for the Tandem protocol (``docs/PROTOCOL.md``).

Needs only ``pyzmq`` and ``msgpack`` (no torch). Of Tandem it imports only
pure-Python modules: ``frontend.protocol`` (the wire constants and generate's
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
calls waiting for them (``_Demux``), and what the replies of one request
(``_Call``) or one ping/info (``_Query``) mean: chunks, the result, typed
errors, timeouts.  The API is written once (``_ClientBase``); two thin
transports drive it: :class:`Client` (blocking queues and a background I/O
thread) and :class:`AsyncClient` (asyncio queues, ``zmq.asyncio``; each API
method a coroutine).  The HTTP frontend's bridge (``frontend/http/bridge.py``)
is a third transport of the same core.  Both open their connection with ``_dealer_socket``, the one
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

import asyncio
import contextlib
import inspect
import io
import os
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

from frontend.protocol import MAX_ID_CHARS, MODEL_FIELDS, OUTPUT_FIELDS, SKILL_FIELDS, VERSION_FRAME, prompt_field
from frontend.protocol import encode_message as _encode
from frontend.skills import native as skills_native
from frontend.skills import skill_output, skill_request
from shared.sampling import SAMPLING_FIELD_NAMES

__all__ = [
    "VERSION_FRAME",
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

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
_LINGER_MS = 200  # how long close() may wait to flush unsent messages (e.g. a last cancel)

# The keyword options of generate/stream: the sampling fields and the output fields
# (``stream`` is set by the method called). None = not sent, the server's default.
GENERATE_OPTIONS = (frozenset(SAMPLING_FIELD_NAMES) | (frozenset(OUTPUT_FIELDS) - {"stream"}) | frozenset(MODEL_FIELDS)
                    | {"images", "skill"} | frozenset(SKILL_FIELDS))


# --------------------------------------------------------------------------- errors


class TandemError(Exception):
    """An ``error`` from the server (or a client-side failure); see ``.code``.

    ``code`` is one of the protocol's codes (``bad_request``, ``unsupported_version``,
    ``duplicate_id``, ``too_long``, ``context_length_exceeded``, ``overloaded``, ``worker_failed``, ``internal``)
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


class ContextLengthExceeded(TooLong):
    """The prompt does not fit the model's context (a kind of too long)."""

    code = "context_length_exceeded"


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
    for c in (BadRequest, UnsupportedVersion, DuplicateId, TooLong, ContextLengthExceeded, Overloaded, WorkerFailed,
              InternalError)
}


# --------------------------------------------------------------------------- results


@dataclass
class Chunk:
    """One ``chunk``: the text and token ids new since the previous chunk (and their logprobs,
    if the request asked for them)."""

    id: str
    seq: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list | None = None  # per token id: [token id, logprob] pairs, best first


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
    reasoning: Any = None  # a Moondream reasoning query: {text, token_ids, grounding}
    id: str = ""
    top_logprobs: Any = None  # only with top_logprobs=N: per token, N [token id, logprob] pairs, best first

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
            reasoning=msg.get("reasoning"),
            top_logprobs=msg.get("top_logprobs"),
        )


def _chunk(msg: dict) -> Chunk:
    return Chunk(msg.get("id"), msg.get("seq", 0), msg.get("text", ""), list(msg.get("token_ids") or []),
                 msg.get("logprobs"), msg.get("top_logprobs"))


# --------------------------------------------------------------------------- core (no I/O)

_CLOSED = {"type": "_closed"}  # put into every waiting queue when the client closes


def _new_id() -> str:
    return uuid.uuid4().hex


def generate_message(
    stream: bool,
    prompt: str | None = None,
    /,
    *,
    messages: Sequence[dict] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    request_id: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The ``generate`` message of a call; TypeError / ValueError for bad arguments."""
    unknown = sorted(set(options) - GENERATE_OPTIONS)
    if unknown:
        raise TypeError(f"unknown generate option(s): {', '.join(unknown)}; known: {', '.join(sorted(GENERATE_OPTIONS))}")
    form = prompt_field({"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids,
                         "skill": options.get("skill")})
    rid = _new_id() if request_id is None else request_id
    if not isinstance(rid, str) or not 1 <= len(rid) <= MAX_ID_CHARS:
        raise ValueError(f"request_id must be a string of 1 to {MAX_ID_CHARS} characters")
    msg: dict[str, Any] = {"type": "generate", "id": rid}  # type and id first: see PROTOCOL.md
    if form == "prompt":
        msg["prompt"] = prompt
    elif form == "messages":
        msg["messages"] = [dict(m) for m in messages]  # type: ignore[union-attr]
    elif form == "prompt_token_ids":
        msg["prompt_token_ids"] = [int(t) for t in prompt_token_ids]  # type: ignore[union-attr]
    msg["stream"] = stream
    for k, v in options.items():
        if k == "images" and v is not None:
            msg[k] = [image_bytes(im) for im in v]
        elif v is not None:
            msg[k] = list(v) if isinstance(v, tuple) else v
    return msg


def image_bytes(image: Any) -> bytes:
    """An image as the encoded file the protocol carries: bytes as they are, a path
    read from disk, a PIL image saved as PNG (PIL is not imported: any object with
    ``save(file, format=)``)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return f.read()
    if hasattr(image, "save"):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an image must be bytes, a path or a PIL image, got {type(image).__name__}")


def _skill_msg(skill: str, image: Any, options: dict[str, Any], family: str | None, **args: Any) -> dict[str, Any]:
    """The generate options of a skill, overridden by the caller's ``options``. A Moondream model
    renders its own skills (``skill`` and its fields); else ``frontend.skills``'s prompt, where the
    image goes before the text (the protocol's rule for messages without image parts)."""
    if family == "moondream":
        own = {"length": args.get("length"), "question": args.get("question"), "object": args.get("obj"),
               "max_objects": args.get("max_objects") if skill in ("point", "detect") else None}
        return {**skills_native(skill, own), **options, "images": [] if image is None else [image]}
    return {**skill_request(skill, **args), **options, "images": [image]}


def _skill_result(skill: str, r: "Result") -> dict[str, Any]:
    out = skill_output(skill, r.text, r.output)
    return {**out, "reasoning": r.reasoning} if r.reasoning is not None else out


def _cancel_msg(request_id: str) -> dict[str, Any]:
    return {"type": "cancel", "id": request_id}




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

    def add_query(self, query: _Query, q: Any) -> None:
        with self._lock:
            if query.nonce is not None:
                self._by_nonce[query.nonce] = q
            else:
                self._infos.append(q)

    def remove_query(self, query: _Query, q: Any) -> None:
        with self._lock:
            if query.nonce is not None:
                self._by_nonce.pop(query.nonce, None)
            elif q in self._infos:
                self._infos.remove(q)

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


def _error_from(msg: dict, rid: str | None) -> TandemError:
    if msg is _CLOSED:
        return ConnectionClosed("the client was closed", id=rid)
    return TandemError.from_code(msg.get("code"), msg.get("message", ""), msg.get("id") if msg.get("id") is not None else rid)


class _Call:
    """What the replies to one ``generate`` mean: chunks, then its result or its error.

    ``open`` registers the call's reply queue (before the request is sent, so
    no reply is missed); the transport then hands every reply to ``feed``
    until ``finished``.  ``live``: opened and not ended, so the server may
    still be running the request (closing a live call cancels it).
    """

    def __init__(self, msg: dict, timeout: float | None) -> None:
        self.msg = msg
        self.id: str = msg["id"]
        self.result: Result | None = None
        self.finished = False
        self._timeout = timeout
        self._deadline: float | None = None
        self._demux: _Demux | None = None  # set once opened

    @property
    def opened(self) -> bool:
        return self._demux is not None

    @property
    def live(self) -> bool:
        return self.opened and not self.finished

    def open(self, demux: _Demux, q: Any) -> None:
        demux.add_request(self.id, q)  # DuplicateId: nothing was registered
        self._demux = demux
        self._deadline = None if self._timeout is None else time.monotonic() + self._timeout

    def remaining(self) -> float | None:
        """Seconds left before the call times out (None: no limit)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def feed(self, reply: dict) -> Chunk | None:
        """The chunk to hand out, or None (after ``done`` the call is finished with its
        ``result``; other types are ignored).  An ``error``, or the client closing,
        finishes the call and raises."""
        t = reply.get("type")
        if t == "chunk":
            return _chunk(reply)
        if t == "done":
            self.result = Result._from_msg(reply)
            self.finish()
        elif t == "error" or reply is _CLOSED:
            self.finish()
            raise _error_from(reply, self.id)
        return None

    def timed_out(self) -> RequestTimeout:
        """The error to raise once ``remaining()`` ran out (after cancelling the call)."""
        return RequestTimeout(f"request {self.id} timed out", id=self.id)

    def finish(self) -> bool:
        """Stop routing replies here. True if the call was live: the caller should cancel it."""
        was_live = self.live
        self.finished = True
        if was_live:
            self._demux.remove_request(self.id)  # type: ignore[union-attr]
        return was_live


class _Query:
    """A request answered by one reply: ``ping`` (its pong is routed by nonce) or
    ``info`` (info replies are routed first-come first-served)."""

    def __init__(self, msg: dict) -> None:
        self.msg = msg
        self.nonce: str | None = msg.get("nonce")
        self.reply_type = "pong" if msg["type"] == "ping" else msg["type"]
        self.sent_at = time.monotonic()  # it is sent right away

    def answer(self, reply: dict | None) -> Any:
        """The call's return value, from its reply (None: the time ran out)."""
        if reply is None:
            raise RequestTimeout(f"{self.msg['type']} timed out")
        if reply.get("type") != self.reply_type:
            raise _error_from(reply, None)
        if self.reply_type == "pong":
            return time.monotonic() - self.sent_at  # the round trip
        return {k: v for k, v in reply.items() if k != "type"}


def _ping() -> _Query:
    return _Query({"type": "ping", "nonce": _new_id()})


def _info() -> _Query:
    return _Query({"type": "info"})


# --------------------------------------------------------------------------- transports: what both share


def _dealer_socket(ctx: zmq.Context, endpoint: str, curve: Any = None) -> zmq.Socket:
    """Both transports' connection to the server (``ctx``: a ``zmq.Context`` or a
    ``zmq.asyncio.Context``); socket security options belong here: ``curve``, a
    ``frontend.curve.CurveClient``, for a server that requires CURVE.

    No high-water marks: a burst of requests or replies is queued, never dropped.
    """
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        if curve is not None:
            curve.apply(sock)
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


class _StreamBase:
    def __init__(self, client: Any, msg: dict, timeout: float | None) -> None:
        self._client = client
        self._call = _Call(msg, timeout)
        self.id: str = self._call.id

    @property
    def result(self) -> Result | None:
        """The final :class:`Result`, once the iteration has ended normally."""
        return self._call.result


class _ClientBase:
    _stream_type: type  # Stream or AsyncStream

    def __init__(self, endpoint: str, timeout: float | None, curve: Any = None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.curve = curve
        self._demux = _Demux()
        self._closed = False
        self._family: str | None = None  # the server's model family, asked once by the first skill call

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _open_stream(self, stream: bool, prompt: str | None, timeout: float | None, request: dict) -> Any:
        return self._stream_type(self, generate_message(stream, prompt, **request), self._timeout(timeout))

    # -- API, written once: on AsyncClient every method but stream() returns a coroutine
    # (the transport's _finish, _send, _query and _then are coroutine functions there).

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **request: Any) -> Result:
        """Run one request to completion (``stream: false``); returns its :class:`Result`.

        Exactly one of ``prompt``, ``messages=`` (a list of ``{"role", "content"}``)
        or ``prompt_token_ids=``; ``request_id=`` (default: a fresh uuid4 hex);
        ``timeout`` (seconds, default: the client's).  Options (PROTOCOL.md):
        max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids,
        ignore_eos, presence_penalty, frequency_penalty, repetition_penalty, min_p,
        logit_bias, logprobs, grammar, images (paths, bytes or PIL images, placed by
        ``<image>`` in the prompt or ``{"type": "image"}`` message parts).  Options left as None are not sent (the
        server's defaults apply: max_tokens the rest of the context, temperature 0 = greedy, top_p 1,
        top_k 0 = off).  Raises :class:`TandemError` (subclass per code) for a
        server ``error``.
        """
        return self._finish(self._open_stream(False, prompt, timeout, request))

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **request: Any) -> Any:
        """A streamed request: iterate the returned stream (``for``, or ``async for`` with
        :class:`AsyncClient`) for its :class:`Chunk` s; after the loop, ``stream.result``
        is the final :class:`Result`.  Arguments as :meth:`generate`.

        :class:`Client` sends the request now; :class:`AsyncClient` (not a coroutine
        here) when the iteration, or ``async with``, starts.
        """
        return self._open_stream(True, prompt, timeout, request)

    def cancel(self, request_id: str) -> None:
        """Ask the server to end a request (its call then returns ``finish_reason="cancelled"``).

        Fire-and-forget: the server sends no reply, and ignores unknown ids.
        """
        return self._send(_cancel_msg(request_id))

    def ping(self, timeout: float | None = None) -> float:
        """Round trip to the server; returns the round-trip time in seconds."""
        return self._query(_ping(), timeout)

    def info(self, timeout: float | None = None) -> dict[str, Any]:
        """The server's ``info``: protocol, model, max_batch, max_model_len, pipeline, device."""
        return self._query(_info(), timeout)

    # -- skills on an image (a path, bytes or a PIL image); prompts and defaults: frontend/skills.py.
    # Keyword options override the skill's defaults (max_tokens, temperature, ...).

    def caption(self, image: Any, length: str = "normal", **kw: Any) -> dict[str, str]:
        """``{"caption": str}``; ``length``: short, normal or long."""
        return self._skill("caption", image, kw, length=length)

    def query(self, image: Any, question: str, **kw: Any) -> dict[str, str]:
        """``{"answer": str}``."""
        return self._skill("query", image, kw, question=question)

    def point(self, image: Any, object: str, max_objects: int = 16, **kw: Any) -> dict[str, list]:
        """``{"points": [{"x", "y"}, ...]}`` (in [0, 1]), decoded under the point grammar."""
        return self._skill("point", image, kw, obj=object, max_objects=max_objects)

    def detect(self, image: Any, object: str, max_objects: int = 16, **kw: Any) -> dict[str, list]:
        """``{"objects": [{"x_min", "y_min", "x_max", "y_max"}, ...]}``, decoded under the box grammar."""
        return self._skill("detect", image, kw, obj=object, max_objects=max_objects)

    def _skill(self, skill: str, image: Any, options: dict[str, Any], **args: Any) -> dict[str, Any]:
        """A Moondream server renders its own skills: the server's family is asked once, by the first call."""
        def send(family: str) -> Any:
            self._family = family
            return self._then(self.generate(**_skill_msg(skill, image, options, family, **args)),
                              lambda r: _skill_result(skill, r))

        if self._family is not None:
            return send(self._family)
        return self._then(self.info(), lambda info: send(info.get("family", "")))

    @property
    def closed(self) -> bool:
        return self._closed


# --------------------------------------------------------------------------- sync transport


def _get(q: queue.Queue, timeout: float | None) -> dict | None:
    """The next reply in ``q``, or None once ``timeout`` seconds have passed."""
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None


class Stream(_StreamBase):
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


class Client(_ClientBase):
    """Synchronous, thread-safe client over one ZeroMQ DEALER connection."""

    _stream_type = Stream

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout: float | None = None, curve: Any = None) -> None:
        super().__init__(endpoint, timeout, curve)
        self._ctx = zmq.Context()
        try:
            # Created here, then used only by the I/O thread (thread start is a memory barrier).
            self._dealer = _dealer_socket(self._ctx, endpoint, curve)
        except zmq.ZMQError:
            self._ctx.term()
            raise
        self._send_lock = threading.Lock()
        self._deferred_cancels: deque[str] = deque()
        # Callers hand frames to the I/O thread through PUSH -> PULL (serialised by _send_lock).
        wake = f"inproc://tandem-client-{_new_id()}"
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
        frames = _encode(msg)
        with self._send_lock:
            if self._closed:
                raise ConnectionClosed("the client is closed", id=msg.get("id"))
            self._push.send_multipart([b"S", *frames])
            self._flush_deferred()

    def _flush_deferred(self) -> None:  # with _send_lock held
        while self._deferred_cancels:
            self._push.send_multipart([b"S", *_encode(_cancel_msg(self._deferred_cancels.popleft()))])

    def _cancel_soon(self, rid: str) -> None:
        """Cancel from a finaliser: send now if no send is in progress, else after it."""
        self._deferred_cancels.append(rid)
        if self._send_lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._flush_deferred()
            finally:
                self._send_lock.release()

    def _query(self, query: _Query, timeout: float | None) -> Any:
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


# --------------------------------------------------------------------------- asyncio transport


async def _aget(q: asyncio.Queue, timeout: float | None) -> dict | None:
    """The next reply in ``q``, or None once ``timeout`` seconds have passed."""
    try:
        return await asyncio.wait_for(q.get(), timeout)
    except asyncio.TimeoutError:
        return None


class AsyncStream(_StreamBase):
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


class AsyncClient(_ClientBase):
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
                self._sock = _dealer_socket(ctx, self.endpoint, self.curve)
            except zmq.ZMQError:
                ctx.term()
                raise
            self._ctx = ctx
            self._reader = asyncio.ensure_future(self._read_loop())

    async def _read_loop(self) -> None:
        assert self._sock is not None
        try:
            while True:
                msg = _decode(await self._sock.recv_multipart())
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

    async def _query(self, query: _Query, timeout: float | None) -> Any:
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
