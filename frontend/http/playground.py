"""The playground: a page at ``GET /`` to try the served model in a browser, and
``GET /v1/stats``, the live figures it shows.

The page is plain HTML, CSS and JavaScript in ``static/`` (no build step, nothing
fetched from elsewhere: it works offline). It calls the same routes as any
client (``/v1/chat/completions``, ``/v1/query`` ...), with the API key the person
types in. The page and its files are public; every route it calls is not.

``/v1/stats`` is the server's ``info`` answer (the worker's counters: committed
tokens, device idle and busy seconds of the decode loop, KV pages ...) with the
request figures of ``/metrics`` and the server's clock, so a client can turn
counters into rates: tokens/s, device idle fraction over the last interval, mean
time to first token of the requests that finished in it.
"""
from __future__ import annotations

import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from frontend.server.metrics import Metrics
from .common import Context, server_info

STATIC_DIR = Path(__file__).parent / "static"
STATIC_PREFIX = "/static/"


def routes(ctx: Context, metrics: Metrics) -> list:
    async def page(request: Request):
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def stats(request: Request):
        return JSONResponse({"model": ctx.model, "time_s": time.time(), "info": await server_info(ctx),
                             "requests": request_figures(metrics)})

    return [
        Route("/", page, methods=["GET"]),
        Route("/v1/stats", stats, methods=["GET"]),
        Mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC_DIR), name="static"),
    ]


def is_public(path: str) -> bool:
    """The page and its files need no API key (a browser cannot send one when it opens a URL)."""
    return path == "/" or path.startswith(STATIC_PREFIX)


def request_figures(metrics: Metrics) -> dict[str, float]:
    """The request counters of ``/metrics`` (finished requests, ZeroMQ and HTTP alike)."""
    value = metrics.registry.get_sample_value
    return {
        "prompt_tokens": value("tandem:prompt_tokens_total") or 0.0,
        "generation_tokens": value("tandem:generation_tokens_total") or 0.0,
        "ttft_count": value("tandem:time_to_first_token_seconds_count") or 0.0,
        "ttft_sum_s": value("tandem:time_to_first_token_seconds_sum") or 0.0,
    }
