"""`gpuguard undrain NODE`: an admin returns a node to service, through the same pipeline, as a recorded act that
clears the node's conditions (gpuguard.pipeline.conditions).

Before anything is lifted the checks that drained the node run again (gather + evaluate, nothing applied, no
kernel-log position moved); while any of them fails, or cannot be read, the node stays drained. A reset-class
condition (Xid 48, 119, ...) also needs evidence of a GPU reset (a reboot, a driver reload, the reset-only state
reading clear): a passing re-check proves nothing there, the Xid being behind the kernel-log position. `--force`
overrides both and says so in the history and the log. The ownership rules are the health check's: a drain
someone else set, a DOWN or maintenance node, a FLAPPING node are refused without `--force`.

On the node itself (or a simulated one) the conditions are cleared in the node's journal, under the node lock.
From another host (`--force` only: nothing can be re-checked there) the undrain leaves a token in the node's
Slurm Comment, which the node's next hook takes in as the admin's recorded undrain (gpuguard.pipeline.reconcile).
Every undrain is in the hooks' log file and resolves the drain's alert.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gpuguard.checks import cleared_only_by_reset
from gpuguard.config.schema import Config
from gpuguard.model import Severity
from gpuguard.pipeline.conditions import LOG_EVIDENCE, Condition, clear, clearing_evidence, standing, undrain_token
from gpuguard.pipeline.journal import journal_for, runtime_dir
from gpuguard.pipeline.lock import NodeLock, lock_path
from gpuguard.pipeline.sources import Sources
from gpuguard.slurm.client import NodeState, SlurmError, client_from_config
from gpuguard.slurm.reason import is_ours, is_slurm_generic, parse_reason

ResolveSources = Callable[[Config, str], Sources]  # (config, node) -> the sources a re-check reads


@dataclass
class UndrainOutcome:
    code: int  # 0 undrained / nothing to do, 1 refused, 2 could not ask Slurm
    message: str
    still_failing: list[str] = field(default_factory=list)


def admin_undrain(cfg: Config, node: str, force: bool, log: Any, resolve: ResolveSources) -> UndrainOutcome:
    """`resolve(cfg, node)`: the sources a re-check reads (the node's own, or a simulated node's: the caller's
    gpuguard.simulate.sources.resolve_sources; the pipeline never imports the simulator)."""
    client = client_from_config(cfg.slurm, cfg.deadlines.scontrol_s)
    try:
        state = client.get_node(node)
    except SlurmError as e:
        return UndrainOutcome(2, f"cannot read {node}: {e}")
    if state is None:
        return UndrainOutcome(2, f"no node {node} in Slurm")
    here = can_check_here(cfg, node)
    conds = standing(journal_for(cfg, node).conditions) if here else []
    if not state.drained and not conds:
        return UndrainOutcome(0, f"{node} is not drained ({'+'.join(sorted(state.states))}) and no condition "
                                 "stands; nothing to do")
    refuse = ownership_refusal(state) if state.drained else None
    failing: list[str] = []
    if not refuse and not force:
        refuse, failing = _recheck_refusal(cfg, node, state, conds, here, resolve)
    if refuse and not force:
        return UndrainOutcome(1, f"not undraining {node}: {refuse}. Use --force to override.", failing)
    detail = "admin --force" + (f" (was refused: {refuse})" if refuse else "") if force else "admin: re-checked, passing"
    cleared = record_admin_clear(cfg, node, detail, log) if here else []
    if state.drained or not here:
        try:
            if not here:  # the node's own hooks take the token in as this recorded undrain
                client.set_comment(node, undrain_token(time.time(), _who()))
            if state.drained:
                client.undrain(node)
        except SlurmError as e:
            return UndrainOutcome(2, f"undrain failed: {e}")
    _record(cfg, node, state, detail, cleared)
    what = f"; cleared: {', '.join(f'{c.keyword} {c.check_id}' for c in cleared)}" if cleared else ""
    log.warning(f"undrain {node} by an admin ({detail}){what}; was: {state.reason}")
    _tell(cfg, node, state, force)
    return UndrainOutcome(0, f"undrained {node} (was: {state.reason}){what}")


def _who() -> str:
    user = os.environ.get("SUDO_USER") or os.environ.get("USER") or str(os.getuid())
    return f"{user}@{socket.gethostname().split('.')[0]}"


def ownership_refusal(state: NodeState) -> Optional[str]:
    parsed = parse_reason(state.reason or "")
    if not is_ours(state.reason) and not is_slurm_generic(state.reason):
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


def drained_for(cfg: Config, node: str, state: NodeState, conds: list[Condition]) -> set[str]:
    """The checks that drained the node: its conditions', the reason's, and every failing check of the run that set
    the drain."""
    checks = {c.check_id for c in conds}
    parsed = parse_reason(state.reason or "")
    if parsed:
        checks.add(parsed.check_id)
    try:
        from gpuguard.store.sqlite import Store

        with Store(cfg.store.path_for(node), timeout_s=2.0) as st:
            drain = st.active_drain(node)
            if drain and drain.get("check_id"):
                checks.add(drain["check_id"])
            for run_id in {c.run_id for c in conds} | {drain.get("run_id") if drain else None}:
                if run_id is not None:
                    checks |= {f["check_id"] for f in st.findings_for(run_id) if f["severity"] == "fail"}
    except Exception:  # noqa: BLE001 - the reason and the conditions still name the checks
        pass
    return checks


def _recheck_refusal(cfg: Config, node: str, state: NodeState, conds: list[Condition], here: bool,
                     resolve: ResolveSources) -> tuple[Optional[str], list[str]]:
    if not here:
        return (f"cannot re-check {node} from this host: run `gpuguard undrain {node}` on {node} itself, or --force "
                "after checking it by hand (the node takes the forced undrain in at its next hook)"), []
    result = _recheck_run(cfg, node, resolve)
    wanted = drained_for(cfg, node, state, conds)
    bad = [f for f in result.findings if f.check_id in wanted and f.severity in (Severity.FAIL, Severity.INCOMPLETE)]
    failing = [f"{f.check_id}: {f.message}" + (" (could not be read)" if f.severity is Severity.INCOMPLETE else "")
               for f in bad]
    if failing:
        return "the checks that drained it still fail: " + "; ".join(failing), failing
    # a reset-class fault needs the reset seen; a reboot-class one only when the re-check cannot see it (kernel-log
    # evidence is read once: gpu.xid "passes" once the position moved past the Xid; a lost GPU back in NVML can)
    no_reset = [c for c in conds if (c.action == "reset" or (c.action == "reboot" and c.check_id in LOG_EVIDENCE))
                and not _reset_seen(cfg, node, c, result, resolve)]
    if no_reset:
        names = ", ".join(f"{c.keyword} {c.check_id}" for c in no_reset)
        if all(c.action == "reboot" for c in no_reset):
            return (f"{names} needs a reboot and none was seen (the boot id is the one it was found in); reboot the "
                    "node (its next hook clears it), or --force once you have"), []
        return (f"{names} needs a GPU reset and none was seen (no reboot, no driver reload, the reset-only state not "
                "read clear); reset the GPU (or reboot) and run this again, or --force once you have reset it"), []
    return None, []


def _recheck_run(cfg: Config, node: str, resolve: ResolveSources) -> Any:
    from gpuguard.context import RunContext
    from gpuguard.pipeline.run import execute

    return execute(RunContext(kind="healthcheck", node=node), cfg, resolve(cfg, node), dry_run=True)


def _reset_seen(cfg: Config, node: str, c: Condition, result: Any, resolve: ResolveSources) -> bool:
    from gpuguard.pipeline.undrain import failing_then
    from gpuguard.probes.system import read_driver_fingerprint
    from gpuguard.store.sqlite import Store

    try:
        with Store(cfg.store.path_for(node), timeout_s=2.0) as st:
            then = failing_then(st, c)
            seen = st.get_cursor(f"driver_fp:{node}") or {}
    except Exception:  # noqa: BLE001 - no history: only what this re-check itself shows
        then, seen = set(), {}
    fp = read_driver_fingerprint(resolve(cfg, node).sysfs_root)
    # a module the store knew and that is not the one loaded now was reloaded (now, at the latest); one the store
    # never saw says nothing
    since = float(seen.get("since") or 0) if fp and seen.get("fp") == fp else \
        (time.time() if fp and seen.get("fp") else 0.0)
    return clearing_evidence(c, boot_id=result.boot_id, findings=result.findings, driver_since=since or None,
                             driver_fp=fp, failing_then=then, reset_only=cleared_only_by_reset(),
                             undrain_replace=True) is not None


def record_admin_clear(cfg: Config, node: str, detail: str, log: Any) -> list[Condition]:
    """The admin's undrain, recorded where every hook reads it: the node's conditions cleared in its journal."""
    rd = runtime_dir(cfg)
    with NodeLock(lock_path(rd, node), 10.0, fallback=f"{cfg.store.path_for(node)}.{node}.lock") as locked:
        if not locked:
            log.warning(f"undrain {node}: the node lock was not free for 10s; clearing its conditions anyway")
        j = journal_for(cfg, node)
        cleared = standing(j.conditions)
        for c in cleared:
            clear(c, f"an admin's undrain ({detail})", time.time())
        j.conditions = []
        j.pending = [p for p in j.pending if p.op != "drain"]
        err = j.save()
    if err:
        log.error(f"undrain {node}: {err}")
    return cleared


def _record(cfg: Config, node: str, state: NodeState, detail: str, cleared: list[Condition]) -> None:
    try:
        from gpuguard.store.sqlite import Store

        with Store(cfg.store.path_for(node), timeout_s=2.0) as st:
            active = st.active_drain(node)
            check_id = active["check_id"] if active else (cleared[0].check_id if cleared else None)
            action = active["action"] if active else (cleared[0].action if cleared else None)
            st.record_drain(node=node, op="undrain", outcome="done", reason=state.reason, check_id=check_id,
                            action=action, run_id=None, detail=detail)
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
