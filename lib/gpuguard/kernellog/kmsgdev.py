"""Reading /dev/kmsg records: non-blocking, one record per read(2), until EAGAIN.

Each read returns one record, "PRI,SEQ,USEC,FLAGS;message\\n" followed by dictionary lines (" KEY=value"); only the
message line is kept. EPIPE means the next record was overwritten in the ring buffer before it was read (reading
goes on at the oldest one still there). Shared by the kmsg source's read-since-cursor and its follower.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Optional
from gpuguard.util.lazyre import lazy

READ_SIZE = 1 << 16  # /dev/kmsg returns EINVAL when the buffer is smaller than one record
_SEQ_RE = lazy(rb"\d{1,4},(\d{1,20}),")


def record_seq(line: bytes, start: int = 0, end: Optional[int] = None) -> Optional[int]:
    """The sequence number of a kmsg record line, or None."""
    m = _SEQ_RE.match(line, start, len(line) if end is None else end)
    return int(m.group(1)) if m else None


class Records:
    """What one pass over the device returned: message lines (with their newline) of records after `after_seq`."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.seqs: list[int] = []
        self.first_seq: Optional[int] = None  # oldest record still in the ring buffer (the first one read)
        self.max_seen: Optional[int] = None
        self.bytes_read = 0
        self.lost = 0  # EPIPE: records overwritten before they were read
        self.timed_out = False


def open_device(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))


def read_records(fd: int, after_seq: Optional[int], *, max_records: Optional[int] = None,
                 deadline: Optional[float] = None) -> Records:
    """Records readable now (EAGAIN ends the pass), skipping those with seq <= after_seq."""
    out = Records()
    count = 0
    while max_records is None or count < max_records:
        count += 1
        if deadline is not None and count % 256 == 0 and time.monotonic() > deadline:
            out.timed_out = True
            break
        try:
            rec = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return out  # EAGAIN: no more records
        except InterruptedError:
            continue
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
            out.lost += 1
            continue
        if not rec:
            return out
        out.bytes_read += len(rec)
        _take(out, rec, after_seq)
    return out


def _take(out: Records, rec: bytes, after_seq: Optional[int]) -> None:
    seq = record_seq(rec)
    if seq is None or rec.find(b";") < 0:
        return
    if out.first_seq is None:
        out.first_seq = seq
    out.max_seen = seq if out.max_seen is None else max(out.max_seen, seq)
    if after_seq is not None and seq <= after_seq:
        return
    nl = rec.find(b"\n")  # dictionary lines (" KEY=value") follow the message line
    out.lines.append((rec if nl < 0 else rec[:nl]) + b"\n")
    out.seqs.append(seq)
