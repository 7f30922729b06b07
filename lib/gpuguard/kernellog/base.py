"""What every kernel-log source is: one class per source (kmsg, journal, dmesg, file) that can both

- `read(cursor, timeout_s)`: everything new since a stored cursor, judged line by line, and the cursor to store
  next (the prolog, epilog and health check); never blocks past `timeout_s`;
- `follow(cursor, start_at)` then `poll()` / `wait_fd()`: new complete lines as they arrive, in `Batch`es that say
  which cursor stands for "everything before this offset was judged" (the watch daemon).

Cursors go in and out as the stored JSON objects of gpuguard.kernellog.cursor, the one codec both use.
"""

from __future__ import annotations

import abc
import os
from typing import Any, Callable, NamedTuple, Optional

from gpuguard.model import KernelLogObservation, ProbeStatus
from gpuguard.util.toolrun import ToolRun, run_tool

DEFAULT_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
START_AT = ("auto", "boot", "end")

StoredCursor = dict[str, Any]


class FollowError(RuntimeError):
    """The source cannot be followed at all (unknown spec, nothing readable)."""


class Batch(NamedTuple):
    """Complete lines read in one go. `cursor_at(off)` (off = 0 or just past a newline in `data`) is the cursor to
    store once everything in data[:off] has been judged."""

    data: bytes
    cursor_at: Callable[[int], StoredCursor]
    json_lines: bool = False  # journal JSON: a MESSAGE may hold the needle as an array of byte values
    skip_seq_upto: Optional[int] = None  # kmsg records with seq <= this were judged before a restart


class FollowStats:
    """Counters of a followed source (a plain class: see cursor.py on dataclasses and import time)."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.lines_skipped_overlong = 0
        self.truncations = 0
        self.rotations = 0
        self.kmsg_lost = 0  # records overwritten in the ring buffer before they were read
        self.restarts = 0  # journalctl / dmesg restarts


class KernelLogSource(abc.ABC):
    """One place to read the kernel log from: since a cursor, or following it."""

    spec: str = ""
    poll_interval_s: float = 1.0  # how often to poll() when wait_fd() is None

    def __init__(self) -> None:
        self.stats = FollowStats()
        self.notes: list[str] = []  # human-readable events (rotation, truncation, restarts) for the daemon's log
        self.finished = False  # following with once=True: everything there was has been read

    @abc.abstractmethod
    def read(self, cursor: Optional[StoredCursor], *, timeout_s: float) -> KernelLogObservation:
        """Events newer than `cursor` (all when None) and the cursor to pass next time. May raise OSError;
        `gpuguard.kernellog.sources.read_xid_events` turns exceptions into an incomplete observation."""

    @abc.abstractmethod
    def follow(self, cursor: Optional[StoredCursor], *, start_at: str = "auto", once: bool = False) -> None:
        """Start following after `cursor`. Without a usable one, `start_at` decides: `boot` = everything the
        source still holds, `end` = only what is written from now on, `auto` = `boot` for the kernel's own
        buffers (they only hold this boot) and `end` for a text file (it spans boots). `once`: read what is
        there and finish. Raises FollowError or OSError when there is nothing to follow."""

    @abc.abstractmethod
    def poll(self) -> Optional[Batch]:
        """While following: what is new right now (None: nothing). Never blocks."""

    def wait_fd(self) -> Optional[int]:
        """A file descriptor that becomes readable when there is news, or None: poll every poll_interval_s."""
        return None

    def close(self) -> None:
        pass


def read_boot_id(path: str = DEFAULT_BOOT_ID_PATH) -> Optional[str]:
    """The current boot id (a UUID string), or None when unreadable."""
    try:
        with open(path, "rb") as f:
            value = f.read(128).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return value if 0 < len(value) <= 64 else None


def tool_env() -> dict[str, str]:
    """Stable unlocalised output and no pager, for journalctl and dmesg."""
    env = dict(os.environ)
    env["LC_ALL"] = "C"
    env.pop("SYSTEMD_PAGER", None)
    return env


def run_log_tool(argv: list[str], timeout_s: float) -> ToolRun:
    return run_tool(argv, timeout_s, env=tool_env())


def stderr_text(run: ToolRun) -> str:
    text = run.stderr.decode("utf-8", errors="replace").strip().splitlines()
    return text[-1][:300] if text else ""


def tool_failed(run: ToolRun, source: str, cursor: Optional[StoredCursor]) -> Optional[KernelLogObservation]:
    """The observation for a tool that could not be run at all (None when it ran)."""
    if run.rc is None and not run.timed_out:
        return KernelLogObservation(status=ProbeStatus(complete=False, error=run.error), source=source, cursor=cursor)
    return None


def kmsg_readable(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True
