"""The cluster's HTTP ingress: ``tandem serve``'s own Starlette app over a bridge to the replicas.

Every route, validation and error is ``frontend/http``'s: the app is built by
``frontend.http.app.build_app`` with a ``ClusterBridge`` in place of the
server's ``Bridge``. A ``ClusterBridge`` call asks the replicas'
``DeploymentHandle`` for the router's choice (``router.AffinityRouter``) and,
when the chosen replica runs on this node, sends the request to its ``tandem
serve`` over ZeroMQ itself (``direct.py``: the tokens never cross Ray); else it
calls the replica through the handle (its actor streams the messages back).
Either way it feeds the same ``Call`` the HTTP routes read, so streaming,
disconnects and cancellation (to the ``tandem serve`` that has the request)
behave as on one server. Under ``tandem cluster`` the ingress's actor serves
the HTTP address itself (``listen``: ``AppServer``, uvicorn on the actor's
loop, as ``tandem serve --http`` runs it on a thread of its own); under ``serve
run`` and KubeRay, Serve's HTTP proxy hands it the requests. Each answer a
replica gave carries its name in
``x-tandem-replica``. A stream that loses its replica (its ``tandem serve``
exited, the actor died, Serve could not route it) gets one ``worker_failed``
error as its terminal message: it never hangs. A request no replica began
(nothing of it had arrived when its ``tandem serve`` closed the connection, or
it reached one that had exited, or an actor that was gone) is sent to another
one, at most ``RETRIES`` times: nothing of it had reached the client, so
nothing is repeated.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError

from shared.page_names import chain
from shared.config import EngineConfig
from shared.families import native_skills
from shared.models.registry import load_tokenizer

from ..http.app import build_app as build_http_app
from ..http.bridge import TERMINAL, Call
from ..http.common import Context
from ..http.listener import AppServer, listen_socket
from frontend.server.metrics import Metrics
from frontend.server.tokenization import chat_prompt_ids, text_prompt_ids
from .direct import DirectPath
from .router import Counted
from .routing import NOT_STARTED

log = logging.getLogger("tandem.cluster")

REPLICA_HEADER = b"x-tandem-replica"
PAGE_SIZE = EngineConfig.page_size  # the replicas' KV page: the prefix cache shares whole pages
RETRIES = 2  # times a request no replica began is sent again (a replica that died just before it arrived)
RETRY_DELAY_S = 0.25
# Serve's gRPC transport serializes each call and streamed item with cloudpickle by default, whose pure-Python
# hooks run for every object of a batch; everything sent here is plain data, for the standard pickle
SERIALIZATION = {"request_serialization": "pickle", "response_serialization": "pickle"}

_answered_by: contextvars.ContextVar[dict | None] = contextvars.ContextVar("answered_by", default=None)


class ClusterBridge:
    """``frontend.http.bridge.Bridge``'s calls (``generate``, ``info``, ``cancel``) over the replicas
    (``direct``: the links to this node's replicas; None: every request through Ray)."""

    def __init__(self, replicas, tokenizer, direct: DirectPath | None = None) -> None:
        self._replicas = replicas.options(**SERIALIZATION)
        self._stream = self._replicas.options(stream=True)
        self._tokenizer = tokenizer
        self._direct = direct
        self._ids = itertools.count(1)
        self._queues: dict[str, asyncio.Queue] = {}  # Call.forget drops its own
        self._pumps: dict[str, asyncio.Task] = {}

    def generate(self, fields: dict[str, Any], session: str | None = None, rid: str | None = None) -> Call:
        rid = rid or f"c{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        route = {"session": session} if session else {"prefix_pages": self._prefix_pages(fields)}
        self._pumps[rid] = asyncio.create_task(self._pump(rid, fields, route, q))
        return Call(self, rid, q)

    async def info(self, timeout: float = 5.0) -> dict[str, Any]:
        info = await asyncio.wait_for(self._replicas.info.remote(), timeout)
        _note_replica(info["replica"])
        return info

    def forget(self, rid: str) -> None:
        self._queues.pop(rid, None)

    async def close(self) -> None:
        if self._direct is not None:
            await self._direct.close()

    def cancel(self, rid: str) -> None:
        pump = self._pumps.get(rid)
        if pump is not None:
            pump.cancel()

    async def _pump(self, rid: str, fields: dict[str, Any], route: dict[str, Any], q: asyncio.Queue) -> None:
        avoid: list[str] = []  # the replicas that refused it unstarted: the router sends it elsewhere
        try:
            for attempt in itertools.count():
                dead = self._direct.dead() if self._direct is not None else ()
                refused = await self._send_once(rid, fields, route, tuple(dict.fromkeys((*avoid, *dead))), q)
                if refused is None:
                    return
                replica, why = refused
                if attempt == RETRIES:
                    raise RuntimeError(why)
                log.warning("request %s was not started (%s): sending it to another replica", rid, why)
                avoid += [replica] if replica else []
                await asyncio.sleep(RETRY_DELAY_S)
        except Exception as e:  # noqa: BLE001 - the replica died or could not be reached
            log.warning("request %s lost its replica: %s", rid, e)
            q.put_nowait({"type": "error", "id": None, "code": "worker_failed",
                          "message": f"the replica serving this request failed ({type(e).__name__}: {e})"})
        finally:
            self._pumps.pop(rid, None)
            self._queues.pop(rid, None)

    async def _send_once(self, rid: str, fields: dict[str, Any], route: dict[str, Any], avoid: tuple[str, ...],
                         q: asyncio.Queue) -> tuple[str | None, str] | None:
        """One replica's answer to the request into ``q``: None once its terminal message is
        queued, or (the replica if it was reached, why) when no replica began it. (``route``:
        the router's ``session`` or ``prefix_pages``.)"""
        if self._direct is not None:
            counted = Counted()  # the router counts it at the choice; its end is ours to report
            try:
                async with self._replicas.generate.choose_replica(avoid=avoid, counted=counted, _reserve=False,
                                                                  **route) as chosen:
                    replica, metadata = chosen.replica_id, chosen.replica_metadata
                link = await self._direct.link(replica, metadata)
                if link is not None:
                    return await self._stream_direct(link, replica, rid, fields, q)
            finally:
                counted.end()  # (a replica elsewhere: the handle's call below is routed, and counted, again)
        return await self._stream_once(fields, route, avoid, q)

    @staticmethod
    async def _stream_direct(link, replica: str, rid: str, fields: dict[str, Any],
                             q: asyncio.Queue) -> tuple[str, str] | None:
        """The request's messages from ``replica``'s ``tandem serve`` over ``link`` into ``q``: None
        once the terminal one is queued; (replica, why) if the connection closed before any arrived."""
        call = link.generate(fields, rid=rid)
        begun = False
        async for batch in call.batches():  # (cancelled: the call's exit cancels the request there)
            if call.lost and not begun and len(batch) == 1:
                return replica, batch[0]["message"]
            if not begun:
                _note_replica(replica)
                begun = True
            for msg in batch:
                q.put_nowait(msg)
        return None

    async def _stream_once(self, fields: dict[str, Any], route: dict[str, Any], avoid: tuple[str, ...],
                           q: asyncio.Queue) -> tuple[str | None, str] | None:
        """``_send_once`` through the replica's actor (its Ray handle's stream)."""
        responses = self._stream.generate.remote(fields, avoid=avoid, **route)
        replica = None
        try:
            async for item in responses:
                if isinstance(item, tuple):  # the first: (the replica's name, the first batch)
                    replica, item = item
                    _note_replica(replica)
                if isinstance(item, dict):  # {NOT_STARTED: why}
                    return replica, item[NOT_STARTED]
                for msg in item:
                    q.put_nowait(msg)
                if item and item[-1]["type"] in TERMINAL:
                    return None
            raise RuntimeError("the replica's stream ended without a terminal message")
        except asyncio.CancelledError:
            responses.cancel()  # the client left: the replica cancels the request in its tandem serve
            raise
        except RayActorError as e:
            if replica is not None:  # it had begun: tokens may have gone out, so it is not sent again
                raise
            return None, f"{type(e).__name__}: {e}"  # (a dead actor: Serve drops it from the candidates)

    def _prefix_pages(self, fields: dict[str, Any]) -> tuple[bytes, ...]:
        """The prefix cache's names (the chained hashes) of the whole KV pages of the prompt as the
        replicas render it (adapters and images, which the replicas' names also cover, left out)."""
        try:
            if fields.get("prompt_token_ids") is not None:
                ids = list(fields["prompt_token_ids"])
            elif fields.get("messages") is not None:
                ids = chat_prompt_ids(self._tokenizer, fields["messages"])
            else:
                ids = text_prompt_ids(self._tokenizer, fields.get("prompt") or "")
        except Exception:  # noqa: BLE001 - a malformed request: the replica answers it with the error
            return ()
        return tuple(chain(ids, PAGE_SIZE, len(ids) // PAGE_SIZE))


def replicas_tokenizer(info: dict[str, Any]):
    """The tokenizer the replicas render prompts with (their ``--chat-template``, if given), from
    their ``info``: /tokenize and the prefix pages' names count the tokens a generate will."""
    tokenizer = load_tokenizer(info["model"])
    if info.get("chat_template") is not None:
        tokenizer.chat_template = info["chat_template"]
    return tokenizer


def _note_replica(name: str) -> None:
    holder = _answered_by.get()
    if holder is not None:
        holder["replica"] = name


class ReplicaHeader:
    """ASGI middleware: ``x-tandem-replica`` on every answer a replica gave (set by the bridge)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        holder: dict = {}
        token = _answered_by.set(holder)  # this request's task; the bridge's pump tasks inherit it

        async def with_header(message):
            if message["type"] == "http.response.start" and "replica" in holder:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER, holder["replica"].encode())]}
            await send(message)

        try:
            await self.app(scope, receive, with_header)
        finally:
            _answered_by.reset(token)


@serve.ingress()
class TandemIngress:
    async def __init__(self, replicas, api_key: str | None = None, metrics_compat: str | None = None,
                       direct: bool = True, listen: tuple[str, int] | None = None) -> None:
        """``direct``: send requests to this node's replicas' ``tandem serve`` directly (``direct.py``;
        the affinity router's choice, which counts them). ``listen``: (host, port) this actor serves the
        HTTP routes on itself (``tandem cluster``), so a client's requests and tokens never cross
        Serve's HTTP proxy; None: Serve's proxy serves them (``serve run``, KubeRay)."""
        self._http: AppServer | None = None
        info = await replicas.info.remote()
        tokenizer = replicas_tokenizer(info)
        node = ray.get_runtime_context().get_node_id()
        self._bridge = ClusterBridge(replicas, tokenizer, DirectPath(node) if direct else None)
        name = info.get("served_model_name") or info["model"]
        ctx = Context(bridge=self._bridge, model=name, tokenizer=tokenizer,
                      aliases=tuple({info["model"]} - {name}), max_model_len=int(info["max_model_len"]),
                      adapters=tuple(info.get("adapters") or ()), vision=bool(info.get("vision")),
                      native_skills=native_skills(info.get("family")),
                      sampling_defaults=info.get("sampling_defaults") or {})
        metrics = Metrics(metrics_compat)  # /metrics: the engine figures of the replica that answers info
        # /health: ready once this runs (it has a replica's info); Serve's router holds a request while no
        # replica is healthy
        self._app = ReplicaHeader(build_http_app(ctx, metrics, lambda: "ready", api_key))
        if listen is not None:
            self._http = AppServer(self._app)
            self._serving = await self._http.begin(listen_socket(*listen))

    async def __del__(self) -> None:
        """Serve's graceful shutdown: the listener's streams end (uvicorn's grace), the direct links'
        sockets close."""
        if self._http is not None:
            self._http.should_exit = True
            await self._serving
        await self._bridge.close()

    def __serve_build_asgi_app__(self):
        return self._app
