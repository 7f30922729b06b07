"""/dev/kmsg, the kernel's ring buffer (the default source), or a regular file of kmsg records (a simulated node's
kernel log: the same records, appended).

Cursor: {"kind": "kmsg", "boot_id", "seq"}: records after `seq` of the same boot; a different boot id, or record
numbers that went backwards (a reboot the boot id did not show), start over. A file of records also keeps the file
position keys ("path", "inode", "offset", "head", "head_len"), used only while the record that ends there is still
record `seq`; otherwise the file is read from its start, skipping records up to `seq`. Cursors written before the
position keys existed (hooks' cursors of a simulated node) are read the same way.
"""

from __future__ import annotations

import bisect
import os
import stat
import time
from typing import Callable, Optional

from gpuguard.kernellog import kmsgdev
from gpuguard.kernellog.base import DEFAULT_BOOT_ID_PATH, Batch, KernelLogSource, StoredCursor, read_boot_id
from gpuguard.kernellog.chunks import last_in_lines
from gpuguard.kernellog.cursor import KmsgCursor, decode, encode, same_boot
from gpuguard.kernellog.filetail import FileTail, Region
from gpuguard.kernellog.scan import DEFAULT_MAX_EVENTS, Accumulator, observation, scan_chunks, scan_lines
from gpuguard.model import KernelLogObservation
from gpuguard.util.lazyre import lazy

_BATCH_RECORDS = 4096  # records per followed batch (the ring buffer holds a few thousand at most)
_EDGE_BYTES = 1 << 16  # how much of a file's head and tail to read for its first and last record numbers
_SEQ_ANY_RE = lazy(rb"(?m)^\d{1,4},(\d{1,20}),\d{1,20}[,;]")


class KmsgSource(KernelLogSource):
    def __init__(self, path: str = "/dev/kmsg", *, boot_id: Optional[str] = None,
                 boot_id_path: str = DEFAULT_BOOT_ID_PATH, max_events: int = DEFAULT_MAX_EVENTS,
                 poll_interval_s: float = 0.25) -> None:
        super().__init__()
        self.path = path
        self.spec = f"kmsg:{path}"
        self.boot_id = boot_id if boot_id is not None else read_boot_id(boot_id_path)
        self.max_events = max_events
        self.poll_interval_s = poll_interval_s
        self._fd = -1
        self._tail: Optional[FileTail] = None
        self._after_seq: Optional[int] = None  # newest record judged (device) / to skip (file)
        self._last_seq: Optional[int] = None  # file: newest record handed out
        self._first_read = True
        self._once = False

    def _cursor_of(self, cursor: Optional[StoredCursor]) -> Optional[KmsgCursor]:
        """The cursor when it is a kmsg one of this boot; a rebooted node's records are numbered from 0 again."""
        c = decode(cursor)
        return c if isinstance(c, KmsgCursor) and same_boot(c.boot_id, self.boot_id) else None

    def _is_file(self) -> bool:
        return stat.S_ISREG(os.stat(self.path).st_mode)

    # ================================================================ since a cursor
    def read(self, cursor: Optional[StoredCursor], *, timeout_s: float) -> KernelLogObservation:
        c = self._cursor_of(cursor)
        deadline = time.monotonic() + timeout_s
        if self._is_file():
            return self._read_file(c, deadline)
        return self._read_device(c.seq if c else None, deadline)

    def _read_device(self, after_seq: Optional[int], deadline: float, *, retried: bool = False) -> KernelLogObservation:
        fd = kmsgdev.open_device(self.path)
        try:
            recs = kmsgdev.read_records(fd, after_seq, deadline=deadline)
        finally:
            os.close(fd)
        if after_seq is not None and recs.max_seen is not None and recs.max_seen < after_seq and not retried:
            # every record is older than the cursor: the numbering restarted (a reboot the boot id did not show,
            # e.g. unreadable boot_id); read everything
            return self._read_device(None, deadline, retried=True)
        acc = Accumulator(None, self.max_events)
        data = b"".join(recs.lines)
        scan_lines(data, 0, len(data), acc)
        acc.result.bytes_scanned = recs.bytes_read
        last = max(recs.seqs) if recs.seqs else after_seq
        obs = observation(acc.result, self.spec, encode(KmsgCursor(self.boot_id, last)))
        if after_seq is not None and recs.first_seq is not None and recs.first_seq > after_seq + 1:
            _incomplete(obs, f"kmsg ring buffer wrapped: records {after_seq + 1}..{recs.first_seq - 1} were "
                             "overwritten before they were read")
        elif recs.lost:
            _incomplete(obs, "kmsg records were overwritten while reading")
        if recs.timed_out:
            _incomplete(obs, f"timed out reading {self.path}")
            obs.status.timed_out = True
        return obs

    def _read_file(self, c: Optional[KmsgCursor], deadline: float) -> KernelLogObservation:
        after_seq = c.seq if c else None
        last_in_file, first_in_file = _file_seq_range(self.path)
        if after_seq is not None and last_in_file is not None and last_in_file < after_seq:
            after_seq = None  # numbering went backwards: a new boot (or a new simulation file)
        tail = FileTail(self.path, self.stats, self.notes)
        if not tail.open(c.position if c and after_seq is not None else None, verify=_ends_with_seq(after_seq)):
            raise FileNotFoundError(2, "No such file or directory", self.path)
        resumed = tail.chunker is not None and tail.chunker.committed > 0
        try:
            assert tail.chunker is not None
            r = scan_chunks(tail.chunker, Accumulator(after_seq, self.max_events), final=True, deadline=deadline)
            last = _seq_before(tail.fd, r.end_offset)
            new_seq = after_seq if r.timed_out or last is None else max(last, after_seq or 0)
            pos = tail.position(r.end_offset)
        finally:
            tail.close()
        obs = observation(r, self.spec, encode(KmsgCursor(self.boot_id, new_seq, pos)))
        if not resumed and after_seq is not None and first_in_file is not None and first_in_file > after_seq + 1:
            _incomplete(obs, f"kmsg records {after_seq + 1}..{first_in_file - 1} are no longer in {self.path}")
        return obs

    # ================================================================ following
    def follow(self, cursor: Optional[StoredCursor], *, start_at: str = "auto", once: bool = False) -> None:
        c = self._cursor_of(cursor)
        self._once = once
        self._after_seq = c.seq if c else None
        at_end = c is None and start_at == "end"
        if self._is_file():
            self._last_seq = self._after_seq
            self._tail = FileTail(self.path, self.stats, self.notes, on_reset=self._file_reset)
            self._tail.open(c.position if c else None, at_end=at_end, verify=_ends_with_seq(self._after_seq))
            return
        self._fd = kmsgdev.open_device(self.path)
        if self._after_seq is None and at_end:
            os.lseek(self._fd, 0, os.SEEK_END)  # /dev/kmsg: SEEK_END = after the newest record

    def wait_fd(self) -> Optional[int]:
        return self._fd if self._fd >= 0 else None

    def poll(self) -> Optional[Batch]:
        batch = self._poll_file() if self._tail is not None else self._poll_device()
        if batch is None:
            self.finished = self._once
        return batch

    def _poll_device(self) -> Optional[Batch]:
        recs = kmsgdev.read_records(self._fd, self._after_seq, max_records=_BATCH_RECORDS)
        self.stats.bytes_read += recs.bytes_read
        if recs.lost:
            self.stats.kmsg_lost += recs.lost
            self.notes.append("kmsg ring buffer overwrote records before they were read")
        if self._first_read:
            self._first_read = False
            if self._after_seq is not None and recs.max_seen is not None and recs.max_seen < self._after_seq \
                    and not recs.lines:
                self.notes.append(f"kmsg sequence restarted below the cursor ({self._after_seq}); reading all")
                self._after_seq = None
                os.lseek(self._fd, 0, os.SEEK_SET)
                return self._poll_device()
        if not recs.lines:
            return None
        base_seq, self._after_seq = self._after_seq, recs.seqs[-1]
        ends = []
        size = 0
        for line in recs.lines:
            size += len(line)
            ends.append(size)
        seqs = recs.seqs

        def cursor_at(off: int) -> StoredCursor:
            i = bisect.bisect_right(ends, off) - 1
            return encode(KmsgCursor(self.boot_id, seqs[i] if i >= 0 else base_seq))

        return Batch(b"".join(recs.lines), cursor_at)

    def _file_reset(self) -> None:
        self._after_seq = None  # a rewritten kmsg file is a new boot's log
        self._last_seq = None

    def _poll_file(self) -> Optional[Batch]:
        assert self._tail is not None
        region = self._tail.poll()
        return None if region is None else self._file_batch(region)

    def _file_batch(self, region: Region) -> Batch:
        tail = self._tail
        assert tail is not None
        data, consumed = tail.region_bytes(region)
        skip, prev_seq, position = self._after_seq, self._last_seq, tail.positions()
        self._last_seq = _last_seq_in(data, len(data)) or prev_seq

        def cursor_at(off: int) -> StoredCursor:
            seq = _last_seq_in(data, off) or prev_seq
            return encode(KmsgCursor(self.boot_id, seq, position(region.offset + min(off, consumed))))

        return Batch(data, cursor_at, skip_seq_upto=skip)

    def close(self) -> None:
        if self._tail is not None:
            self._tail.close()
            self._tail = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# --------------------------------------------------------------------------- a file of records


def _incomplete(obs: KernelLogObservation, error: str) -> None:
    obs.status.complete = False
    obs.status.error = error


def _last_seq_in(data: bytes, off: int) -> Optional[int]:
    """Sequence number of the last record line ending at or before `off` (just past a newline) in `data`."""
    return last_in_lines(data, off, kmsgdev.record_seq)


def _seq_before(fd: int, offset: int) -> Optional[int]:
    """The sequence number of the last record that ends at or before `offset` in the file."""
    start = max(0, offset - _EDGE_BYTES)
    data = os.pread(fd, offset - start, start)
    if start:
        data = data[data.find(b"\n") + 1:]  # the first line may be cut
    return _last_seq_in(data, len(data))


def _ends_with_seq(seq: Optional[int]) -> Callable[[int, int], bool]:
    """A check that a stored position still ends at record `seq` (else the file changed under it)."""
    def verify(fd: int, offset: int) -> bool:
        return seq is not None and _seq_before(fd, offset) == seq

    return verify


def _file_seq_range(path: str) -> tuple[Optional[int], Optional[int]]:
    """(last, first) record sequence numbers in a file of kmsg records, from its tail and head only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = [int(x) for x in _SEQ_ANY_RE.findall(f.read(_EDGE_BYTES))]
        f.seek(max(0, size - _EDGE_BYTES))
        tail = [int(x) for x in _SEQ_ANY_RE.findall(f.read(_EDGE_BYTES))]
    return (tail[-1] if tail else None), (head[0] if head else None)
