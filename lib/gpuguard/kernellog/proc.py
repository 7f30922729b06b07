"""Following a log tool's output (`journalctl -f`, `dmesg --follow`): shared by the journal and dmesg sources.

The tool runs in its own session (so closing kills its whole process group) with its stdout non-blocking. When it
exits (journald restarted, the journal vacuumed) it is started again with a growing back-off, from the position
the source then asks for. Output is handed out as complete lines; a line longer than MAX_LINE_BYTES is skipped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable, Optional

from gpuguard.kernellog.base import FollowStats, tool_env
from gpuguard.kernellog.chunks import LineChunker
from gpuguard.util.toolrun import which

# called with the exit status and whether the run printed any complete line
OnExit = Callable[[int, bool], None]


class ToolFollower:
    def __init__(self, argv: Callable[[], list[str]], stats: FollowStats, notes: list[str], *, keep_running: bool,
                 on_exit: OnExit, restart_initial_s: float = 1.0, restart_max_s: float = 30.0) -> None:
        self.argv = argv
        self.stats = stats
        self.notes = notes
        self.keep_running = keep_running  # False: read what the tool prints and finish (--once)
        self.on_exit = on_exit
        self.restart_initial_s = restart_initial_s
        self.restart_max_s = restart_max_s
        self.finished = False
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._chunker: Optional[LineChunker] = None
        self._eof = False
        self._printed = False
        self._backoff = restart_initial_s
        self._restart_at = 0.0
        self._spawn()

    def _spawn(self) -> None:
        argv = self.argv()
        exe = which(argv[0]) or argv[0]
        try:
            self._proc = subprocess.Popen([exe, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                                          env=tool_env())
        except OSError as e:
            self._proc = None
            self.notes.append(f"cannot run {argv[0]}: {e.strerror}; retrying in {self._backoff:g}s")
            self._schedule_restart()
            return
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        os.set_blocking(fd, False)
        self._eof = False
        self._printed = False
        self._chunker = LineChunker(self._reader(fd))

    def _reader(self, fd: int) -> Callable[[memoryview], int]:
        def read_into(mv: memoryview) -> int:
            try:
                n = os.readv(fd, [mv])
            except BlockingIOError:
                return 0
            self._eof = self._eof or n == 0
            return n

        return read_into

    def _schedule_restart(self) -> None:
        self._restart_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.restart_max_s)

    def wait_fd(self) -> Optional[int]:
        if self._proc is not None and self._proc.stdout is not None:
            return self._proc.stdout.fileno()
        return None

    def read_lines(self) -> Optional[bytes]:
        """Complete lines the tool printed since the last call (None: nothing new). Never blocks."""
        if self._proc is None:
            if self.finished or time.monotonic() < self._restart_at:
                return None
            self._spawn()
            if self._proc is None:
                return None
        assert self._chunker is not None
        overlong = self._chunker.overlong
        region = self._chunker.next(final=False)
        if region is None and self._eof and not self.keep_running:
            region = self._chunker.next(final=True)  # the tool is done: its last line is complete as it is
        self.stats.lines_skipped_overlong += self._chunker.overlong - overlong
        data = None
        if region is not None:
            data = bytes(self._chunker.buf[region[0]:region[1]])
            data += b"" if data.endswith(b"\n") else b"\n"
            self.stats.bytes_read += len(data)
            self._printed = True
            self._backoff = self.restart_initial_s  # it works again
        elif self._eof:
            self._reap()
        return data

    def _reap(self) -> None:
        assert self._proc is not None and self._chunker is not None
        rc = self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None
        self._chunker.release()
        self._chunker = None
        if not self.keep_running:
            self.finished = True
            return
        self.on_exit(rc, self._printed)
        self.stats.restarts += 1
        self.notes.append(f"{self.argv()[0]} exited with {rc}; restarting in {self._backoff:g}s")
        self._schedule_restart()

    def close(self) -> None:
        if self._proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self._proc.wait(timeout=2.0)
                break
            except subprocess.TimeoutExpired:
                continue
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None
