"""``build_app(args)``: the Tandem application on Ray Serve (``tandem cluster``, ``serve run``,
``serve deploy``, KubeRay's ``serveConfigV2``: ``import_path: frontend.cluster:build_app``).

``args`` are ``tandem serve``'s options by their Python names (``model``,
``device``, ``max_batch``, ``drain_timeout``, ...: what ``tandem serve --help``
lists, less the network ones), plus ``replicas`` (default 1), ``api_key``
(default ``$TANDEM_API_KEY``), ``not_ready_grace_s``, ``router``
(``affinity``, or ``ray``: Serve's default, for A/B runs) and ``max_overload``
(the affinity router's load bound, ``routing.py``) and ``listen``
(``HOST:PORT``: the ingress serves HTTP there itself, on the node that
deploys the application, instead of Serve's HTTP proxy; ``tandem cluster``
gives it). Each replica runs
``tandem serve`` with exactly those options (``serve_argv``: the mapping is
read from the ``serve`` command itself, so it is never written twice).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from . import HOP_ENV, MAX_OVERLOAD, NOT_READY_GRACE_S, ROUTERS, ROUTING_STATS_PERIOD_S, SERVE_ONLY
from .ingress import TandemIngress
from .replica import TandemReplica
from .router import AffinityRouter
from .routing import checked_overload
from ..cli.serve_options import parse_http

CLUSTER_ARGS = ("replicas", "api_key", "not_ready_grace_s", "router", "max_overload", "listen")
NOT_FORWARDED = frozenset({*SERVE_ONLY, "http", "host", "port", "api_key", "insecure"})  # all but SERVE_ONLY: the ingress's
HEALTH_CHECK_PERIOD_S = 2.0
QUIET = {"enable_access_log": False}  # Serve logs a line per request and per replica call otherwise
SHUTDOWN_MARGIN_S = 10.0  # beyond the child's --drain-timeout: its worker stops, its sockets close


def serve_params() -> dict[str, Any]:
    """``tandem serve``'s options that a replica's ``tandem serve`` takes, by Python name."""
    from frontend.cli.main import serve as serve_command

    return {p.name: p for p in serve_command.params if p.expose_value and p.name not in NOT_FORWARDED}


def serve_argv(options: Mapping[str, Any]) -> list[str]:
    """The command-line arguments of ``tandem serve`` for ``options`` (ValueError naming an unknown one)."""
    params = serve_params()
    argv: list[str] = []
    for name, value in options.items():
        p = params.get(name)
        if p is None:
            raise ValueError(f"unknown option {name!r}; tandem serve takes {', '.join(sorted(params))} "
                             f"(and the cluster {', '.join(CLUSTER_ARGS)})")
        flag = max(p.opts, key=len)
        if p.is_flag:  # (`serve run ... no_pipeline=true` passes a string)
            argv += [flag] if value is True or str(value).lower() in ("1", "true", "yes") else []
        elif p.multiple:
            argv += [a for v in value for a in (flag, str(v))]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def build_app(args: Mapping[str, Any]) -> serve.Application:
    options = dict(args)
    replicas = int(options.pop("replicas", 1))
    api_key = options.pop("api_key", None) or os.environ.get("TANDEM_API_KEY")
    grace_s = float(options.pop("not_ready_grace_s", NOT_READY_GRACE_S))
    router = options.pop("router", "affinity")
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")
    max_overload = checked_overload(float(options.pop("max_overload", MAX_OVERLOAD)))
    listen = options.pop("listen", None)
    listen = parse_http(listen) if listen is not None else None
    argv = serve_argv(options)
    # the hop's settings in the deployments' processes also where Ray was started without them (serve run,
    # tandem cluster --address); Serve's proxy has them only from the Ray nodes' own environment
    hop_env = {"env_vars": {name: os.environ.get(name, value) for name, value in HOP_ENV.items()}}
    defaults = serve_params()
    drain_s = float(options.get("drain_timeout", defaults["drain_timeout"].default))
    max_queue = int(options.get("max_queue", defaults["max_queue"].default))
    replica = serve.deployment(
        TandemReplica, name="TandemReplica", num_replicas=replicas,
        max_ongoing_requests=max_queue,  # the child's own queue decides ('overloaded'), not Serve's
        ray_actor_options={"num_cpus": 1, "num_gpus": _gpus(str(options.get("device", "auto"))),
                           "runtime_env": hop_env},
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=5.0,
        graceful_shutdown_timeout_s=drain_s + SHUTDOWN_MARGIN_S, logging_config=QUIET,
        max_constructor_retry_count=3,  # a tandem serve that cannot start (a bad --model) fails the deploy soon
        request_router_config=RequestRouterConfig(
            **({"request_router_class": AffinityRouter, "request_router_kwargs": {"max_overload": max_overload}}
               if router == "affinity" else {}),
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S, request_routing_stats_timeout_s=2.0))
    ingress = serve.deployment(TandemIngress, name="TandemIngress", num_replicas=1,
                               max_ongoing_requests=replicas * max_queue,
                               ray_actor_options={"num_cpus": 0, "runtime_env": hop_env,
                                                  **(_on_this_node() if listen is not None else {})},
                               logging_config=QUIET)
    # the direct token path needs the router that counts what the ingress sends itself (direct.py)
    return ingress.bind(replica.bind(argv, max_queue, grace_s), api_key, options.get("metrics_compat"),
                        direct=router == "affinity", listen=listen)


def _on_this_node() -> dict[str, Any]:
    """Actor options that place it on this process's Ray node (where its HTTP address is)."""
    if not ray.is_initialized():
        return {}
    here = ray.get_runtime_context().get_node_id()
    resources = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == here)
    node = next(name for name in resources if name.startswith("node:") and name != "node:__internal_head__")
    return {"resources": {node: 0.001}}


def _gpus(device: str) -> int:
    """One GPU per replica on CUDA (``auto``: when the Ray cluster has GPUs)."""
    if device.startswith("cuda"):
        return 1
    return int(device == "auto" and ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0)
