"""Decide: findings + the node's history -> one verdict (gpuguard.pipeline.policy holds the pure rules).

History read here: earlier boots that drained for the same fault (a fault back after reboots needs hardware
inspection), how long a condition that must persist has been seen, how many runs in a row a check was
incomplete. With no readable configuration at all (`restricted`), only unambiguous hardware evidence drains.
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.checks import is_hardware_evidence
from gpuguard.config.schema import Config
from gpuguard.context import RunContext
from gpuguard.model import Finding, Severity, Verdict
from gpuguard.pipeline.policy import apply_persistence, decide, escalate_recurring

def is_unambiguous(f: Finding) -> bool:
    """Unambiguous per-node hardware evidence (the registry's `hardware_evidence`, never a mismatch or a launch
    choice): judged even when no config can be read, and never held back by the drain-storm guard (a real Xid 79
    on 40 nodes is 40 broken nodes)."""
    return bool(is_hardware_evidence(f))


def judge(findings: list[Finding], ctx: RunContext, cfg: Config, store: Any, boot_id: Optional[str], now: float,
          restricted: bool = False) -> tuple[list[Finding], Verdict]:
    pol = cfg.policy
    reboot_cfg = cfg.reboot
    since = now - reboot_cfg.window_days * 86400
    recurrences = {(f.check_id, f.keyword): store.previous_fault_boots(ctx.node, f.check_id, f.keyword, boot_id, since)
                   for f in findings if f.severity is Severity.FAIL and f.keyword}
    findings = escalate_recurring(findings, recurrences, reboot_cfg.escalate_after)
    # conditions that must persist before they drain (HW slowdown): when did the current streak start?
    persist_keys = {(f.check_id, str(f.evidence["persist"]["key"])) for f in findings
                    if f.severity is Severity.FAIL and isinstance(f.evidence.get("persist"), dict)}
    # nobody looked for longer than this between two runs: the streak is broken (3 health-check intervals, >= 1 h)
    max_gap = max(3600.0, 3 * cfg.metrics.healthcheck_interval_s)
    findings = apply_persistence(findings, {k: store.persist_streak_start(ctx.node, k[0], k[1], max_gap)
                                            for k in persist_keys}, now)
    if restricted:
        findings = [_restricted(f) for f in findings]
    streaks = store.incomplete_streaks(ctx.node, [f.check_id for f in findings if f.severity is Severity.INCOMPLETE])
    verdict = decide(findings, ctx.kind, on_failure=pol.on_failure, on_incomplete=pol.on_incomplete,
                     incomplete_escalate_after=pol.incomplete_escalate_after, incomplete_history=streaks)
    return findings, verdict


def _restricted(f: Finding) -> Finding:
    """No configuration could be read: built-in defaults judge only unambiguous hardware evidence; anything a
    site setting could change (thresholds, expected counts) warns."""
    if f.severity is Severity.FAIL and not is_unambiguous(f):
        return Finding(f.check_id, Severity.WARN, f"{f.message} (not drained: no readable configuration, only "
                       "unambiguous hardware evidence drains)", keyword=f.keyword, remediation=f.remediation,
                       evidence={**f.evidence, "held": "no readable configuration"}, gpu=f.gpu)
    if f.severity is Severity.INCOMPLETE:  # never escalated to a drain on defaults alone
        return Finding(f.check_id, Severity.INCOMPLETE, f.message, keyword=f.keyword, remediation=f.remediation,
                       evidence={**f.evidence, "no_escalation": True}, gpu=f.gpu)
    return f
