"""Judging kernel-log lines as they arrive, for `gpuguard watch`. Pure: no I/O, no clock (callers pass `now`).

Each line goes through the one kernel-log parser (`gpuguard.kernellog.formats.parse_kernel_log_line`, with its
kernel-only rules: a line forged from userspace is never an event) and each Xid through the one Xid verdict the
hooks use (`gpuguard.checks.xid.judge_kernel_log`; `gpuguard.pipeline.policy.decide` turns its findings into the drain).
What is the watch's own is the de-duplicator: repeats (the same code on the same GPU within a window) fold into
the first event, so a flood of Xid 13 costs one parse per line and nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional

from gpuguard.checks import get_check
from gpuguard.checks.xid import judge_kernel_log, xid_info
from gpuguard.kernellog.find import candidate_lines
from gpuguard.kernellog.formats import MAX_LINE_BYTES, LineResult, Verdict, parse_kernel_log_line
from gpuguard.model import Action, Finding, KernelLogObservation, Severity, XidEvent
from gpuguard.pipeline.policy import Verdict as NodeVerdict
from gpuguard.pipeline.policy import decide
from gpuguard.xid.catalog import NVLINK5_CODES, XidCatalog, XidInfo

CHECK_ID = "gpu.xid"
CONTEXT = "watch"
SOURCE = "watch"

# (code, GPU) of an Xid line without the full parse, to skip repeats cheaply during a flood. Only ever used to
# *skip* a line whose key is already being folded: a key is only admitted by a fully parsed kernel line, so a
# forged line can neither start nor extend a suppression window.
_FAST_KEY = re.compile(rb"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})[^)]{0,40}\):\s?(\d{1,5})")


def xid_line_spans(data: bytes, json_lines: bool = False) -> Iterator[tuple[int, int]]:
    """(start, end) of each line of `data` that may hold an Xid, `end` before its newline. Only these lines are
    decoded and parsed; the search itself runs in C, so a busy log costs little."""
    return candidate_lines(data, 0, len(data), json_lines=json_lines)


class XidDeduper:
    """The same key (Xid code, GPU) within `window_s` of the last reported one is a repeat, not an event."""

    def __init__(self, window_s: float, max_keys: int = 4096) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._last: dict[tuple[object, ...], list[float]] = {}  # key -> [reported at, repeats since]

    def fold_if_suppressed(self, key: tuple[object, ...], now: float) -> bool:
        """Count a repeat without admitting anything: True when `key` is inside its window."""
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return True
        return False

    def admit(self, key: tuple[object, ...], now: float) -> Optional[int]:
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
    """One Xid worth acting on or recording (repeats already folded away), with the check's findings on it."""

    event: XidEvent
    info: XidInfo  # how the check read the event (catalog entry with the driver's own verdict applied)
    findings: tuple[Finding, ...]
    repeats_before: int = 0  # repeats of this code on this GPU folded into the previous report

    @property
    def fatal(self) -> bool:
        return any(f.severity is Severity.FAIL for f in self.findings)

    @property
    def action(self) -> Action:
        """What the check asks for the node (NONE unless fatal)."""
        return max((f.action for f in self.findings if f.severity is Severity.FAIL), key=lambda a: a.rank,
                   default=Action.NONE)


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
        self.spec = get_check(CHECK_ID)
        self.dedupe = XidDeduper(window_s)
        self.counts = JudgeCounts()

    def judge_bytes(self, line: bytes, now: float, skip_seq_upto: Optional[int] = None) -> Optional[WatchEvent]:
        """Judge one raw line (no newline)."""
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
        # resolved before de-duplicating, so a Fatal NVLink5 event is never folded into the Nonfatal ones of the
        # same code on the same GPU
        info = xid_info(ev, self.catalog)
        repeats = self.dedupe.admit((ev.code, ev.pci, info.severity), now)
        if repeats is None:
            c.duplicates += 1
            return None
        we = WatchEvent(ev, info, tuple(self._check(ev, repeats)), repeats)
        c.events += 1
        c.fatal += we.fatal
        return we

    def _check(self, ev: XidEvent, repeats: int) -> list[Finding]:
        findings = judge_kernel_log(KernelLogObservation(source=SOURCE, events=[ev]), self.catalog, spec=self.spec,
                                    kind=CONTEXT)
        for f in findings:
            f.keyword = f.keyword or f"XID{ev.code}"  # the watch records one event per run: searchable by its code
            f.evidence.update(pid=ev.pid, process=ev.process_name, seq=ev.seq, timestamp=ev.timestamp,
                              repeats_before=repeats, source=SOURCE)
        return findings

    def forged_findings(self, count: int) -> list[Finding]:
        """What the check says about `count` Xid-looking lines that did not come from the kernel."""
        return judge_kernel_log(KernelLogObservation(source=SOURCE, rejected_non_kernel=count), self.catalog,
                                spec=self.spec, kind=CONTEXT)


def node_verdict(findings: list[Finding], on_failure: str = "drain") -> NodeVerdict:
    """The policy's verdict on the check's findings, as the hooks reach theirs (reason context `watch`)."""
    return decide(findings, CONTEXT, on_failure=on_failure)
