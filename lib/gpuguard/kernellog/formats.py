"""Kernel-log line formats and the Xid message: pure parsing, no I/O.

The NVIDIA driver reports GPU faults as kernel messages of the form

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

(older drivers print `(0000:3b:00)` without `PCI:`, MIG attributes appear as `(PCI:... GPU-I:05 GPU-CI:00)`,
and a process the driver cannot attribute is `pid='<unknown>', name=<unknown>`). This module turns such lines,
whatever tool printed them, into `XidEvent`s: `parse_xid_message` (the message text) and `parse_kernel_log_line`
(one line of any supported format, auto-detected per line: raw /dev/kmsg records, `dmesg` plain/`-T`/`--raw`/`-x`/
`--time-format iso`, `journalctl -k` short/short-iso/short-precise/short-monotonic/short-full/short-unix,
`journalctl -o json`, syslog files (BSD and RFC 3339 timestamps, with or without the kernel's `[ 1234.5]` inside)).

Security: only kernel messages count. The prolog and health check run as root and drain nodes, so a user must
not be able to drain a node by writing a fake Xid line with `logger`:
- raw /dev/kmsg: the record's facility (PRI >> 3) must be 0. The kernel forces a non-zero facility (LOG_USER)
  on anything written to /dev/kmsg from userspace, even when the writer asks for facility 0 ("<0>...").
- `journalctl -o json`: `_TRANSPORT` must be `kernel` and `SYSLOG_FACILITY`, when present, 0 (journald files
  userspace writes to /dev/kmsg under the kernel transport too, but records their non-zero facility).
- `dmesg --raw`: the `<N>` prefix must be a bare level (0-7); the dmesg source also passes `--kernel`.
- syslog / journal short text: the tag must be exactly `kernel`. `logger -t kernel` can still forge that tag
  in a syslog file, which is why the default sources are /dev/kmsg and `journalctl -k` (both only ever return
  kernel-transport records) and why a syslog-format file given to the file source must be a kernel-only file
  (e.g. kern.log written by rsyslog's `kern.*` rule from imklog), never a mixed /var/log/messages.
Lines that fail these rules are `Verdict.NON_KERNEL`, never events. Xid-looking lines that do not parse are
`Verdict.MALFORMED`. Hostile input (huge lines, NUL bytes, invalid UTF-8) never raises.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from typing import Optional

from gpuguard.model import XidEvent
from gpuguard.util.record import Frozen, record
from gpuguard.util.lazyre import lazy

NEEDLE = b"NVRM: Xid"
_NEEDLE_STR = NEEDLE.decode()
# journalctl -o json prints a MESSAGE holding control or non-UTF-8 bytes as an array of numbers
JSON_ARRAY_NEEDLE = b"[" + b",".join(str(b).encode() for b in NEEDLE)
# No kernel record is longer than 8 KiB (journald reads /dev/kmsg with an 8 KiB buffer); a longer line with
# the needle in it cannot be a real Xid, so it is counted as malformed instead of parsed.
MAX_LINE_BYTES = 64 << 10
_MAX_TEXT = 4096  # cap on the detail/raw text kept per event

_FACILITIES = (
    "kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7]"
)

# --------------------------------------------------------------------------- the Xid message

# Format strings in the driver (open-gpu-kernel-modules, kernel_rc_notification.c):
#   "NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, %s"  plus " GPU-I:%02u[ GPU-CI:%02u]" under MIG.
# Older drivers: "NVRM: Xid (%04x:%02x:%02x): %d, %s". Some tools print the function too ("0000:3b:00.0").
_XID_RE = lazy(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?"
    r"(?P<mig>(?: GPU-C?I:\s?\d{1,3})*)\):\s?(?P<code>\d{1,5})(?P<tail>[,\s].*)?\Z",
    re.S,
)
_PID_RE = lazy(r"pid=(?P<pid>'[^']*'|<[^>]*>|[^,\s]*)(?:,\s?|\s*\Z)")
_NAME_RE = lazy(r"name=(?P<name>.*?)(?:,\s?|\Z)", re.S)
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


# --------------------------------------------------------------------------- one log line


class Verdict:
    """What one line turned out to be (plain strings so results print and compare simply)."""

    XID = "xid"
    MALFORMED = "malformed"  # Xid-looking, from the kernel (or origin unknown), but not parseable
    NON_KERNEL = "non_kernel"  # Xid-looking but written by userspace: never an event
    OTHER = "other"  # no Xid in it


@record
class LineResult(Frozen):
    verdict: str
    event: Optional[XidEvent] = None
    fmt: str = ""  # detected format, e.g. "kmsg", "dmesg", "dmesg-ctime", "syslog", "journal-json"
    seq: Optional[int] = None  # kmsg sequence number, when the line has one
    reason: str = ""  # why it was rejected or malformed (for humans and tests)


_KMSG_RE = lazy(r"(?P<pri>\d{1,4}),(?P<seq>\d{1,20}),(?P<usec>\d{1,20})(?:,[^;\n]*)?;(?P<msg>.*)\Z", re.S)
_DMESG_RAW_RE = lazy(r"<(?P<pri>\d{1,4})>(?:\[\s*(?P<mono>\d+\.\d+)\]\s?)?(?P<msg>.*)\Z", re.S)
# `dmesg -x`: "kern  :warn  : [ 12.3] msg" (facility and level names padded)
_DMESG_DECODED_RE = lazy(r"(?P<fac>" + _FACILITIES + r")\s*:(?P<lvl>[a-z]+)\s*: (?P<rest>.*)\Z", re.S)
# `talosctl dmesg`: "10.0.0.1: kern: warning: [2026-04-22T21:27:51.291660856Z]: msg"
_TALOS_RE = lazy(
    r"(?P<host>\S+): (?P<fac>" + _FACILITIES + r"): (?P<lvl>[a-z]+): \[(?P<ts>[^\]]{1,64})\]: (?P<msg>.*)\Z", re.S
)
_MONO_RE = lazy(r"\[\s*(?P<mono>\d{1,12}\.\d{1,9})\]\s?")
_CTIME_RE = lazy(r"\[(?P<ts>[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\]\s?")
_ISO_RE = lazy(
    r"(?P<ts>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?P<frac>[.,]\d{1,9})?(?:Z|[+-]\d\d(?::?\d\d)?)?)\s+"
)
_FULL_RE = lazy(r"(?P<ts>[A-Z][a-z]{2} \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,9})? [A-Za-z0-9+:_/-]{1,32})\s+")
_UNIX_RE = lazy(r"(?P<ts>\d{9,11}\.\d{1,9})\s+")
# month names are locale dependent in journalctl output ("Okt", "sep"), so any short word is accepted
_BSD_RE = lazy(r"(?P<ts>[^\W\d_]{3,9}\.?\s{1,2}\d{1,2} \d\d:\d\d:\d\d(?:\.\d{1,9})?)\s+")
_TAGGED_RE = lazy(
    r"(?:(?P<host>[^\s\[\]:]{1,255})\s+)?(?P<tag>[^\s:\[\]]{1,128})(?:\[(?P<pid>\d{1,10})\])?:\s(?P<msg>.*)\Z", re.S
)
# CONFIG_PRINTK_CALLER kernels add "[T1234]" / "[C3]" before the message
_CALLER_RE = lazy(r"\[\s*[TC]\d{1,10}\]\s?")


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
    res = _parse_with_origin(s)
    if res is not None:
        return res
    m = _DMESG_DECODED_RE.match(s)
    if m is None:
        return _parse_by_timestamp(s, s, "")
    if m.group("fac") != "kern":
        return LineResult(Verdict.NON_KERNEL, fmt="dmesg-decoded", reason=f"facility {m.group('fac')}")
    return _parse_by_timestamp(m.group("rest"), s, "dmesg-decoded")


def _parse_with_origin(s: str) -> Optional[LineResult]:
    """Formats that carry the record's priority or facility: raw /dev/kmsg, `dmesg --raw`, `talosctl dmesg`."""
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
        # userspace record is ambiguous; the dmesg source therefore also asks dmesg for --kernel records only.
        if int(m.group("pri")) > 7:
            return LineResult(Verdict.NON_KERNEL, fmt="dmesg-raw", reason=f"priority {m.group('pri')}")
        mono = float(m.group("mono")) if m.group("mono") else None
        return _xid_or_malformed(m.group("msg"), raw=s, fmt="dmesg-raw", timestamp=m.group("mono"), mono=mono)
    m = _TALOS_RE.match(s)
    if m:
        if m.group("fac") != "kern":
            return LineResult(Verdict.NON_KERNEL, fmt="talos", reason=f"facility {m.group('fac')}")
        return _xid_or_malformed(m.group("msg"), raw=s, fmt="talos", timestamp=m.group("ts"), mono=None)
    return None


def _parse_by_timestamp(body: str, raw: str, fmt: str) -> LineResult:
    """`body` starts with a timestamp (or with nothing) of a dmesg, journalctl or syslog line; `fmt` is
    "dmesg-decoded" when `dmesg -x` already proved the line came from the kernel."""
    # timestamps that only dmesg-like tools print: the message may follow directly
    m = _MONO_RE.match(body)
    if m:
        return _after_prefix(body[m.end():], raw=raw, fmt=fmt or "dmesg", timestamp=m.group("mono"),
                             mono=float(m.group("mono")), direct_ok=True)
    m = _CTIME_RE.match(body)
    if m:
        return _after_prefix(body[m.end():], raw=raw, fmt=fmt or "dmesg-ctime", timestamp=m.group("ts"), mono=None,
                             direct_ok=True)
    m = _ISO_RE.match(body)
    if m:
        # `dmesg --time-format iso` writes a comma before the fraction ("10:11:12,123456+00:00"); journalctl
        # short-iso and rsyslog RFC 3339 timestamps are followed by host and tag, which must be checked
        dmesg_iso = bool(m.group("frac")) and m.group("frac").startswith(",")
        return _after_prefix(body[m.end():], raw=raw, fmt=fmt or ("dmesg-iso" if dmesg_iso else "syslog-iso"),
                             timestamp=m.group("ts"), mono=None, direct_ok=dmesg_iso or bool(fmt))
    if fmt:  # dmesg -x without a timestamp
        return _after_prefix(body, raw=raw, fmt=fmt, timestamp=None, mono=None, direct_ok=True)
    for regex, name in ((_FULL_RE, "journal-full"), (_UNIX_RE, "journal-unix"), (_BSD_RE, "syslog")):
        m = regex.match(body)
        if m:
            return _after_prefix(body[m.end():], raw=raw, fmt=name, timestamp=m.group("ts"), mono=None,
                                 direct_ok=False)
    # no timestamp at all: `journalctl -k -o cat`, `dmesg -t`, or "kernel: NVRM: ..." excerpts
    return _after_prefix(body, raw=raw, fmt="bare", timestamp=None, mono=None, direct_ok=True)


def parse_xid_line(line: str) -> Optional[XidEvent]:
    """The Xid event on one log line, or None (no Xid, malformed, or not from the kernel)."""
    return parse_kernel_log_line(line).event
