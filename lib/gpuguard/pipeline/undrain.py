"""Lifting gpuguard's own drains: automatically from the health check once the cause has cleared, or by an admin
(`gpuguard undrain`, which re-runs the checks that drained the node first).

Ownership first (DESIGN §3): only a node still drained with a gpuguard reason; never one an admin took over.
A node gpuguard keeps drained costs slurmctld nothing per health check: Slurm is asked only when the store says
the drain could be lifted now, or every `undrain.resync_s` (an admin may have resumed or re-drained it).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from gpuguard.checks import cleared_only_by_reset
from gpuguard.config.schema import Config
from gpuguard.model import Finding, Severity
from gpuguard.pipeline.act import SlurmHandle
from gpuguard.pipeline.policy import UndrainDecision, decide_undrain
from gpuguard.slurm.reason import format_reason, parse_reason
from gpuguard.slurm.client import NodeState, SlurmError

def slurm_seen_cursor(node: str) -> str:
    return f"slurm_seen:{node}"


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


def reset_evidence(drain: dict[str, Any], store: Any, findings: list[Finding], boot_changed: bool,
                   driver: Optional[dict[str, Any]]) -> Optional[str]:
    """What shows that the GPUs were reset since a reset-class drain."""
    if boot_changed:
        return "a reboot"
    if driver and float(driver.get("since") or 0) > float(drain["ts"]):
        return "a driver reload"
    drained_for = {drain.get("check_id")}
    if drain.get("run_id") is not None:
        drained_for |= {f["check_id"] for f in store.findings_for(drain["run_id"]) if f["severity"] == "fail"}
    # States only a reset clears: one that failed when the node was drained and reads clear now shows the GPU was
    # reset. "Clear" means read and OK: a value NVML could not read is incomplete, never evidence of a reset.
    for check_id, what in cleared_only_by_reset().items():
        now = [f for f in findings if f.check_id == check_id]
        if check_id in drained_for and now and all(f.severity is Severity.OK for f in now):
            return what
    return None


def own_undrains(store: Any, node: str, check_id: Optional[str], since: float) -> int:
    """gpuguard's own undrains of drains for `check_id` in the window: what FLAPPING counts. An admin's undrain of
    the same fault, and undrains of other faults, are not the node flapping."""
    return int(store.count_ops(node, "undrain", since, check_id=check_id, exclude_admin=True))


def maybe_undrain(store: Any, slurm: SlurmHandle, node: str, verdict: str, boot_id: Optional[str], cfg: Config,
                  run_id: Optional[int], findings: list[Finding], driver: Optional[dict[str, Any]],
                  now: float) -> Optional[dict[str, Any]]:
    """The health check's part: lift a drain gpuguard put on this node once its cause has cleared."""
    drain = store.active_drain(node)
    if drain is None:
        return None
    ucfg = cfg.undrain
    window = now - ucfg.window_h * 3600
    passes = store.consecutive_passes(node, drain["check_id"] or "", since=drain["ts"]) if drain["check_id"] else 0
    boot_changed = bool(boot_id and drain["boot_id"] and boot_id != drain["boot_id"])
    evidence = reset_evidence(drain, store, findings, boot_changed, driver)

    def decision_for(state: NodeState) -> UndrainDecision:
        return decide_undrain(
            drain_action=drain["action"] or "drain", node_drained=state.drained, node_reason=state.reason,
            node_down=state.down, node_maintenance=state.maintenance, verdict=verdict, passes=passes,
            required_passes=ucfg.passes, boot_changed=boot_changed,
            undrains_in_window=own_undrains(store, node, drain["check_id"], window), max_undrains=ucfg.max_undrains,
            undrain_replace=ucfg.replace, reset_evidence=evidence)

    # As the store knows it: still drained with gpuguard's reason. While that says "wait", Slurm is not asked.
    assumed = decision_for(NodeState(name=node, states=frozenset({"DRAIN"}), reason=drain["reason"]))
    seen = store.get_cursor(slurm_seen_cursor(node)) or {}
    resync_due = now - float(seen.get("ts") or 0) >= ucfg.resync_s
    if assumed.action in ("wait", "admin") and not resync_due:
        return {"decision": assumed.action, "outcome": assumed.action, "detail": assumed.detail, "asked_slurm": False}
    try:
        state = slurm.client().get_node(node)
    except SlurmError as e:
        return {"outcome": "failed", "detail": f"reading node state: {e}"}
    store.set_cursor(slurm_seen_cursor(node), {"ts": now})
    if state is None:
        return {"outcome": "failed", "detail": "node unknown to Slurm"}
    return _carry_out(decision_for(state), store, slurm, node, drain, state, run_id, cfg, now)


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
