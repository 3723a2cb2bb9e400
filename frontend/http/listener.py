"""Run the HTTP app beside a ``Server``: uvicorn on its own thread and asyncio loop.

The listening socket is bound first (``listen_socket``; ``tandem serve`` does it
before the model loads, so a taken port fails at once, with the address in the
message); the thread's loop runs the app and one ``Bridge`` into the server's
``inproc_endpoint``.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from frontend.server.service import served_name

from .app import build_app
from .bridge import Bridge
from .common import Context
from .errors import bad_request


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on HOST:PORT (OSError naming the address if it is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without it
    # Nagle's algorithm holds each response's body behind its headers for a delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class JsonErrorsH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, answering a request it cannot parse (request line, headers,
    chunked framing) with the JSON error body of every other error instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response to this request begun
            body = json.dumps(bad_request(f"malformed HTTP request: {msg}").body()).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()  # else a response is under way: ending the connection is all that is left


class AppServer(uvicorn.Server):
    """uvicorn serving ``app`` on the running loop, with the JSON errors of every route; the process's
    signals are left to its owner (``tandem serve``, or the Ray actor of the cluster's ingress), where
    uvicorn's own handlers would take SIGTERM from them when it runs on the main thread."""

    def __init__(self, app) -> None:
        super().__init__(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=5, ws="none", http=JsonErrorsH11Protocol))
        self.config.setup_event_loop = lambda: None

    def capture_signals(self):
        return contextlib.nullcontext()

    async def begin(self, sock: socket.socket) -> asyncio.Task:
        """Serve on ``sock`` (``listen_socket``) in a task of the running loop; returned once it accepts
        connections (raising what stopped it before)."""
        serving = asyncio.create_task(self.serve(sockets=[sock]))
        while not self.started:
            if serving.done():
                serving.result()
                raise RuntimeError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)
        return serving


class HttpListener:
    def __init__(self, server, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 sock: socket.socket | None = None) -> None:
        """``sock``: a socket from ``listen_socket(host, port)`` bound earlier (else bound here)."""
        self._server = server
        self._api_key = api_key
        self._sock = sock if sock is not None else listen_socket(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}"
        self._uvicorn: AppServer | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "HttpListener":
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError("the HTTP listener did not start")
        if self._error is not None:
            raise RuntimeError(f"the HTTP listener failed to start: {self._error}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        self._thread.join(timeout)

    def _state(self) -> str:
        server = self._server
        if server.draining:
            return "draining"
        if server.service.worker is None:
            return "stopped"
        if not server.service.worker_ready:
            return "starting" if server.service.generation == 1 else "restarting"
        return "ready"

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
        finally:
            self._started.set()

    async def _serve(self) -> None:
        bridge = Bridge(self._server.inproc_endpoint, self._server.ctx)
        await bridge.start()
        service = self._server.service
        # The loop thread's tokenizer is its own (a Rust tokenizer borrowed by two threads at once
        # may raise "Already borrowed"): this thread decodes logprobs' token strings with a copy.
        name = served_name(service.config)
        ctx = Context(bridge=bridge, model=name, tokenizer=copy.deepcopy(service.tokenizer),
                      aliases=tuple({service.config.model} - {name}), max_model_len=self._server.gate.max_model_len,
                      limits=self._server.limits, adapters=tuple(service.adapters), vision=service.model.vision,
                      native_skills=service.model.family.native_skills,
                      sampling_defaults=service.model.sampling_defaults)
        self._uvicorn = AppServer(build_app(ctx, self._server.metrics, self._state, self._api_key))
        try:
            serving = await self._uvicorn.begin(self._sock)
            self._started.set()
            await serving
        finally:
            await bridge.close()
