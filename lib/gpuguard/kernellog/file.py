"""A kernel-only log file in any supported text format (kern.log, a `dmesg` or `journalctl -k` dump).

Cursor: {"kind": "file", "path", "inode", "offset", "head", "head_len"} (gpuguard.kernellog.cursor): only the
bytes after `offset`, which ends at the last complete line judged; a replaced, truncated or rewritten file is read
from the start.
"""

from __future__ import annotations

import time
from typing import Optional

from gpuguard.kernellog.base import Batch, KernelLogSource, StoredCursor
from gpuguard.kernellog.chunks import DEFAULT_CHUNK_SIZE
from gpuguard.kernellog.cursor import FileCursor, decode, encode
from gpuguard.kernellog.filetail import FileTail, Region
from gpuguard.kernellog.scan import DEFAULT_MAX_EVENTS, Accumulator, observation, scan_chunks
from gpuguard.model import KernelLogObservation


class FileSource(KernelLogSource):
    def __init__(self, path: str, *, chunk_size: int = DEFAULT_CHUNK_SIZE, max_events: int = DEFAULT_MAX_EVENTS,
                 poll_interval_s: float = 0.25) -> None:
        super().__init__()
        self.path = path
        self.spec = f"file:{path}"
        self.chunk_size = chunk_size
        self.max_events = max_events
        self.poll_interval_s = poll_interval_s
        self._tail: Optional[FileTail] = None
        self._once = False

    def _new_tail(self) -> FileTail:
        return FileTail(self.path, self.stats, self.notes, chunk_size=self.chunk_size)

    @staticmethod
    def _position(cursor: Optional[StoredCursor]) -> Optional[FileCursor]:
        c = decode(cursor)
        return c if isinstance(c, FileCursor) else None

    # ---------------------------------------------------------------- since a cursor
    def read(self, cursor: Optional[StoredCursor], *, timeout_s: float) -> KernelLogObservation:
        deadline = time.monotonic() + timeout_s
        c = self._position(cursor)
        tail = self._new_tail()
        if not tail.open(c.position if c else None):
            raise FileNotFoundError(2, "No such file or directory", self.path)
        try:
            assert tail.chunker is not None
            r = scan_chunks(tail.chunker, Accumulator(None, self.max_events), deadline=deadline)
            new_cursor = encode(FileCursor(tail.position(r.end_offset)))
        finally:
            tail.close()
        return observation(r, self.spec, new_cursor)

    # ---------------------------------------------------------------- following
    def follow(self, cursor: Optional[StoredCursor], *, start_at: str = "auto", once: bool = False) -> None:
        c = self._position(cursor)
        self._tail = self._new_tail()
        self._once = once
        # a text file spans boots: old lines cannot be told apart, so `auto` starts at its end
        self._tail.open(c.position if c else None, at_end=c is None and start_at in ("end", "auto"))

    def poll(self) -> Optional[Batch]:
        assert self._tail is not None, "follow() first"
        region = self._tail.poll()
        if region is None:
            self.finished = self._once
            return None
        return self._batch(region)

    def _batch(self, region: Region) -> Batch:
        tail = self._tail
        assert tail is not None
        data, consumed = tail.region_bytes(region)
        position = tail.positions()

        def cursor_at(off: int) -> StoredCursor:
            return encode(FileCursor(position(region.offset + min(off, consumed))))

        return Batch(data, cursor_at)

    def close(self) -> None:
        if self._tail is not None:
            self._tail.close()
