"""``tandem cluster``: start (or join) Ray, deploy the application, serve HTTP, stop cleanly.

The ingress serves the HTTP address itself, on this node (``build_app``'s
``listen``); Serve's HTTP proxy is not started (a hop of its own, on the path
of every token: BENCHMARKS.md, the cluster hop). Without ``--address`` a
local Ray instance is started in this process (its GCS, raylet and workers
are this process's descendants) with every address on loopback, and stopped
on exit. SIGINT/SIGTERM: the application is shut
down (each replica's ``tandem serve`` drains), then the Ray instance this
command started; nothing is left running. With ``--address`` only the
application is deleted.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import click

from ..http.listener import listen_socket
from . import HOP_ENV

APP_NAME = "tandem"


class _Stop(Exception):
    """A signal arrived: leave whatever is blocking, then clean up."""


def run(replicas: int, address: str | None, http: tuple[str, int], options: dict[str, Any]) -> None:
    """``options``: ``build_app``'s arguments other than ``replicas``."""
    stopping = threading.Event()

    def on_signal(signum, frame):
        if not stopping.is_set():
            stopping.set()
            raise _Stop()

    def trap(handler) -> None:
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    trap(on_signal)
    if address is None:  # (read when ray is imported) Ray's own ports on loopback, not the host's address
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    for name, value in HOP_ENV.items():  # before Ray starts: its processes (Serve's proxy too) inherit them
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    from .app import build_app

    host, port = http
    try:  # a taken address fails now, naming it, not once the ingress's actor cannot bind it
        listen_socket(host, port).close()
    except OSError as e:
        raise click.ClickException(str(e)) from None
    shown = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        if address is None:
            click.echo("tandem: starting a local Ray instance ...", err=True)
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False,
                     num_cpus=max(os.cpu_count() or 1, replicas))  # one logical CPU per replica at least
        else:
            ray.init(address=address)
        trap(on_signal)  # again: ray.init installs its own SIGTERM handler
        serve.start(proxy_location="Disabled", http_options={"host": host, "port": port})  # (the address Serve logs)
        click.echo(f"tandem: deploying {replicas} replica(s) ...", err=True)
        serve.run(build_app({"replicas": replicas, "listen": shown.removeprefix("http://"), **options}),
                  name=APP_NAME, route_prefix="/", blocking=False)
        click.echo(f"tandem: serving on {shown} ({replicas} replica(s))", err=True)
        stopping.wait()
    except _Stop:
        pass
    finally:
        trap(signal.SIG_IGN)  # cleaning up: a second signal would leave it half done
        click.echo("tandem: stopping (replicas drain) ...", err=True)
        if ray.is_initialized():
            if address is None:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
            ray.shutdown()
    click.echo("tandem: stopped", err=True)
