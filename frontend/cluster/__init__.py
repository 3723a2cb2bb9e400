"""Scale-out on Ray Serve: many whole Tandem servers behind one address (``tandem cluster``).

Each replica is a ``tandem serve`` (frontend + worker, one GPU) run as the
child process of a Serve replica (``replica.py``); the ingress serves the
HTTP routes of ``tandem serve`` itself over a bridge to the replicas
(``ingress.py``; on the address of ``tandem cluster`` itself, else behind
Serve's HTTP proxy), reading a same-node replica's ``tandem serve`` over ZeroMQ
itself (``direct.py``: Ray chooses, the tokens do not cross it); the router keeps sessions and shared prompt prefixes on one
replica while its load stays within a bound (``routing.py``, pure;
``router.py``, its Serve router);
``app.py`` builds the application (``frontend.cluster:build_app``, for
``serve run``, ``serve deploy`` and KubeRay) and ``run.py`` is the command.
Nothing here imports torch; Ray is the ``tandem[cluster]`` extra, imported
only by the modules that need it.
"""

NOT_READY_GRACE_S = 120.0  # how long a replica's worker may stay not ready (a restart warming up) before Serve
                           # replaces the replica (tandem cluster --not-ready-grace, build_app's not_ready_grace_s)
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve asks each replica for its routing stats (what routing.Load reads)
MAX_OVERLOAD = 0.25  # how far above the average load a replica may go before affinity yields (tandem cluster
                    # --max-overload, build_app's max_overload; routing.py)
SERVE_ONLY = ("bind", "curve_secret_key", "curve_clients")  # serve's options a cluster has no use for (its replicas
                                                          # listen on private ipc:// endpoints)
# Ray Serve's settings for the hop, read by each Ray process when it imports Serve (BENCHMARKS.md, Cluster: the
# hop). Under serve run and KubeRay a streamed batch crosses one hop, ingress -> Serve's HTTP proxy (none under
# tandem cluster, whose ingress serves HTTP itself; one more from a replica on another node: replica -> ingress;
# a same-node replica's are read over ZeroMQ, direct.py): over gRPC between the two
# processes instead of one Ray object each (the object store's bookkeeping per item); Serve's code, the user's
# and the router on each process's one event loop (not a thread and a loop of their own: a handoff per item);
# request-path logs buffered. Ray's own RAY_SERVE_THROUGHPUT_OPTIMIZED, less its direct ingress (which would
# serve each ingress replica on a port of its own on every interface). The environment wins.
HOP_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_PROXY_USE_GRPC": "1",
           "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
           "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000"}
ROUTERS = ("affinity", "ray")  # ours (router.py), or Serve's default (power of two choices): for A/B runs


def __getattr__(name: str):
    if name == "build_app":  # the import path Serve and KubeRay take: frontend.cluster:build_app
        from .app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
