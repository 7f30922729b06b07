"""Make Slurm agree with the node's standing conditions (gpuguard.pipeline.conditions).

Run first by every hook (and periodically by the watch daemon) while a condition stands. It reads this one node's
state from slurmctld (one single-node RPC: a condition standing is rare, and its truth is Slurm's state now, never
what the store remembers) and then:

| Slurm shows | done |
|---|---|
| drained with a gpuguard reason | nothing: Slurm agrees |
| drained or DOWN with a reason Slurm wrote itself (`Prolog error`, `Not responding`, ...) | gpuguard's reason replaces it: the admin sees the GPU, and gpuguard owns (and later lifts) the drain |
| drained with an admin's reason, DOWN, maintenance | nothing: the node takes no jobs, the admin owns it; the condition still stands |
| not drained (someone ran a plain `scontrol update state=resume`) | drained again, with a reason that says how to clear the condition |
| nothing (slurmctld down or hung) | a pending drain in the journal: every prolog refuses meanwhile, the next hook retries |

A condition a reboot clears (reset- and reboot-class) is cleared first when the boot changed, without asking Slurm.
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.model import PendingDrain
from gpuguard.pipeline.act import SlurmHandle, new_id
from gpuguard.pipeline.conditions import (Condition, cleared_by_reboot, clear, first_standing, mark_applied,
                                          parse_undrain_token, standing, standing_reason)
from gpuguard.pipeline.journal import Journal
from gpuguard.slurm.client import NodeState, SlurmError, drain_node
from gpuguard.slurm.reason import is_ours, is_slurm_generic


def clear_by_reboot(journal: Journal, boot_id: Optional[str], now: float) -> list[Condition]:
    """Conditions a reboot clears, on a node that has rebooted since they were found: cleared (returned)."""
    out = []
    for c in standing(journal.conditions):
        why = cleared_by_reboot(c, boot_id)
        if why:
            clear(c, why, now)
            out.append(c)
    return out


def agree(journal: Journal, slurm: SlurmHandle, node: str, now: float) -> dict[str, Any]:
    """Bring Slurm in line with the standing conditions. {"outcome": none | agreed | applied | redrained | replaced |
    admin | pending, "detail", "state": NodeState or None, "reason", "applied": the pending drains this resolved};
    pending drains of the journal are resolved once Slurm shows the node drained."""
    top = first_standing(journal.conditions)
    if top is None:
        return {"outcome": "none", "state": None}
    state, error = _read(slurm, node)
    if state is None:
        return _pending(journal, top, node, now, error or f"node {node} unknown to Slurm")
    remote = admin_token(journal, slurm, node, state, now)
    top = first_standing(journal.conditions)
    if top is None:
        return {"outcome": "cleared", "detail": remote, "state": state}
    held = state.drained or state.down
    if held and is_ours(state.reason):
        out = {"outcome": "agreed", "detail": "Slurm shows gpuguard's drain", "state": state}
    elif state.maintenance or (held and not is_slurm_generic(state.reason)):
        out = _admin(state)
    else:
        # never applied (its drain was pending, or lost with an unwritable journal): its own reason; applied once and
        # resumed since by someone: the reason that says how to clear it
        resumed = not held and top.applied
        reason = standing_reason(top, node) if resumed else top.reason
        d = drain_node(slurm.client(), node, reason, state=state)
        if d.outcome == "failed":
            slurm.unreachable = d.detail[:200]
            return _pending(journal, top, node, now, d.detail)
        if d.outcome == "foreign":
            out = _admin(state)
        else:
            what = "replaced" if held else ("redrained" if resumed else "applied")
            out = {"outcome": what, "reason": reason, "state": state, "previous_reason": state.reason,
                   "detail": {"replaced": f"Slurm's own reason {state.reason!r} replaced by gpuguard's",
                              "redrained": "resumed while the condition stands: drained again",
                              "applied": "the condition's drain applied"}[what],
                   "applied": [{"pending": p, "outcome": d.outcome, "detail": d.detail}
                               for p in journal.pending if p.op == "drain"]}
    mark_applied(journal.conditions)
    journal.pending = [p for p in journal.pending if p.op != "drain"]  # Slurm shows the node drained now
    return out


def admin_token(journal: Journal, slurm: SlurmHandle, node: str, state: NodeState, now: float) -> Optional[str]:
    """An admin's `gpuguard undrain --force` from another host (its token in the node's Comment) clears the
    conditions found before it; the token is removed once taken in. Returns what was cleared, if anything."""
    token = parse_undrain_token((state.fields or {}).get("Comment"))
    if token is None:
        return None
    when, who = token
    cleared = [c for c in standing(journal.conditions) if c.first_seen <= when]
    for c in cleared:
        clear(c, f"an admin's undrain --force ({who})", now)
    try:
        set_comment = getattr(slurm.client(), "set_comment", None)
        if set_comment is not None:
            set_comment(node, "")
    except SlurmError:
        pass  # taken in already: a token older than every condition clears nothing the next time
    return f"{len(cleared)} condition(s) cleared by an admin's undrain --force ({who})" if cleared else None


def _admin(state: NodeState) -> dict[str, Any]:
    return {"outcome": "admin", "state": state,
            "detail": f"{'+'.join(sorted(state.states))} by someone else (reason {state.reason!r}): not touched, "
                      "the condition stands"}


def _read(slurm: SlurmHandle, node: str) -> tuple[Optional[NodeState], Optional[str]]:
    if slurm.unreachable:
        return None, f"not tried: {slurm.unreachable}"
    try:
        return slurm.client().get_node(node), None
    except SlurmError as e:
        slurm.unreachable = str(e)[:200]
        return None, f"reading node state: {e}"


def _pending(journal: Journal, top: Condition, node: str, now: float, error: str) -> dict[str, Any]:
    """Slurm could not be asked or told: the drain waits in the journal (prologs refuse meanwhile)."""
    entry = next((p for p in journal.pending if p.op == "drain"), None)
    if entry is None:
        entry = journal.add_pending(PendingDrain(id=new_id(), op="drain", reason=top.reason, action=top.action,
                                                 check_id=top.check_id, created=now, origin="condition",
                                                 run_id=top.run_id))
    entry.attempts += 1
    entry.last_error, entry.last_attempt = error[:300], now
    return {"outcome": "pending", "detail": error, "state": None}
