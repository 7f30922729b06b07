"""Decide: findings + context + history -> one verdict (pass / warn / drain with an action).

Hardware evidence fails closed (drain) unless the site chose `policy.on_failure: report`.
Probes that could not finish are a warning, escalating to a drain when the same check stays incomplete
for `incomplete_escalate_after` consecutive runs (a node whose fi_info hangs every time is not healthy).
"""

from __future__ import annotations

from typing import Mapping, Optional

from gpuguard.checks import check_priority, priority_of
from gpuguard.model import Action, Finding, Severity, Verdict
from gpuguard.slurm.reason import format_reason, is_ours, parse_reason, safe_keyword
from gpuguard.util.record import Record, record


def __getattr__(name: str) -> object:
    # When several checks fail, the reason names the most actionable one: root causes first. The order is each
    # check's CheckSpec.priority (gpuguard.checks.check_priority()).
    if name == "CHECK_PRIORITY":
        return check_priority()
    raise AttributeError(name)


def _priority(f: Finding) -> tuple[int, int]:
    return (-f.action.rank, priority_of(f.check_id))


def escalate_recurring(findings: list[Finding], recurrences: Mapping[tuple[str, str], int],
                       escalate_after: int) -> list[Finding]:
    """A reboot/reset-class fault that already drained the node in `escalate_after` earlier boots is not fixed
    by rebooting: the node needs hardware inspection (action replace)."""
    if not escalate_after:
        return findings
    out = []
    for f in findings:
        seen = recurrences.get((f.check_id, f.keyword), 0)
        if f.severity is Severity.FAIL and f.action in (Action.REBOOT, Action.RESET) and seen >= escalate_after:
            f = Finding(f.check_id, f.severity, f"{f.message}; back after {seen} reboots", keyword=f.keyword,
                        remediation="the fault survived reboots: hardware inspection / RMA. " + f.remediation,
                        action=Action.REPLACE, evidence={**f.evidence, "recurred_boots": seen}, gpu=f.gpu)
        out.append(f)
    return out


def apply_persistence(findings: list[Finding], streak_start: Mapping[tuple[str, str], Optional[float]],
                      now: float) -> list[Finding]:
    """A failure that needs persistence (evidence {"persist": {"key", "seconds"}}, e.g. HW slowdown throttling)
    drains only when the same condition was seen in every run for at least that long (`streak_start`: when the
    current streak began in earlier runs, None if this run is the first to see it). Until then it is a warning
    that says when it will drain."""
    out = []
    for f in findings:
        p = f.evidence.get("persist") if f.severity is Severity.FAIL else None
        if not isinstance(p, dict) or "key" not in p:
            out.append(f)
            continue
        need = float(p.get("seconds", 0) or 0)
        since = streak_start.get((f.check_id, str(p["key"])))
        held = now - since if since is not None else 0.0
        if need and held < need:
            f = Finding(f.check_id, Severity.WARN,
                        f"{f.message} (seen for {held:.0f}s; drains if it persists {need:.0f}s)", keyword=f.keyword,
                        remediation=f.remediation, evidence={**f.evidence, "persist_held_s": round(held, 1)},
                        gpu=f.gpu)
        elif need:
            f = Finding(f.check_id, f.severity, f"{f.message} for {held:.0f}s", keyword=f.keyword,
                        remediation=f.remediation, action=f.action,
                        evidence={**f.evidence, "persist_held_s": round(held, 1)}, gpu=f.gpu)
        out.append(f)
    return out


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
        if f.evidence.get("unsupported") or f.evidence.get("no_escalation"):
            continue  # the driver/GPU cannot answer it, the same on every node: never drains (nor counts as clear)
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
        # a keyword the check did not declare falls back to its default: deciding never raises
        reason = format_reason(primary.check_id, safe_keyword(primary.check_id, primary.keyword), detail, kind,
                               action.value)
        if on_failure == "report":
            return Verdict("warn", action, primary, drainers, reason, [f.check_id for f in escalated],
                           reported_only=True)
        return Verdict("drain", action, primary, drainers, reason, [f.check_id for f in escalated])
    warns = [f for f in findings if f.severity in (Severity.WARN, Severity.INCOMPLETE)]
    if warns:
        return Verdict("warn", Action.NONE, sorted(warns, key=_priority)[0], warns)
    return Verdict("pass")


# --------------------------------------------------------------------------- undrain


@record
class UndrainDecision(Record):
    action: str  # undrain | wait | flapping | admin | closed
    detail: str


def decide_undrain(
    *,
    drain_action: str,
    node_drained: bool,
    node_reason: Optional[str],
    node_down: bool,
    node_maintenance: bool,
    verdict: str,
    passes: int,
    required_passes: int,
    boot_changed: bool,
    undrains_in_window: int,
    max_undrains: int,
    undrain_replace: bool = False,
    reset_evidence: Optional[str] = None,
) -> UndrainDecision:
    """May the health check lift the drain gpuguard put on this node? Ownership first (DESIGN §3): only a
    node that is still drained with a gpuguard reason, never one an admin took over."""
    if not node_drained:
        return UndrainDecision("closed", "no longer drained (resumed by someone else)")
    if not is_ours(node_reason):
        return UndrainDecision("closed", f"reason changed to {node_reason!r}: an admin owns the node now")
    if node_down or node_maintenance:
        return UndrainDecision("wait", "node is down or in maintenance")
    parsed = parse_reason(node_reason or "")
    if parsed and parsed.keyword == "FLAPPING":
        return UndrainDecision("flapping", "marked FLAPPING: stays drained until an admin runs gpuguard undrain")
    if verdict == "drain":
        return UndrainDecision("wait", "still failing")
    if drain_action == "replace" and not undrain_replace:
        return UndrainDecision("admin", "hardware-inspection fault: an admin undrains after the repair")
    if drain_action == "reboot" and not boot_changed:
        return UndrainDecision("wait", "reboot-class fault: waiting for a reboot")
    if drain_action == "reset" and not (boot_changed or reset_evidence):
        # A GPU that needs a reset still needs it after any number of passing health checks: the cursor having
        # moved past the Xid proves nothing. Only a reset does: a reboot, a driver reload (NVIDIA's reset procedure
        # unloads and reloads the modules), or the driver's own recovery action back to NONE.
        return UndrainDecision("wait", "reset-class fault: waiting for evidence of a GPU reset (reboot, driver "
                                       "reload, or recovery action back to NONE)")
    if passes < required_passes:
        return UndrainDecision("wait", f"{passes}/{required_passes} passing runs")
    if max_undrains and undrains_in_window >= max_undrains:
        return UndrainDecision("flapping", f"already undrained {undrains_in_window} times in the window")
    after = " after a reboot" if boot_changed else (f" after {reset_evidence}" if reset_evidence else "")
    return UndrainDecision("undrain", f"{passes} passing runs{after}")
