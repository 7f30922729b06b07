"""Node conditions: a fatal finding stands as a condition of the node until what clears it is seen.

A drain verdict is an event of one run; the fault behind it is a state of the node. Kernel-log evidence (an Xid)
is read once: once a run has moved the node's kernel-log position past it, nothing but the condition remembers it.
So the evidence is consumed only *into* a condition, in the same journal write that moves the position
(gpuguard.pipeline.journal), and the condition stands, whatever Slurm shows, whoever drained or resumed the node
and however many hooks run at once, until what clears it is seen:

| action of the fault | cleared by |
|---|---|
| reset   | a reboot, a driver reload after it, or a state only a reset clears reading clear again |
| reboot  | a reboot (a new boot id) |
| replace | an admin's `gpuguard undrain` (or the check passing when `undrain.replace` is set) |
| drain   | the check passing again in a health check (which judges every GPU) |

and, for every class, an admin's recorded `gpuguard undrain` (reset-class ones only with reset evidence or
`--force`). While one stands every prolog refuses its job and the next hook makes Slurm agree
(gpuguard.pipeline.reconcile). A cleared condition no longer refuses jobs; the health check lifts gpuguard's drain
once every condition has cleared and the usual passes are in (gpuguard.pipeline.undrain).

Pure: no I/O, no clock (callers pass `now`).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Optional

from gpuguard.model import Action, Finding, Severity, Verdict
from gpuguard.slurm.reason import format_reason, safe_keyword
from gpuguard.util.record import Record, field, record

ACTIONS = ("drain", "reset", "reboot", "replace")
# checks whose evidence is read once from the kernel log: the check "passes" once the position moved past it, which
# says nothing about the fault (a re-check cannot clear what these found)
LOG_EVIDENCE = frozenset({"gpu.xid"})
# Evidence kept with a condition: scalars only, short (the journal is read by every hook)
_EVIDENCE_KEYS = ("code", "xid", "pci", "seq", "timestamp", "name", "gpu", "value", "expected", "count",
                  "recurred_boots", "incomplete_runs", "busbw_gbps", "baseline_gbps", "switch", "source")
_MAX_TEXT = 200


@record
class Condition(Record):
    """One standing (or cleared, not yet lifted) fault of the node."""

    id: str
    check_id: str
    keyword: str
    action: str  # drain | reset | reboot | replace
    reason: str  # the drain reason gpuguard sets for it (DESIGN §3 grammar)
    message: str
    first_seen: float
    last_seen: float
    origin: str  # the run kind that found it: prolog, epilog, healthcheck, watch, preflight, store (upgrade)
    boot_id: Optional[str] = None
    gpus: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    run_id: Optional[int] = None
    cleared_by: Optional[str] = None  # what was seen that clears it ("a reboot", "an admin's undrain", ...)
    cleared_at: Optional[float] = None
    applied: bool = False  # Slurm has shown the node drained for it (a later undrained node was resumed by someone)
    failing_with: list[str] = field(default_factory=list)  # every check failing in the run that found it
    # the loaded nvidia module when it was found (gpuguard.probes.system.read_driver_fingerprint): another one later
    # is a driver reload, i.e. a GPU reset
    driver_fp: Optional[str] = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.check_id, self.keyword)

    @property
    def standing(self) -> bool:
        return self.cleared_by is None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, d: Any) -> Optional["Condition"]:
        """None for anything that is not a well-formed condition (a damaged journal never raises)."""
        if not isinstance(d, dict):
            return None
        try:
            c = cls(**{k: d[k] for k in _FIELDS if k in d})
        except TypeError:
            return None
        ok = all(isinstance(getattr(c, k), str) and getattr(c, k) for k in ("id", "check_id", "keyword", "reason")) \
            and c.action in ACTIONS and isinstance(c.first_seen, (int, float)) \
            and isinstance(c.last_seen, (int, float)) and isinstance(c.gpus, list) and isinstance(c.evidence, dict)
        return c if ok else None


_FIELDS = ("id", "check_id", "keyword", "action", "reason", "message", "first_seen", "last_seen", "origin",
           "boot_id", "gpus", "evidence", "run_id", "cleared_by", "cleared_at", "applied",
           "failing_with", "driver_fp")


def new_id() -> str:
    return os.urandom(6).hex()


def _gpu_names(f: Finding) -> list[str]:
    names = []
    pci = f.evidence.get("pci")
    if isinstance(pci, str) and pci:
        names.append(pci[:32])
    if f.gpu is not None:
        names.append(str(f.gpu))
    return names


def _evidence(f: Finding) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in _EVIDENCE_KEYS:
        v = f.evidence.get(k)
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out[k] = v
        elif isinstance(v, str):
            out[k] = v[:_MAX_TEXT]
    return out


def conditions_from_verdict(verdict: Verdict, origin: str, now: float, boot_id: Optional[str],
                            run_id: Optional[int] = None, driver_fp: Optional[str] = None) -> list[Condition]:
    """One condition per failing (check, keyword) of a drain verdict; the verdict's reason on its primary."""
    if verdict.outcome != "drain" or not verdict.reason:
        return []
    out: dict[tuple[str, str], Condition] = {}
    together = sorted({f.check_id for f in verdict.failing})
    for f in verdict.failing:
        if f.severity is not Severity.FAIL and not f.evidence.get("incomplete_runs"):
            continue
        keyword = safe_keyword(f.check_id, f.keyword)
        action = f.action if f.action is not Action.NONE else Action.DRAIN
        key = (f.check_id, keyword)
        if key in out:
            c = out[key]
            c.gpus = sorted(set(c.gpus) | set(_gpu_names(f)))
            if action.rank > Action(c.action).rank:
                c.action = action.value
            continue
        primary = verdict.primary is not None and (verdict.primary.check_id, verdict.primary.keyword) == \
            (f.check_id, f.keyword)
        reason = verdict.reason if primary else format_reason(f.check_id, keyword, f.message, origin, action.value)
        out[key] = Condition(id=new_id(), check_id=f.check_id, keyword=keyword, action=action.value, reason=reason,
                             message=f.message[:_MAX_TEXT], first_seen=now, last_seen=now, origin=origin,
                             boot_id=boot_id, gpus=sorted(set(_gpu_names(f))), evidence=_evidence(f), run_id=run_id,
                             failing_with=together, driver_fp=driver_fp)
    # the verdict's primary first: among conditions of the same action and age, its reason is the one Slurm shows
    return sorted(out.values(), key=lambda c: c.reason != verdict.reason)


def merge(existing: list[Condition], found: Iterable[Condition]) -> tuple[list[Condition], list[Condition]]:
    """(all conditions, the ones that are new): a finding of a standing condition's (check, keyword) updates it
    (last seen, GPUs, a stronger action); one that had cleared stands again as a new condition."""
    conds = list(existing)
    new: list[Condition] = []
    for c in found:
        same = next((e for e in conds if e.key == c.key and e.standing), None)
        if same is None:
            conds = [e for e in conds if e.key != c.key]  # a cleared one of the same fault is superseded
            conds.append(c)
            new.append(c)
            continue
        same.last_seen = max(same.last_seen, c.last_seen)
        same.gpus = sorted(set(same.gpus) | set(c.gpus))
        if Action(c.action).rank > Action(same.action).rank:  # e.g. escalated to replace after reboots
            same.action, same.reason, same.message = c.action, c.reason, c.message
    return conds, new


def mark_applied(conds: Iterable[Condition]) -> None:
    for c in conds:
        if c.standing:
            c.applied = True


def standing(conds: Iterable[Condition]) -> list[Condition]:
    return [c for c in conds if c.standing]


def first_standing(conds: Iterable[Condition]) -> Optional[Condition]:
    """The condition whose reason Slurm should show: the strongest action, then the oldest."""
    s = standing(conds)
    return min(s, key=lambda c: (-Action(c.action).rank, c.first_seen)) if s else None


# --------------------------------------------------------------------------- what clears a condition

CLEARS = {
    "reset": "evidence of a GPU reset (a reboot, a driver reload, or the reset-only state reading clear again)",
    "reboot": "a reboot",
    "replace": "the hardware being replaced (an admin's gpuguard undrain)",
    "drain": "the check passing again in a health check",
}


def how_to_clear(c: Condition, node: str) -> str:
    """The words a re-drain's reason carries: what the admin does (short: reasons are <= 120 characters)."""
    if c.action == "reset":
        return f"reset GPU then gpuguard undrain {node}"
    if c.action == "reboot":
        return "reboot the node"
    if c.action == "replace":
        return f"repair then gpuguard undrain {node} --force"
    return f"gpuguard undrain {node} once fixed"


def standing_reason(c: Condition, node: str) -> str:
    """The reason for re-draining a node someone resumed while `c` stands: says how to clear it."""
    return format_reason(c.check_id, c.keyword, f"{how_to_clear(c, node)}: {c.message}", "standing", c.action)


def cleared_by_reboot(c: Condition, boot_id: Optional[str]) -> Optional[str]:
    if c.action in ("reset", "reboot") and boot_id and c.boot_id and boot_id != c.boot_id:
        return "a reboot"
    return None


def check_reads_clear(check_id: str, findings: Iterable[Finding]) -> bool:
    """The check ran and every finding of it is OK (a value that could not be read is never clear)."""
    mine = [f for f in findings if f.check_id == check_id]
    return bool(mine) and all(f.severity is Severity.OK for f in mine)


def driver_reloaded(c: Condition, driver_fp: Optional[str], driver_since: Optional[float]) -> bool:
    """The nvidia module was loaded again since `c` was found: its fingerprint then and now differ (or, for a
    condition that does not know it, the store saw a new one after it)."""
    if c.driver_fp is not None:
        return driver_fp is not None and driver_fp != c.driver_fp
    return bool(driver_since and driver_since > c.first_seen)


def clearing_evidence(c: Condition, *, boot_id: Optional[str], findings: list[Finding],
                      driver_since: Optional[float], failing_then: Iterable[str],
                      reset_only: dict[str, str], undrain_replace: bool,
                      driver_fp: Optional[str] = None) -> Optional[str]:
    """What a health check (every GPU judged) saw that clears `c`, or None. `failing_then`: the checks that failed
    in the run that found it; `reset_only`: check id -> words for the states only a GPU reset clears; `driver_fp`:
    the loaded nvidia module now."""
    if any(f.check_id == c.check_id and f.severity is Severity.FAIL for f in findings):
        return None  # found again this run
    reboot = cleared_by_reboot(c, boot_id)
    if reboot:
        return reboot
    if c.action == "reset":
        if driver_reloaded(c, driver_fp, driver_since):
            return "a driver reload"
        for check_id, what in reset_only.items():
            if (check_id == c.check_id or check_id in failing_then) and check_reads_clear(check_id, findings):
                return what
        return None
    if c.action == "reboot":
        return None
    if c.action == "replace" and not undrain_replace:
        return None
    return "the check passing again" if check_reads_clear(c.check_id, findings) else None


def clear(c: Condition, why: str, now: float) -> None:
    c.cleared_by, c.cleared_at = why, now


def summary(conds: Iterable[Condition]) -> str:
    """One line for logs and notes: `XID119 gpu.xid (reset, since ...)`."""
    return "; ".join(f"{c.keyword} {c.check_id} ({c.action}" + (f", cleared by {c.cleared_by}" if not c.standing
                                                               else "") + ")" for c in conds)


# --------------------------------------------------------------------------- an admin's undrain from another host

# `gpuguard undrain NODE --force` run where the node's own state cannot be reached (a login or head node) leaves its
# record in Slurm, in the node's Comment (only Slurm's operators can set it, as only they can resume a node): the
# node's next hook sees it, clears its conditions as an admin's recorded undrain and removes the token.
UNDRAIN_TOKEN = "gpuguard-undrain"


def undrain_token(now: float, who: str) -> str:
    safe = "".join(ch for ch in who if ch.isalnum() or ch in "-_.@")[:64] or "admin"
    return f"{UNDRAIN_TOKEN}:{int(now)}:{safe}"


def parse_undrain_token(comment: Optional[str]) -> Optional[tuple[float, str]]:
    """(when, who) from a node Comment that holds gpuguard's undrain token; None otherwise."""
    parts = (comment or "").strip().split(":")
    if len(parts) != 3 or parts[0] != UNDRAIN_TOKEN or not parts[1].isdigit():
        return None
    return float(parts[1]), parts[2]
