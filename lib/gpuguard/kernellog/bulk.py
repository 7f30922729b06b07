"""A whole log file at the C library's speed, for `gpuguard xid scan --file`.

A regular file of at least PARALLEL_MIN_BYTES per part is split at line boundaries across the CPUs this process may
use; each part is scanned by a forked child that maps it (gpuguard.kernellog.mapped: no byte copied, only the lines
holding the needle read by Python; a file of MAPPED_MIN_BYTES or more takes one such child even when it is not
split) and sends its result back through a pipe (marshal: no pickle import). A child that fails, for whatever
reason (a file truncated under its mapping ends it with SIGBUS), costs time only: its part is scanned here again,
read with pread(2). Lines are not counted (counting every newline costs as much as finding the needles); bytes are.
A pipe, a small file, journal JSON, or a caller that may not fork (`workers=1`) is read here with pread(2).
"""

from __future__ import annotations

import marshal
import os
import stat
from typing import Callable, Optional

from gpuguard.kernellog import mapped
from gpuguard.kernellog.scan import DEFAULT_MAX_EVENTS, Accumulator, ScanResult, scan_xid_stream
from gpuguard.model import XidEvent
from gpuguard.util.record import field_names

PARALLEL_MIN_BYTES = 64 << 20  # below this per part, forking costs more than it saves
MAPPED_MIN_BYTES = 16 << 20  # below this, a child and a mapping cost more than the copy they save
MAX_WORKERS = 8


def scan_file(path: str, *, workers: Optional[int] = None, max_events: int = DEFAULT_MAX_EVENTS) -> ScanResult:
    """Every kernel Xid line in the file (any supported format), the last line complete even without its newline.
    `workers`: at most this many processes (default: the CPUs this process may run on; pass 1 from a process that
    runs threads, where forking is unsafe). Raises OSError."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        st = os.fstat(fd)
        json_lines = _looks_like_journal_json(fd, st)
        n = _parts(st, workers)
        mapped_parts = _mappable(st, n, workers, json_lines)
        if n <= 1 and not mapped_parts:
            acc = Accumulator(None, max_events)
            return scan_xid_stream(f.readinto, final=True, acc=acc, count_lines=False, json_lines=json_lines)
        bounds = _split(fd, st.st_size, n)
        if mapped_parts:
            children = [_fork(lambda s=start, e=end: _scan_part_mapped(fd, s, e, max_events)) for start, end in bounds]
            results = []
        else:
            children = [None] + [_fork(lambda s=start, e=end: _scan_part(fd, s, e, max_events, json_lines))
                                 for start, end in bounds[1:]]
            results = [_scan_part(fd, *bounds[0], max_events, json_lines)]
        for (start, end), child in list(zip(bounds, children))[len(results):]:
            results.append(_collect(child) or _scan_part(fd, start, end, max_events, json_lines))
    return _merge(results, max_events)


def _mappable(st: os.stat_result, parts: int, workers: Optional[int], json_lines: bool) -> bool:
    """Whether the parts go to children that map them (gpuguard.kernellog.mapped)."""
    if json_lines or not stat.S_ISREG(st.st_mode) or not hasattr(os, "fork") or workers == 1:
        return False
    return (parts > 1 or st.st_size >= MAPPED_MIN_BYTES) and mapped.available()


def _scan_part_mapped(fd: int, start: int, end: int, max_events: int) -> ScanResult:
    found = mapped.scan_region(fd, start, end, max_events)
    return found if found is not None else _scan_part(fd, start, end, max_events, False)


def _looks_like_journal_json(fd: int, st: os.stat_result) -> bool:
    """`journalctl -o json` output: a MESSAGE may hold the needle as an array of byte values."""
    return stat.S_ISREG(st.st_mode) and os.pread(fd, 1, 0) == b"{"


def _parts(st: os.stat_result, workers: Optional[int]) -> int:
    if not stat.S_ISREG(st.st_mode) or not hasattr(os, "fork"):
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    most = min(workers or cpus, MAX_WORKERS)
    return max(1, min(most, st.st_size // PARALLEL_MIN_BYTES))


def _split(fd: int, size: int, n: int) -> list[tuple[int, int]]:
    """`n` (start, end) parts of the file, each starting at a line start."""
    cuts = [0]
    for i in range(1, n):
        cuts.append(_next_line_start(fd, max(size * i // n, cuts[-1]), size))
    cuts.append(size)
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def _next_line_start(fd: int, pos: int, size: int) -> int:
    """Just past the first newline at or after `pos` (never inside a line: a part that started mid-line could make
    a line's tail look like a kernel message of its own)."""
    while pos < size:
        window = os.pread(fd, 1 << 20, pos)
        if not window:
            break
        nl = window.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(window)
    return size


def _scan_part(fd: int, start: int, end: int, max_events: int, json_lines: bool) -> ScanResult:
    pos = start

    def read_into(mv: memoryview) -> int:
        nonlocal pos
        n = os.preadv(fd, [mv], pos)
        pos += n
        return n

    return scan_xid_stream(read_into, base_offset=start, final=True, acc=Accumulator(None, max_events),
                           count_lines=False, limit=end - start, json_lines=json_lines)


# --------------------------------------------------------------------------- the children


def _fork(scan: Callable[[], ScanResult]) -> Optional[tuple[int, int]]:
    """(pid, read end of the result pipe) of a child running `scan`, or None when no child could be made."""
    try:
        r, w = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the child: never returns, never runs the parent's cleanup
        code = 1
        try:
            os.close(r)
            _write_all(w, _encode(scan()))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.close(fd)


def _collect(child: Optional[tuple[int, int]]) -> Optional[ScanResult]:
    """The child's result, or None when it failed (its part is then scanned again here)."""
    if child is None:
        return None
    pid, r = child
    chunks = []
    try:
        while True:
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return None
    try:
        return _decode(b"".join(chunks))
    except (ValueError, EOFError, TypeError):
        return None


def _encode(r: ScanResult) -> bytes:
    names = field_names(XidEvent)  # dataclasses.astuple's order, without importing dataclasses (and inspect)
    events = [tuple(getattr(e, n) for n in names) for e in r.events]
    return marshal.dumps((events, r.malformed, r.rejected_non_kernel, r.bytes_scanned,
                          r.end_offset, r.events_dropped))


def _decode(data: bytes) -> ScanResult:
    events, malformed, rejected, nbytes, end, dropped = marshal.loads(data)
    return ScanResult(events=[XidEvent(*e) for e in events], malformed=malformed, rejected_non_kernel=rejected,
                      bytes_scanned=nbytes, end_offset=end, events_dropped=dropped)


def _merge(parts: list[ScanResult], max_events: int) -> ScanResult:
    """The parts' results as one scan of the whole file would give them: events in file order, the same cap (an
    event a part dropped was a repeat beyond the cap there, so it is one in the whole file too)."""
    acc = Accumulator(None, max_events)
    r = acc.result
    for p in parts:
        for ev in p.events:
            acc.add_event(ev)
        r.malformed += p.malformed
        r.rejected_non_kernel += p.rejected_non_kernel
        r.bytes_scanned += p.bytes_scanned
        r.events_dropped += p.events_dropped
        r.end_offset = max(r.end_offset, p.end_offset)
    return r

