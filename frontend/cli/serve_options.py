"""``tandem serve``'s network options (HTTP, API key, CURVE, ``--insecure``), the client-side
CURVE options of ``--connect`` commands, ``tandem keygen``, and the exposure rule:

    binding HTTP or ZeroMQ beyond loopback without authentication refuses to
    start (one line naming the address and the fix) unless ``--insecure``.

HTTP is authenticated by ``--api-key`` (or ``TANDEM_API_KEY``), ZeroMQ by CURVE
(``--curve-secret-key`` + ``--curve-clients``). ``ipc://`` and ``inproc://``
endpoints are local (file permissions guard ``ipc``).
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

import click

from frontend.curve import CurveClient, CurveServer, keygen
from frontend.cli.options import apply, option

DEFAULT_HTTP = "127.0.0.1:8000"


def network_options(fn):
    """The options ``tandem serve`` gains (values arrive as keyword arguments)."""
    opts = [
        option("Server", "--http", "http", default=None, show_default=DEFAULT_HTTP,
               help="HOST:PORT for the HTTP API (OpenAI, Moondream, /health, /metrics); 'none' turns it off. "
                    "Or say it with --host and --port (not both ways)."),
        option("Server", "--host", default=None, show_default=DEFAULT_HTTP.rpartition(":")[0],
               help="The HTTP API's host (with --port; instead of --http)."),
        option("Server", "--port", type=click.IntRange(0, 65535), default=None,
               show_default=DEFAULT_HTTP.rpartition(":")[2], help="The HTTP API's port (with --host; instead of --http)."),
        option("Server", "--api-key", envvar="TANDEM_API_KEY", show_envvar=True, default=None,
               help="Require this key on every HTTP route but the probes /health and /ready (Bearer or X-Moondream-Auth)."),
        option("Server", "--curve-secret-key", type=click.Path(dir_okay=False), default=None,
               help="ZeroMQ CURVE: the server's .key_secret file (tandem keygen)."),
        option("Server", "--curve-clients", type=click.Path(file_okay=False), default=None,
               help="ZeroMQ CURVE: directory of the allowed clients' public .key files."),
        option("Server", "--insecure", is_flag=True,
               help="Allow binding beyond loopback without authentication."),
    ]
    return apply(fn, opts)


def client_key_options(fn):
    """CURVE options of commands that ``--connect`` to a server."""
    opts = [
        option("Connection", "--server-key", type=click.Path(dir_okay=False), default=None,
               help="ZeroMQ CURVE: the server's public .key file."),
        option("Connection", "--client-key", type=click.Path(dir_okay=False), default=None,
               help="ZeroMQ CURVE: this client's .key_secret file."),
    ]
    return apply(fn, opts)


def client_curve(server_key: str | None, client_key: str | None) -> CurveClient | None:
    if (server_key is None) != (client_key is None):
        raise click.UsageError("CURVE needs both --server-key and --client-key")
    return None if server_key is None else CurveClient(server_key, client_key)


@dataclass
class Network:
    """What the options resolved to; checked before the worker starts (a refusal costs nothing)."""

    http: tuple[str, int] | None
    api_key: str | None
    curve: CurveServer | None

    _sock: Any = None

    def listen(self) -> None:
        """Bind the HTTP port now, before the model loads: a taken port fails at once."""
        if self.http is not None:
            from frontend.http.listener import listen_socket

            self._sock = listen_socket(*self.http)

    def start_http(self, server) -> Any:
        """The HTTP listener for ``server`` (None with ``--http none``)."""
        if self.http is None:
            return None
        from frontend.http import HttpListener

        return HttpListener(server, *self.http, api_key=self.api_key, sock=self._sock).start()


def resolve(bind: str, http: str | None, host: str | None, port: int | None, api_key: str | None,
            curve_secret_key: str | None, curve_clients: str | None, insecure: bool) -> Network:
    if (curve_secret_key is None) != (curve_clients is None):
        raise click.UsageError("CURVE needs both --curve-secret-key and --curve-clients")
    http_addr = resolve_http(http, host, port, api_key, insecure)
    if not insecure:
        host = zmq_host(bind)
        if host is not None and curve_secret_key is None and not is_loopback(host):
            raise click.UsageError(f"refusing to bind ZeroMQ on {bind} (beyond loopback) without CURVE; pass "
                                   "--curve-secret-key and --curve-clients (tandem keygen), bind 127.0.0.1, "
                                   "or pass --insecure")
    curve = CurveServer(curve_secret_key, curve_clients) if curve_secret_key is not None else None
    return Network(http_addr, api_key, curve)


def resolve_http(http: str | None, host: str | None, port: int | None, api_key: str | None,
                 insecure: bool) -> tuple[str, int] | None:
    """The HTTP address as (host, port), under the exposure rule (``tandem serve`` and ``tandem cluster``)."""
    if api_key is not None and not api_key.strip():
        raise click.UsageError("--api-key / TANDEM_API_KEY is empty")
    http = http_address(http, host, port)
    http_addr = parse_http(http)
    if not insecure and http_addr is not None and api_key is None and not is_loopback(http_addr[0]):
        raise click.UsageError(f"refusing to serve HTTP on {http} (beyond loopback) without --api-key; "
                               "set one (or TANDEM_API_KEY), bind 127.0.0.1, or pass --insecure")
    return http_addr


def http_address(http: str | None, host: str | None, port: int | None) -> str:
    """``--http HOST:PORT`` (or none), or ``--host`` and ``--port``, each defaulting to its part of
    DEFAULT_HTTP: one way to say it per command line (both ways is a usage error, even if they agree)."""
    if http is not None and (host is not None or port is not None):
        raise click.UsageError("give the HTTP address either as --http HOST:PORT or as --host/--port, not both")
    if http is not None:
        return http
    default_host, _, default_port = DEFAULT_HTTP.rpartition(":")
    host = default_host if host is None else host
    port = default_port if port is None else port
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 host in brackets


def parse_http(text: str) -> tuple[str, int] | None:
    if text.strip().lower() == "none":
        return None
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise click.BadParameter(f"{text!r} is not HOST:PORT (or none)", param_hint="--http")
    return host, int(port)


def zmq_host(endpoint: str) -> str | None:
    """The host a ``tcp://`` endpoint binds (``*`` for all); None for local transports."""
    if "://" not in endpoint:  # a bare HOST:PORT is tcp
        endpoint = "tcp://" + endpoint
    scheme, _, rest = endpoint.partition("://")
    if scheme not in ("tcp", "ws", "wss", "udp", "pgm", "epgm"):
        return None
    host = rest.rpartition(":")[0].rpartition(";")[2]  # tcp://[source;]host:port
    return host.strip("[]") or "*"


def is_loopback(host: str) -> bool:
    """Every address ``host`` names is a loopback address (``*``, ``0.0.0.0``, ``::`` are not)."""
    if host in ("*", ""):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # an interface name or unknown host: treat as exposed
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def keygen_command():
    @click.command("keygen")
    @click.argument("directory", type=click.Path(file_okay=False))
    @click.option("--name", default="server", show_default=True, help="File name stem: NAME.key, NAME.key_secret.")
    def command(directory: str, name: str) -> None:
        """Write a ZeroMQ CURVE key pair: NAME.key (public, share it) and NAME.key_secret (keep it).

        \b
        Examples:
          tandem keygen /etc/tandem/curve --name server
          tandem keygen ~/.config/tandem --name laptop   # then copy laptop.key into the server's --curve-clients
        """
        public, secret = keygen(directory, name)
        click.echo(f"public key: {public}\nsecret key: {secret}")

    return command
