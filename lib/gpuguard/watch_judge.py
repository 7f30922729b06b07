"""Judging kernel-log lines as they arrive, for `gpuguard watch`. Pure: no I/O, no clock (callers pass `now`).

Each line goes through the one kernel-log parser (`gpuguard.probes.kernel_log.parse_kernel_log_line`, with its
kernel-only rules: a line forged from userspace is never an event), the Xid catalog decides fatal or not, and
a de-duplicator folds repeats (the same code on the same GPU within a window) into the first event, so a flood
of Xid 13 costs one parse per line and nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional

from gpuguard.model import Action, Finding, Severity, XidEvent
from gpuguard.probes.kernel_log import _JSON_ARRAY_NEEDLE, MAX_LINE_BYTES, NEEDLE, LineResult, Verdict
from gpuguard.reason import format_reason
from gpuguard.xid import NVLINK5_CODES, XidCatalog, XidInfo

CHECK_ID = "gpu.xid"
CONTEXT = "watch"

# (code, GPU) of an Xid line without the full parse, to skip repeats cheaply during a flood. Only ever used to
# *skip* a line whose key is already being folded: a key is only admitted by a fully parsed kernel line, so a
# forged line can neither start nor extend a suppression window.
_FAST_KEY = re.compile(rb"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})[^)]{0,40}\):\s?(\d{1,5})")


def xid_line_spans(data: bytes, json_lines: bool = False) -> Iterator[tuple[int, int]]:
    """(start, end) of each line of `data` that may hold an Xid, `end` before its newline. Only these lines are
    decoded and parsed; the search itself runs in C, so a busy log costs little."""
    needles = (NEEDLE, _JSON_ARRAY_NEEDLE) if json_lines else (NEEDLE,)
    pos = 0
    n = len(data)
    while pos < n:
        hits = [h for h in (data.find(needle, pos) for needle in needles) if h >= 0]
        if not hits:
            return
        hit = min(hits)
        start = data.rfind(b"\n", 0, hit) + 1
        end = data.find(b"\n", hit)
        if end < 0:
            end = n
        yield start, end
        pos = end + 1


class XidDeduper:
    """The same key (Xid code, GPU) within `window_s` of the last reported one is a repeat, not an event."""

    def __init__(self, window_s: float, max_keys: int = 4096) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._last: dict[tuple[int, str, str], list[float]] = {}  # key -> [reported at, repeats since]

    def fold_if_suppressed(self, key: tuple[int, str, str], now: float) -> bool:
        """Count a repeat without admitting anything: True when `key` is inside its window."""
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return True
        return False

    def admit(self, key: tuple[int, str, str], now: float) -> Optional[int]:
        """None for a repeat; else how many repeats were folded into the previous report of this key."""
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return None
        repeats = int(entry[1]) if entry is not None else 0
        self._last.pop(key, None)
        self._last[key] = [now, 0]  # re-inserted: the dict stays ordered by report time
        if len(self._last) > self.max_keys:
            del self._last[next(iter(self._last))]
        return repeats


@dataclass(frozen=True)
class WatchEvent:
    """One Xid worth acting on or recording (repeats already folded away)."""

    event: XidEvent
    info: XidInfo
    repeats_before: int = 0  # repeats of this code on this GPU folded into the previous report

    @property
    def fatal(self) -> bool:
        return self.info.severity == "fatal"


@dataclass
class JudgeCounts:
    xid_lines: int = 0  # lines that looked like an Xid at all
    events: int = 0
    fatal: int = 0
    duplicates: int = 0
    forged: int = 0  # Xid-looking lines not from the kernel: never an event
    malformed: int = 0
    already_judged: int = 0  # kmsg records at or before the cursor of a previous run


class WatchJudge:
    def __init__(self, catalog: XidCatalog, window_s: float) -> None:
        self.catalog = catalog
        self.dedupe = XidDeduper(window_s)
        self.counts = JudgeCounts()

    def judge_bytes(self, line: bytes, now: float, skip_seq_upto: Optional[int] = None) -> Optional[WatchEvent]:
        """Judge one raw line (no newline)."""
        from gpuguard.probes.kernel_log import parse_kernel_log_line

        if len(line) > MAX_LINE_BYTES:  # no kernel record is this long
            self.counts.xid_lines += 1
            self.counts.malformed += 1
            return None
        m = _FAST_KEY.search(line)
        if m is not None:  # an Xid flood costs microseconds per line: fold repeats before the full parse
            code = int(m.group(2))
            # codes whose severity depends on the message (154, NVLink5 144-150) always get the full parse
            if code != 154 and code not in NVLINK5_CODES and self.dedupe.fold_if_suppressed(
                    (code, m.group(1).decode().lower(), self.catalog.lookup(code).severity), now):
                self.counts.xid_lines += 1
                self.counts.duplicates += 1
                return None
        return self.judge(parse_kernel_log_line(line.decode("utf-8", errors="replace")), now, skip_seq_upto)

    def judge(self, result: LineResult, now: float, skip_seq_upto: Optional[int] = None) -> Optional[WatchEvent]:
        c = self.counts
        if result.verdict == Verdict.OTHER:
            return None
        c.xid_lines += 1
        if skip_seq_upto is not None and result.seq is not None and result.seq <= skip_seq_upto:
            c.already_judged += 1
            return None
        if result.verdict == Verdict.NON_KERNEL:
            c.forged += 1
            return None
        if result.verdict == Verdict.MALFORMED or result.event is None:
            c.malformed += 1
            return None
        ev = result.event
        # Xid 154 names its own recovery action; Xids 144-150 say Fatal/Nonfatal: resolve before de-duplicating,
        # so a Fatal event is never folded into the Nonfatal ones of the same code on the same GPU.
        info = self.catalog.resolve(ev.code, ev.detail)
        repeats = self.dedupe.admit((ev.code, ev.pci, info.severity), now)
        if repeats is None:
            c.duplicates += 1
            return None
        c.events += 1
        if info.severity == "fatal":
            c.fatal += 1
        return WatchEvent(ev, info, repeats)


# --------------------------------------------------------------------------- what gets recorded


def node_action(info: XidInfo) -> Action:
    """The node action for a fatal Xid (the catalog's, at least a drain)."""
    try:
        action = Action(info.action)
    except ValueError:
        return Action.DRAIN
    return Action.DRAIN if action is Action.NONE else action


def finding_reason(finding: Finding) -> str:
    """The same reason shape the prolog writes, with `watch` as the context."""
    return format_reason(CHECK_ID, finding.keyword, finding.message, CONTEXT, finding.action.value)


def drain_reason(we: WatchEvent) -> str:
    return finding_reason(event_finding(we))


def _evidence(we: WatchEvent) -> dict[str, object]:
    ev = we.event
    return {"xid": ev.code, "pci": ev.pci, "pid": ev.pid, "process": ev.process_name, "timestamp": ev.timestamp,
            "seq": ev.seq, "first": ev.raw[:300], "nvidia_action": we.info.nvidia_action,
            "catalog_severity": we.info.severity, "repeats_before": we.repeats_before, "source": CONTEXT}


def event_finding(we: WatchEvent) -> Finding:
    ev, info = we.event, we.info
    if we.fatal:
        return Finding(CHECK_ID, Severity.FAIL, f"{info.name} on {ev.pci}", keyword=f"XID{ev.code}",
                       remediation=info.nvidia_action_text or f"see `gpuguard xid explain {ev.code}`",
                       action=node_action(info), evidence=_evidence(we))
    who = f", pid {ev.pid}" + (f" {ev.process_name}" if ev.process_name else "") if ev.pid is not None else ""
    severity = Severity.WARN if info.severity == "warn" else Severity.OK
    return Finding(CHECK_ID, severity, f"Xid {ev.code} ({info.name}) on {ev.pci}{who}: {info.severity}-class, "
                   "recorded; the node stays in service", keyword=f"XID{ev.code}",
                   remediation=info.nvidia_action_text, evidence=_evidence(we))


def forged_finding(count: int) -> Finding:
    return Finding(CHECK_ID, Severity.WARN, f"{count} Xid-looking line(s) not from the kernel ignored", keyword="XID",
                   remediation="someone wrote fake NVRM lines to the log (logger?); investigate, the node is not "
                   "drained for them", evidence={"rejected": count, "source": CONTEXT})
