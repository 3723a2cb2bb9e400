"""The Starlette application: routes, API-key authentication, errors in OpenAI's shape.

Routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``
(``openai.py``); ``/v1/caption``, ``/v1/query``, ``/v1/point``, ``/v1/detect``
(``moondream.py``); ``/tokenize``, ``/detokenize`` (``tokens.py``); ``GET /``, the
playground page, and ``GET /v1/stats``, its live figures (``playground.py``);
``GET /version``, ``GET /metrics`` (Prometheus), ``GET /openapi.json`` (``openapi.py``: the
document, built from the routes below and the definitions the validation uses) and the probes:

- ``GET /health``: live. 200 whenever the process answers, also while the worker
  restarts or the server drains (a liveness probe must not kill a pod that heals itself).
- ``GET /ready``: 200 only while the worker is up and warm and the server takes
  requests; else 503 naming why (``starting``, ``restarting``, ``draining``, ``stopped``).

With an API key every route but the probes and the page's own files needs
``Authorization: Bearer KEY`` or ``X-Moondream-Auth: KEY``; anything else is a
401 before the request is read (no work is done for it).
"""
from __future__ import annotations

import hmac
import importlib.metadata
import logging
from typing import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend.server.metrics import CONTENT_TYPE, Metrics
from ..protocol.encode import Unencodable
from . import moondream, openai, openapi, playground, tokens
from .common import ClientGone, Context, server_info
from .errors import HttpError, bad_request

log = logging.getLogger("tandem.http")

VERSION = importlib.metadata.version("tandem")

OPEN_PATHS = frozenset({"/health", "/ready"})
NOT_READY = {  # /ready's answer for each state but ready
    "starting": "the worker is loading the model and warming up",
    "restarting": "the worker failed and a new one is warming up; requests wait for it",
    "draining": "the server is shutting down: requests in flight finish, new ones are refused",
    "stopped": "the server has no worker",
}


def build_app(ctx: Context, metrics: Metrics, state: Callable[[], str], api_key: str | None = None):
    """``state()`` names the server's state: ``ready``, or why it is not (a key of ``NOT_READY``)."""

    def post(fn):
        async def endpoint(request: Request):
            try:
                return await fn(ctx, request)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; the request was cancelled
        return endpoint

    async def models(request: Request):
        return openai.models(ctx)

    async def health(request: Request):
        return JSONResponse({"status": "live", "state": state()})

    async def ready(request: Request):
        now = state()
        if now == "ready":
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": now, "reason": NOT_READY[now]}, status_code=503)

    async def version(request: Request):
        return JSONResponse({"version": VERSION})

    async def metrics_route(request: Request):
        # info None (the server loop is busy): counters and histograms only
        return Response(metrics.render(await server_info(ctx)), media_type=CONTENT_TYPE)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", post(openai.chat_completions), methods=["POST"]),
        Route("/v1/completions", post(openai.completions), methods=["POST"]),
        Route("/v1/caption", post(moondream.caption), methods=["POST"]),
        Route("/v1/query", post(moondream.query), methods=["POST"]),
        Route("/v1/point", post(moondream.point), methods=["POST"]),
        Route("/v1/detect", post(moondream.detect), methods=["POST"]),
        Route("/tokenize", post(tokens.tokenize), methods=["POST"]),
        Route("/detokenize", post(tokens.detokenize), methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        *playground.routes(ctx, metrics),
    ]
    served = [(r.path, tuple(sorted(r.methods - {"HEAD"}))) for r in routes if isinstance(r, Route)]
    served.append(("/openapi.json", ("GET",)))
    spec = openapi.document(served, _is_open, VERSION)  # (the document lists itself)

    async def openapi_route(request: Request):
        return JSONResponse(spec)

    routes.append(Route("/openapi.json", openapi_route, methods=["GET"]))
    handlers = {HttpError: _http_error, Unencodable: _unencodable, HTTPException: _starlette_error}
    app = Starlette(routes=routes, exception_handlers=handlers, middleware=[Middleware(InternalErrors)])
    return ApiKeyAuth(app, api_key) if api_key else app


class ApiKeyAuth:
    """ASGI middleware: the API key or a 401 (pure ASGI, so streamed answers pass untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not _is_open(scope["path"]) and not self._allowed(scope):
            err = HttpError(401, "a valid API key is required (Authorization: Bearer KEY or X-Moondream-Auth: KEY)",
                            "invalid_api_key")
            return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-moondream-auth":
                given = value.strip()
            else:
                continue
            if hmac.compare_digest(given, self._key):
                return True
        return False


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or playground.is_public(path)


async def _http_error(request: Request, exc: HttpError):
    return exc.response()


async def _starlette_error(request: Request, exc: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
    message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
    return HttpError(exc.status_code, message, code).response()


async def _unencodable(request: Request, exc: Unencodable):
    return bad_request(str(exc)).response()


class InternalErrors:
    """ASGI middleware: a server bug is a 500 in OpenAI's shape, logged once, and the connection
    stays open. (Starlette's own last-resort handler re-raises after answering, and the HTTP
    server then drops the keep-alive connection: a client's next request on it would fail.)"""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if started or scope["type"] != "http":  # too late to answer: the server ends the connection
                raise
            log.exception("internal error on %s %s", scope["method"], scope["path"])
            err = HttpError(500, f"internal error: {type(exc).__name__}", "internal", "server_error")
            await err.response()(scope, receive, send)
