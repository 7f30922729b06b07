"""A region of a regular file searched where it lies in the page cache: mapped read-only (mmap(2)) and searched with
the C library's memmem, memchr and memrchr, so that no byte is copied and only the lines holding `NVRM: Xid` are
ever read by Python. For `gpuguard xid scan --file` (gpuguard.kernellog.bulk), in forked children only.

Against reading the region in 1 MiB chunks with pread(2) (gpuguard.kernellog.chunks, which copies every byte and
walks the chunks in Python), this takes about half the CPU time on a 1 GiB kern.log (bench/kernel_log_scan.py).
A file truncated while it is mapped ends the process that reads the mapping with SIGBUS: which is why only a forked
child maps (bulk.py scans a part whose child failed again, by pread, in the parent).

The result is the chunked scan's (tests/unit/test_kernellog_scan.py compares them): a line holding the needle is
parsed, one longer than MAX_LINE_BYTES counts as malformed, the region's last line counts without its newline.
"""

from __future__ import annotations

import mmap
from typing import Any, Optional

from gpuguard.kernellog.formats import MAX_LINE_BYTES, NEEDLE
from gpuguard.kernellog.scan import Accumulator, ScanResult

_libc: Any = None  # None: not loaded yet; False: not available


def available() -> bool:
    """Whether the C library gives mmap, memmem, memchr and memrchr (glibc, musl)."""
    return bool(_load())


def _load() -> Any:
    global _libc
    if _libc is None:
        try:
            import ctypes  # only for a bulk scan (`gpuguard xid scan --file` of a large file)

            libc = ctypes.CDLL(None, use_errno=True)
            sigs = {"mmap": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int, ctypes.c_long]),
                    "munmap": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
                    "memmem": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]),
                    "memchr": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]),
                    "memrchr": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t])}
            for name, (restype, argtypes) in sigs.items():
                fn = getattr(libc, name)
                fn.restype, fn.argtypes = restype, argtypes
            _libc = (libc, ctypes)
        except (ImportError, OSError, AttributeError):
            _libc = False
    return _libc


def scan_region(fd: int, start: int, end: int, max_events: int) -> Optional[ScanResult]:
    """The Xid lines of file bytes [start, end) (`start` at a line start), or None when the region cannot be mapped
    (then read it otherwise)."""
    loaded = _load()
    if not loaded:
        return None
    libc, ctypes = loaded
    acc = Accumulator(None, max_events)
    acc.result.bytes_scanned, acc.result.end_offset = end - start, end
    if end <= start:
        return acc.result
    offset = start - start % mmap.ALLOCATIONGRANULARITY
    length = end - offset
    base = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if not base or base == ctypes.c_void_p(-1).value:  # MAP_FAILED
        return None
    try:
        _scan_mapped(libc, ctypes, base - offset, start, end, acc)
    finally:
        libc.munmap(base, length)
    return acc.result


def _scan_mapped(libc: Any, ctypes: Any, origin: int, start: int, end: int, acc: Accumulator) -> None:
    """`origin + n` is the address of file byte n, for n in [start, end)."""
    pos = start
    while pos < end:
        hit = libc.memmem(origin + pos, end - pos, NEEDLE, len(NEEDLE))
        if not hit:
            return
        at = hit - origin
        newline = libc.memrchr(origin + pos, 0x0A, at - pos) if at > pos else None
        line_start = newline - origin + 1 if newline else pos
        newline = libc.memchr(hit, 0x0A, end - at)
        line_end = newline - origin if newline else end
        if line_end - line_start > MAX_LINE_BYTES:
            acc.result.malformed += 1  # as Accumulator.add_line counts it, without copying the line
        else:
            acc.add_line(ctypes.string_at(origin + line_start, line_end - line_start), 0, line_end - line_start)
        pos = line_end + 1
