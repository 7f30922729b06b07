"""A growing text file read from a stored position, with `tail -F` semantics: the part shared by the file source
and the kmsg source's simulated (file) form.

New complete lines only: a partial last line is held until its newline arrives. Truncation (copytruncate,
`> file`) and rewriting (size below the read position, or the first bytes changed) are read from the start;
rotation (the path names a new inode) is handled by finishing the old file first, its unterminated last line
included. A stored position is used only while it still describes the file (cursor.FilePosition).
"""

from __future__ import annotations

import os
import stat
from typing import Callable, NamedTuple, Optional

from gpuguard.kernellog.base import FollowError, FollowStats
from gpuguard.kernellog.chunks import DEFAULT_CHUNK_SIZE, LineChunker
from gpuguard.kernellog.cursor import HEAD_BYTES, FilePosition, head_digest
from gpuguard.kernellog.formats import MAX_LINE_BYTES

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Region(NamedTuple):
    """Complete lines: chunker.buf[start:end], whose first byte is at `offset` in the file."""

    start: int
    end: int
    offset: int


class FileTail:
    """`open()` then `next_region()` (read to the end once) or `poll()` (follow: also notices truncation, rewriting
    and rotation). `on_reset` is called when the file starts over (its old positions mean nothing now)."""

    def __init__(self, path: str, stats: FollowStats, notes: list[str], *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 on_reset: Optional[Callable[[], None]] = None) -> None:
        self.path = path
        self.stats = stats
        self.notes = notes
        self.chunk_size = chunk_size
        self.on_reset = on_reset
        self.fd = -1
        self.inode: Optional[int] = None
        self.chunker: Optional[LineChunker] = None
        self._dev_ino: Optional[tuple[int, int]] = None
        self._head = b""  # the file's first bytes (up to HEAD_BYTES) as last seen
        self._size_seen = -1
        self._missing_noted = False

    # ---------------------------------------------------------------- opening
    def open(self, position: Optional[FilePosition] = None, *, at_end: bool = False,
             verify: Optional[Callable[[int, int], bool]] = None) -> bool:
        """Open the path at `position` when it still describes the file (and `verify(fd, offset)` agrees), else
        at its end (`at_end`) or start. False when the file does not exist (yet)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError:
            if not self._missing_noted:
                self.notes.append(f"{self.path} does not exist (yet); waiting for it")
                self._missing_noted = True
            return False
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise FollowError(f"{self.path} is not a regular file")
        self.fd, self.inode, self._dev_ino = fd, st.st_ino, (st.st_dev, st.st_ino)
        self._missing_noted = False
        offset = self._resume_offset(position, st, verify)
        if offset is None:
            offset = _last_line_end(fd, st.st_size) if at_end else 0
        self._start_at(offset)
        self._head = os.pread(fd, HEAD_BYTES, 0)
        self._size_seen = st.st_size
        return True

    def _resume_offset(self, pos: Optional[FilePosition], st: os.stat_result,
                       verify: Optional[Callable[[int, int], bool]]) -> Optional[int]:
        if pos is None or pos.path != self.path or pos.inode != st.st_ino or st.st_size < pos.offset:
            return None
        head = os.pread(self.fd, pos.head_len, 0)
        if len(head) != pos.head_len or head_digest(head) != pos.head:
            return None  # rewritten in place since the position was taken
        if verify is not None and not verify(self.fd, pos.offset):
            return None
        return pos.offset

    def _start_at(self, offset: int) -> None:
        os.lseek(self.fd, offset, os.SEEK_SET)
        fd = self.fd
        self.chunker = LineChunker(lambda mv: os.readv(fd, [mv]), offset=offset, chunk_size=self.chunk_size)

    def close(self) -> None:
        if self.chunker is not None:
            self.chunker.release()
            self.chunker = None
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    # ---------------------------------------------------------------- positions
    def position(self, offset: int) -> FilePosition:
        """The stored position for `offset` (just past a complete line) in the open file."""
        return self.positions()(offset)

    def positions(self) -> Callable[[int], FilePosition]:
        """`position` for offsets up to what has been read so far, still right after the file is closed or
        rotated (a batch's cursors are asked for after the next read)."""
        path, inode, head = self.path, self.inode, self._head
        if self.chunker is not None and len(head) < min(HEAD_BYTES, self.chunker.committed) and self.fd >= 0:
            head = os.pread(self.fd, HEAD_BYTES, 0)

        def position(offset: int) -> FilePosition:
            head_len = min(HEAD_BYTES, offset, len(head))
            return FilePosition(path, inode, offset, head_digest(head[:head_len]), head_len)

        return position

    # ---------------------------------------------------------------- reading
    def region_bytes(self, region: Region) -> tuple[bytes, int]:
        """(the region's lines as a batch holds them, how many of those bytes are the file's): a rotated file's
        unterminated last line gets its newline, it is complete now."""
        assert self.chunker is not None
        data = bytes(self.chunker.buf[region.start:region.end])
        return (data, len(data)) if data.endswith(b"\n") else (data + b"\n", len(data))

    def next_region(self, final: bool = False) -> Optional[Region]:
        """The next complete lines of the open file (None: none now)."""
        assert self.chunker is not None
        read_before, overlong_before = self.chunker.bytes_read, self.chunker.overlong
        span = self.chunker.next(final)
        self.stats.bytes_read += self.chunker.bytes_read - read_before
        self.stats.lines_skipped_overlong += self.chunker.overlong - overlong_before
        if span is None:
            return None
        if len(self._head) < HEAD_BYTES and self.chunker.committed > len(self._head):
            self._head = os.pread(self.fd, HEAD_BYTES, 0)
        return Region(span[0], span[1], self.chunker.committed - (span[1] - span[0]))

    def poll(self) -> Optional[Region]:
        """Following: what is new, across truncation, rewriting and rotation."""
        if self.fd < 0 and not self.open():
            return None
        self._check_rewritten()
        region = self.next_region()
        if region is not None:
            return region
        if not self._path_moved():
            return None
        # rotated: whatever was appended to the old file before the rename counts, even a last line without its
        # newline (no more will ever come)
        region = self.next_region(final=True)
        if region is not None:
            return region
        self.stats.rotations += 1
        self.notes.append(f"{self.path} was rotated: following the new file")
        self.close()
        return self.next_region() if self.open() else None

    def _check_rewritten(self) -> None:
        assert self.chunker is not None
        st = os.fstat(self.fd)
        if st.st_size == self._size_seen:
            return
        if st.st_size < self.chunker.read_pos:
            self._restart_from_zero("was truncated")
        elif self._head and os.pread(self.fd, len(self._head), 0) != self._head[:st.st_size]:
            self._restart_from_zero("was rewritten")
        self._head = os.pread(self.fd, HEAD_BYTES, 0)
        self._size_seen = st.st_size

    def _restart_from_zero(self, why: str) -> None:
        self.stats.truncations += 1
        self.notes.append(f"{self.path} {why}: reading it from the start")
        assert self.chunker is not None
        self.chunker.release()
        self._start_at(0)
        self._reset()

    def _reset(self) -> None:
        if self.on_reset is not None:
            self.on_reset()

    def _path_moved(self) -> bool:
        """True when the path now names another file (rotated) or nothing (rotated, not recreated yet)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._dev_ino


def _last_line_end(fd: int, size: int) -> int:
    """Just past the file's last newline: where "only lines written from now on" starts (a trailing partial line
    is the start of the first new one)."""
    tail_start = max(0, size - MAX_LINE_BYTES)
    tail = os.pread(fd, size - tail_start, tail_start)
    nl = tail.rfind(b"\n")
    return tail_start + nl + 1 if nl >= 0 else (0 if tail_start == 0 else size)
