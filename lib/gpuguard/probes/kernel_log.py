"""NVIDIA Xid events from the kernel log: /dev/kmsg, `journalctl -k`, `dmesg`, or a log file.

The NVIDIA driver reports GPU faults as kernel messages of the form

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

(older drivers print `(0000:3b:00)` without `PCI:`, MIG attributes appear as `(PCI:... GPU-I:05 GPU-CI:00)`,
and a process the driver cannot attribute is `pid='<unknown>', name=<unknown>`). This module turns such lines,
whatever tool printed them, into `XidEvent`s.

Layers:
- pure parsing: `parse_xid_message` (the message text), `parse_kernel_log_line` (one line of any supported
  format, auto-detected per line: raw /dev/kmsg records, `dmesg` plain/`-T`/`--raw`/`-x`/`--time-format iso`,
  `journalctl -k` short/short-iso/short-precise/short-monotonic/short-full/short-unix, `journalctl -o json`,
  syslog files (BSD and RFC 3339 timestamps, with or without the kernel's `[ 1234.5]` inside)).
- fast scanning: `scan_xid_bytes` / `scan_xid_file` jump between occurrences of `NVRM: Xid` with C-level
  searches and only decode the lines that contain one, so a 1 GiB log scans at `grep -c` speed.
- sources with cursors (`KmsgSource`, `JournalSource`, `DmesgSource`, `FileSource`): each read returns only
  what is new since a small JSON-able cursor, and the cursor to store for next time.
- `read_xid_events(spec, cursor, timeout_s=...)`: the probe entry point; never raises.

Security: only kernel messages count. The prolog and health check run as root and drain nodes, so a user must
not be able to drain a node by writing a fake Xid line with `logger`:
- raw /dev/kmsg: the record's facility (PRI >> 3) must be 0. The kernel forces a non-zero facility (LOG_USER)
  on anything written to /dev/kmsg from userspace, even when the writer asks for facility 0 ("<0>...").
- `journalctl -o json`: `_TRANSPORT` must be `kernel` and `SYSLOG_FACILITY`, when present, 0 (journald files
  userspace writes to /dev/kmsg under the kernel transport too, but records their non-zero facility).
- `dmesg --raw`: the `<N>` prefix must be a bare level (0-7); `DmesgSource` also passes `--kernel`.
- syslog / journal short text: the tag must be exactly `kernel`. `logger -t kernel` can still forge that tag
  in a syslog file, which is why the default sources are /dev/kmsg and `journalctl -k` (both only ever return
  kernel-transport records) and why a syslog-format file given to `FileSource` must be a kernel-only file
  (e.g. kern.log written by rsyslog's `kern.*` rule from imklog), never a mixed /var/log/messages.
Lines that fail these rules are counted in `rejected_non_kernel`, never returned. Xid-looking lines that do
not parse are counted in `malformed`. Hostile input (huge lines, NUL bytes, invalid UTF-8) never raises.
"""

from __future__ import annotations

import abc
import datetime as _dt
import hashlib
import io
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from gpuguard.model import KernelLogObservation, ProbeStatus, XidEvent
from gpuguard.tools import ToolRun, run_tool

# --------------------------------------------------------------------------- constants

NEEDLE = b"NVRM: Xid"
_NEEDLE_STR = NEEDLE.decode()
# journalctl -o json prints a MESSAGE holding control or non-UTF-8 bytes as an array of numbers
_JSON_ARRAY_NEEDLE = b"[" + b",".join(str(b).encode() for b in NEEDLE)

# Finding candidate lines: memchr (bytes.find of one byte) runs several times faster than a substring
# search, so the scanner hops between occurrences of the rarest byte of the needle and checks the needle at
# each. Which byte is rarest depends on the log (upper-case 'X' usually, but not in a log full of "XFS"), so
# it is chosen per window from a small sample; when every candidate byte is common, or a window turns out
# denser than its sample, the C substring search (two-way) is used instead.
_ANCHOR_CANDIDATES = tuple(bytes([b]) for b in sorted(set(b"NVRMXid")))
_ANCHOR_MISS_BUDGET = 64
_WINDOW = 4 << 20
_SAMPLE = 16 << 10
_MAX_ANCHOR_DENSITY = 1 / 1024  # above ~1 per KiB, per-hit Python overhead costs more than two-way search

DEFAULT_CHUNK_SIZE = 4 << 20  # measured fastest of 1-16 MiB: small enough to stay in cache between passes
# No kernel record is longer than 8 KiB (journald reads /dev/kmsg with an 8 KiB buffer); a longer line with
# the needle in it cannot be a real Xid, so it is counted as malformed instead of parsed.
MAX_LINE_BYTES = 64 << 10
_MAX_TEXT = 4096  # cap on the detail/raw text kept per event
DEFAULT_MAX_EVENTS = 10_000
_KMSG_READ_SIZE = 1 << 16  # /dev/kmsg returns EINVAL when the buffer is smaller than one record
_HEAD_BYTES = 256
DEFAULT_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

_FACILITIES = (
    "kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7]"
)

# --------------------------------------------------------------------------- parsing: the Xid message

# Format strings in the driver (open-gpu-kernel-modules, kernel_rc_notification.c):
#   "NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, %s"  plus " GPU-I:%02u[ GPU-CI:%02u]" under MIG.
# Older drivers: "NVRM: Xid (%04x:%02x:%02x): %d, %s". Some tools print the function too ("0000:3b:00.0").
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?"
    r"(?P<mig>(?: GPU-C?I:\s?\d{1,3})*)\):\s?(?P<code>\d{1,5})(?P<tail>[,\s].*)?\Z",
    re.S,
)
_PID_RE = re.compile(r"pid=(?P<pid>'[^']*'|<[^>]*>|[^,\s]*)(?:,\s?|\s*\Z)")
_NAME_RE = re.compile(r"name=(?P<name>.*?)(?:,\s?|\Z)", re.S)
_UNKNOWN_VALUES = {"", "<unknown>", "'<unknown>'", "<n/a>", "'n/a'", "n/a", "unknown"}


def _cap(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "..."


def parse_xid_message(
    message: str,
    *,
    raw: Optional[str] = None,
    timestamp: Optional[str] = None,
    monotonic_s: Optional[float] = None,
    seq: Optional[int] = None,
) -> Optional[XidEvent]:
    """Parse a kernel message that starts with `NVRM: Xid (...)`; None when it is not a well-formed Xid."""
    m = _XID_RE.match(message.rstrip())
    if m is None:
        return None
    tail = (m.group("tail") or "").lstrip(", \t")
    pid: Optional[int] = None
    name: Optional[str] = None
    pm = _PID_RE.match(tail)
    if pm:
        value = pm.group("pid")
        if value.isdigit() and len(value) <= 10:
            pid = int(value)
        tail = tail[pm.end():]
        nm = _NAME_RE.match(tail)
        if nm:
            name = nm.group("name").strip()
            if name.lower() in _UNKNOWN_VALUES:
                name = None
            tail = tail[nm.end():]
    return XidEvent(
        code=int(m.group("code")),
        pci=m.group("pci").lower(),
        detail=_cap(tail.strip()),
        pid=pid,
        process_name=_cap(name) if name else None,
        timestamp=timestamp,
        monotonic_s=monotonic_s,
        seq=seq,
        raw=_cap(raw if raw is not None else message.rstrip()),
    )


# --------------------------------------------------------------------------- parsing: one log line


class Verdict:
    """What one line turned out to be (plain strings so results print and compare simply)."""

    XID = "xid"
    MALFORMED = "malformed"  # Xid-looking, from the kernel (or origin unknown), but not parseable
    NON_KERNEL = "non_kernel"  # Xid-looking but written by userspace: never an event
    OTHER = "other"  # no Xid in it


@dataclass(frozen=True)
class LineResult:
    verdict: str
    event: Optional[XidEvent] = None
    fmt: str = ""  # detected format, e.g. "kmsg", "dmesg", "dmesg-ctime", "syslog", "journal-json"
    seq: Optional[int] = None  # kmsg sequence number, when the line has one
    reason: str = ""  # why it was rejected or malformed (for humans and tests)


_KMSG_RE = re.compile(r"(?P<pri>\d{1,4}),(?P<seq>\d{1,20}),(?P<usec>\d{1,20})(?:,[^;\n]*)?;(?P<msg>.*)\Z", re.S)
_DMESG_RAW_RE = re.compile(r"<(?P<pri>\d{1,4})>(?:\[\s*(?P<mono>\d+\.\d+)\]\s?)?(?P<msg>.*)\Z", re.S)
# `dmesg -x`: "kern  :warn  : [ 12.3] msg" (facility and level names padded)
_DMESG_DECODED_RE = re.compile(r"(?P<fac>" + _FACILITIES + r")\s*:(?P<lvl>[a-z]+)\s*: (?P<rest>.*)\Z", re.S)
# `talosctl dmesg`: "10.0.0.1: kern: warning: [2026-04-22T21:27:51.291660856Z]: msg"
_TALOS_RE = re.compile(
    r"(?P<host>\S+): (?P<fac>" + _FACILITIES + r"): (?P<lvl>[a-z]+): \[(?P<ts>[^\]]{1,64})\]: (?P<msg>.*)\Z", re.S
)
_MONO_RE = re.compile(r"\[\s*(?P<mono>\d{1,12}\.\d{1,9})\]\s?")
_CTIME_RE = re.compile(r"\[(?P<ts>[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\]\s?")
_ISO_RE = re.compile(
    r"(?P<ts>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?P<frac>[.,]\d{1,9})?(?:Z|[+-]\d\d(?::?\d\d)?)?)\s+"
)
_FULL_RE = re.compile(r"(?P<ts>[A-Z][a-z]{2} \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,9})? [A-Za-z0-9+:_/-]{1,32})\s+")
_UNIX_RE = re.compile(r"(?P<ts>\d{9,11}\.\d{1,9})\s+")
# month names are locale dependent in journalctl output ("Okt", "sep"), so any short word is accepted
_BSD_RE = re.compile(r"(?P<ts>[^\W\d_]{3,9}\.?\s{1,2}\d{1,2} \d\d:\d\d:\d\d(?:\.\d{1,9})?)\s+")
_TAGGED_RE = re.compile(
    r"(?:(?P<host>[^\s\[\]:]{1,255})\s+)?(?P<tag>[^\s:\[\]]{1,128})(?:\[(?P<pid>\d{1,10})\])?:\s(?P<msg>.*)\Z", re.S
)
# CONFIG_PRINTK_CALLER kernels add "[T1234]" / "[C3]" before the message
_CALLER_RE = re.compile(r"\[\s*[TC]\d{1,10}\]\s?")


def _strip_caller(msg: str) -> str:
    m = _CALLER_RE.match(msg)
    return msg[m.end():] if m else msg


def _xid_or_malformed(
    msg: str, *, raw: str, fmt: str, timestamp: Optional[str], mono: Optional[float], seq: Optional[int] = None
) -> LineResult:
    """A line whose origin is the kernel: an event if the message is a well-formed Xid, else malformed."""
    msg = _strip_caller(msg)
    if _NEEDLE_STR not in msg:
        return LineResult(Verdict.OTHER, fmt=fmt, seq=seq)
    if not msg.startswith(_NEEDLE_STR):
        # The kernel prints some user-controlled text at the start of a message (a 15-char process name in
        # "comm[pid]: segfault ..."), so only a message that *is* an Xid report counts.
        return LineResult(Verdict.MALFORMED, fmt=fmt, seq=seq, reason="Xid text not at message start")
    event = parse_xid_message(msg, raw=raw, timestamp=timestamp, monotonic_s=mono, seq=seq)
    if event is None:
        return LineResult(Verdict.MALFORMED, fmt=fmt, seq=seq, reason="unparseable Xid message")
    return LineResult(Verdict.XID, event=event, fmt=fmt, seq=seq)


def _after_prefix(
    body: str, *, raw: str, fmt: str, timestamp: Optional[str], mono: Optional[float], direct_ok: bool
) -> LineResult:
    """`body` is what follows the timestamp: the kernel message itself (dmesg-like formats, only when
    `direct_ok`) or `[host] tag[pid]: message` (syslog / journal text), where the tag must be `kernel`."""
    if direct_ok and _strip_caller(body).startswith(_NEEDLE_STR):
        return _xid_or_malformed(body, raw=raw, fmt=fmt, timestamp=timestamp, mono=mono)
    m = _TAGGED_RE.match(body)
    if m is None:
        return LineResult(Verdict.MALFORMED, fmt=fmt, reason="unrecognised line structure")
    if m.group("tag") != "kernel" or m.group("pid") is not None:
        return LineResult(Verdict.NON_KERNEL, fmt=fmt, reason=f"tag {m.group('tag')!r} is not 'kernel'")
    msg = m.group("msg")
    mm = _MONO_RE.match(msg)  # syslog from imklog keeps the kernel's own "[ 1234.567890]"
    if mm:
        mono = float(mm.group("mono"))
        msg = msg[mm.end():]
    return _xid_or_malformed(msg, raw=raw, fmt=fmt, timestamp=timestamp, mono=mono)


def _usec_text(usec: int) -> str:
    return f"{usec // 1_000_000}.{usec % 1_000_000:06d}"


def _parse_journal_json(line: str) -> LineResult:
    fmt = "journal-json"
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return LineResult(Verdict.MALFORMED, fmt=fmt, reason="invalid JSON")
    if not isinstance(obj, dict):
        return LineResult(Verdict.MALFORMED, fmt=fmt, reason="JSON is not an object")
    message = obj.get("MESSAGE")
    if isinstance(message, list):
        if not all(isinstance(b, int) and 0 <= b <= 255 for b in message):
            return LineResult(Verdict.MALFORMED, fmt=fmt, reason="MESSAGE array is not bytes")
        message = bytes(message).decode("utf-8", errors="replace")
    if not isinstance(message, str):
        return LineResult(Verdict.MALFORMED, fmt=fmt, reason="no MESSAGE")
    if _NEEDLE_STR not in message:
        return LineResult(Verdict.OTHER, fmt=fmt)
    if obj.get("_TRANSPORT") != "kernel":
        return LineResult(Verdict.NON_KERNEL, fmt=fmt, reason=f"_TRANSPORT={obj.get('_TRANSPORT')!r}")
    facility = obj.get("SYSLOG_FACILITY")
    if facility is not None and str(facility) != "0":
        return LineResult(Verdict.NON_KERNEL, fmt=fmt, reason=f"SYSLOG_FACILITY={facility!r}")
    timestamp: Optional[str] = None
    realtime = str(obj.get("__REALTIME_TIMESTAMP", ""))
    if realtime.isdigit() and len(realtime) <= 20:
        try:
            when = _dt.datetime.fromtimestamp(int(realtime) / 1e6, tz=_dt.timezone.utc)
            timestamp = when.isoformat()
        except (OverflowError, OSError, ValueError):
            timestamp = None
    mono: Optional[float] = None
    # journald stores the kernel's own timestamp of a kmsg record as _SOURCE_MONOTONIC_TIMESTAMP
    for key in ("_SOURCE_MONOTONIC_TIMESTAMP", "__MONOTONIC_TIMESTAMP"):
        value = str(obj.get(key, ""))
        if value.isdigit() and len(value) <= 20 and int(value) > 0:
            mono = int(value) / 1e6
            break
    return _xid_or_malformed(message, raw=line, fmt=fmt, timestamp=timestamp, mono=mono)


def parse_kernel_log_line(line: str) -> LineResult:
    """Classify one log line of any supported format (auto-detected) and parse the Xid in it, if any."""
    s = line.rstrip("\r\n")
    if s.startswith("{"):
        return _parse_journal_json(s)
    if _NEEDLE_STR not in s:
        return LineResult(Verdict.OTHER)
    if s[:1] in (" ", "\t"):
        # kmsg dictionary lines (" DEVICE=+pci:...") and dmesg continuation lines of multi-line records
        # have no origin of their own; the driver prints every Xid on a single line
        return LineResult(Verdict.MALFORMED, fmt="continuation", reason="indented continuation line")

    m = _KMSG_RE.match(s)
    if m:
        seq = int(m.group("seq"))
        if int(m.group("pri")) >> 3 != 0:
            return LineResult(Verdict.NON_KERNEL, fmt="kmsg", seq=seq, reason=f"facility {int(m.group('pri')) >> 3}")
        usec = int(m.group("usec"))
        return _xid_or_malformed(
            m.group("msg"), raw=s, fmt="kmsg", timestamp=_usec_text(usec), mono=usec / 1e6, seq=seq
        )

    m = _DMESG_RAW_RE.match(s)
    if m:
        # util-linux prints LOG_MAKEPRI(facility, level) without shifting the facility, so the prefix of a
        # userspace record is ambiguous; DmesgSource therefore also asks dmesg for --kernel records only.
        if int(m.group("pri")) > 7:
            return LineResult(Verdict.NON_KERNEL, fmt="dmesg-raw", reason=f"priority {m.group('pri')}")
        mono = float(m.group("mono")) if m.group("mono") else None
        return _xid_or_malformed(m.group("msg"), raw=s, fmt="dmesg-raw", timestamp=m.group("mono"), mono=mono)

    m = _TALOS_RE.match(s)
    if m:
        if m.group("fac") != "kern":
            return LineResult(Verdict.NON_KERNEL, fmt="talos", reason=f"facility {m.group('fac')}")
        return _xid_or_malformed(m.group("msg"), raw=s, fmt="talos", timestamp=m.group("ts"), mono=None)

    m = _DMESG_DECODED_RE.match(s)
    if m:
        if m.group("fac") != "kern":
            return LineResult(Verdict.NON_KERNEL, fmt="dmesg-decoded", reason=f"facility {m.group('fac')}")
        s_body = m.group("rest")
        fmt = "dmesg-decoded"
    else:
        s_body = s
        fmt = ""

    # timestamps that only dmesg-like tools print: the message may follow directly
    m = _MONO_RE.match(s_body)
    if m:
        return _after_prefix(
            s_body[m.end():], raw=s, fmt=fmt or "dmesg", timestamp=m.group("mono"),
            mono=float(m.group("mono")), direct_ok=True,
        )
    m = _CTIME_RE.match(s_body)
    if m:
        return _after_prefix(
            s_body[m.end():], raw=s, fmt=fmt or "dmesg-ctime", timestamp=m.group("ts"), mono=None, direct_ok=True
        )
    m = _ISO_RE.match(s_body)
    if m:
        # `dmesg --time-format iso` writes a comma before the fraction ("10:11:12,123456+00:00"); journalctl
        # short-iso and rsyslog RFC 3339 timestamps are followed by host and tag, which must be checked
        dmesg_iso = bool(m.group("frac")) and m.group("frac").startswith(",")
        return _after_prefix(
            s_body[m.end():], raw=s, fmt=fmt or ("dmesg-iso" if dmesg_iso else "syslog-iso"),
            timestamp=m.group("ts"), mono=None, direct_ok=dmesg_iso or bool(fmt),
        )
    if fmt:  # dmesg -x without a timestamp
        return _after_prefix(s_body, raw=s, fmt=fmt, timestamp=None, mono=None, direct_ok=True)
    for regex, name in ((_FULL_RE, "journal-full"), (_UNIX_RE, "journal-unix"), (_BSD_RE, "syslog")):
        m = regex.match(s_body)
        if m:
            return _after_prefix(
                s_body[m.end():], raw=s, fmt=name, timestamp=m.group("ts"), mono=None, direct_ok=False
            )
    # no timestamp at all: `journalctl -k -o cat`, `dmesg -t`, or "kernel: NVRM: ..." excerpts
    return _after_prefix(s_body, raw=s, fmt="bare", timestamp=None, mono=None, direct_ok=True)


def parse_xid_line(line: str) -> Optional[XidEvent]:
    """The Xid event on one log line, or None (no Xid, malformed, or not from the kernel)."""
    return parse_kernel_log_line(line).event


# --------------------------------------------------------------------------- fast scanning


@dataclass
class ScanResult:
    events: list[XidEvent] = field(default_factory=list)
    lines_scanned: int = 0
    malformed: int = 0
    rejected_non_kernel: int = 0
    bytes_scanned: int = 0
    # offset just past the last complete line consumed (a file cursor resumes here)
    end_offset: int = 0
    timed_out: bool = False
    events_dropped: int = 0  # beyond max_events, repeats of an already seen (code, pci) are not kept


class _Accumulator:
    """Collects line verdicts; keeps memory bounded when a GPU floods the log with Xids."""

    def __init__(self, after_seq: Optional[int], max_events: int) -> None:
        self.result = ScanResult()
        self.after_seq = after_seq
        self.max_events = max_events
        self._seen: set[tuple[int, str]] = set()

    def add(self, res: LineResult) -> None:
        if res.verdict == Verdict.OTHER:
            return
        if self.after_seq is not None and res.seq is not None and res.seq <= self.after_seq:
            return  # already reported by an earlier read
        r = self.result
        if res.verdict == Verdict.MALFORMED:
            r.malformed += 1
        elif res.verdict == Verdict.NON_KERNEL:
            r.rejected_non_kernel += 1
        elif res.event is not None:
            key = (res.event.code, res.event.pci)
            if len(r.events) < self.max_events or key not in self._seen:
                r.events.append(res.event)
                self._seen.add(key)
            else:
                r.events_dropped += 1

    def add_line_bytes(self, data: Union[bytes, bytearray, memoryview], start: int, end: int) -> None:
        if end - start > MAX_LINE_BYTES:
            self.result.malformed += 1
            return
        line = bytes(data[start:end]).decode("utf-8", errors="replace")
        self.add(parse_kernel_log_line(line))


_Buf = Union[bytes, bytearray]


def _choose_anchor(buf: _Buf, start: int, end: int) -> Optional[bytes]:
    """The needle byte rarest in a sample of buf[start:end], or None when all are too common to hop on."""
    mid = start + max(0, (end - start - _SAMPLE) // 2)
    s_end = min(end, mid + _SAMPLE)
    if s_end - mid < 1024:
        return None  # too little data to be worth sampling
    best, best_count = None, None
    for cand in _ANCHOR_CANDIDATES:
        c = buf.count(cand, mid, s_end)
        if best_count is None or c < best_count:
            best, best_count = cand, c
    if best_count is not None and best_count <= (s_end - mid) * _MAX_ANCHOR_DENSITY:
        return best
    return None


def _find_needle(buf: _Buf, pos: int, end: int, anchor: Optional[bytes]) -> int:
    """Index of the next NEEDLE starting in buf[pos:end] (and ending by `end`), or -1."""
    if anchor is None:
        return buf.find(NEEDLE, pos, end)
    offset = NEEDLE.index(anchor)
    p = pos + offset
    misses = 0
    # hopping stays cheaper than the substring search up to about _MAX_ANCHOR_DENSITY misses per byte
    budget = max(_ANCHOR_MISS_BUDGET, int((end - pos) * _MAX_ANCHOR_DENSITY))
    while True:
        a = buf.find(anchor, p, end)
        if a < 0:
            return -1
        s = a - offset
        if buf.startswith(NEEDLE, s, end):
            return s
        misses += 1
        if misses > budget:
            # denser than sampled: every needle starting at or before s had its anchor checked already
            return buf.find(NEEDLE, max(pos, s + 1), end)
        p = a + 1


def _scan_complete_lines(buf: _Buf, start: int, end: int, acc: _Accumulator) -> None:
    """buf[start:end] holds complete lines only (start is a line start, end is just past a newline or the
    end of the data). Lines are counted in C; only lines containing the needle are decoded."""
    acc.result.lines_scanned += buf.count(b"\n", start, end)
    pos = start
    win_end = start  # the anchor choice holds for buf[..win_end]
    anchor: Optional[bytes] = None
    while pos < end:
        if pos >= win_end:
            win_end = min(end, pos + _WINDOW)
            anchor = _choose_anchor(buf, pos, win_end)
        # a needle starting before win_end may end after it
        hit = _find_needle(buf, pos, min(end, win_end + len(NEEDLE) - 1), anchor)
        if hit < 0:
            pos = win_end
            continue
        nl = buf.rfind(b"\n", pos, hit)
        line_start = nl + 1 if nl >= 0 else pos
        line_end = buf.find(b"\n", hit, end)
        if line_end < 0:
            line_end = end
        acc.add_line_bytes(buf, line_start, line_end)
        pos = line_end + 1


def _scan_stream(
    readinto: Callable[[memoryview], Optional[int]],
    *,
    base_offset: int,
    chunk_size: int,
    final: bool,
    acc: _Accumulator,
    deadline: Optional[float],
) -> None:
    """Scan a stream in fixed chunks read into one reusable buffer. An incomplete last line is carried to
    the front of the buffer and completed by the next read; a line longer than MAX_LINE_BYTES is skipped
    to its end (counted, and counted malformed if it holds the needle) so memory stays bounded."""
    chunk_size = max(1, chunk_size)
    keep = len(NEEDLE) - 1  # bytes kept while skipping an overlong line, to see a needle split by a read
    buf = bytearray(chunk_size + MAX_LINE_BYTES + len(NEEDLE) + 1)
    mv = memoryview(buf)
    r = acc.result
    carry = 0  # buf[:carry] is the start of an incomplete line (or, when skipping, its last `keep` bytes)
    buf_offset = base_offset  # stream offset of buf[0]
    committed = base_offset  # stream offset just past the last complete line
    skipping = False
    skip_has_needle = False
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                r.timed_out = True
                break
            n = readinto(mv[carry:carry + chunk_size]) or 0
            if n <= 0:
                break
            r.bytes_scanned += n
            end = carry + n
            start = 0
            if skipping:
                nl = buf.find(b"\n", 0, end)
                if nl < 0:
                    skip_has_needle = skip_has_needle or buf.find(NEEDLE, 0, end) >= 0
                    tail = min(keep, end)
                    buf[:tail] = buf[end - tail:end]
                    buf_offset += end - tail
                    carry = tail
                    continue
                skip_has_needle = skip_has_needle or buf.find(NEEDLE, 0, nl) >= 0
                r.lines_scanned += 1
                if skip_has_needle:
                    r.malformed += 1
                skipping = False
                skip_has_needle = False
                start = nl + 1
                committed = buf_offset + start
            last_nl = buf.rfind(b"\n", start, end)
            if last_nl >= 0:
                _scan_complete_lines(buf, start, last_nl + 1, acc)
                committed = buf_offset + last_nl + 1
                start = last_nl + 1
            rest = end - start
            if rest > MAX_LINE_BYTES:
                skipping = True
                skip_has_needle = buf.find(NEEDLE, start, end) >= 0
                tail = min(keep, rest)
                buf[:tail] = buf[end - tail:end]
                buf_offset += end - tail
                carry = tail
            else:
                if start:
                    buf[:rest] = buf[start:end]
                buf_offset += start
                carry = rest
        if final and not r.timed_out and carry:
            # the data ended without a newline: the last line is complete as it is
            if skipping:
                r.lines_scanned += 1
                if skip_has_needle or buf.find(NEEDLE, 0, carry) >= 0:
                    r.malformed += 1
            else:
                r.lines_scanned += 1
                if buf.find(NEEDLE, 0, carry) >= 0:
                    acc.add_line_bytes(buf, 0, carry)
            committed = buf_offset + carry
    finally:
        mv.release()
    r.end_offset = committed


def scan_xid_bytes(
    data: Union[bytes, bytearray],
    *,
    final: bool = True,
    chunk_size: Optional[int] = None,
    after_seq: Optional[int] = None,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> ScanResult:
    """Scan log bytes of any supported format for kernel Xid lines. `final`: a last line without a newline
    is complete. `chunk_size` feeds the data through the chunked file path (tests use it to split lines
    across reads). `after_seq`: ignore kmsg records with a sequence number <= it."""
    acc = _Accumulator(after_seq, max_events)
    if chunk_size is not None:
        stream = io.BytesIO(data)
        _scan_stream(stream.readinto, base_offset=0, chunk_size=chunk_size, final=final, acc=acc, deadline=None)
        return acc.result
    r = acc.result
    r.bytes_scanned = len(data)
    last_nl = data.rfind(b"\n")
    _scan_complete_lines(data, 0, last_nl + 1, acc)
    r.end_offset = last_nl + 1
    if final and last_nl + 1 < len(data):
        r.lines_scanned += 1
        if data.find(NEEDLE, last_nl + 1) >= 0:
            acc.add_line_bytes(data, last_nl + 1, len(data))
        r.end_offset = len(data)
    return r


def scan_xid_file(
    path: str,
    start_offset: int = 0,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    final: bool = False,
    after_seq: Optional[int] = None,
    max_events: int = DEFAULT_MAX_EVENTS,
    deadline: Optional[float] = None,
) -> ScanResult:
    """Scan a log file from `start_offset` in large chunks. `end_offset` in the result is just past the last
    complete line, so a growing file can be resumed there; with `final` a trailing partial line counts too.
    `deadline` (time.monotonic()) stops between chunks and sets `timed_out`. Raises OSError."""
    acc = _Accumulator(after_seq, max_events)
    with open(path, "rb", buffering=0) as f:
        if start_offset:
            f.seek(start_offset)
        _scan_stream(
            f.readinto, base_offset=start_offset, chunk_size=chunk_size, final=final, acc=acc, deadline=deadline
        )
    return acc.result


def _observation(result: ScanResult, source: str, cursor: Optional[dict[str, Any]]) -> KernelLogObservation:
    status = ProbeStatus()
    if result.events_dropped:
        status.error = f"{result.events_dropped} repeated Xid events (same code and GPU) beyond the cap not kept"
    if result.timed_out:
        status.complete = False
        status.timed_out = True
        status.error = "timed out while scanning the kernel log"
    return KernelLogObservation(
        status=status,
        source=source,
        events=result.events,
        lines_scanned=result.lines_scanned,
        malformed=result.malformed,
        rejected_non_kernel=result.rejected_non_kernel,
        cursor=cursor,
    )


def scan_text_for_xids(text: Union[str, bytes]) -> KernelLogObservation:
    """Xid events in a log text of any supported format (format auto-detected per line); for
    `gpuguard xid scan --file`. No cursor: the whole text is scanned."""
    data = text.encode("utf-8", errors="replace") if isinstance(text, str) else text
    return _observation(scan_xid_bytes(data, final=True), "text", None)


# --------------------------------------------------------------------------- helpers for sources


def read_boot_id(path: str = DEFAULT_BOOT_ID_PATH) -> Optional[str]:
    """The current boot id (a UUID string), or None when unreadable."""
    try:
        with open(path, "rb") as f:
            value = f.read(128).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return value if 0 < len(value) <= 64 else None


def _run_tool(argv: list[str], timeout_s: float) -> ToolRun:
    """The shared tool runner, with stable unlocalised output and no pager."""
    env = dict(os.environ)
    env["LC_ALL"] = "C"
    env.pop("SYSTEMD_PAGER", None)
    return run_tool(argv, timeout_s, env=env)


def _stderr_text(run: ToolRun) -> str:
    text = run.stderr.decode("utf-8", errors="replace").strip().splitlines()
    return text[-1][:300] if text else ""


def _cursor_of(cursor: Optional[dict[str, Any]], kind: str) -> Optional[dict[str, Any]]:
    """The cursor if it belongs to this kind of source; a stale or foreign cursor means 'from the start'."""
    if isinstance(cursor, dict) and cursor.get("kind") == kind:
        return cursor
    return None


def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


# --------------------------------------------------------------------------- sources


class KernelLogSource(abc.ABC):
    """One place to read the kernel log from, resumable with a cursor."""

    spec: str = ""

    @abc.abstractmethod
    def read(self, cursor: Optional[dict[str, Any]], *, timeout_s: float) -> KernelLogObservation:
        """Events newer than `cursor` (all when None) and the cursor to pass next time. May raise OSError;
        `read_xid_events` turns exceptions into an incomplete observation."""


class KmsgSource(KernelLogSource):
    """/dev/kmsg (one record per read, non-blocking until EAGAIN), or a regular file of kmsg records for
    simulation. Cursor: {"kind": "kmsg", "boot_id", "seq"}; a different boot starts from the beginning."""

    def __init__(
        self,
        path: str = "/dev/kmsg",
        *,
        boot_id: Optional[str] = None,
        boot_id_path: str = DEFAULT_BOOT_ID_PATH,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        self.path = path
        self.spec = f"kmsg:{path}"
        self.boot_id = boot_id if boot_id is not None else read_boot_id(boot_id_path)
        self.max_events = max_events

    def _after_seq(self, cursor: Optional[dict[str, Any]]) -> Optional[int]:
        c = _cursor_of(cursor, "kmsg")
        if c is None:
            return None
        if c.get("boot_id") is not None and self.boot_id is not None and c.get("boot_id") != self.boot_id:
            return None  # rebooted: sequence numbers start again at 0
        return _int_or_none(c.get("seq"))

    def read(self, cursor: Optional[dict[str, Any]], *, timeout_s: float) -> KernelLogObservation:
        after_seq = self._after_seq(cursor)
        deadline = time.monotonic() + timeout_s
        st = os.stat(self.path)
        if stat.S_ISREG(st.st_mode):
            return self._read_file(after_seq, deadline)
        return self._read_device(after_seq, deadline)

    def _new_cursor(self, seq: Optional[int]) -> dict[str, Any]:
        return {"kind": "kmsg", "boot_id": self.boot_id, "seq": seq}

    def _read_device(self, after_seq: Optional[int], deadline: float, *, retried: bool = False) -> KernelLogObservation:
        acc = _Accumulator(after_seq, self.max_events)
        r = acc.result
        last_seq = after_seq  # newest record reported (the new cursor)
        first_seq: Optional[int] = None  # oldest record still in the ring buffer
        max_seen: Optional[int] = None
        overwritten = False
        timed_out = False
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            count = 0
            while True:
                count += 1
                if count % 256 == 0 and time.monotonic() > deadline:
                    timed_out = True
                    break
                try:
                    rec = os.read(fd, _KMSG_READ_SIZE)
                except BlockingIOError:
                    break  # EAGAIN: no more records
                except InterruptedError:
                    continue
                except BrokenPipeError:
                    # EPIPE: the record we were about to read was overwritten; the next read goes on from the
                    # oldest one still there
                    overwritten = True
                    continue
                if not rec:
                    break
                header_end = rec.find(b";")
                header = rec[:header_end].split(b",", 3) if header_end > 0 else []
                if len(header) < 3 or not header[1].isdigit():
                    continue
                seq = int(header[1])
                if first_seq is None:
                    first_seq = seq
                max_seen = seq if max_seen is None else max(max_seen, seq)
                if after_seq is not None and seq <= after_seq:
                    continue
                last_seq = seq if last_seq is None else max(last_seq, seq)
                nl = rec.find(b"\n")  # dictionary lines (" KEY=value") follow the message line
                line_end = nl if nl >= 0 else len(rec)
                r.lines_scanned += 1
                r.bytes_scanned += len(rec)
                if rec.find(NEEDLE, 0, line_end) >= 0:
                    acc.add_line_bytes(rec, 0, line_end)
        finally:
            os.close(fd)
        if after_seq is not None and max_seen is not None and max_seen < after_seq and not retried:
            # every sequence number is below the cursor: the numbering restarted (a reboot the boot id did not
            # show, e.g. unreadable boot_id); read everything
            return self._read_device(None, deadline, retried=True)
        obs = _observation(r, self.spec, self._new_cursor(last_seq))
        if after_seq is not None and first_seq is not None and first_seq > after_seq + 1:
            obs.status.complete = False
            obs.status.error = (
                f"kmsg ring buffer wrapped: records {after_seq + 1}..{first_seq - 1} were overwritten before "
                "they were read"
            )
        elif overwritten:
            obs.status.complete = False
            obs.status.error = "kmsg records were overwritten while reading"
        if timed_out:
            obs.status.complete = False
            obs.status.timed_out = True
            obs.status.error = f"timed out reading {self.path}"
        return obs

    def _read_file(self, after_seq: Optional[int], deadline: float) -> KernelLogObservation:
        last_seq, first_seq = _kmsg_file_seq_range(self.path)
        if after_seq is not None and last_seq is not None and last_seq < after_seq:
            after_seq = None  # sequence went backwards: a new boot (or a new simulation file)
        result = scan_xid_file(
            self.path, 0, final=True, after_seq=after_seq, max_events=self.max_events, deadline=deadline
        )
        new_seq = after_seq if last_seq is None else max(last_seq, after_seq or 0)
        if result.timed_out:
            new_seq = after_seq  # did not get through the file: read it again next time
        obs = _observation(result, self.spec, self._new_cursor(new_seq))
        if after_seq is not None and first_seq is not None and first_seq > after_seq + 1:
            obs.status.complete = False
            obs.status.error = f"kmsg records {after_seq + 1}..{first_seq - 1} are no longer in {self.path}"
        return obs


def _kmsg_file_seq_range(path: str) -> tuple[Optional[int], Optional[int]]:
    """(last, first) record sequence numbers in a file of kmsg records, from its tail and head only."""
    def seqs(chunk: bytes) -> list[int]:
        found = []
        for line in chunk.split(b"\n"):
            m = re.match(rb"\d{1,4},(\d{1,20}),\d{1,20}[,;]", line)
            if m:
                found.append(int(m.group(1)))
        return found

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = seqs(f.read(1 << 16))
        f.seek(max(0, size - (1 << 16)))
        tail = seqs(f.read(1 << 16))
    return (tail[-1] if tail else None), (head[0] if head else None)


class JournalSource(KernelLogSource):
    """`journalctl -k -o json`; with a cursor, only entries after it. Cursor: {"kind": "journal",
    "cursor": __CURSOR of the last entry, "boot_id"}."""

    def __init__(
        self,
        journalctl: str = "journalctl",
        *,
        boot_id: Optional[str] = None,
        boot_id_path: str = DEFAULT_BOOT_ID_PATH,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        self.journalctl = journalctl
        self.spec = "journal" if journalctl == "journalctl" else f"journal:{journalctl}"
        self.boot_id = boot_id if boot_id is not None else read_boot_id(boot_id_path)
        self.max_events = max_events

    def argv(self, journal_cursor: Optional[str]) -> list[str]:
        # -k already limits to _TRANSPORT=kernel of the current boot; --all keeps long fields (null otherwise)
        base = [self.journalctl, "-k", "-o", "json", "--no-pager", "--all"]
        return base + ([f"--after-cursor={journal_cursor}"] if journal_cursor else ["-b"])

    def read(self, cursor: Optional[dict[str, Any]], *, timeout_s: float) -> KernelLogObservation:
        c = _cursor_of(cursor, "journal")
        journal_cursor = c.get("cursor") if c else None
        if not isinstance(journal_cursor, str) or not (0 < len(journal_cursor) <= 1024) or "\n" in journal_cursor:
            journal_cursor = None
        if c and c.get("boot_id") is not None and self.boot_id is not None and c.get("boot_id") != self.boot_id:
            journal_cursor = None
        deadline = time.monotonic() + timeout_s
        run = _run_tool(self.argv(journal_cursor), timeout_s)
        if journal_cursor and not run.timed_out and run.rc not in (0, None) and not run.stdout.strip():
            # e.g. "Failed to seek to cursor" after the journal was vacuumed: read this boot from its start
            run = _run_tool(self.argv(None), max(0.001, deadline - time.monotonic()))
            journal_cursor = None
        if run.rc is None and not run.timed_out:
            return KernelLogObservation(
                status=ProbeStatus(complete=False, error=run.error), source=self.spec, cursor=cursor
            )
        obs = self.parse_output(run.stdout, previous_cursor=journal_cursor)
        if run.timed_out:
            obs.status.complete = False
            obs.status.timed_out = True
            obs.status.error = run.error
        elif run.rc != 0:
            obs.status.complete = False
            obs.status.error = f"journalctl exited {run.rc}: {_stderr_text(run)}"
        return obs

    def parse_output(self, stdout: bytes, *, previous_cursor: Optional[str] = None) -> KernelLogObservation:
        """Pure: Xid events and the new cursor from `journalctl -o json` output (one object per line)."""
        acc = _Accumulator(None, self.max_events)
        r = acc.result
        last_cursor = previous_cursor
        boot_id = self.boot_id
        lines = stdout.split(b"\n")
        if lines and lines[-1] and not stdout.endswith(b"\n"):
            lines = lines[:-1]  # cut off mid-line (killed at the timeout): not a complete entry
        for raw_line in lines:
            if not raw_line.startswith(b"{"):
                continue
            r.lines_scanned += 1
            r.bytes_scanned += len(raw_line) + 1
            if NEEDLE in raw_line or _JSON_ARRAY_NEEDLE in raw_line:
                acc.add_line_bytes(raw_line, 0, len(raw_line))
        for raw_line in reversed(lines):  # the cursor of the last complete entry
            if raw_line.startswith(b"{"):
                try:
                    obj = json.loads(raw_line.decode("utf-8", errors="replace"))
                except ValueError:
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("__CURSOR"), str):
                    last_cursor = obj["__CURSOR"]
                    if isinstance(obj.get("_BOOT_ID"), str) and boot_id is None:
                        boot_id = obj["_BOOT_ID"]
                    break
        new_cursor = {"kind": "journal", "cursor": last_cursor, "boot_id": boot_id}
        return _observation(r, self.spec, new_cursor)


_DMESG_TS_RE = re.compile(rb"<\d{1,4}>\[\s*(\d+\.\d+)\]")


class DmesgSource(KernelLogSource):
    """`dmesg --kernel --raw`: `<level>[seconds] message`, kernel-facility records only. util-linux prints
    LOG_MAKEPRI(facility, level) with an unshifted facility, so the prefix cannot tell a userspace record
    from a kernel one; `--kernel` makes dmesg itself filter on the facility it read from /dev/kmsg.
    Cursor: {"kind": "dmesg", "boot_id", "monotonic_s": last timestamp, "same_ts": lines seen with it}."""

    def __init__(
        self,
        dmesg: str = "dmesg",
        *,
        boot_id: Optional[str] = None,
        boot_id_path: str = DEFAULT_BOOT_ID_PATH,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        self.dmesg = dmesg
        self.spec = "dmesg" if dmesg == "dmesg" else f"dmesg:{dmesg}"
        self.boot_id = boot_id if boot_id is not None else read_boot_id(boot_id_path)
        self.max_events = max_events

    def argv(self) -> list[str]:
        return [self.dmesg, "--kernel", "--raw"]

    def read(self, cursor: Optional[dict[str, Any]], *, timeout_s: float) -> KernelLogObservation:
        run = _run_tool(self.argv(), timeout_s)
        if run.rc is None and not run.timed_out:
            return KernelLogObservation(
                status=ProbeStatus(complete=False, error=run.error), source=self.spec, cursor=cursor
            )
        obs = self.parse_output(run.stdout, cursor, complete_output=not run.timed_out)
        if run.timed_out:
            obs.status.complete = False
            obs.status.timed_out = True
            obs.status.error = run.error
            obs.cursor = cursor  # partial ring-buffer dump: keep the old position
        elif run.rc != 0:
            obs.status.complete = False
            obs.status.error = f"dmesg exited {run.rc}: {_stderr_text(run)}"
            if not run.stdout:
                obs.cursor = cursor
        return obs

    def parse_output(
        self, stdout: bytes, cursor: Optional[dict[str, Any]], *, complete_output: bool = True
    ) -> KernelLogObservation:
        """Pure: events after `cursor` and the new cursor from `dmesg --kernel --raw` output."""
        c = _cursor_of(cursor, "dmesg")
        if c and c.get("boot_id") is not None and self.boot_id is not None and c.get("boot_id") != self.boot_id:
            c = None
        last_ts = c.get("monotonic_s") if c else None
        last_ts = float(last_ts) if isinstance(last_ts, (int, float)) and not isinstance(last_ts, bool) else None
        same_ts = _int_or_none(c.get("same_ts")) if c else None
        same_ts = same_ts or 0
        acc = _Accumulator(None, self.max_events)
        r = acc.result
        lines = stdout.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        if lines and not complete_output:
            lines.pop()
        new_ts = last_ts
        new_same = same_ts
        seen_at_last = 0
        skip_record = False
        for line in lines:
            if not line.startswith(b"<"):
                # continuation of a multi-line record: no prefix of its own, so it can never be an event
                if skip_record:
                    continue
                r.lines_scanned += 1
                if NEEDLE in line:
                    r.malformed += 1
                continue
            m = _DMESG_TS_RE.match(line)
            ts = float(m.group(1)) if m else None
            skip_record = False
            if ts is not None and last_ts is not None:
                if ts < last_ts:
                    skip_record = True
                elif ts == last_ts:
                    seen_at_last += 1
                    skip_record = seen_at_last <= same_ts
            if skip_record:
                continue
            r.lines_scanned += 1
            r.bytes_scanned += len(line) + 1
            if ts is not None:
                if new_ts is None or ts > new_ts:
                    new_ts, new_same = ts, 1
                elif ts == new_ts:
                    new_same += 1
            if NEEDLE in line:
                acc.add_line_bytes(line, 0, len(line))
        new_cursor = {"kind": "dmesg", "boot_id": self.boot_id, "monotonic_s": new_ts, "same_ts": new_same}
        return _observation(r, self.spec, new_cursor)


class FileSource(KernelLogSource):
    """A kernel-only log file in any supported text format (kern.log, a `dmesg`/`journalctl -k` dump, a file
    of kmsg records). Cursor: {"kind": "file", "path", "inode", "offset", "head", "head_len"}: a replaced
    file (new inode) or a truncated/rewritten one (smaller than the offset, different first bytes) is read
    from the start; otherwise only the bytes after `offset`, which ends at the last complete line."""

    def __init__(self, path: str, *, chunk_size: int = DEFAULT_CHUNK_SIZE, max_events: int = DEFAULT_MAX_EVENTS):
        self.path = path
        self.spec = f"file:{path}"
        self.chunk_size = chunk_size
        self.max_events = max_events

    @staticmethod
    def _head_hash(f: Any, length: int) -> str:
        f.seek(0)
        return hashlib.sha256(f.read(length)).hexdigest()[:32]

    def read(self, cursor: Optional[dict[str, Any]], *, timeout_s: float) -> KernelLogObservation:
        deadline = time.monotonic() + timeout_s
        c = _cursor_of(cursor, "file")
        with open(self.path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            start = 0
            if c and c.get("path") == self.path and c.get("inode") == st.st_ino:
                offset = _int_or_none(c.get("offset"))
                head_len = _int_or_none(c.get("head_len"))
                if (
                    offset is not None
                    and head_len is not None
                    and st.st_size >= offset
                    and st.st_size >= head_len
                    and self._head_hash(f, head_len) == c.get("head")
                ):
                    start = offset
            f.seek(start)
            acc = _Accumulator(None, self.max_events)
            _scan_stream(
                f.readinto, base_offset=start, chunk_size=self.chunk_size, final=False, acc=acc, deadline=deadline
            )
            result = acc.result
            # the head covers at most what has been consumed, so a file that grows past 256 bytes later
            # still matches its earlier hash
            head_len = min(_HEAD_BYTES, result.end_offset)
            head = self._head_hash(f, head_len)
        new_cursor = {
            "kind": "file",
            "path": self.path,
            "inode": st.st_ino,
            "offset": result.end_offset,
            "head": head,
            "head_len": head_len,
        }
        return _observation(result, self.spec, new_cursor)


# --------------------------------------------------------------------------- entry point


def _kmsg_readable(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    os.close(fd)
    return True


def make_source(
    source_spec: str,
    *,
    boot_id_path: str = DEFAULT_BOOT_ID_PATH,
    boot_id: Optional[str] = None,
) -> KernelLogSource:
    """`auto` | `kmsg[:PATH]` | `journal[:JOURNALCTL]` | `dmesg[:DMESG]` | `file:PATH`. `auto` = /dev/kmsg if
    it can be opened, else journalctl if installed, else dmesg. Raises ValueError for an unknown spec."""
    kind, _, arg = source_spec.partition(":")
    ids = {"boot_id": boot_id, "boot_id_path": boot_id_path}
    if kind == "auto" and not arg:
        if _kmsg_readable("/dev/kmsg"):
            return KmsgSource("/dev/kmsg", **ids)
        if shutil.which("journalctl"):
            return JournalSource("journalctl", **ids)
        return DmesgSource("dmesg", **ids)
    if kind == "kmsg":
        return KmsgSource(arg or "/dev/kmsg", **ids)
    if kind == "journal":
        return JournalSource(arg or "journalctl", **ids)
    if kind == "dmesg":
        return DmesgSource(arg or "dmesg", **ids)
    if kind == "file" and arg:
        return FileSource(arg)
    raise ValueError(f"unknown kernel log source {source_spec!r} (auto, kmsg[:PATH], journal, dmesg, file:PATH)")


def read_xid_events(
    source_spec: str,
    cursor: Optional[dict[str, Any]],
    *,
    timeout_s: float,
    boot_id_path: str = DEFAULT_BOOT_ID_PATH,
    boot_id: Optional[str] = None,
) -> KernelLogObservation:
    """Xid events from the kernel log since `cursor` (None: everything available) and the next cursor.
    Never raises: a failure gives status.complete False with status.error, and the old cursor back so the
    next run retries from the same place."""
    started = time.monotonic()
    try:
        source = make_source(source_spec, boot_id_path=boot_id_path, boot_id=boot_id)
        obs = source.read(cursor, timeout_s=timeout_s)
    except Exception as e:  # a probe reports failure as an incomplete observation, never upward
        obs = KernelLogObservation(
            status=ProbeStatus(complete=False, error=f"{type(e).__name__}: {e}"),
            source=source_spec,
            cursor=cursor,
        )
    obs.status.duration_s = time.monotonic() - started
    return obs
