"""Decide: findings + context + history -> one verdict (pass / warn / drain with an action).

Hardware evidence fails closed (drain) unless the site chose `policy.on_failure: report`.
Probes that could not finish are a warning, escalating to a drain when the same check stays incomplete
for `incomplete_escalate_after` consecutive runs (a node whose fi_info hangs every time is not healthy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from gpuguard.model import Action, Finding, Severity
from gpuguard.reason import format_reason

# When several checks fail, the reason names the most actionable one: root causes first.
CHECK_PRIORITY = [
    "gpu.xid", "gpu.nvml", "gpu.count", "gpu.recovery_action", "gpu.row_remap", "gpu.retired_pages", "gpu.ecc",
    "gpu.nvlink", "gpu.pcie", "gpu.temperature", "gpu.throttle", "fabric.efa", "fabric.ib", "gpu.model",
    "gpu.memory", "gpu.processes", "sys.memory", "sys.disk", "sys.cpu",
]


@dataclass
class Verdict:
    outcome: str  # "pass" | "warn" | "drain"
    action: Action = Action.NONE
    primary: Optional[Finding] = None
    failing: list[Finding] = field(default_factory=list)
    reason: Optional[str] = None  # drain reason (DESIGN §3 grammar) when outcome == "drain"
    escalated: list[str] = field(default_factory=list)  # checks drained because incomplete too often
    reported_only: bool = False  # a failure seen under policy.on_failure == "report"

    @property
    def healthy(self) -> bool:
        return self.outcome != "drain"


def _priority(f: Finding) -> tuple[int, int]:
    try:
        idx = CHECK_PRIORITY.index(f.check_id)
    except ValueError:
        idx = len(CHECK_PRIORITY)
    return (-f.action.rank, idx)


def decide(
    findings: list[Finding],
    kind: str,
    on_failure: str = "drain",
    on_incomplete: str = "warn",
    incomplete_escalate_after: int = 3,
    incomplete_history: Optional[Mapping[str, int]] = None,
) -> Verdict:
    """`incomplete_history`: check id -> consecutive incomplete runs *before* this one."""
    history = incomplete_history or {}
    fails = [f for f in findings if f.severity is Severity.FAIL]
    incompletes = [f for f in findings if f.severity is Severity.INCOMPLETE]
    escalated: list[Finding] = []
    for f in incompletes:
        if f.evidence.get("internal_error"):
            continue  # our own bug: governed by on_internal_error, never a hardware verdict
        runs = history.get(f.check_id, 0) + 1
        if on_incomplete == "drain" or (incomplete_escalate_after and runs >= incomplete_escalate_after):
            escalated.append(Finding(
                f.check_id, Severity.FAIL,
                f"{f.message} ({runs} runs in a row)" if runs > 1 else f.message,
                keyword="TIMEOUT" if "time" in f.message.lower() else (f.keyword or "TIMEOUT"),
                remediation=f.remediation, action=Action.DRAIN, evidence={**f.evidence, "incomplete_runs": runs}))
    drainers = fails + escalated
    if drainers:
        primary = sorted(drainers, key=_priority)[0]
        action = max((f.action for f in drainers), key=lambda a: a.rank)
        if action is Action.NONE:
            action = Action.DRAIN
        detail = primary.message
        others = len({f.check_id for f in drainers}) - 1
        if others > 0:
            detail += f" +{others} more"
        reason = format_reason(primary.check_id, primary.keyword or "INTERNAL", detail, kind, action.value)
        if on_failure == "report":
            return Verdict("warn", action, primary, drainers, reason, [f.check_id for f in escalated],
                           reported_only=True)
        return Verdict("drain", action, primary, drainers, reason, [f.check_id for f in escalated])
    warns = [f for f in findings if f.severity in (Severity.WARN, Severity.INCOMPLETE)]
    if warns:
        return Verdict("warn", Action.NONE, sorted(warns, key=_priority)[0], warns)
    return Verdict("pass")
