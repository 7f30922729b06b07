"""Logging for hook runs: syslog (what admins grep) plus an optional file. slurmd discards a prolog's
stdout, so anything worth knowing must land here."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class HookLog:
    def __init__(self, use_syslog: bool = True, path: Optional[str] = None, level: str = "info",
                 stderr: bool = True) -> None:
        self.use_syslog = use_syslog
        self.path = path
        self.level = _LEVELS.get(level, 20)
        self.stderr = stderr
        self._syslog = None
        if use_syslog:
            try:
                import syslog

                syslog.openlog("gpuguard", syslog.LOG_PID, syslog.LOG_DAEMON)
                self._syslog = syslog
            except Exception:  # noqa: BLE001 - no syslog is not an error
                self._syslog = None

    def log(self, level: str, msg: str) -> None:
        if _LEVELS[level] < self.level:
            return
        msg = msg.replace("\n", " | ")
        if self._syslog is not None:
            pri = {"debug": self._syslog.LOG_DEBUG, "info": self._syslog.LOG_INFO,
                   "warning": self._syslog.LOG_WARNING, "error": self._syslog.LOG_ERR}[level]
            self._syslog.syslog(pri, msg)
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} gpuguard[{os.getpid()}] {level}: {msg}\n"
        if self.path:
            try:
                with open(self.path, "a") as f:
                    f.write(line)
            except OSError:
                pass
        if self.stderr:
            sys.stderr.write(line)

    def info(self, msg: str) -> None:
        self.log("info", msg)

    def warning(self, msg: str) -> None:
        self.log("warning", msg)

    def error(self, msg: str) -> None:
        self.log("error", msg)
