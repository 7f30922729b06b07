"""What the drain worker keeps about each fatal event until its drain resolves, and what it remembers after."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpuguard.kernellog.base import StoredCursor
from gpuguard.model import Finding
from gpuguard.watch.judge import WatchEvent


@dataclass
class PendingEvent:
    """A fatal event whose drain has not resolved yet."""

    we: WatchEvent
    reason: str
    finding: Finding
    before_cursor: Optional[StoredCursor]
    seen_wall: float
    seen_mono: float
    attempts: int = 0
    run_id: Optional[int] = None
    failure_recorded: bool = False
    pending_id: Optional[str] = None  # its entry in the node's verdict journal (gpuguard.pipeline.journal)
    journaled: bool = False  # durable there: the kernel-log position may move past it, and the prolog refuses jobs


@dataclass
class DrainOutcomeRecord:
    """What happened to one fatal event (kept in memory for `--once`, tests and the benchmark)."""

    reason: str
    outcome: str
    detail: str
    attempts: int
    latency_s: float  # from reading the Xid to Slurm answering the drain
