"""Lifting gpuguard's own drains: automatically from the health check once every condition of the node has
cleared (gpuguard.pipeline.conditions: reset evidence for reset-class faults, a reboot for reboot-class ones, the
check passing again for the others), or by an admin (`gpuguard undrain`, gpuguard.pipeline.admin).

Ownership first (DESIGN §3): only a node still drained with a gpuguard reason; never one an admin took over.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from gpuguard.checks import cleared_only_by_reset
from gpuguard.config.schema import Config
from gpuguard.model import Action, Finding, RunResult
from gpuguard.pipeline.act import SlurmHandle
from gpuguard.pipeline.conditions import CLEARS, Condition, clear, clearing_evidence, new_id, standing
from gpuguard.pipeline.journal import Journal
from gpuguard.pipeline.policy import UndrainDecision, decide_undrain
from gpuguard.slurm.reason import format_reason, is_ours, parse_reason
from gpuguard.slurm.client import NodeState, SlurmError

def driver_seen(store: Any, node: str, fingerprint: Optional[str], read_only: bool,
                now: Optional[float] = None) -> Optional[dict[str, Any]]:
    """Since when the health check sees the loaded nvidia module (gpuguard.probes.system.read_driver_fingerprint):
    {"fp": ..., "since": epoch}. `since` is 0 for the first fingerprint ever seen (unknown, so it can never pass for
    a reload after a drain) and the time of the run that first saw a new one."""
    name = f"driver_fp:{node}"
    seen = store.get_cursor(name)
    if fingerprint is None:
        return seen
    if not seen or not seen.get("fp"):
        seen = {"fp": fingerprint, "since": 0}
    elif seen["fp"] != fingerprint:
        seen = {"fp": fingerprint, "since": now if now is not None else time.time()}
    else:
        return seen
    if not read_only:
        store.set_cursor(name, seen)
    return seen


def failing_then(store: Any, c: Condition) -> set[str]:
    """The checks that failed in the run that found `c` (a reset-only state among them clears it when it reads
    clear again)."""
    then = set(c.failing_with)
    if c.run_id is not None:
        then |= {f["check_id"] for f in store.findings_for(c.run_id) if f["severity"] == "fail"}
    return then


def own_undrains(store: Any, node: str, check_id: Optional[str], since: float) -> int:
    """gpuguard's own undrains of drains for `check_id` in the window: what FLAPPING counts. An admin's undrain of
    the same fault, and undrains of other faults, are not the node flapping."""
    return int(store.count_ops(node, "undrain", since, check_id=check_id, exclude_admin=True))


def adopt_store_drain(journal: Journal, store: Any, slurm: SlurmHandle, node: str, now: float) -> dict[str, Any]:
    """A node drained by a gpuguard from before conditions (or whose conditions were lost with the journal and its
    copy): the store's record of the drain in place becomes a condition, if Slurm still shows it."""
    drain = store.active_drain(node)
    if drain is None:
        return {"outcome": "none"}
    try:
        state = slurm.client().get_node(node)
    except SlurmError as e:
        return {"outcome": "none", "detail": f"reading node state: {e}"}
    if state is None or not (state.drained and is_ours(state.reason)):
        store.record_drain(node=node, op="undrain", outcome="gone", reason=state.reason if state else None,
                           check_id=drain["check_id"], action=drain["action"], run_id=None,
                           detail="no longer drained by gpuguard (seen when adopting the store's drain)")
        return {"outcome": "none", "state": state}
    parsed = parse_reason(state.reason or "")
    journal.conditions.append(Condition(
        id=new_id(), check_id=drain["check_id"] or (parsed.check_id if parsed else "unknown"),
        keyword=parsed.keyword if parsed else "INTERNAL", action=drain["action"] or "drain",
        reason=state.reason or drain["reason"], message=parsed.detail if parsed else (drain["reason"] or ""),
        first_seen=float(drain["ts"]), last_seen=float(drain["ts"]), origin="store", boot_id=drain.get("boot_id"),
        run_id=drain.get("run_id")))
    return {"outcome": "agreed", "detail": "the store's drain adopted as a condition", "state": state}


def clear_by_evidence(journal: Journal, store: Any, findings: list[Finding], boot_id: Optional[str], cfg: Config,
                      driver: Optional[dict[str, Any]], now: float) -> list[Condition]:
    """The health check's part (every GPU judged): the conditions what it saw clears (returned, cleared)."""
    reset_only = cleared_only_by_reset()
    out = []
    for c in standing(journal.conditions):
        why = clearing_evidence(c, boot_id=boot_id, findings=findings, driver_fp=(driver or {}).get("fp"),
                                driver_since=float((driver or {}).get("since") or 0) or None,
                                failing_then=failing_then(store, c), reset_only=reset_only,
                                undrain_replace=cfg.undrain.replace)
        if why:
            clear(c, why, now)
            out.append(c)
    return out


def lift_conditions(journal: Journal, store: Any, slurm: SlurmHandle, node: str, result: RunResult, cfg: Config,
                    state: Optional[NodeState], now: float) -> dict[str, Any]:
    """Once no condition stands, lift gpuguard's drain (ownership, passes and flapping rules:
    gpuguard.pipeline.policy). `state`: the node as this run read it already, if it did."""
    still = standing(journal.conditions)
    if still:
        waits = "; ".join(f"{c.keyword} {c.check_id} waits for {CLEARS[c.action]}" for c in still)
        return {"decision": "wait", "outcome": "wait", "detail": waits, "check_id": still[0].check_id}
    if state is None:
        try:
            state = slurm.client().get_node(node)
        except SlurmError as e:
            return {"outcome": "failed", "detail": f"reading node state: {e}"}
        if state is None:
            return {"outcome": "failed", "detail": "node unknown to Slurm"}
    return _lift(journal, store, slurm, node, result, cfg, state, now)


def _lift(journal: Journal, store: Any, slurm: SlurmHandle, node: str, result: RunResult, cfg: Config,
          state: NodeState, now: float) -> dict[str, Any]:
    cleared = sorted(journal.conditions, key=lambda c: c.first_seen)
    top = max(cleared, key=lambda c: Action(c.action).rank)
    ucfg = cfg.undrain
    passes = min(store.consecutive_passes(node, c.check_id, since=c.first_seen) for c in cleared)
    decision = decide_undrain(
        drain_action="drain", node_drained=state.drained, node_reason=state.reason, node_down=state.down,
        node_maintenance=state.maintenance, verdict=result.verdict.outcome, passes=passes,
        required_passes=ucfg.passes, boot_changed=False,
        undrains_in_window=own_undrains(store, node, top.check_id, now - ucfg.window_h * 3600),
        max_undrains=ucfg.max_undrains, undrain_replace=ucfg.replace)
    evidence = ", ".join(sorted({c.cleared_by or "" for c in cleared}))
    detail = f"{decision.detail} after {evidence}" if decision.action == "undrain" else decision.detail
    drain = {"check_id": top.check_id, "action": top.action}
    out = _carry_out(UndrainDecision(decision.action, detail), store, slurm, node, drain, state, result.run_id, cfg,
                     now)
    if out.get("outcome") in ("done", "gone"):
        journal.conditions = []  # lifted (or someone else resumed the node after they cleared): over
    return out


def _carry_out(decision: UndrainDecision, store: Any, slurm: SlurmHandle, node: str, drain: dict[str, Any],
               state: NodeState, run_id: Optional[int], cfg: Config, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {"decision": decision.action, "detail": decision.detail, "check_id": drain["check_id"]}
    if decision.action == "undrain":
        try:
            slurm.client().undrain(node)
            out["outcome"] = "done"
        except SlurmError as e:
            out["outcome"] = "failed"
            out["detail"] += f"; {e}"
        store.record_drain(node=node, op="undrain", outcome=out["outcome"], reason=state.reason,
                           check_id=drain["check_id"], action=drain["action"], run_id=run_id, detail=decision.detail)
    elif decision.action == "closed":
        out["outcome"] = "gone"
        store.record_drain(node=node, op="undrain", outcome="gone", reason=state.reason, check_id=drain["check_id"],
                           action=drain["action"], run_id=run_id, detail=decision.detail)
    elif decision.action == "flapping":
        out.update(_pin_flapping(store, slurm, node, drain, state, run_id, cfg, decision, now))
    else:
        out["outcome"] = decision.action  # wait | admin
    return out


def _pin_flapping(store: Any, slurm: SlurmHandle, node: str, drain: dict[str, Any], state: NodeState,
                  run_id: Optional[int], cfg: Config, decision: UndrainDecision, now: float) -> dict[str, Any]:
    parsed = parse_reason(state.reason or "")
    if not parsed or parsed.keyword == "FLAPPING":
        return {"outcome": "flapping-already"}
    ucfg = cfg.undrain
    n = own_undrains(store, node, drain["check_id"], now - ucfg.window_h * 3600)
    reason = format_reason(parsed.check_id, "FLAPPING",
                           f"drained again after {n} undrains in {ucfg.window_h:g}h: {parsed.detail}",
                           "healthcheck", "replace")
    out: dict[str, Any] = {}
    try:
        slurm.client().set_reason(node, reason)
        out["outcome"] = "flapping"
    except SlurmError as e:
        out["outcome"] = "failed"
        out["detail"] = f"{decision.detail}; {e}"
    store.record_drain(node=node, op="drain", outcome=out["outcome"], reason=reason, check_id=drain["check_id"],
                       action="replace", run_id=run_id, detail=decision.detail)
    return out
