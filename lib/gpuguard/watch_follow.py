"""Following the kernel log as it grows, for `gpuguard watch`.

A follower turns one kernel-log source into `Batch`es of complete lines, each able to say what cursor
means "everything before this offset has been judged". Parsing stays in `gpuguard.probes.kernel_log`;
this module only moves bytes and keeps positions.

- `KmsgDeviceFollower`: /dev/kmsg, non-blocking reads of one record each, woken by poll(2) on the fd (no
  polling timer: an idle watch does not wake up at all). Cursor {"kind": "kmsg", "boot_id", "seq"}, as the
  prolog's KmsgSource; a different boot id starts over.
- `FileFollower`: a growing file with `tail -F` semantics: new complete lines only, a partial last line is
  held until its newline arrives, truncation (copytruncate, `> file`) and rewriting are detected (size below
  the offset, or the first bytes changed) and read from the start, rotation (the path names a new inode) is
  handled by finishing the old file first. Cursor {"kind": "file", "path", "inode", "offset", "head",
  "head_len"} as FileSource's. A file of /dev/kmsg records (a simulated node) uses the kmsg cursor plus
  those position keys, so a restart resumes at the offset and a new boot starts over.
- `JournalFollower`: `journalctl -k -f -o json`, restarted with `--after-cursor` when it exits.
  Cursor {"kind": "journal", "cursor", "boot_id"}, as JournalSource's.
"""

from __future__ import annotations

import abc
import bisect
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gpuguard.probes.kernel_log import MAX_LINE_BYTES, _kmsg_readable

READ_CHUNK = 4 << 20  # bytes per file read: large enough for throughput, small enough to bound memory
_KMSG_READ_SIZE = 1 << 16  # /dev/kmsg returns EINVAL when the buffer is smaller than one record
_KMSG_MAX_RECORDS = 4096  # records per batch (the ring buffer holds a few thousand at most)
_HEAD_BYTES = 256  # as FileSource: the head hash covers at most this many leading bytes
_KMSG_SEQ_RE = re.compile(rb"\d{1,4},(\d{1,20}),")
_JOURNAL_CURSOR_RE = re.compile(rb'"__CURSOR"\s*:\s*"([^"\\\n]{1,1024})"')

Cursor = dict[str, Any]


class FollowError(RuntimeError):
    """The source cannot be followed at all (unknown spec, nothing readable)."""


@dataclass
class Batch:
    """Complete lines read in one go. `cursor_at(off)` (off = 0 or just past a newline in `data`) is the
    cursor to store once everything in data[:off] has been judged."""

    data: bytes
    cursor_at: Callable[[int], Cursor]
    json_lines: bool = False  # journal JSON: a MESSAGE may hold the needle as an array of byte values
    skip_seq_upto: Optional[int] = None  # kmsg records with seq <= this were judged before a restart


@dataclass
class FollowStats:
    bytes_read: int = 0
    lines_skipped_overlong: int = 0
    truncations: int = 0
    rotations: int = 0
    kmsg_lost: int = 0  # records overwritten in the ring buffer before they were read
    restarts: int = 0  # journalctl restarts


class Follower(abc.ABC):
    spec: str = ""
    poll_interval_s: float = 1.0

    def __init__(self) -> None:
        self.stats = FollowStats()
        self.notes: list[str] = []  # human-readable events (rotation, truncation) for the daemon's log

    def wait_fd(self) -> Optional[int]:
        """A file descriptor that becomes readable when there is news, or None: poll every poll_interval_s."""
        return None

    @abc.abstractmethod
    def read(self) -> Optional[Batch]:
        """What is new right now (None: nothing). Never blocks."""

    def close(self) -> None:
        pass


def _head_hash(head: bytes) -> str:
    return hashlib.sha256(head).hexdigest()[:32]


def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


# --------------------------------------------------------------------------- /dev/kmsg


class KmsgDeviceFollower(Follower):
    """The kernel's ring buffer, record by record. Reading starts at the oldest record still there (the whole
    boot, when the buffer has not wrapped), after `after_seq` when resuming, or at the end with `at_end`."""

    def __init__(self, path: str = "/dev/kmsg", *, boot_id: Optional[str], after_seq: Optional[int] = None,
                 at_end: bool = False) -> None:
        super().__init__()
        self.path = path
        self.spec = f"kmsg:{path}"
        self.boot_id = boot_id
        self.after_seq = after_seq
        self._first_read = True
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        if after_seq is None and at_end:
            os.lseek(self._fd, 0, os.SEEK_END)  # /dev/kmsg: SEEK_END = after the newest record

    def wait_fd(self) -> Optional[int]:
        return self._fd

    def _cursor(self, seq: Optional[int]) -> Cursor:
        return {"kind": "kmsg", "boot_id": self.boot_id, "seq": seq}

    def read(self) -> Optional[Batch]:
        lines: list[bytes] = []
        ends: list[int] = []
        seqs: list[int] = []
        size = 0
        max_seen: Optional[int] = None
        for _ in range(_KMSG_MAX_RECORDS):
            try:
                rec = os.read(self._fd, _KMSG_READ_SIZE)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except BrokenPipeError:
                # EPIPE: the next record was overwritten before we read it; reading goes on at the oldest one
                self.stats.kmsg_lost += 1
                self.notes.append("kmsg ring buffer overwrote records before they were read")
                continue
            if not rec:
                break
            self.stats.bytes_read += len(rec)
            m = _KMSG_SEQ_RE.match(rec)
            if m is None:
                continue
            seq = int(m.group(1))
            max_seen = seq if max_seen is None else max(max_seen, seq)
            if self.after_seq is not None and seq <= self.after_seq:
                continue
            nl = rec.find(b"\n")  # dictionary lines (" KEY=value") follow the message line
            line = rec if nl < 0 else rec[:nl]
            lines.append(line + b"\n")
            size += len(line) + 1
            ends.append(size)
            seqs.append(seq)
        if self._first_read:
            self._first_read = False
            if self.after_seq is not None and max_seen is not None and max_seen < self.after_seq and not lines:
                # every record is older than the cursor: the numbering restarted (a reboot the boot id did not
                # show); judge the buffer from its start
                self.notes.append(f"kmsg sequence restarted below the cursor ({self.after_seq}); reading all")
                self.after_seq = None
                os.lseek(self._fd, 0, os.SEEK_SET)
                return self.read()
        if not lines:
            return None
        base_seq = self.after_seq
        self.after_seq = seqs[-1]

        def cursor_at(off: int, ends: list[int] = ends, seqs: list[int] = seqs) -> Cursor:
            i = bisect.bisect_right(ends, off) - 1
            return self._cursor(seqs[i] if i >= 0 else base_seq)

        return Batch(b"".join(lines), cursor_at)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# --------------------------------------------------------------------------- files (tail -F)


class FileFollower(Follower):
    """A growing log file. `kmsg_records`: the file holds /dev/kmsg records (a simulated node's kernel log),
    so cursors carry the record sequence number and boot id as well as the file position."""

    def __init__(self, path: str, *, cursor: Optional[Cursor] = None, at_end: bool = False,
                 kmsg_records: bool = False, boot_id: Optional[str] = None, poll_interval_s: float = 0.25) -> None:
        super().__init__()
        self.path = path
        self.kmsg_records = kmsg_records
        self.spec = f"kmsg:{path}" if kmsg_records else f"file:{path}"
        self.boot_id = boot_id
        self.poll_interval_s = poll_interval_s
        self._fd = -1
        self._ino: Optional[tuple[int, int]] = None
        self._offset = 0  # next byte to read = start of the (possibly partial) next line
        self._head = b""  # the file's first bytes (up to _HEAD_BYTES) as last seen
        self._size_seen = -1
        self._skipping = False  # inside an overlong line: discard up to its newline
        self._last_seq: Optional[int] = None  # kmsg: newest record judged
        self.skip_seq_upto: Optional[int] = None
        self._resume = self._valid_cursor(cursor)
        self._at_end = at_end and cursor is None
        self._missing_noted = False
        self._open_path(initial=True)

    # ---------------------------------------------------------------- cursor handling
    def _valid_cursor(self, cursor: Optional[Cursor]) -> Optional[Cursor]:
        want = "kmsg" if self.kmsg_records else "file"
        if not isinstance(cursor, dict) or cursor.get("kind") != want:
            return None
        if self.kmsg_records:
            if cursor.get("boot_id") is not None and self.boot_id is not None and cursor["boot_id"] != self.boot_id:
                return None  # a new boot: its kernel log starts over
            seq = _int_or_none(cursor.get("seq"))
            self.skip_seq_upto = seq
            self._last_seq = seq
        return cursor

    def _position_from(self, cursor: Optional[Cursor], st: os.stat_result) -> int:
        """Where to resume in the file just opened: the cursor's offset when it still describes this file."""
        if cursor is None or cursor.get("path") != self.path or cursor.get("inode") != st.st_ino:
            return 0
        offset = _int_or_none(cursor.get("offset"))
        head_len = _int_or_none(cursor.get("head_len"))
        if offset is None or head_len is None or head_len > _HEAD_BYTES or st.st_size < offset:
            return 0
        head = os.pread(self._fd, head_len, 0)
        if len(head) != head_len or _head_hash(head) != cursor.get("head"):
            return 0  # rewritten in place since the cursor was taken
        return offset

    def cursor(self, offset: int, last_seq: Optional[int]) -> Cursor:
        head_len = min(_HEAD_BYTES, offset)
        head = self._head[:head_len] if len(self._head) >= head_len else os.pread(self._fd, head_len, 0)
        pos = {"path": self.path, "inode": self._ino[1] if self._ino else None, "offset": offset,
               "head": _head_hash(head), "head_len": head_len}
        if self.kmsg_records:
            return {"kind": "kmsg", "boot_id": self.boot_id, "seq": last_seq, **pos}
        return {"kind": "file", **pos}

    # ---------------------------------------------------------------- opening, rotation, truncation
    def _open_path(self, initial: bool = False) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if not self._missing_noted:
                self.notes.append(f"{self.path} does not exist (yet); waiting for it")
                self._missing_noted = True
            return False
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise FollowError(f"{self.path} is not a regular file")
        self._fd = fd
        self._ino = (st.st_dev, st.st_ino)
        self._missing_noted = False
        self._skipping = False
        if initial and self._resume is not None:
            self._offset = self._position_from(self._resume, st)
        elif initial and self._at_end:
            # only lines written from now on; a trailing partial line is the start of the first new one
            tail_start = max(0, st.st_size - MAX_LINE_BYTES)
            tail = os.pread(fd, st.st_size - tail_start, tail_start)
            nl = tail.rfind(b"\n")
            self._offset = tail_start + nl + 1 if nl >= 0 else (0 if tail_start == 0 else st.st_size)
        else:
            self._offset = 0
        self._resume = None
        self._head = os.pread(fd, _HEAD_BYTES, 0)
        self._size_seen = st.st_size
        return True

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def _path_moved(self) -> bool:
        """True when the path now names another file (rotated) or nothing (rotated, not recreated yet)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._ino

    def _restart_from_zero(self, why: str) -> None:
        self.stats.truncations += 1
        self.notes.append(f"{self.path} {why}: reading it from the start")
        self._offset = 0
        self._skipping = False
        self.skip_seq_upto = None  # a rewritten kmsg file is a new boot's log
        self._last_seq = None

    # ---------------------------------------------------------------- reading
    def read(self) -> Optional[Batch]:
        if self._fd < 0 and not self._open_path():
            return None
        st = os.fstat(self._fd)
        if st.st_size != self._size_seen:
            if st.st_size < self._offset:
                self._restart_from_zero("was truncated")
            elif self._head and os.pread(self._fd, len(self._head), 0) != self._head[:st.st_size]:
                self._restart_from_zero("was rewritten")
            self._head = os.pread(self._fd, _HEAD_BYTES, 0)
            self._size_seen = st.st_size
        batch = self._read_new(final=False)
        if batch is not None:
            return batch
        if self._path_moved():
            # rotated: whatever was appended to the old file before the rename counts, even a last line
            # without its newline (no more will ever come)
            batch = self._read_new(final=True)
            if batch is not None:
                return batch
            self.stats.rotations += 1
            self.notes.append(f"{self.path} was rotated: following the new file")
            self._close_fd()
            if self._open_path():
                return self._read_new(final=False)
        return None

    def _read_new(self, *, final: bool) -> Optional[Batch]:
        while True:
            start = self._offset
            data = os.pread(self._fd, READ_CHUNK, start)
            if not data:
                return None
            self.stats.bytes_read += len(data)
            if self._skipping:
                nl = data.find(b"\n")
                if nl < 0:
                    self._offset += len(data)
                    continue
                self._skipping = False
                self._offset += nl + 1
                continue
            last_nl = data.rfind(b"\n")
            if last_nl < 0:
                if len(data) > MAX_LINE_BYTES:
                    # no kernel record is this long: skip the line rather than hold it in memory
                    self.stats.lines_skipped_overlong += 1
                    self._skipping = True
                    self._offset += len(data)
                    continue
                if not final:
                    return None  # a partial line: wait for the rest
                data = data + b"\n"
                end = len(data) - 1
            else:
                data = data[:last_nl + 1]
                end = len(data)
            self._offset = start + end
            if self._offset <= _HEAD_BYTES or len(self._head) < _HEAD_BYTES:
                self._head = os.pread(self._fd, _HEAD_BYTES, 0)
            return self._batch(data, start, end)

    def _batch(self, data: bytes, base: int, consumed: int) -> Batch:
        skip = self.skip_seq_upto
        prev_seq = self._last_seq
        if self.kmsg_records:
            self._last_seq = _last_kmsg_seq(data, len(data)) or prev_seq

        def cursor_at(off: int) -> Cursor:
            seq = (_last_kmsg_seq(data, off) or prev_seq) if self.kmsg_records else None
            return self.cursor(base + min(off, consumed), seq)

        return Batch(data, cursor_at, skip_seq_upto=skip)

    def close(self) -> None:
        self._close_fd()


def _last_kmsg_seq(data: bytes, off: int) -> Optional[int]:
    """Sequence number of the last kmsg record line ending at or before `off` (just past a newline)."""
    end = off - 1
    while end > 0:
        start = data.rfind(b"\n", 0, end) + 1
        m = _KMSG_SEQ_RE.match(data, start, end)
        if m:
            return int(m.group(1))
        end = start - 1
    return None


# --------------------------------------------------------------------------- journalctl


class JournalFollower(Follower):
    """`journalctl -k -f -o json`; when it exits (journald restarted, vacuumed) it is started again from the
    last entry read, with a growing back-off. `follow=False` reads what is there and stops (--once)."""

    def __init__(self, journalctl: str = "journalctl", *, cursor: Optional[Cursor] = None,
                 boot_id: Optional[str] = None, at_end: bool = False, follow: bool = True,
                 restart_initial_s: float = 1.0, restart_max_s: float = 30.0) -> None:
        super().__init__()
        self.journalctl = journalctl
        self.spec = "journal" if journalctl == "journalctl" else f"journal:{journalctl}"
        self.boot_id = boot_id
        self.follow = follow
        self.poll_interval_s = 1.0
        self._journal_cursor: Optional[str] = None
        if isinstance(cursor, dict) and cursor.get("kind") == "journal":
            c = cursor.get("cursor")
            same_boot = cursor.get("boot_id") is None or boot_id is None or cursor.get("boot_id") == boot_id
            if isinstance(c, str) and 0 < len(c) <= 1024 and "\n" not in c and same_boot:
                self._journal_cursor = c
        self._at_end = at_end and self._journal_cursor is None
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._lines_this_run = 0
        self._buf = b""
        self._skipping = False
        self._restart_initial = restart_initial_s
        self._restart_max = restart_max_s
        self._backoff = restart_initial_s
        self._restart_at = 0.0
        self.finished = False  # follow=False: journalctl has printed everything
        self._spawn()

    def argv(self) -> list[str]:
        # -k = this boot's kernel-transport records only; --all keeps long fields (null otherwise)
        argv = [self.journalctl, "-k", "-o", "json", "--no-pager", "--all"]
        if self.follow:
            argv.append("-f")
        if self._journal_cursor:
            argv.append(f"--after-cursor={self._journal_cursor}")
        elif self.follow:
            argv.append("--lines=0" if self._at_end else "--lines=all")  # -f alone shows only the last 10
        return argv

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["LC_ALL"] = "C"
        env.pop("SYSTEMD_PAGER", None)
        exe = shutil.which(self.journalctl) or self.journalctl
        try:
            self._proc = subprocess.Popen([exe, *self.argv()[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, env=env)
        except OSError as e:
            self._proc = None
            self.notes.append(f"cannot run {self.journalctl}: {e.strerror}; retrying in {self._backoff:g}s")
            self._schedule_restart()
            return
        assert self._proc.stdout is not None
        os.set_blocking(self._proc.stdout.fileno(), False)
        self._lines_this_run = 0

    def _schedule_restart(self) -> None:
        self._restart_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._restart_max)

    def wait_fd(self) -> Optional[int]:
        if self._proc is not None and self._proc.stdout is not None:
            return self._proc.stdout.fileno()
        return None

    def _reap(self) -> None:
        assert self._proc is not None
        rc = self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None
        if not self.follow:
            self.finished = True
            return
        if rc != 0 and self._lines_this_run == 0 and self._journal_cursor:
            # "Failed to seek to cursor": the saved position is gone. Re-reading the boot could drain again for
            # an Xid already acted on, so follow from now on (the prolog and health check scan the journal too).
            self.notes.append(f"{self.journalctl} cannot resume after the saved cursor (exit {rc}); "
                              "following new entries only")
            self._journal_cursor = None
            self._at_end = True
        self.stats.restarts += 1
        self.notes.append(f"{self.journalctl} exited with {rc}; restarting in {self._backoff:g}s")
        self._schedule_restart()

    def read(self) -> Optional[Batch]:
        if self._proc is None:
            if self.finished or time.monotonic() < self._restart_at:
                return None
            self._spawn()
            if self._proc is None:
                return None
        assert self._proc.stdout is not None
        chunks = []
        eof = False
        total = 0
        while total < READ_CHUNK:
            try:
                chunk = os.read(self._proc.stdout.fileno(), 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
            total += len(chunk)
        if chunks:
            self.stats.bytes_read += total
            if eof and not self.follow:
                chunks.append(b"" if (chunks[-1].endswith(b"\n")) else b"\n")
            batch = self._take_lines(b"".join(chunks))
        else:
            batch = None
        if eof:
            self._reap()
            self._backoff = self._restart_initial if batch is not None else self._backoff
        elif batch is not None:
            self._backoff = self._restart_initial  # it works again
        return batch

    def _take_lines(self, new: bytes) -> Optional[Batch]:
        data = self._buf + new
        if self._skipping:
            nl = data.find(b"\n")
            if nl < 0:
                self._buf = b""
                return None
            self._skipping = False
            data = data[nl + 1:]
        last_nl = data.rfind(b"\n")
        rest = data[last_nl + 1:]
        if len(rest) > MAX_LINE_BYTES:
            self.stats.lines_skipped_overlong += 1
            self._skipping = True
            rest = b""
        self._buf = rest
        if last_nl < 0:
            return None
        data = data[:last_nl + 1]
        self._lines_this_run += 1
        prev = self._journal_cursor
        last = _last_journal_cursor(data, len(data))
        if last is not None:
            self._journal_cursor = last

        def cursor_at(off: int) -> Cursor:
            return {"kind": "journal", "cursor": _last_journal_cursor(data, off) or prev, "boot_id": self.boot_id}

        return Batch(data, cursor_at, json_lines=True)

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._proc.wait(timeout=2.0)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None


def _last_journal_cursor(data: bytes, off: int) -> Optional[str]:
    """__CURSOR of the last JSON entry ending at or before `off`."""
    end = off - 1
    while end > 0:
        start = data.rfind(b"\n", 0, end) + 1
        m = _JOURNAL_CURSOR_RE.search(data, start, end)
        if m:
            return m.group(1).decode("utf-8", errors="replace")
        end = start - 1
    return None


# --------------------------------------------------------------------------- choosing a follower


def source_kind(spec: str) -> str:
    """`kmsg` | `journal` | `file` for a followable spec (auto resolves to what make_follower would use)."""
    kind, _, arg = spec.partition(":")
    if kind == "auto":
        return "kmsg" if _kmsg_readable("/dev/kmsg") else "journal"
    return kind


def make_follower(spec: str, *, cursor: Optional[Cursor], boot_id: Optional[str], start_at: str = "auto",
                  poll_interval_s: float = 0.25, follow: bool = True) -> Follower:
    """A follower for `auto` | `kmsg[:PATH]` | `journal[:JOURNALCTL]` | `file:PATH`, resuming after `cursor`.

    Without a usable cursor, `start_at` decides: `boot` judges everything the source still has (the kernel
    log of this boot), `end` only what is written from now on, `auto` is `boot` for kmsg and the journal
    (they only hold this boot) and `end` for a text file (it spans boots: old lines cannot be told apart)."""
    kind, _, arg = spec.partition(":")
    if kind == "auto" and not arg:
        if _kmsg_readable("/dev/kmsg"):
            kind, arg = "kmsg", "/dev/kmsg"
        elif shutil.which("journalctl"):
            kind, arg = "journal", ""
        else:
            raise FollowError("no kernel log to follow: /dev/kmsg is not readable and journalctl is not installed")
    if kind == "kmsg":
        path = arg or "/dev/kmsg"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            return FileFollower(path, cursor=cursor, kmsg_records=True, boot_id=boot_id,
                                at_end=start_at == "end", poll_interval_s=poll_interval_s)
        if st is None:
            raise FollowError(f"{path} does not exist")
        c = cursor if isinstance(cursor, dict) and cursor.get("kind") == "kmsg" else None
        after = None
        if c is not None and (c.get("boot_id") is None or boot_id is None or c.get("boot_id") == boot_id):
            after = _int_or_none(c.get("seq"))
        try:
            return KmsgDeviceFollower(path, boot_id=boot_id, after_seq=after, at_end=start_at == "end")
        except OSError as e:
            raise FollowError(f"cannot open {path}: {e.strerror}") from None
    if kind == "journal":
        return JournalFollower(arg or "journalctl", cursor=cursor, boot_id=boot_id, at_end=start_at == "end",
                               follow=follow)
    if kind == "file" and arg:
        return FileFollower(arg, cursor=cursor, at_end=start_at in ("end", "auto"), poll_interval_s=poll_interval_s)
    if kind == "dmesg":
        raise FollowError("dmesg cannot be followed: use kmsg (the default) or journal for the watch")
    raise FollowError(f"unknown kernel log source {spec!r} (auto, kmsg[:PATH], journal[:JOURNALCTL], file:PATH)")


__all__ = ["Batch", "Cursor", "FileFollower", "FollowError", "FollowStats", "Follower", "JournalFollower",
           "KmsgDeviceFollower", "make_follower", "source_kind"]
