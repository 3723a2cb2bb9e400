"""What tests that start ``tandem`` processes share: the repository root, the command line, a free port,
and a stop that drains first."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "frontend.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
