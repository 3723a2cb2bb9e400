"""What a call means, without I/O: the messages, the reply routing, one request's and one query's replies,
the results, and the API both transports share (``ClientBase``)."""
from __future__ import annotations

import io
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import zmq

from frontend.client.errors import ConnectionClosed, DuplicateId, RequestTimeout, TandemError
from frontend.protocol.wire import (CHAT_TEMPLATE_FIELDS, MAX_CHOICES, MAX_ID_CHARS, MODEL_FIELDS,
                                    OUTPUT_FIELDS, SKILL_FIELDS, VERSION_FRAME, choice_request, prompt_field)
from frontend.skills import native as skills_native
from frontend.skills import skill_output, skill_request
from shared.families import native_skills
from shared.sampling import SAMPLING_FIELD_NAMES

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
LINGER_MS = 200  # how long close() may wait to flush unsent messages (e.g. a last cancel)

# The keyword options of generate/stream: the sampling fields and the output fields
# (``stream`` is set by the method called). None = not sent, the server's default.
GENERATE_OPTIONS = (frozenset(SAMPLING_FIELD_NAMES) | (frozenset(OUTPUT_FIELDS) - {"stream"}) | frozenset(MODEL_FIELDS)
                    | {"images", "skill"} | frozenset(SKILL_FIELDS) | frozenset(CHAT_TEMPLATE_FIELDS)
                    | {"truncate_prompt_tokens"})


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


def chunk_from(msg: dict) -> Chunk:
    return Chunk(msg.get("id"), msg.get("seq", 0), msg.get("text", ""), list(msg.get("token_ids") or []),
                 msg.get("logprobs"), msg.get("top_logprobs"))


CLOSED = {"type": "_closed"}  # put into every waiting queue when the client closes


def new_id() -> str:
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
    rid = new_id() if request_id is None else request_id
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


def skill_message(skill: str, image: Any, options: dict[str, Any], native: bool, **args: Any) -> dict[str, Any]:
    """The generate options of a skill, overridden by the caller's ``options``. A Moondream model
    renders its own skills (``skill`` and its fields); else ``frontend.skills``'s prompt, where the
    image goes before the text (the protocol's rule for messages without image parts)."""
    if native:
        own = {"length": args.get("length"), "question": args.get("question"), "object": args.get("obj"),
               "max_objects": args.get("max_objects") if skill in ("point", "detect") else None}
        return {**skills_native(skill, own), **options, "images": [] if image is None else [image]}
    return {**skill_request(skill, **args), **options, "images": [image]}


def skill_result(skill: str, r: "Result") -> dict[str, Any]:
    out = skill_output(skill, r.text, r.output)
    return {**out, "reasoning": r.reasoning} if r.reasoning is not None else out


def cancel_message(request_id: str) -> dict[str, Any]:
    return {"type": "cancel", "id": request_id}




def decode_reply(frames: list[bytes]) -> dict | None:
    """A server message as a dict, or None if it is not one (ignored)."""
    if len(frames) < 2 or frames[0] != VERSION_FRAME:
        return None
    try:
        msg = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except Exception:
        return None
    return msg if isinstance(msg, dict) else None


class Demux:
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

    def add_query(self, query: Query, q: Any) -> None:
        with self._lock:
            if query.nonce is not None:
                self._by_nonce[query.nonce] = q
            else:
                self._infos.append(q)

    def remove_query(self, query: Query, q: Any) -> None:
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
            q.put_nowait(CLOSED)


def error_from(msg: dict, rid: str | None) -> TandemError:
    if msg is CLOSED:
        return ConnectionClosed("the client was closed", id=rid)
    return TandemError.from_code(msg.get("code"), msg.get("message", ""), msg.get("id") if msg.get("id") is not None else rid)


class Call:
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
        self._demux: Demux | None = None  # set once opened

    @property
    def opened(self) -> bool:
        return self._demux is not None

    @property
    def live(self) -> bool:
        return self.opened and not self.finished

    def open(self, demux: Demux, q: Any) -> None:
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
            return chunk_from(reply)
        if t == "done":
            self.result = Result._from_msg(reply)
            self.finish()
        elif t == "error" or reply is CLOSED:
            self.finish()
            raise error_from(reply, self.id)
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


class Query:
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
            raise error_from(reply, None)
        if self.reply_type == "pong":
            return time.monotonic() - self.sent_at  # the round trip
        return {k: v for k, v in reply.items() if k != "type"}


def ping_query() -> Query:
    return Query({"type": "ping", "nonce": new_id()})


def info_query() -> Query:
    return Query({"type": "info"})


def dealer_socket(ctx: zmq.Context, endpoint: str, curve: Any = None) -> zmq.Socket:
    """Both transports' connection to the server (``ctx``: a ``zmq.Context`` or a
    ``zmq.asyncio.Context``); socket security options belong here: ``curve``, a
    ``frontend.curve.CurveClient``, for a server that requires CURVE.

    No high-water marks: a burst of requests or replies is queued, never dropped.
    """
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if curve is not None:
            curve.apply(sock)
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


class StreamBase:
    def __init__(self, client: Any, msg: dict, timeout: float | None) -> None:
        self._client = client
        self._call = Call(msg, timeout)
        self.id: str = self._call.id

    @property
    def result(self) -> Result | None:
        """The final :class:`Result`, once the iteration has ended normally."""
        return self._call.result


class ClientBase:
    _stream_type: type  # Stream or AsyncStream

    def __init__(self, endpoint: str, timeout: float | None, curve: Any = None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.curve = curve
        self._demux = Demux()
        self._closed = False
        self._native_skills: bool | None = None  # the server's model renders its skills: asked once, by the first

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
        logit_bias, min_tokens, include_stop_str_in_output, skip_special_tokens, logprobs, top_logprobs, grammar, images (paths, bytes or PIL images, placed by
        ``<image>`` in the prompt or ``{"type": "image"}`` message parts).  Options left as None are not sent (the
        server's defaults apply: max_tokens the rest of the context, temperature 0 = greedy, top_p 1,
        top_k 0 = off).  Raises :class:`TandemError` (subclass per code) for a
        server ``error``.
        """
        return self._finish(self._open_stream(False, prompt, timeout, request))

    def choices(self, prompt: str | None = None, *, n: int, timeout: float | None = None,
                **request: Any) -> list[Result]:
        """``n`` answers to one request (OpenAI's ``n``), each a :class:`Result`, in order. Each choice is a
        request of its own (``protocol.choice_request``: id ``ID-i``, with a seed ``seed + i``, so choice
        i is exactly :meth:`generate` with that seed), sent together; an error in one cancels the
        others and is raised. Arguments as :meth:`generate`."""
        if isinstance(n, bool) or not (isinstance(n, int) and 1 <= n <= MAX_CHOICES):
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
        msg = generate_message(False, prompt, **request)
        choice_request(msg, n - 1)  # the longest id fits (ValueError before anything is sent)
        streams = [self._stream_type(self, choice_request(msg, i), self._timeout(timeout)) for i in range(n)]
        return self._all(streams)

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
        return self._send(cancel_message(request_id))

    def ping(self, timeout: float | None = None) -> float:
        """Round trip to the server; returns the round-trip time in seconds."""
        return self._query(ping_query(), timeout)

    def info(self, timeout: float | None = None) -> dict[str, Any]:
        """The server's ``info``: protocol, model, max_batch, max_model_len, pipeline, device."""
        return self._query(info_query(), timeout)

    # -- skills on an image (a path, bytes or a PIL image); prompts and defaults: frontend/skills.py.
    # Keyword options override the skill's defaults (max_tokens, temperature, ...).

    def caption(self, image: Any, length: str = "normal", **kw: Any) -> dict[str, str]:
        """``{"caption": str}``; ``length``: short, normal or long."""
        return self._skill("caption", image, kw, length=length)

    def query(self, image: Any, question: str, **kw: Any) -> dict[str, str]:
        """``{"answer": str}``."""
        return self._skill("query", image, kw, question=question)

    def point(self, image: Any, object: str, max_objects: int | None = None, **kw: Any) -> dict[str, list]:
        """``{"points": [{"x", "y"}, ...]}`` (in [0, 1]), decoded under the point grammar; ``max_objects``
        None: the model's default (Moondream's ``DEFAULT_MAX_OBJECTS``, a Moondream model's own)."""
        return self._skill("point", image, kw, obj=object, max_objects=max_objects)

    def detect(self, image: Any, object: str, max_objects: int | None = None, **kw: Any) -> dict[str, list]:
        """``{"objects": [{"x_min", "y_min", "x_max", "y_max"}, ...]}``, decoded under the box grammar
        (``max_objects`` as :meth:`point`'s)."""
        return self._skill("detect", image, kw, obj=object, max_objects=max_objects)

    def _skill(self, skill: str, image: Any, options: dict[str, Any], **args: Any) -> dict[str, Any]:
        """A Moondream server renders its own skills: whether it does is asked once, by the first call."""
        def send(native: bool) -> Any:
            self._native_skills = native
            return self._then(self.generate(**skill_message(skill, image, options, native, **args)),
                              lambda r: skill_result(skill, r))

        if self._native_skills is not None:
            return send(self._native_skills)
        return self._then(self.info(), lambda info: send(native_skills(info.get("family"))))

    @property
    def closed(self) -> bool:
        return self._closed
