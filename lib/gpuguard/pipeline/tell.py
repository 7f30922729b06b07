"""Telling humans what a run did: metrics for node_exporter (gpuguard.metrics.node) and notifications
(gpuguard.notify). Both cost nothing when not configured, never raise and stay within the run's deadline."""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.config.schema import Config
from gpuguard.model import Handoff, RunResult
from gpuguard.pipeline.budget import StageBudget


def unknown_xids(result: RunResult) -> list[tuple[int, str]]:
    """(code, pci) of the Xids this run saw that the catalog does not know."""
    out: dict[tuple[int, str], None] = {}
    for f in result.findings:
        if f.check_id != "gpu.xid":
            continue
        for e in [f.evidence.get("xid")] + list(f.evidence.get("xids") or []):
            if isinstance(e, dict) and e.get("catalog") == "unknown":
                out[(int(e["code"]), str(e.get("pci")))] = None
    return list(out)


def drained_gpu(failing: list[Any]) -> Optional[int]:
    """The one GPU (NVML index) a drain is about: the failing findings name it (an Xid's PCI address resolved by
    gpuguard.checks.xid), and no other GPU. None for a node-wide cause, several GPUs (the event's `gpus` lists
    them) or a GPU no index is known for (its PCI address stays in the evidence). Pure."""
    named = {f.gpu for f in failing if f.gpu is not None}
    return named.pop() if len(named) == 1 else None


def run_events(result: RunResult) -> list[Any]:
    """What a human should hear about this run: a drain (or a prolog that failed a job without being able to
    drain), an earlier pending drain applied, an undrain or the end of gpuguard's drain (both resolve the drain's
    alert: same dedupe key), a node pinned as FLAPPING, unknown Xids, and what the run decided to page about (the
    drain-storm guard, a broken configuration). Hardware alerts name the GPUs by UUID and serial."""
    from gpuguard.notify import Event, gpu_identities

    ctx, v = result.context, result.verdict
    p = v.primary
    failing = ([p] if p else []) + [f for f in v.failing if f is not p]
    gpus = gpu_identities(getattr(result.observations, "nvml", None), (f.gpu for f in failing))
    base = dict(node=ctx.node, job_id=ctx.job_id, check_id=p.check_id if p else None,
                evidence=dict(p.evidence) if p else {}, gpus=gpus, gpu=drained_gpu(failing))
    events: list[Any] = []
    drain = result.drain or {}
    if drain.get("outcome") == "done":
        events.append(Event(kind="drain", severity="critical", message=p.message if p else (v.reason or ""),
                            reason=v.reason, action=f"{v.action.value}: {p.remediation}" if p else v.action.value,
                            **base))
    elif v.outcome == "drain" and ctx.kind == "prolog" and drain.get("outcome") in ("foreign", "failed"):
        events.append(Event(kind="prolog_failure", severity="critical",
                            message=f"{p.message if p else v.reason} (drain {drain['outcome']}: {drain['detail']})",
                            reason=v.reason, action=p.remediation if p else None, **base))
    elif v.outcome == "drain" and drain.get("outcome") == "failed" and drain.get("pending"):
        # slurmctld did not take it: the drain waits in the journal (prologs refuse jobs meanwhile) and is paged
        # now, once; the page when it is applied says so (result.applied)
        events.append(Event(kind="drain", severity="critical", reason=v.reason,
                            message=f"drain PENDING, Slurm did not take it ({drain['detail']}): "
                                    f"{p.message if p else v.reason}; jobs are refused until it is applied",
                            action=f"{v.action.value}: {p.remediation}" if p else v.action.value,
                            **dict(base, evidence={**base["evidence"], "drain": "pending"})))
    for a in result.applied:
        pd = a["pending"]
        if pd.op == "drain" and a["outcome"] == "done":
            events.append(Event(kind="drain", severity="critical", node=ctx.node, check_id=pd.check_id,
                                reason=pd.reason, action=pd.action,
                                message=f"drained after slurmctld came back ({pd.attempts + 1} attempts): {pd.reason}"))
    events.extend(_undrain_events(result))
    for code, pci in unknown_xids(result):  # warned, never drained: a human decides what the new code means
        events.append(Event(kind="unknown_xid", severity="warning", node=ctx.node, job_id=ctx.job_id,
                            check_id="gpu.xid", message=f"Xid {code} on {pci} is not in gpuguard's Xid catalog "
                            "(a newer driver?): recorded and alerted, the node was not drained",
                            evidence={"xid": code, "pci": pci}))
    events.extend(mismatch_events(result))
    events.extend(result.events)
    return events


def mismatch_events(result: RunResult) -> list[Any]:
    """Warned, never drained, alerted once: a node whose hardware differs from its profile the first time it is
    seen (a launch choice: fewer EFA interfaces than the instance type has), a disk check on a path users can
    write (a user filling /tmp must not drain the node, but an admin should know)."""
    from gpuguard.notify import Event

    out = []
    for f in result.findings:
        if f.severity.value != "warn" or not (f.evidence.get("first_seen") or f.evidence.get("user_writable")):
            continue
        out.append(Event(kind="mismatch", severity="warning", node=result.context.node, check_id=f.check_id,
                         gpu=f.gpu, message=f.message, action=f.remediation or None, evidence=dict(f.evidence)))
    return out


def _undrain_events(result: RunResult) -> list[Any]:
    from gpuguard.notify import Event

    node = result.context.node
    u = result.undrain or {}
    check = u.get("check_id")
    if u.get("outcome") == "done":
        return [Event(kind="undrain", severity="info", node=node, check_id=check, message=f"undrained: {u['detail']}")]
    if u.get("outcome") == "gone":  # resumed or taken over outside gpuguard: its drain alert is over
        return [Event(kind="undrain", severity="info", node=node, check_id=check,
                      message=f"gpuguard's drain ended outside gpuguard: {u['detail']}",
                      action="none from gpuguard: the node is no longer drained by it")]
    if u.get("outcome") == "flapping":
        return [Event(kind="flapping", severity="critical", node=node, check_id=check,
                      message=f"pinned drained as FLAPPING: {u['detail']}",
                      action="hardware inspection; then gpuguard undrain --force")]
    return []


def notify_configured(cfg: Config) -> bool:
    """Anything to receive notifications (gpuguard.notify.api.enabled's test, without importing notify)."""
    return cfg.notify.receivers


def tell_humans(cfg: Config, result: RunResult, budget: StageBudget, defer: bool = False) -> None:
    """Metrics, then notifications (their budget: gpuguard.notify.budget). `defer`: run by slurmd, whose hook process
    ends right after: the messages are spooled, `result.handoff` says so, and a process of its own delivers them
    after the hook (gpuguard.notify.handoff)."""
    try:
        if cfg.metrics.textfile_dir:
            from gpuguard.metrics.node import write_run_metrics  # cold path: only where metrics are configured

            # the store is shared with the other hooks of a burst: wait for it like the run's own records do
            write_run_metrics(cfg, result, store_timeout_s=min(5.0, max(1.0, budget.remaining() / 4)))
        if not notify_configured(cfg):
            return  # every event would be "disabled": nothing to build, nothing to import
        if not (result.drain or result.undrain or result.applied or result.events
                or result.context.kind == "healthcheck" or unknown_xids(result)
                or any(f.evidence.get("first_seen") or f.evidence.get("user_writable") for f in result.findings)):
            return  # nothing to tell: keep the healthy prolog's path free of the notify import
        events = run_events(result)
        if events or result.context.kind == "healthcheck":
            from gpuguard.notify import emit, flush
            from gpuguard.notify.budget import emit_budget_s, flush_budget_s

            handoff = Handoff() if defer else None
            for ev in events:
                emit(cfg, ev, budget_s=emit_budget_s(budget.remaining()), defer=handoff)
            if result.context.kind == "healthcheck":  # deliver what earlier runs had to spool
                flush(cfg, budget_s=flush_budget_s(budget.remaining()), defer=handoff)
            result.handoff = bool(handoff and handoff.wanted)
    except Exception:  # noqa: BLE001 - telling humans must never change what the run decided
        pass
