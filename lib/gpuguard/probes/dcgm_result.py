"""What `dcgmi diag` found, as both of its output forms parse into: the JSON (`gpuguard.probes.dcgm`) and the table
admins paste (`gpuguard.probes.dcgm_text`). The dcgm.diag check reads only these types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from gpuguard.model import ProbeStatus

# dcgmErrorSeverity_t
SEVERITY_NAMES = {0: "NONE", 1: "MONITOR", 2: "ISOLATE", 3: "UNKNOWN", 4: "TRIAGE", 5: "CONFIG", 6: "RESET"}


class DcgmParseError(ValueError):
    """dcgmi printed something that is not its diagnostic JSON."""


@dataclass
class DcgmEntityResult:
    status: str  # pass | fail | warn | skip
    gpus: list[int] = field(default_factory=list)  # empty = not GPU-specific
    warnings: list[str] = field(default_factory=list)
    info: list[str] = field(default_factory=list)
    severities: list[int] = field(default_factory=list)  # error_severity of each structured warning
    error_ids: list[int] = field(default_factory=list)


@dataclass
class DcgmTest:
    category: str
    name: str
    status: str  # pass | fail | warn | skip (the summary's, else derived from the entity results)
    results: list[DcgmEntityResult] = field(default_factory=list)
    summary_warnings: list[str] = field(default_factory=list)
    summary_info: list[str] = field(default_factory=list)

    @property
    def failed_gpus(self) -> list[int]:
        return sorted({g for r in self.results if r.status == "fail" for g in r.gpus})

    @property
    def messages(self) -> list[str]:
        seen: list[str] = []
        for msg in [w for r in self.results for w in r.warnings] + self.summary_warnings:
            if msg not in seen:
                seen.append(msg)
        return seen

    @property
    def max_severity(self) -> Optional[int]:
        sev = [s for r in self.results for s in r.severities]
        return max(sev) if sev else None

    @property
    def severities(self) -> set[int]:
        return {s for r in self.results for s in r.severities}


@dataclass
class DcgmObservation:
    status: ProbeStatus = field(default_factory=ProbeStatus)
    ran: bool = False
    tool_missing: bool = False  # dcgmi not installed: incomplete, never a hardware failure
    level: Optional[int] = None
    version: Optional[str] = None
    driver_version: Optional[str] = None
    tests: list[DcgmTest] = field(default_factory=list)
    error: Optional[str] = None  # dcgmi's own error (host engine down, runtime_error) when it judged nothing
    exit_code: Optional[int] = None


_STATUS = {"pass": "pass", "fail": "fail", "warn": "warn", "warning": "warn", "skip": "skip", "skipped": "skip",
           "not run": "skip", "not_run": "skip", "notrun": "skip"}


def normalise_status(value: Any) -> str:
    """'PASS' / 'Pass' -> 'pass'; 'SKIPPED' / 'Not Run' -> 'skip'; anything unknown -> 'warn' (never silently ok)."""
    return _STATUS.get(str(value or "").strip().lower(), "warn")


def worst_status(statuses: list[str]) -> str:
    """The test's status from its results': fail over warn over pass; none of them -> skip."""
    for s in ("fail", "warn", "pass"):
        if s in statuses:
            return s
    return "skip"
