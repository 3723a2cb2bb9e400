"""ZeroMQ CURVE authentication and encryption: key files, and applying them to sockets.

Key files are ZeroMQ's certificate format (``zmq.auth``): ``NAME.key`` holds
the public key, ``NAME.key_secret`` the public and the secret key.
``tandem keygen DIR --name NAME`` writes a pair.

- Server: ``CurveServer(secret_key_file, clients_dir)``. The ROUTER socket
  becomes a CURVE server, and a ZAP authenticator (a thread of the socket's
  ZeroMQ context) admits only clients whose public key file is in
  ``clients_dir`` (any ``*.key`` there). A client with another key fails the
  handshake: it gets no answer at all, and the server never sees its messages.
  In-process ``inproc://`` connections (the HTTP frontend) carry no security
  handshake in ZeroMQ and stay open to code in the same process only.
- Client: ``CurveClient(server_public_key_file, client_secret_key_file)``,
  applied to the DEALER before it connects.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (secret, mode 0600) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (d / f"{name}{suffix}").exists():
            raise FileExistsError(f"{d / (name + suffix)} exists; keys are never overwritten")
    public, secret = zmq.auth.create_certificates(str(d), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_secret(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file."""
    public, secret = _load(path)
    if secret is None:
        raise ValueError(f"{path}: no secret key in this file (use the .key_secret file of the pair)")
    return public, secret


def load_public(path: str | Path) -> bytes:
    return _load(path)[0]


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such key file")
    try:
        public, secret = zmq.auth.load_certificate(str(p))
    except Exception as e:  # noqa: BLE001 - zmq raises ValueError or OSError for a malformed file
        raise ValueError(f"{p}: not a ZeroMQ key file ({e})") from None
    if not public:
        raise ValueError(f"{p}: not a ZeroMQ key file (no public key)")
    return public, secret


@dataclass
class CurveServer:
    secret_key_file: str | Path
    clients_dir: str | Path

    def __post_init__(self) -> None:
        self.public, self.secret = load_secret(self.secret_key_file)
        d = Path(self.clients_dir)
        if not d.is_dir():
            raise FileNotFoundError(f"{d}: the client key directory does not exist")
        self._auth: ThreadAuthenticator | None = None

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet bound) a CURVE server admitting only the allowed clients."""
        if self._auth is None:
            self._auth = ThreadAuthenticator(sock.context)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.clients_dir))
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


@dataclass
class CurveClient:
    server_public_key_file: str | Path
    client_secret_key_file: str | Path

    def __post_init__(self) -> None:
        self.server_public = load_public(self.server_public_key_file)
        self.public, self.secret = load_secret(self.client_secret_key_file)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet connected) a CURVE client of that server."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
