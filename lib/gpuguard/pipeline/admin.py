"""`gpuguard undrain NODE`: an admin returns a node gpuguard drained to service, through the same pipeline.

Before lifting the drain, the checks that drained the node run again (gather + evaluate, nothing applied, no
kernel-log position moved); while any of them fails, or cannot be read, the node stays drained (`--force`
overrides, and says so in the history and the log). The ownership rules are the health check's: a drain someone
else set, a DOWN or maintenance node, a FLAPPING node are refused without `--force`. Every undrain is in the hooks'
log file and resolves the drain's alert.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Optional

from gpuguard.config.schema import Config
from gpuguard.model import Severity
from gpuguard.slurm.reason import is_ours, parse_reason
from gpuguard.slurm.client import NodeState, SlurmError, client_from_config


@dataclass
class UndrainOutcome:
    code: int  # 0 undrained / nothing to do, 1 refused, 2 could not ask Slurm
    message: str
    still_failing: list[str] = field(default_factory=list)


def admin_undrain(cfg: Config, node: str, force: bool, log: Any) -> UndrainOutcome:
    client = client_from_config(cfg.slurm, cfg.deadlines.scontrol_s)
    try:
        state = client.get_node(node)
    except SlurmError as e:
        return UndrainOutcome(2, f"cannot read {node}: {e}")
    if state is None:
        return UndrainOutcome(2, f"no node {node} in Slurm")
    if not state.drained:
        return UndrainOutcome(0, f"{node} is not drained ({'+'.join(sorted(state.states))}); nothing to do")
    refuse = ownership_refusal(state)
    failing: list[str] = []
    if not refuse and not force:
        checked = recheck(cfg, node, state)
        if checked is None:
            refuse = (f"cannot re-check {node} from this host: run `gpuguard undrain {node}` on {node} itself, "
                      "or --force after checking it by hand")
        elif checked:
            failing = checked
            refuse = "the checks that drained it still fail: " + "; ".join(checked)
    if refuse and not force:
        return UndrainOutcome(1, f"not undraining {node}: {refuse}. Use --force to override.", failing)
    try:
        client.undrain(node)
    except SlurmError as e:
        return UndrainOutcome(2, f"undrain failed: {e}")
    detail = "admin --force" + (f" (was refused: {refuse})" if refuse else "") if force else "admin: re-checked, passing"
    _record(cfg, node, state, detail)
    log.warning(f"undrain {node} by an admin ({detail}); was: {state.reason}")
    _tell(cfg, node, state, force)
    return UndrainOutcome(0, f"undrained {node} (was: {state.reason})")


def ownership_refusal(state: NodeState) -> Optional[str]:
    parsed = parse_reason(state.reason or "")
    if not is_ours(state.reason):
        return f"drained by someone else (Reason={state.reason!r}); gpuguard does not lift it"
    if state.down or state.maintenance:
        return f"node is {'+'.join(sorted(state.states))}"
    if parsed and parsed.keyword == "FLAPPING":
        return f"node is FLAPPING ({state.reason}); make sure the hardware was fixed"
    return None


def can_check_here(cfg: Config, node: str) -> bool:
    """A simulated node (the config names its scenario) or this very host."""
    sim = cfg.simulation
    if sim.scenario or sim.scenario_dir:
        return True
    here = cfg.node.name or socket.gethostname().split(".")[0]
    return here == node


def drained_for(cfg: Config, node: str, state: NodeState) -> set[str]:
    """The checks that drained the node: the reason's, and every failing check of the run that set it."""
    checks: set[str] = set()
    parsed = parse_reason(state.reason or "")
    if parsed:
        checks.add(parsed.check_id)
    try:
        from gpuguard.store.sqlite import Store

        with Store(cfg.store.path_for(node), timeout_s=2.0) as st:
            drain = st.active_drain(node)
            if drain and drain.get("check_id"):
                checks.add(drain["check_id"])
            if drain and drain.get("run_id") is not None:
                checks |= {f["check_id"] for f in st.findings_for(drain["run_id"]) if f["severity"] == "fail"}
    except Exception:  # noqa: BLE001 - the reason alone still names the check
        pass
    return checks


def recheck(cfg: Config, node: str, state: NodeState) -> Optional[list[str]]:
    """What still fails (or cannot be read) among the checks that drained the node; None when this host cannot
    look at that node."""
    if not can_check_here(cfg, node):
        return None
    from gpuguard.context import RunContext
    from gpuguard.pipeline.run import execute
    from gpuguard.simulate.sources import resolve_sources

    wanted = drained_for(cfg, node, state)
    result = execute(RunContext(kind="healthcheck", node=node), cfg, resolve_sources(cfg, node), dry_run=True)
    bad = [f for f in result.findings if f.check_id in wanted and f.severity in (Severity.FAIL, Severity.INCOMPLETE)]
    return [f"{f.check_id}: {f.message}" + (" (could not be read)" if f.severity is Severity.INCOMPLETE else "")
            for f in bad]


def _record(cfg: Config, node: str, state: NodeState, detail: str) -> None:
    try:
        from gpuguard.store.sqlite import Store

        with Store(cfg.store.path_for(node), timeout_s=2.0) as st:
            active = st.active_drain(node)
            st.record_drain(node=node, op="undrain", outcome="done", reason=state.reason,
                            check_id=active["check_id"] if active else None,
                            action=active["action"] if active else None, run_id=None, detail=detail)
    except Exception:  # noqa: BLE001 - the node's own store learns it from Slurm at its next health check
        pass


def _tell(cfg: Config, node: str, state: NodeState, force: bool) -> None:
    try:  # the drain's alert is over: same dedupe key, so receivers (PagerDuty, Opsgenie, ...) close it
        from gpuguard.notify import Event, emit

        parsed = parse_reason(state.reason or "")
        emit(cfg, Event(kind="undrain", severity="info", node=node, check_id=parsed.check_id if parsed else None,
                        message=f"undrained by an admin{' (--force)' if force else ''} (was: {state.reason})"),
             budget_s=3.0)
    except Exception:  # noqa: BLE001 - the undrain itself is done; telling is best effort
        pass
