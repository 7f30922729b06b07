"""A byte stream as runs of complete lines, read in large chunks into one reusable buffer.

Used by every reader of a text log: the bulk scan (`gpuguard xid scan`), the hooks' read of a file since its
cursor and the watch daemon following it. An incomplete last line is kept at the front of the buffer and
completed by the next read (or, with `final`, handed out as it is); a line longer than MAX_LINE_BYTES is skipped
to its newline, counted in `overlong` (and in `overlong_xid` when it holds the needle), so memory stays bounded
whatever the input.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

from gpuguard.kernellog.formats import MAX_LINE_BYTES, NEEDLE

DEFAULT_CHUNK_SIZE = 1 << 20  # fastest of 128 KiB-16 MiB here: the chunk stays in cache while it is searched
_KEEP = len(NEEDLE) - 1  # bytes kept while skipping an overlong line, to see a needle split by a read

ReadInto = Callable[[memoryview], Optional[int]]
T = TypeVar("T")


def last_in_lines(data: bytes, off: int, value: Callable[[bytes, int, int], Optional[T]]) -> Optional[T]:
    """`value(data, start, end)` of the last line of data[:off] (off: 0 or just past a newline) that has one:
    what a cursor says after a batch's first `off` bytes (the last record's sequence number, journal cursor)."""
    end = off - 1
    while end > 0:
        start = data.rfind(b"\n", 0, end) + 1
        found = value(data, start, end)
        if found is not None:
            return found
        end = start - 1
    return None


class LineChunker:
    """`next()` returns (start, end) of complete lines in `buf`, valid until the next call; `committed` is the
    stream offset just past the last line handed out or skipped (where a cursor may resume)."""

    def __init__(self, read_into: ReadInto, *, offset: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.chunk_size = max(1, chunk_size)
        self.buf = bytearray(self.chunk_size + MAX_LINE_BYTES + len(NEEDLE) + 1)
        self._mv = memoryview(self.buf)
        self._read_into = read_into
        self.committed = offset
        self.bytes_read = 0
        self.overlong = 0
        self.overlong_xid = 0
        self._base = offset  # stream offset of buf[0]
        self._carry = 0  # buf[:carry]: an incomplete line (while skipping: the last _KEEP bytes read)
        self._rest: Optional[tuple[int, int]] = None  # bytes after the lines last handed out
        self._skipping = False
        self._skip_xid = False

    @property
    def read_pos(self) -> int:
        """Stream offset of the next byte to read."""
        if self._rest is not None:
            return self._base + self._rest[1]
        return self._base + self._carry

    def release(self) -> None:
        self._mv.release()

    def next(self, final: bool = False) -> Optional[tuple[int, int]]:
        """The next run of complete lines, or None when the stream has no more (for now). With `final`, the
        data after the last newline counts as a complete last line once the stream ends."""
        self._keep_rest()
        while True:
            n = self._read_into(self._mv[self._carry:self._carry + self.chunk_size]) or 0
            if n <= 0:
                return self._finish() if final else None
            self.bytes_read += n
            end = self._carry + n
            start = self._end_skip(end) if self._skipping else 0
            if start < 0:
                continue  # still inside an overlong line
            last_nl = self.buf.rfind(b"\n", start, end)
            if last_nl >= 0:
                self.committed = self._base + last_nl + 1
                self._rest = (last_nl + 1, end)
                return start, last_nl + 1
            self._rest = (start, end)
            self._keep_rest()

    def _keep_rest(self) -> None:
        """Move the bytes after the last handed-out line to the front of the buffer, or start skipping them."""
        if self._rest is None:
            return
        start, end = self._rest
        self._rest = None
        rest = end - start
        if rest > MAX_LINE_BYTES:
            self._skipping = True
            self._skip_xid = self.buf.find(NEEDLE, start, end) >= 0
            self._keep_tail(end)
            return
        if start:
            self.buf[:rest] = self.buf[start:end]
        self._base += start
        self._carry = rest

    def _keep_tail(self, end: int) -> None:
        tail = min(_KEEP, end)
        self.buf[:tail] = self.buf[end - tail:end]
        self._base += end - tail
        self._carry = tail

    def _end_skip(self, end: int) -> int:
        """Skipping an overlong line: -1 while its newline has not come, else the index just past it."""
        nl = self.buf.find(b"\n", 0, end)
        self._skip_xid = self._skip_xid or self.buf.find(NEEDLE, 0, end if nl < 0 else nl) >= 0
        if nl < 0:
            self._keep_tail(end)
            return -1
        self._count_overlong()
        self.committed = self._base + nl + 1
        return nl + 1

    def _count_overlong(self) -> None:
        self.overlong += 1
        self.overlong_xid += self._skip_xid
        self._skipping = self._skip_xid = False

    def _finish(self) -> Optional[tuple[int, int]]:
        """The stream ended: an unterminated last line is complete as it is."""
        carry, self._carry = self._carry, 0
        if self._skipping:
            self._skip_xid = self._skip_xid or self.buf.find(NEEDLE, 0, carry) >= 0
            self._count_overlong()
            self._base += carry
            self.committed = self._base
            return None
        if not carry:
            return None
        self.committed = self._base + carry
        self._rest = (carry, carry)
        return 0, carry
