"""`journalctl -k -o json`: this boot's kernel-transport records from the systemd journal.

Cursor: {"kind": "journal", "cursor": __CURSOR of the last entry judged, "boot_id"}. Reading since a cursor runs
journalctl once with `--after-cursor` (without one: `-b`, this boot); following runs `journalctl -f` and starts it
again from the last entry read when it exits. A cursor journalctl can no longer seek to (the journal was vacuumed)
is dropped: a read judges this boot from its start again, the follower goes on with new entries only (re-reading
the boot could drain again for an Xid already acted on; the hooks scan the journal too).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Optional

from gpuguard.kernellog.base import Batch, StoredCursor, run_log_tool, stderr_text, tool_failed
from gpuguard.kernellog.chunks import last_in_lines
from gpuguard.kernellog.cursor import JournalCursor, decode, encode, same_boot
from gpuguard.kernellog.formats import JSON_ARRAY_NEEDLE, NEEDLE
from gpuguard.kernellog.scan import Accumulator, observation
from gpuguard.kernellog.toolsource import ToolSource
from gpuguard.model import KernelLogObservation
from gpuguard.util.lazyre import lazy

_CURSOR_RE = lazy(rb'"__CURSOR"\s*:\s*"([^"\\\n]{1,1024})"')
_BOOT_RE = lazy(rb'"_BOOT_ID"\s*:\s*"([0-9a-fA-F-]{1,64})"')


class JournalSource(ToolSource):
    def __init__(self, journalctl: str = "journalctl", **kw: Any) -> None:
        """`kw`: ToolSource's (boot_id, boot_id_path, max_events, restart back-off)."""
        super().__init__("journal" if journalctl == "journalctl" else f"journal:{journalctl}", **kw)
        self.journalctl = journalctl
        self._journal_cursor: Optional[str] = None
        self._at_end = False

    def _start_cursor(self, cursor: Optional[StoredCursor]) -> Optional[str]:
        c = decode(cursor)
        if isinstance(c, JournalCursor) and same_boot(c.boot_id, self.boot_id):
            return c.cursor
        return None

    def argv(self, journal_cursor: Optional[str], *, follow: bool = False, at_end: bool = False) -> list[str]:
        # -k = this boot's kernel-transport records only; --all keeps long fields (null otherwise)
        argv = [self.journalctl, "-k", "-o", "json", "--no-pager", "--all"]
        if follow:
            argv.append("-f")
        if journal_cursor:
            return argv + [f"--after-cursor={journal_cursor}"]
        if follow:
            return argv + ["--lines=0" if at_end else "--lines=all"]  # -f alone shows only the last 10
        return argv + ["-b"]

    # ---------------------------------------------------------------- since a cursor
    def read(self, cursor: Optional[StoredCursor], *, timeout_s: float) -> KernelLogObservation:
        journal_cursor = self._start_cursor(cursor)
        deadline = time.monotonic() + timeout_s
        run = run_log_tool(self.argv(journal_cursor), timeout_s)
        if journal_cursor and not run.timed_out and run.rc not in (0, None) and not run.stdout.strip():
            # e.g. "Failed to seek to cursor" after the journal was vacuumed: read this boot from its start
            run = run_log_tool(self.argv(None), max(0.001, deadline - time.monotonic()))
            journal_cursor = None
        failed = tool_failed(run, self.spec, cursor)
        if failed is not None:
            return failed
        obs = self.parse_output(run.stdout, previous_cursor=journal_cursor)
        if run.timed_out:
            obs.status.complete = False
            obs.status.timed_out = True
            obs.status.error = run.error
        elif run.rc != 0:
            obs.status.complete = False
            obs.status.error = f"journalctl exited {run.rc}: {stderr_text(run)}"
        return obs

    def parse_output(self, stdout: bytes, *, previous_cursor: Optional[str] = None) -> KernelLogObservation:
        """Pure: Xid events and the new cursor from `journalctl -o json` output (one object per line)."""
        acc = Accumulator(None, self.max_events)
        r = acc.result
        end = stdout.rfind(b"\n") + 1  # a line cut off at the timeout is not a complete entry
        for line in stdout[:end].split(b"\n"):
            if not line.startswith(b"{"):
                continue
            r.lines_scanned += 1
            r.bytes_scanned += len(line) + 1
            if NEEDLE in line or JSON_ARRAY_NEEDLE in line:
                acc.add_line(line, 0, len(line))
        boot_id = self.boot_id if self.boot_id is not None else last_boot_id(stdout, end)
        new = JournalCursor(last_journal_cursor(stdout, end) or previous_cursor, boot_id)
        return observation(r, self.spec, encode(new))

    # ---------------------------------------------------------------- following
    def follow(self, cursor: Optional[StoredCursor], *, start_at: str = "auto", once: bool = False) -> None:
        self._journal_cursor = self._start_cursor(cursor)
        self._at_end = self._journal_cursor is None and start_at == "end"
        self._start_following(lambda: self.argv(self._journal_cursor, follow=not once, at_end=self._at_end), once)

    def _exited(self, rc: int, printed: bool) -> None:
        if rc != 0 and not printed and self._journal_cursor:
            self.notes.append(f"{self.journalctl} cannot resume after the saved cursor (exit {rc}); "
                              "following new entries only")
            self._journal_cursor = None
            self._at_end = True

    def poll(self) -> Optional[Batch]:
        data = self._new_output()
        if data is None:
            return None
        prev = self._journal_cursor
        self._journal_cursor = last_journal_cursor(data, len(data)) or prev

        def cursor_at(off: int) -> StoredCursor:
            return encode(JournalCursor(last_journal_cursor(data, off) or prev, self.boot_id))

        return Batch(data, cursor_at, json_lines=True)


def _first_group(regex: "re.Pattern[bytes]") -> Callable[[bytes, int, int], Optional[str]]:
    def value(data: bytes, start: int, end: int) -> Optional[str]:
        m = regex.search(data, start, end)
        return m.group(1).decode("utf-8", errors="replace") if m else None

    return value


_cursor_of_line = _first_group(_CURSOR_RE)
_boot_of_line = _first_group(_BOOT_RE)


def last_journal_cursor(data: bytes, off: int) -> Optional[str]:
    """__CURSOR of the last JSON entry ending at or before `off` (0 or just past a newline)."""
    return last_in_lines(data, off, _cursor_of_line)


def last_boot_id(data: bytes, off: int) -> Optional[str]:
    """_BOOT_ID of the last entry ending at or before `off` that names one."""
    return last_in_lines(data, off, _boot_of_line)
