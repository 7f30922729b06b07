"""`dmesg --kernel --raw`: `<level>[seconds] message`, kernel-facility records only.

util-linux prints LOG_MAKEPRI(facility, level) with an unshifted facility, so the prefix cannot tell a userspace
record from a kernel one; `--kernel` makes dmesg itself filter on the facility it read from /dev/kmsg.
Cursor: {"kind": "dmesg", "boot_id", "monotonic_s": last timestamp, "same_ts": records seen with it}: dmesg always
prints the whole ring buffer, so records up to the cursor are skipped by their timestamp. Following runs
`dmesg --follow` (restarted when it exits; each run prints the buffer again and the same filter skips it).
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.kernellog.base import Batch, StoredCursor, run_log_tool, stderr_text, tool_failed
from gpuguard.kernellog.cursor import DmesgCursor, decode, encode, same_boot
from gpuguard.kernellog.formats import NEEDLE
from gpuguard.kernellog.scan import Accumulator, observation
from gpuguard.kernellog.toolsource import ToolSource
from gpuguard.model import KernelLogObservation
from gpuguard.util.lazyre import lazy

_TS_RE = lazy(rb"<\d{1,4}>\[\s*(\d+\.\d+)\]")


class DmesgFilter:
    """Which records of a dmesg run are new after `cursor` (by timestamp, counting the records that share the
    cursor's), and the cursor after each one (new_ts, new_same)."""

    def __init__(self, cursor: Optional[DmesgCursor] = None) -> None:
        self.last_ts = self.new_ts = cursor.monotonic_s if cursor else None
        self.same_ts = self.new_same = cursor.same_ts if cursor else 0
        self._seen_at_last = 0
        self._skipping = False  # the current record (and its continuation lines) is not new

    def feed(self, line: bytes) -> bool:
        """True when `line` (without its newline) is new; updates the running cursor."""
        if not line.startswith(b"<"):
            # continuation of a multi-line record: no prefix of its own, so it can never be an event
            return not self._skipping
        m = _TS_RE.match(line)
        ts = float(m.group(1)) if m else None
        self._skipping = False
        if ts is not None and self.last_ts is not None:
            if ts < self.last_ts:
                self._skipping = True
            elif ts == self.last_ts:
                self._seen_at_last += 1
                self._skipping = self._seen_at_last <= self.same_ts
        if self._skipping:
            return False
        if ts is not None:
            if self.new_ts is None or ts > self.new_ts:
                self.new_ts, self.new_same = ts, 1
            elif ts == self.new_ts:
                self.new_same += 1
        return True

    def restart(self) -> None:
        """A new dmesg run prints the buffer again: skip everything up to the running cursor."""
        self.last_ts, self.same_ts, self._seen_at_last, self._skipping = self.new_ts, self.new_same, 0, False


class DmesgSource(ToolSource):
    def __init__(self, dmesg: str = "dmesg", **kw: Any) -> None:
        """`kw`: ToolSource's (boot_id, boot_id_path, max_events, restart back-off)."""
        super().__init__("dmesg" if dmesg == "dmesg" else f"dmesg:{dmesg}", **kw)
        self.dmesg = dmesg
        self._filter = DmesgFilter()

    def argv(self, *, follow: bool = False) -> list[str]:
        return [self.dmesg, "--kernel", "--raw"] + (["--follow"] if follow else [])

    def _cursor_of(self, cursor: Optional[StoredCursor]) -> Optional[DmesgCursor]:
        c = decode(cursor)
        return c if isinstance(c, DmesgCursor) and same_boot(c.boot_id, self.boot_id) else None

    def _encode(self, f: DmesgFilter) -> StoredCursor:
        return encode(DmesgCursor(self.boot_id, f.new_ts, f.new_same))

    # ---------------------------------------------------------------- since a cursor
    def read(self, cursor: Optional[StoredCursor], *, timeout_s: float) -> KernelLogObservation:
        run = run_log_tool(self.argv(), timeout_s)
        failed = tool_failed(run, self.spec, cursor)
        if failed is not None:
            return failed
        obs = self.parse_output(run.stdout, cursor, complete_output=not run.timed_out)
        if run.timed_out:
            obs.status.complete = False
            obs.status.timed_out = True
            obs.status.error = run.error
            obs.cursor = cursor  # partial ring-buffer dump: keep the old position
        elif run.rc != 0:
            obs.status.complete = False
            obs.status.error = f"dmesg exited {run.rc}: {stderr_text(run)}"
            if not run.stdout:
                obs.cursor = cursor
        return obs

    def parse_output(self, stdout: bytes, cursor: Optional[StoredCursor], *,
                     complete_output: bool = True) -> KernelLogObservation:
        """Pure: events after `cursor` and the new cursor from `dmesg --kernel --raw` output."""
        f = DmesgFilter(self._cursor_of(cursor))
        acc = Accumulator(None, self.max_events)
        r = acc.result
        lines = stdout.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        if lines and not complete_output:
            lines.pop()
        for line in lines:
            if not f.feed(line):
                continue
            r.lines_scanned += 1
            if not line.startswith(b"<"):
                r.malformed += NEEDLE in line
                continue
            r.bytes_scanned += len(line) + 1
            if NEEDLE in line:
                acc.add_line(line, 0, len(line))
        return observation(r, self.spec, self._encode(f))

    # ---------------------------------------------------------------- following
    def follow(self, cursor: Optional[StoredCursor], *, start_at: str = "auto", once: bool = False) -> None:
        c = self._cursor_of(cursor)
        if c is None and start_at == "end":
            c = self._cursor_now()
        self._filter = DmesgFilter(c)
        self._start_following(lambda: self.argv(follow=not once), once)

    def _cursor_now(self) -> Optional[DmesgCursor]:
        """The cursor after the newest record in the buffer now (None if dmesg cannot say)."""
        run = run_log_tool(self.argv(), 10.0)
        if run.rc != 0 or run.timed_out:
            return None
        c = decode(self.parse_output(run.stdout, None).cursor)
        return c if isinstance(c, DmesgCursor) else None

    def _exited(self, rc: int, printed: bool) -> None:
        self._filter.restart()

    def poll(self) -> Optional[Batch]:
        data = self._new_output()
        if data is None:
            return None
        kept: list[bytes] = []
        cursors: list[tuple[int, StoredCursor]] = [(0, self._encode(self._filter))]
        size = 0
        for line in data[:-1].split(b"\n"):
            if self._filter.feed(line):
                kept.append(line + b"\n")
                size += len(line) + 1
                cursors.append((size, self._encode(self._filter)))
        if not kept:
            return None

        def cursor_at(off: int) -> StoredCursor:
            return next(c for end, c in reversed(cursors) if end <= off)

        return Batch(b"".join(kept), cursor_at)
