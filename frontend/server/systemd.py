"""sd_notify without dependencies: one datagram to $NOTIFY_SOCKET per state change."""
from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self) -> None:
        addr = os.environ.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):  # abstract namespace
            addr = "\0" + addr[1:]
        self.addr = addr or None
        usec = os.environ.get("WATCHDOG_USEC", "")
        # Ping at half the watchdog period, as sd_watchdog_enabled() recommends.
        self.watchdog_interval_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None

    def notify(self, state: str) -> None:
        if self.addr is None:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.sendto(state.encode(), self.addr)
            except OSError:
                pass  # systemd went away: nothing useful to do

    def ready(self, status: str = "") -> None:
        self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")
