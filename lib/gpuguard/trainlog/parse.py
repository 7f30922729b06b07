"""From log text to records: `parse_line` (stateless, one line, for the monitor's follower) and `scan_log`
(a whole log: picks one rank's copy of the lines, numbers HF Trainer's step-less records, turns Lightning's
per-epoch batch counter into a global step, and splits the log into attempts at every resume)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

from gpuguard.trainlog.events import parse_event
from gpuguard.trainlog.formats import PARSERS
from gpuguard.trainlog.records import IterRecord, LogEvent

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# the start of a Megatron / Megatron-DeepSpeed iteration line (see formats.py)
_MEGATRON_HEAD = re.compile(r"\biteration\s+\d{1,15}\s*/\s*(?:\d{1,15}|infinity)\s*\|", re.IGNORECASE)
MAX_JOINED = 4  # a wrapped progress line spans at most this many physical lines
SELF_TERMINATED = ("megatron", "hf")  # formats whose line is recognised only when complete (" |", "{...}")
_SOURCE = re.compile(r"\[(?:rank|default)(\d{1,7})\]:|^\s*(\d{1,7}):\s")
MAX_SEGMENT = 64 << 10  # a progress line is < 1 KiB; a longer one is cut, never parsed for minutes


def segments(line: str) -> list[str]:
    """A physical line -> its logical lines: ANSI colours removed, split at carriage returns (tqdm and Lightning
    redraw their bar with `\\r`, so a captured log holds many updates on one line), each cut at MAX_SEGMENT."""
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    return [s[:MAX_SEGMENT] for s in line.split("\r") if s.strip()]


def _source(seg: str) -> str:
    m = _SOURCE.search(seg[:200])
    if not m:
        return ""
    return f"rank {int(m.group(1) or m.group(2))}"


def _parse_segment(seg: str, line_no: int) -> Optional[IterRecord]:
    for parser in PARSERS:
        rec = parser(seg, line_no)
        if rec is not None:
            rec.source = _source(seg)
            return rec
    return None


def parse_line(line: str, line_no: int = 0) -> Optional[IterRecord]:
    """One log line -> the last training-progress record on it, or None. Never raises. HF Trainer records have
    `iteration` None here (its lines carry no step); `scan_log` numbers them."""
    out = None
    for seg in segments(line):
        rec = _parse_segment(seg, line_no)
        if rec is not None:
            out = rec
    return out


@dataclass
class TrainLog:
    records: list[IterRecord] = field(default_factory=list)
    events: list[LogEvent] = field(default_factory=list)
    duplicates: int = 0  # lines dropped as another rank's copy or a progress-bar redraw of the same step
    sources: list[str] = field(default_factory=list)  # rank tags seen on progress lines
    source: str = ""  # the one whose lines were used
    incomplete: int = 0  # progress lines cut short (a log being written, an excerpt): skipped, never judged


def _unfinished(line: str) -> bool:
    """A Megatron iteration line without its closing "|": cut, or wrapped onto the next line(s)."""
    return "|" in line and bool(_MEGATRON_HEAD.search(line)) and not line.rstrip().endswith("|")


def complete_lines(lines: Iterable[str]) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, complete) of each logical line: a Megatron line a document wrapped is joined with its
    continuation lines (up to MAX_JOINED, none of which starts a new progress line); one still unfinished is
    returned with complete=False, as is a last line the reader says was cut (`lines.incomplete_last`)."""
    it = iter(lines)
    pending: Optional[tuple[int, str, int]] = None  # (line number, text so far, lines joined)
    n = 0
    for n, line in enumerate(it, 1):
        if pending is not None:
            start, text, joined = pending
            if _MEGATRON_HEAD.search(line) or joined >= MAX_JOINED or not line.strip():
                yield start, text, False
                pending = None
            else:
                text = text + line.lstrip() if text.endswith((" ", "\t")) else text + line
                if _unfinished(text):
                    pending = (start, text, joined + 1)
                else:
                    yield start, text, True
                    pending = None
                continue
        if _unfinished(line):
            pending = (n, line, 1)
            continue
        yield n, line, True
    if pending is not None:
        yield pending[0], pending[1], False
        pending = None


def _raw(lines: Iterable[str]) -> tuple[list[IterRecord], list[LogEvent], int]:
    records: list[IterRecord] = []
    events: list[LogEvent] = []
    incomplete = 0
    logical = list(complete_lines(lines))
    if logical and getattr(lines, "incomplete_last", False) and logical[-1][2] and \
            not any((r := _parse_segment(seg, 0)) is not None and r.fmt in SELF_TERMINATED
                    for seg in segments(logical[-1][1])):
        # the file ends mid-line (still being written) in a format whose lines have no end marker of their own
        logical[-1] = (logical[-1][0], logical[-1][1], False)
    for n, line, complete in logical:
        if not complete:
            incomplete += any(_parse_segment(seg, n) is not None or _MEGATRON_HEAD.search(seg)
                              for seg in segments(line))
            continue
        for seg in segments(line):
            rec = _parse_segment(seg, n)
            if rec is not None:
                records.append(rec)
                continue
            event = parse_event(seg, n)
            if event is not None:
                events.append(event)
    return records, events, incomplete


def _pick_source(records: list[IterRecord]) -> tuple[str, list[str]]:
    """Several ranks printing the same progress lines (torchtitan without rank filtering, `srun -l` of every
    rank): follow the one with the most lines (the first seen on a tie); untagged lines are always kept."""
    counts: dict[str, int] = {}
    for r in records:
        if r.source:
            counts[r.source] = counts.get(r.source, 0) + 1
    if not counts:
        return "", []
    best = max(counts, key=lambda s: counts[s])  # dicts keep insertion order: ties go to the first seen
    return best, list(counts)


class _Numbering:
    """Per-attempt state that turns each format's own counter into an increasing iteration: HF Trainer's
    records are numbered 1, 2, ...; Lightning's batch index restarts every epoch, so earlier epochs' lengths
    (the bar's total, else the largest index seen) are added to it."""

    def __init__(self) -> None:
        self.ordinal = 0
        self.epoch: Optional[float] = None
        self.offset = 0
        self.epoch_len = 0

    def number(self, rec: IterRecord) -> None:
        if rec.fmt == "hf" and rec.iteration is None:
            self.ordinal += 1
            rec.iteration = self.ordinal
        elif rec.fmt == "lightning" and rec.epoch is not None and rec.iteration is not None:
            if self.epoch is None:  # the first epoch of this attempt (a resumed job starts at its epoch)
                self.epoch, self.offset = rec.epoch, int(rec.epoch) * (rec.total or 0)
            elif rec.epoch > self.epoch:
                self.offset += self.epoch_len * max(1, int(rec.epoch - self.epoch))
                self.epoch, self.epoch_len = rec.epoch, 0
            self.epoch_len = max(self.epoch_len, rec.total or 0, rec.iteration)
            rec.iteration = self.offset + rec.iteration


def _key(rec: IterRecord) -> tuple:
    return rec.fmt, rec.epoch if rec.fmt == "lightning" else None, rec.iteration


def _same(a: Optional[float], b: Optional[float]) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def _copy_of(rec: IterRecord, prev: IterRecord) -> bool:
    """Another rank's copy of the previous line reports the same step with the same loss and grad norm (the
    throughput it measured may differ); the same step with other values is a rerun of that step."""
    if rec.fmt == "lightning":
        return True  # a redraw of the same bar position
    return _same(rec.loss, prev.loss) and _same(rec.grad_norm, prev.grad_norm)


def scan_log(lines: Iterable[str]) -> TrainLog:
    """Parse a whole log. A new attempt starts after a resume marker that follows progress lines (Megatron's
    "successfully loaded checkpoint ... at iteration N", torchtitan's "Training starts at step N", HF's
    "Continuing training from global step N", Lightning's "Restoring states from the checkpoint path"), where
    the epoch goes backwards, or where the iteration goes backwards (a requeued job appending to its log after
    resuming from an older checkpoint). A line repeating the previous line's step is another rank's copy or a
    progress-bar redraw: Lightning's later redraw is kept (its postfix carries the finished step's metrics),
    otherwise the first copy."""
    raw, events, incomplete = _raw(lines)
    source, sources = _pick_source(raw)
    resumes = sorted(e.line_no for e in events if e.kind == "resume")
    out = TrainLog(events=events, sources=sources, source=source, incomplete=incomplete)
    numbering = _Numbering()
    attempt, ri = 0, 0
    prev: Optional[IterRecord] = None
    prev_key: tuple = ()
    for rec in raw:
        if rec.source and rec.source != source:
            out.duplicates += 1
            continue
        resumed = False
        while ri < len(resumes) and resumes[ri] < rec.line_no:
            resumed = resumed or prev is not None
            ri += 1
        key = _key(rec)
        if prev is not None and not resumed and rec.fmt != "hf" and key == prev_key and _copy_of(rec, prev):
            out.duplicates += 1
            if rec.fmt == "lightning":
                rec.iteration, rec.attempt = prev.iteration, prev.attempt
                out.records[-1] = prev = rec
            continue
        epoch_back = (prev is not None and rec.fmt == prev.fmt and rec.fmt in ("hf", "lightning")
                      and rec.epoch is not None and prev.epoch is not None and rec.epoch < prev.epoch)
        if resumed or epoch_back:
            attempt += 1
            numbering = _Numbering()
        numbering.number(rec)
        if prev is not None and prev.attempt == attempt and rec.iteration is not None and \
                prev.iteration is not None and rec.iteration <= prev.iteration and rec.fmt != "hf":
            attempt += 1  # the iteration went backwards: resumed from an older checkpoint
        rec.attempt = attempt
        out.records.append(rec)
        prev, prev_key = rec, key
    return out


def parse_log(lines: Iterable[str]) -> list[IterRecord]:
    return scan_log(lines).records
