"""Logging for hook runs: syslog (what admins grep) plus an optional file. slurmd discards a prolog's
stdout, so anything worth knowing must land here.

Everything a message quotes may be hostile: process names (a user picks them), hostnames, kernel-log lines, job
comments. Escaping happens here, at the sink, so that no caller can forget it: no ESC (terminal escape sequences
in `tail -f`), no CR (a line that overwrites itself), no other control or non-printable character reaches the
log file, syslog or stderr raw; each is written as `\\xNN` / `\\uNNNN` instead. Newlines become ` | ` (one event,
one line).

Root writes the log file: it is opened without following a symlink (O_NOFOLLOW) and written only when it is a
regular file owned by root (or this process's user) that others cannot write, so a user who can write the
file's directory cannot make root append to a file of their choosing.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from typing import Optional

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_text(text: object) -> str:
    """`text` as one inert line: newlines as ` | `, every non-printable character (ESC, CR, TAB, other C0/C1
    controls, DEL, bidi overrides, unpaired surrogates) as an escape. Printable Unicode stays. Pure."""
    s = str(text).replace("\r\n", "\n").replace("\n", " | ")
    if s.isprintable():
        return s  # the common case: nothing to do
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in s)


_REFUSED_SAID: set[str] = set()  # log files whose refusal this process said already (once each)


def log_file_refusal(path: str) -> Optional[str]:
    """Why root must not append to `path` (None: it may; the file may not exist yet). Its directory is walked
    like every root write (gpuguard.util.trust: no user's symlink, no directory a user may write; /tmp's sticky
    bit is fine, the file is opened O_NOFOLLOW and checked)."""
    from gpuguard.util.trust import open_trusted_dir  # only root, only with a log file

    try:
        os.close(open_trusted_dir(os.path.dirname(os.path.abspath(path)), sticky_end=True, create=False))
    except OSError as e:
        return str(e)
    return None


def open_log_for_append(path: str) -> Optional[int]:
    """An fd to append to `path`, never through a symlink (O_NOFOLLOW on the file; O_NONBLOCK so that a FIFO
    planted there cannot block the hook); None when it is not a regular file owned by root or us and
    unwritable by others, or (as root) its directory is not root's alone (then only syslog/stderr get the
    message, and stderr is told once why)."""
    why = log_file_refusal(path) if os.geteuid() == 0 else None
    fd = None
    if why is None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            why = f"{path}: {e.strerror or e}"
    if fd is not None:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022:
            return fd
        os.close(fd)
        why = f"{path} is not a regular file of root's that only root may write"
    if path not in _REFUSED_SAID:
        _REFUSED_SAID.add(path)
        try:
            sys.stderr.write(f"gpuguard: logging.file refused: {why}; logging to syslog only\n")
        except (OSError, ValueError):
            pass
    return None


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
        msg = escape_text(msg)
        if self._syslog is not None:
            pri = {"debug": self._syslog.LOG_DEBUG, "info": self._syslog.LOG_INFO,
                   "warning": self._syslog.LOG_WARNING, "error": self._syslog.LOG_ERR}[level]
            self._syslog.syslog(pri, msg)
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} gpuguard[{os.getpid()}] {level}: {msg}\n"
        if self.path:
            fd = open_log_for_append(self.path)
            if fd is not None:
                try:
                    os.write(fd, line.encode("utf-8", "backslashreplace"))
                except OSError:
                    pass
                finally:
                    os.close(fd)
        if self.stderr:
            try:
                sys.stderr.write(line)
            except (OSError, ValueError):  # a closed or broken stderr must not break a hook
                pass

    def info(self, msg: str) -> None:
        self.log("info", msg)

    def warning(self, msg: str) -> None:
        self.log("warning", msg)

    def error(self, msg: str) -> None:
        self.log("error", msg)
