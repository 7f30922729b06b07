"""Finding the lines that may hold an Xid: C-level substring search, so only those lines are ever decoded.

CPython's own `bytes.find` runs at about 1.8 GB/s on a kernel log for the 9-byte needle `NVRM: Xid` (its last
byte, 'd', is common, so the search stops often). The C library's `memmem` skips on pairs of bytes and runs
about 4x faster on the same data (bench/kernel_log_scan.py), so large buffers are searched with it, called
through ctypes; small ones (a prolog's few new kernel records) keep `bytes.find` and never import ctypes
(~4 ms). Where libc has no memmem, everything uses `bytes.find`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Union

from gpuguard.kernellog.formats import JSON_ARRAY_NEEDLE, NEEDLE

Buffer = Union[bytes, bytearray]
MEMMEM_MIN_BYTES = 256 << 10  # below this, memmem saves less than importing ctypes costs (~4 ms)

_memmem: Any = None  # None: not loaded yet; False: not available


def _load_memmem() -> Any:
    global _memmem
    if _memmem is None:
        try:
            import ctypes  # only for large buffers: see the module docstring

            fn = ctypes.CDLL(None).memmem
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
            _memmem = (fn, ctypes)
        except (ImportError, OSError, AttributeError):
            _memmem = False
    return _memmem


def _address(ctypes: Any, buf: Buffer) -> Optional[tuple[int, Any]]:
    """(address of buf[0], an object keeping that address valid) for a bytes or bytearray object."""
    if isinstance(buf, bytearray):
        if not buf:
            return None
        keep = ctypes.c_char.from_buffer(buf)  # also pins the bytearray's size while it lives
        return ctypes.addressof(keep), keep
    keep = ctypes.c_char_p(bytes(buf))
    return ctypes.cast(keep, ctypes.c_void_p).value, keep


def finder(buf: Buffer, needle: bytes, span: int) -> Callable[[int, int], int]:
    """`find(start, end)`: index of the next `needle` that lies wholly in buf[start:end], or -1; `span`: how many
    bytes will be searched in all (what decides between bytes.find and memmem)."""
    if span < MEMMEM_MIN_BYTES or not _load_memmem():
        return lambda start, end: buf.find(needle, start, end)
    fn, ctypes = _memmem
    addressed = _address(ctypes, buf)
    if addressed is None or addressed[0] is None:
        return lambda start, end: buf.find(needle, start, end)
    base, keep = addressed
    size = len(needle)

    def find(start: int, end: int, keep: Any = keep) -> int:
        start = max(0, start)
        end = min(end, len(buf))
        if end - start < size:
            return -1
        hit = fn(base + start, end - start, needle, size)
        return -1 if not hit else hit - base

    return find


def candidate_lines(buf: Buffer, start: int, end: int, *, json_lines: bool = False) -> Iterator[tuple[int, int]]:
    """(line_start, line_end) of each line of buf[start:end] that holds the needle (`json_lines`: or the needle
    as a journal JSON byte array); line_end is at its newline or at `end`. buf[start:end] must start a line."""
    finders = [finder(buf, n, end - start) for n in ((NEEDLE, JSON_ARRAY_NEEDLE) if json_lines else (NEEDLE,))]
    next_hit = [f(start, end) for f in finders]  # each needle searched once per hit, not once per line
    pos = start
    while True:
        live = [h for h in next_hit if h >= 0]
        if not live:
            return
        hit = min(live)
        line_start = buf.rfind(b"\n", pos, hit) + 1 or pos
        line_end = buf.find(b"\n", hit, end)
        if line_end < 0:
            line_end = end
        yield line_start, line_end
        pos = line_end + 1
        next_hit = [h if h >= pos else (f(pos, end) if pos < end else -1) for f, h in zip(finders, next_hit)]
