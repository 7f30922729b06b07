"""Record: the run, its drains and the cursors that let the next run judge only what is new, in the history store.

The store is history, not the guard: a store that cannot be opened or written (disk full, read-only, locked) never
changes a verdict (gpuguard.store.sqlite.GuardedStore), and what must not be lost lives in the verdict journal.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from gpuguard.checks import CheckSpec
from gpuguard.checks.inventory import update_inventory
from gpuguard.context import RunContext
from gpuguard.model import Observations, RunResult


def node_cursor(node: str) -> str:
    return f"kernel_log:{node}"


def job_cursor(ctx: RunContext) -> Optional[str]:
    return f"job:{ctx.node}:{ctx.job_id}" if ctx.job_id else None


def record_run(store: Any, result: RunResult) -> Optional[int]:
    ctx, v = result.context, result.verdict
    return store.record_run(
        started=result.started, duration_ms=result.duration_s * 1000, node=ctx.node, kind=ctx.kind, job_id=ctx.job_id,
        profile=result.profile.name, verdict=v.outcome, action=v.action.value, reason=v.reason,
        exit_code=result.exit_code, error=None, boot_id=result.boot_id, findings=result.findings,
        restart_count=ctx.restart_count if ctx.job_id else None)


def record_drains(store: Any, result: RunResult) -> None:
    """This run's drain (done, already, foreign, failed: then pending in the journal) and the earlier pending
    drains it got applied."""
    node = result.context.node
    if result.drain and result.drain["outcome"] != "kept":  # kept: nothing was done, nothing to count
        primary = result.verdict.primary
        store.record_drain(node=node, op="drain", outcome=result.drain["outcome"], reason=result.drain["reason"],
                           check_id=primary.check_id if primary else None, action=result.verdict.action.value,
                           run_id=result.run_id, detail=result.drain["detail"])
    for a in result.applied:
        p = a["pending"]
        if p.op != "drain":
            continue
        store.record_drain(node=node, op="drain", outcome=a["outcome"], reason=p.reason, check_id=p.check_id,
                           action=p.action, run_id=p.run_id if p.run_id is not None else result.run_id,
                           detail=f"pending since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(p.created))}, "
                                  f"applied at attempt {p.attempts + 1}: {a['detail']}".strip(": "))


def save_cursors(store: Any, ctx: RunContext, specs: list[CheckSpec], obs: Observations, boot_id: Optional[str],
                 kernel_position: Optional[dict[str, Any]], slurm_seen: bool = False, profile: Any = None) -> None:
    """The store's copies of where this run got to (the journal holds the kernel-log position that counts).
    `slurm_seen`: this run read the node's state from Slurm (undrain.resync_s counts from it)."""
    if slurm_seen:
        store.set_cursor(f"slurm_seen:{ctx.node}", {"ts": _now(obs)})
    _save_tier_cursors(store, ctx, specs, obs, boot_id)
    replays = pcie_replay_baseline(obs.previous.get("pcie_replay") or {}, obs)
    if replays is not None:
        store.set_cursor(f"pcie_replay:{ctx.node}", replays)
    if profile is not None:
        seen = update_inventory(obs.previous.get("inventory"), obs, profile)
        if seen is not None:
            store.set_cursor(f"inventory:{ctx.node}", seen)
    jc = job_cursor(ctx)
    if ctx.kind == "epilog":
        if jc:
            store.delete_cursor(jc)
    elif kernel_position is not None:
        store.set_cursor(node_cursor(ctx.node), kernel_position)
        if ctx.kind == "prolog" and jc:
            store.set_cursor(jc, kernel_position)  # where the job's window starts
    if ctx.kind == "healthcheck":
        store.prune_cursors(f"job:{ctx.node}:", older_than=_now(obs) - 7 * 86400)  # jobs without an epilog


def _now(obs: Observations) -> float:
    """The run's clock reading (the pipeline sets obs.now once per run); a bare observation: now."""
    return obs.now if obs.now is not None else time.time()


def pcie_replay_baseline(previous: dict[str, Any], obs: Observations, min_age_s: float = 60.0) -> Optional[dict[str, Any]]:
    """The PCIe replay counters to compare the next run with: a GPU's reading replaces its baseline once the
    baseline is at least `min_age_s` old (prologs every few seconds would otherwise never span a minute), or
    when the counter went down (driver reload / reset). None: nothing to change."""
    if obs.nvml is None or obs.now is None:
        return None
    out = dict(previous)
    changed = False
    for g in obs.nvml.gpus:
        if g.pcie_replay_counter is None:
            continue
        key = g.uuid or str(g.index)
        before = previous.get(key)
        stale = not (isinstance(before, list) and len(before) == 2) or obs.now - float(before[1]) >= min_age_s \
            or g.pcie_replay_counter < int(before[0])
        if stale:
            out[key] = [g.pcie_replay_counter, obs.now]
            changed = True
    return out if changed else None


def _save_tier_cursors(store: Any, ctx: RunContext, specs: list[CheckSpec], obs: Observations,
                       boot_id: Optional[str]) -> None:
    """EFA counters are judged as deltas since the last run; the optional tier runs once per boot (or
    interval): both remember where they were."""
    if obs.efa_counters is not None and getattr(obs.efa_counters, "cursor", None) is not None \
            and getattr(getattr(obs.efa_counters, "status", None), "complete", False):
        from gpuguard.probes.efa_counters import cursor_name as efa_cursor_name

        store.set_cursor(efa_cursor_name(ctx.node), obs.efa_counters.cursor)
    if any("tier" in s.kinds for s in specs):
        from gpuguard.nccl.tier import cursor_name, tier_cursor

        store.set_cursor(cursor_name(ctx.node), tier_cursor(boot_id, _now(obs)))
