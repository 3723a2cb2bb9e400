"""The ZeroMQ server: PROTOCOL.md over a ROUTER socket, in front of a ``Service``.

One thread runs one loop: it polls the client socket and the worker's fds
(token-ring eventfd, control socket), validates and submits requests, lets the
service deliver tokens, and sends chunks, done and errors back.

- ``ROUTER_MANDATORY`` is on: a message to a peer that is gone or cannot take
  more raises instead of being dropped silently; that peer's requests are
  cancelled (their resources freed in the worker) and the loop never blocks.
  What a peer that cannot take more was to get is held for it, in order
  (``outbox.py``): its terminal messages still arrive once it reads.
- A closed client connection cancels its requests at once, ``stream: false``
  ones included (``connections.py``: the socket monitor, by fd).
- At most one chunk per request per step: the service emits one event per
  committed token, and each ring entry is one step.
- Every request gets exactly one terminal message, also on shutdown.
- Besides its ``bind`` endpoint the socket listens on ``inproc_endpoint``, for
  clients in this process (the HTTP frontend): the same request table,
  validation and limits for every client. ``Gate`` is the one way a
  generate enters the service, also for ``tandem generate`` without ``--connect``.
- ``metrics`` (``frontend/server/metrics.py``) counts every request's end.
- Stopping drains first (``drain_timeout_s``): new requests are refused with
  ``overloaded``, those in flight may finish until the deadline; what is left
  then ends with an error. A second stop request stops at once.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import zmq

from frontend import logs
from frontend.protocol.wire import CancelRequest, ClientMessage, GenerateRequest, InfoRequest, Limits, PingRequest
from frontend.protocol.parse import ProtocolError, parse_client_message
from frontend.protocol.encode import encode_chunk, encode_done, encode_error, encode_info, encode_pong
from frontend.client import DEFAULT_ENDPOINT
from frontend.client.core import new_id
from frontend.server.connections import Connections
from frontend.curve import CurveServer
from frontend.grammars import GrammarCompiler, GrammarError
from frontend.images.idefics3 import image_prompt_ids
from frontend.moondream import skills as moondream_skills
from frontend.server.metrics import Metrics
from frontend.cli.options import MAX_QUEUE
from frontend.server.outbox import Outbox, Sent
from frontend.server.request import Request
from frontend.server.service import Service, served_name
from frontend.server.systemd import Notifier
from frontend.server.tokenization import chat_prompt_ids, image_chat_prompt_ids, text_prompt_ids

log = logging.getLogger("tandem.server")

# The worker's figures that ``info`` passes on (besides the contract's fields).
INFO_STATS = ("kv_pages_free", "kv_pages_total", "rows_free", "rows_total", "waiting", "running", "steps",
              "zombie_rows", "host_s", "device_idle_fraction", "bubble_idle_s", "bubble_busy_s",
              "committed_tokens", "prefill_tokens", "prefix_hit_tokens", "prefix_query_tokens")


class Gate:
    """The one path from a client's ``generate`` into ``Service``: this server's (and through it
    the HTTP frontend's) and ``tandem generate``'s without ``--connect``, so the same input gets
    the same answer everywhere. ``parse`` validates the message (``protocol/parse.py``); ``submit``
    renders the prompt (text, chat messages or token ids; with images, once the image pool knows
    their tiling), compiles the grammar, checks what needs the model (an empty prompt, the
    context length, images on a text model) and submits. Bad input raises ``ProtocolError``
    (``bad_request``, ``too_long``, ``context_length_exceeded``) naming the field; nothing has been submitted then."""

    def __init__(self, service: Service, limits: Limits | None = None) -> None:
        self.service = service
        self.max_model_len = int(service.info["max_model_len"])  # the worker's (context_length: why that long)
        # a prompt needs one token less than the context: at least one is generated
        self.limits = limits or Limits(vocab_size=service.vocab_size, max_messages=self.max_model_len - 1)
        self.grammars = GrammarCompiler(service.tokenizer, service.vocab_size, service.model.eos_token_ids)

    def parse(self, frames: Sequence[bytes]) -> ClientMessage:
        """A client message, validated (``ProtocolError`` otherwise)."""
        return parse_client_message(frames, self.limits)

    def submit(self, msg: GenerateRequest, on_event: Callable[[Request, str, dict], None] | None = None,
               user_data: Any = None) -> Request:
        """Render, check and submit one request; its events go to ``on_event``."""
        service = self.service
        if msg.images and not service.model.vision:
            raise ProtocolError("bad_request", "images: this model takes no images (it has no vision encoder)",
                                  msg.id)
        if msg.skill is not None:
            return self._submit_skill(msg, on_event, user_data)
        if msg.images and service.model.family.native_skills:
            if msg.messages is None:
                raise ProtocolError("bad_request", "images: a Moondream model takes its image with a skill request "
                                      "(skill: caption, query, point or detect) or a chat message", msg.id)
            try:  # a chat about an image: Moondream's query skill
                skill = moondream_skills.chat_query(msg.messages)
            except ValueError as e:
                raise ProtocolError("bad_request", str(e), msg.id) from None
            return self._submit_skill(replace(msg, skill=skill), on_event, user_data)
        try:
            ids = self._prompt_ids(msg) if not msg.images else None
            constraint = self.grammars.compile(msg.grammar).matcher() if msg.grammar is not None else None
        except GrammarError as e:
            raise ProtocolError("bad_request", f"grammar: {e}", msg.id) from None
        except ValueError as e:
            raise ProtocolError("bad_request", str(e), msg.id) from None
        if ids is not None and not ids:
            raise ProtocolError("bad_request", "the prompt is empty after tokenization", msg.id)
        if ids is not None and len(ids) >= self.max_model_len:
            raise ProtocolError("context_length_exceeded", f"the prompt has {len(ids)} tokens; the context holds "
                                  f"{self.max_model_len} (prompt + at least one generated token)", msg.id)
        kw = dict(stop=msg.stop, constraint=constraint, logprobs=msg.logprobs, top_logprobs=msg.top_logprobs,
                  on_event=on_event, user_data=user_data, adapter=msg.adapter)
        try:
            sampling = self.sampling(msg)  # the model's defaults may conflict with the request (min_tokens)
            if msg.images:  # decoded off the loop; the prompt is rendered once their tiling is known
                return service.submit_images(list(msg.images), self._image_renderer(msg), sampling, **kw)
            return service.submit(ids, sampling, **kw)
        except ValueError as e:
            raise ProtocolError("bad_request", str(e), msg.id) from None

    def sampling(self, msg: GenerateRequest):
        """The request's sampling parameters: the fields it sets, the model's defaults
        (generation_config.json) for those it leaves out, the protocol's defaults for the rest."""
        defaults = {k: v for k, v in self.service.model.sampling_defaults.items() if k not in msg.explicit}
        return replace(msg.sampling, **defaults) if defaults else msg.sampling

    def _submit_skill(self, msg: GenerateRequest, on_event, user_data) -> Request:
        """A skill request: the model renders its own prompt (Moondream: its token templates); the
        sampling fields the client set override the skill's defaults."""
        s = msg.sampling
        pick = lambda name: getattr(s, name) if name in msg.explicit else None  # noqa: E731
        try:
            return self.service.submit_skill(msg.skill, list(msg.images), max_tokens=pick("max_tokens"),
                                             temperature=pick("temperature"), top_p=pick("top_p"), seed=pick("seed"),
                                             on_event=on_event, user_data=user_data)
        except ValueError as e:
            raise ProtocolError("bad_request", str(e), msg.id) from None

    def _prompt_ids(self, msg: GenerateRequest) -> list[int]:
        tok = self.service.tokenizer
        if msg.prompt_token_ids is not None:
            ids = list(msg.prompt_token_ids)
        elif msg.messages is not None:
            ids = chat_prompt_ids(tok, msg.messages, **msg.template_options)
        else:
            ids = text_prompt_ids(tok, msg.prompt)
        return ids[-msg.truncate_prompt_tokens:] if msg.truncate_prompt_tokens else ids

    def _image_renderer(self, msg: GenerateRequest) -> Callable:
        tok, params = self.service.tokenizer, self.service.image_params
        if msg.messages is not None:
            return lambda images: image_chat_prompt_ids(tok, msg.messages, images, params, **msg.template_options)
        return lambda images: image_prompt_ids(tok, msg.prompt, images, params)


@dataclass
class ClientRequest:
    identity: bytes
    id: str
    stream: bool
    seq: int = 0  # next chunk number
    t_last: float | None = None  # when its last token was committed (inter-token latency)


class Server:
    def __init__(self, service: Service, bind: str = DEFAULT_ENDPOINT, *, max_queue: int = MAX_QUEUE,
                 limits: Limits | None = None, notifier: Notifier | None = None,
                 drain_timeout_s: float = 0.0, curve: CurveServer | None = None,
                 metrics_compat: str | None = None) -> None:
        self.service = service
        self.max_queue = max_queue
        self.drain_timeout_s = drain_timeout_s
        self.gate = Gate(service, limits)  # validation, prompt rendering, grammars: one path
        self.limits = self.gate.limits
        self.notifier = notifier or Notifier()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ drops the connection of a peer that exceeds MAXMSGSIZE (its other requests
        # would lose their terminal messages), so the hard cap sits far above the protocol
        # limit and oversized messages are answered with too_long by the parser instead.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * max(self.limits.max_image_message_bytes,
                                                     2 * self.limits.max_message_bytes))
        self.curve = curve
        if curve is not None:
            curve.apply(self.sock)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # A fresh name each time: a closed socket's inproc name is released later, by ZeroMQ's
        # reaper thread, so a name derived from id(self) can still be taken when the id is reused.
        self.inproc_endpoint = f"inproc://tandem-server-{new_id()}"
        self.sock.bind(self.inproc_endpoint)
        self.metrics = Metrics(metrics_compat)  # metrics_compat: also under vLLM's names (metrics.py)
        self.connections = Connections(self.sock)
        self.outbox = Outbox(self.sock, max_held=2 * max_queue + 1024)  # ~2 per request, and replies
        self.live: dict[tuple[bytes, str], Request] = {}
        self._stop = threading.Event()
        self._drain_deadline: float | None = None  # set when a graceful stop begins
        self._last_watchdog = 0.0

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        """Begin a graceful stop (drain), or stop at once if one has begun or there is no drain time.
        Safe from a signal handler or another thread: it only sets flags the loop reads."""
        if self._drain_deadline is None and self.drain_timeout_s > 0:
            self._drain_deadline = time.monotonic() + self.drain_timeout_s
        else:
            self._stop.set()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def serve_forever(self) -> None:
        self.notifier.ready(f"serving on {self.endpoint}")
        poller, generation, stopping = None, -1, False
        try:
            while not self._stop.is_set():
                if self.draining:
                    if not stopping:
                        stopping = True
                        self.notifier.stopping()
                        log.warning("draining: %d requests in flight, at most %.0f s", len(self.live),
                                    self.drain_timeout_s)
                    if not self.live or time.monotonic() > self._drain_deadline:
                        break
                if generation != self.service.generation:  # a restarted worker has new fds
                    poller, generation = self._poller(), self.service.generation
                events = dict(poller.poll(20))
                if self.sock in events:
                    self._read_clients()
                if self.connections.monitor in events:
                    self._clients_gone(self.connections.poll())
                self.service.poll(0)
                if self.outbox.held:
                    self._clients_gone(self.outbox.flush())
                if not stopping:
                    self._feed_watchdog()
        finally:
            if not stopping:
                self.notifier.stopping()
            self._shutdown()

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.connections.monitor, zmq.POLLIN)
        for fd in self.service.fds():
            poller.register(fd, zmq.POLLIN)
        return poller

    def _feed_watchdog(self) -> None:
        interval = self.notifier.watchdog_interval_s
        if interval is None or time.monotonic() - self._last_watchdog < interval:
            return
        if self.service.worker is not None and self.service.worker.failure() is None:
            self.notifier.watchdog()  # only while the worker's heartbeat is fresh
            self._last_watchdog = time.monotonic()

    def _shutdown(self) -> None:
        self.service.close()  # ends every live request: exactly one terminal message each
        self.live.clear()
        deadline = time.monotonic() + 2.0  # what slow clients are still to read
        while self.outbox.held and time.monotonic() < deadline:
            self.outbox.flush()
            time.sleep(0.01)
        self.connections.close()
        self.sock.close(linger=2000)  # let those terminal messages go out
        if self.curve is not None:
            self.curve.close()

    # ------------------------------------------------------------------ client messages
    def _read_clients(self) -> None:
        for _ in range(256):  # bounded: the worker's tokens must not wait behind a flood
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, body = frames[0].bytes, [f.bytes for f in frames[1:]]
            self._clients_gone(self.connections.message_from(identity, frames[-1]))
            msg = None
            try:
                msg = self.gate.parse(body)
                self._handle(identity, msg)
            except ProtocolError as e:
                self.metrics.error(e.code)
                self._send(identity, e.to_frames(), keep=e.id is not None)
            except Exception as e:  # noqa: BLE001 - one bad request never takes the server down
                log.exception("internal error handling a client message")
                self.metrics.error("internal")
                # a generate that failed here is not live: this error is its terminal message
                rid = msg.id if isinstance(msg, GenerateRequest) else None
                error = encode_error(rid, "internal", f"{type(e).__name__}: {e}")
                self._send(identity, error, keep=rid is not None)

    def _handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, PingRequest):
            self._send(identity, encode_pong(msg.nonce), keep=False)
        elif isinstance(msg, InfoRequest):
            info = self.service.info
            extra = {"generation": self.service.generation, "worker_ready": self.service.worker_ready,
                     "live_requests": len(self.live), "unsent": len(self.service.unsent),
                     "grammar_cache_hits": self.gate.grammars.cache_hits,
                     "adapters": list(self.service.adapters),
                     "vision": self.service.model.vision, "family": self.service.model.family.name,
                     "sampling_defaults": self.service.model.sampling_defaults,
                     "served_model_name": served_name(self.service.config),
                     "chat_template": self.service.config.chat_template}  # --chat-template's text, or None
            try:
                stats = self.service.stats(timeout=2.0)
                extra |= {k: stats[k] for k in INFO_STATS if k in stats}
                extra["encoder_cache"] = {k: int(stats[f"encoder_cache_{k}"]) for k in ("hits", "misses", "entries")}
                extra["prefix_cache"] = {"hit_tokens": stats["prefix_hit_tokens"],
                                         "query_tokens": stats["prefix_query_tokens"]}
                extra["adapters_loaded"] = stats.get("adapters_loaded", [])  # the adapters in device slots
            except (TimeoutError, KeyError):
                pass  # a busy or restarting worker: answer without the engine figures
            self._send(identity, encode_info(
                model=self.service.config.model, max_batch=info.get("max_batch", 0),
                max_model_len=self.gate.max_model_len, pipeline=bool(info.get("pipeline")),
                device=str(info.get("device")), **extra), keep=False)
        elif isinstance(msg, CancelRequest):
            req = self.live.get((identity, msg.id))
            if req is not None:
                self.service.cancel(req)  # emits the terminal done(cancelled)
        else:
            self._generate(identity, msg)

    def _generate(self, identity: bytes, msg: GenerateRequest) -> None:
        key = (identity, msg.id)
        if key in self.live:
            raise ProtocolError("duplicate_id", f"request id {msg.id!r} is already live on this connection",
                                  msg.id)
        if self.draining:
            raise ProtocolError("overloaded", "the server is shutting down; retry on another instance or later",
                                  msg.id)
        if len(self.live) >= self.max_queue:
            raise ProtocolError("overloaded", f"{len(self.live)} requests in flight; retry later", msg.id)
        req = self.gate.submit(msg, self._on_event, ClientRequest(identity, msg.id, msg.stream))
        if not req.ended:
            self.live[key] = req

    # ------------------------------------------------------------------ service events
    def _on_event(self, req: Request, kind: str, payload: dict[str, Any]) -> None:
        state: ClientRequest = req.user_data
        if kind == "chunk":
            now = time.perf_counter()
            if state.t_last is not None:
                self.metrics.token_gap(now - state.t_last)
            state.t_last = now
            if state.stream:
                sent = self._send(state.identity, encode_chunk(state.id, state.seq, payload["text"],
                                                                 payload["token_ids"], payload.get("logprobs"),
                                                                 payload.get("top_logprobs")))
                state.seq += 1
                if sent is Sent.GONE:
                    self._clients_gone([state.identity])
                elif sent is Sent.HELD:  # it cannot keep up: stop its requests (their ends still reach it)
                    self._cancel_requests_of([state.identity])
            return
        self.live.pop((state.identity, state.id), None)
        self._log_end(req, state.id, kind, payload)
        if kind == "done":
            self.metrics.done(payload)
            try:
                frames = encode_done(state.id, payload["finish_reason"], payload["text"], payload["token_ids"],
                                       payload["usage"], payload["metrics"], payload.get("output"),
                                       payload.get("logprobs"), payload.get("reasoning"), payload.get("top_logprobs"))
            except Exception as e:  # noqa: BLE001 - a bug: still one terminal message, and the loop lives
                log.exception("cannot encode the answer of request %r", state.id)
                frames = encode_error(state.id, "internal", f"the answer cannot be encoded ({type(e).__name__})")
        else:
            self.metrics.error(payload["code"])
            frames = encode_error(state.id, payload["code"], payload["message"])
        self._send(state.identity, frames)

    def _log_end(self, req: Request, rid: str, kind: str, payload: dict[str, Any]) -> None:
        model = req.adapter or served_name(self.service.config)
        if kind == "done":
            logs.request_line(rid, model, payload["usage"], payload["metrics"], payload["finish_reason"])
        else:
            usage = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.token_ids)}
            took = None if req.t_end is None else {"total_ms": (req.t_end - req.t_submit) * 1000}
            logs.request_line(rid, model, usage, took, None, error=payload["code"])

    def _send(self, identity: bytes, frames: list[bytes], keep: bool = True) -> Sent:
        """Never blocks; ``keep``: a request's message, held for a client that cannot take it now."""
        return self.outbox.send(identity, frames, keep)

    def _clients_gone(self, identities: list[bytes]) -> None:
        """Clients whose connection closed: cancel their requests (streaming or not), free their
        resources, and drop what was held for them."""
        if identities:
            self._cancel_requests_of(identities)
            self.outbox.drop(identities)

    def _cancel_requests_of(self, identities: list[bytes]) -> None:
        gone = set(identities)
        for (ident, _rid), req in list(self.live.items()):
            if ident in gone:
                self.service.cancel(req)


def install_signal_handlers(server: Server) -> None:
    def handler(signum, frame):
        log.warning("signal %d: shutting down", signum)
        server.stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
