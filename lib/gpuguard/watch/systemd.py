"""systemd's notification protocol (Type=notify): READY/STOPPING and the watchdog, over $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
from typing import Optional


def sd_notify(message: str) -> bool:
    """Tell systemd (Type=notify) something, e.g. READY=1. No $NOTIFY_SOCKET: not under systemd, nothing to do."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    elif not addr.startswith("/"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.settimeout(1.0)
            s.connect(addr)
            s.sendall(message.encode("utf-8", errors="replace"))
    except OSError:
        return False
    return True


def watchdog_interval() -> Optional[float]:
    """Half of systemd's WatchdogSec when it is set for this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) <= 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
