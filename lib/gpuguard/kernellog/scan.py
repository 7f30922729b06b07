"""Scanning kernel-log text for Xid events at the speed of the C library: lines are found with a C-level search
for `NVRM: Xid` (gpuguard.kernellog.find) and only the lines holding it are decoded and parsed (formats).

- `scan_xid_bytes(data)`: a buffer of any supported format.
- `scan_xid_stream(read_into)` / `scan_xid_file(path)`: a stream or file in large chunks (chunks.LineChunker).
- `Accumulator`: the verdicts of many lines, with memory bounded when a GPU floods the log with Xids.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from gpuguard.kernellog.chunks import DEFAULT_CHUNK_SIZE, LineChunker, ReadInto
from gpuguard.kernellog.find import Buffer, candidate_lines
from gpuguard.kernellog.formats import MAX_LINE_BYTES, LineResult, Verdict, parse_kernel_log_line
from gpuguard.model import KernelLogObservation, ProbeStatus, XidEvent
from gpuguard.util.record import Record, field, record

DEFAULT_MAX_EVENTS = 10_000


@record
class ScanResult(Record):
    events: list[XidEvent] = field(default_factory=list)
    lines_scanned: int = 0  # not counted by a bulk scan that was asked not to (counting costs as much as finding)
    malformed: int = 0
    rejected_non_kernel: int = 0
    bytes_scanned: int = 0
    end_offset: int = 0  # just past the last complete line consumed (a file cursor resumes here)
    timed_out: bool = False
    events_dropped: int = 0  # beyond max_events, repeats of an already seen (code, pci) are not kept


class Accumulator:
    """Collects line verdicts. Beyond `max_events` events only a (code, GPU) not seen yet is kept, so a flood of
    one Xid costs bounded memory and every code on every GPU still reaches the check."""

    def __init__(self, after_seq: Optional[int] = None, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.result = ScanResult()
        self.after_seq = after_seq  # kmsg records with seq <= this were reported by an earlier read
        self.max_events = max_events
        self._seen: set[tuple[int, str]] = set()

    def add(self, res: LineResult) -> None:
        if res.verdict == Verdict.OTHER:
            return
        if self.after_seq is not None and res.seq is not None and res.seq <= self.after_seq:
            return
        r = self.result
        if res.verdict == Verdict.MALFORMED:
            r.malformed += 1
        elif res.verdict == Verdict.NON_KERNEL:
            r.rejected_non_kernel += 1
        elif res.event is not None:
            self.add_event(res.event)

    def add_event(self, event: XidEvent) -> None:
        r = self.result
        key = (event.code, event.pci)
        if len(r.events) < self.max_events or key not in self._seen:
            r.events.append(event)
            self._seen.add(key)
        else:
            r.events_dropped += 1

    def add_line(self, data: Buffer, start: int, end: int) -> None:
        if end - start > MAX_LINE_BYTES:
            self.result.malformed += 1
            return
        self.add(parse_kernel_log_line(bytes(data[start:end]).decode("utf-8", errors="replace")))


def scan_lines(buf: Buffer, start: int, end: int, acc: Accumulator, *, count_lines: bool = True,
               json_lines: bool = False) -> None:
    """buf[start:end] holds complete lines only (the last one may lack its newline). Lines are counted in C;
    only lines holding the needle are decoded."""
    if count_lines:
        acc.result.lines_scanned += buf.count(b"\n", start, end) + (end > start and buf[end - 1] != 0x0A)
    for line_start, line_end in candidate_lines(buf, start, end, json_lines=json_lines):
        acc.add_line(buf, line_start, line_end)


def scan_xid_bytes(data: Buffer, *, final: bool = True, chunk_size: Optional[int] = None,
                   after_seq: Optional[int] = None, max_events: int = DEFAULT_MAX_EVENTS,
                   json_lines: bool = False) -> ScanResult:
    """Scan log bytes of any supported format for kernel Xid lines. `final`: a last line without a newline is
    complete. `chunk_size` feeds the data through the chunked stream reader (tests use it to split lines across
    reads). `after_seq`: ignore kmsg records with a sequence number <= it."""
    acc = Accumulator(after_seq, max_events)
    if chunk_size is not None:
        view = memoryview(data)
        pos = 0

        def read_into(mv: memoryview) -> int:
            nonlocal pos
            n = min(len(mv), len(view) - pos)
            mv[:n] = view[pos:pos + n]
            pos += n
            return n

        return scan_xid_stream(read_into, final=final, chunk_size=chunk_size, acc=acc)
    r = acc.result
    r.bytes_scanned = len(data)
    end = len(data) if final else data.rfind(b"\n") + 1
    scan_lines(data, 0, end, acc, json_lines=json_lines)
    r.end_offset = end
    return r


def scan_xid_stream(read_into: ReadInto, *, base_offset: int = 0, final: bool = False,
                    chunk_size: int = DEFAULT_CHUNK_SIZE, acc: Optional[Accumulator] = None,
                    deadline: Optional[float] = None, count_lines: bool = True,
                    limit: Optional[int] = None, json_lines: bool = False) -> ScanResult:
    """Scan a stream in chunks. `deadline` (time.monotonic()) stops between chunks and sets `timed_out`;
    `limit`: stop after this many bytes (a region of a file that starts and ends at line boundaries)."""
    chunker = LineChunker(read_into if limit is None else _bounded(read_into, limit), offset=base_offset,
                          chunk_size=chunk_size)
    try:
        return scan_chunks(chunker, acc or Accumulator(), final=final, deadline=deadline, count_lines=count_lines,
                           json_lines=json_lines)
    finally:
        chunker.release()


def scan_chunks(chunker: LineChunker, acc: Accumulator, *, final: bool = False, deadline: Optional[float] = None,
                count_lines: bool = True, json_lines: bool = False) -> ScanResult:
    """Scan what `chunker` reads until its stream has no more (or `deadline` passes: `timed_out`); `end_offset` is
    where the next read may resume."""
    r = acc.result
    read_before, overlong_before, xid_before = chunker.bytes_read, chunker.overlong, chunker.overlong_xid
    while True:
        if deadline is not None and time.monotonic() > deadline:
            r.timed_out = True
            break
        region = chunker.next(final)
        if region is None:
            break
        scan_lines(chunker.buf, region[0], region[1], acc, count_lines=count_lines, json_lines=json_lines)
    r.bytes_scanned += chunker.bytes_read - read_before
    r.lines_scanned += chunker.overlong - overlong_before if count_lines else 0
    r.malformed += chunker.overlong_xid - xid_before
    r.end_offset = chunker.committed
    return r


def _bounded(read_into: ReadInto, limit: int) -> ReadInto:
    left = limit

    def read(mv: memoryview) -> int:
        nonlocal left
        n = (read_into(mv[:left]) or 0) if left > 0 else 0
        left -= n
        return n

    return read


def scan_xid_file(path: str, start_offset: int = 0, *, chunk_size: int = DEFAULT_CHUNK_SIZE, final: bool = False,
                  after_seq: Optional[int] = None, max_events: int = DEFAULT_MAX_EVENTS,
                  deadline: Optional[float] = None, count_lines: bool = True) -> ScanResult:
    """Scan a log file from `start_offset`. `end_offset` in the result is just past the last complete line, so a
    growing file can be resumed there; with `final` a trailing partial line counts too. Raises OSError."""
    acc = Accumulator(after_seq, max_events)
    with open(path, "rb", buffering=0) as f:
        if start_offset:
            f.seek(start_offset)
        return scan_xid_stream(f.readinto, base_offset=start_offset, final=final, chunk_size=chunk_size, acc=acc,
                               deadline=deadline, count_lines=count_lines)


def observation(result: ScanResult, source: str, cursor: Optional[dict[str, Any]]) -> KernelLogObservation:
    """The probe's observation of a scan (incomplete when it timed out)."""
    status = ProbeStatus()
    if result.events_dropped:
        status.error = f"{result.events_dropped} repeated Xid events (same code and GPU) beyond the cap not kept"
    if result.timed_out:
        status.complete = False
        status.timed_out = True
        status.error = "timed out while scanning the kernel log"
    return KernelLogObservation(status=status, source=source, events=result.events,
                                lines_scanned=result.lines_scanned, malformed=result.malformed,
                                rejected_non_kernel=result.rejected_non_kernel, cursor=cursor)


def scan_text_for_xids(text: Union[str, bytes]) -> KernelLogObservation:
    """Xid events in a log text of any supported format (auto-detected per line); no cursor."""
    data = text.encode("utf-8", errors="replace") if isinstance(text, str) else text
    return observation(scan_xid_bytes(data, final=True), "text", None)
