"""gpu.xid: fatal Xids in the kernel log since the last check drain the node.

`judge_kernel_log` is the one Xid verdict: the hooks (through `check_xid`), the watch daemon and `gpuguard xid scan`
all judge their kernel-log observations with it, and `xid_info` is how it reads one event (the catalog entry,
with the driver's own Fatal/Nonfatal token for NVLink5 Xids 144-150 and Xid 154's recovery action)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from gpuguard.checks._util import fail, incomplete, ok, spec_of, warn
from gpuguard.checks.spec import CheckInput, CheckSpec
from gpuguard.model import Action, Finding, GpuInfo, KernelLogObservation, Observations, XidEvent

if TYPE_CHECKING:
    from gpuguard.xid.catalog import XidCatalog, XidInfo

_ACTIONS = {"none": Action.DRAIN, "drain": Action.DRAIN, "reset": Action.RESET, "reboot": Action.REBOOT,
            "replace": Action.REPLACE}


# what "recorded, not a node fault" is about, per run kind
_WHERE = {"epilog": "during the job", "watch": "in the kernel log", "scan": "in the log"}


def _gpu_for(event: XidEvent, gpus: Sequence[GpuInfo]) -> Optional[GpuInfo]:
    for g in gpus:
        if g.pci_bus_id and g.pci_bus_id.lower().startswith(event.pci.lower()):
            return g
    return None


def xid_info(event: XidEvent, catalog: "XidCatalog") -> "XidInfo":
    """What one Xid event is: its catalog entry, resolved with the event's own message (Xid 154 names its recovery
    action, Xids 144-150 carry the driver's Fatal/Nonfatal verdict)."""
    return catalog.resolve(event.code, event.detail)


def check_xid(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    if obs.kernel_log is None:
        return [incomplete(s, "kernel log not read")]
    if inp.xid_catalog is None:
        return [incomplete(s, "Xid catalog not loaded")]
    return judge_kernel_log(obs.kernel_log, inp.xid_catalog, gpus=obs.nvml.gpus if obs.nvml else [], kind=inp.kind,
                            spec=s)


def judge_kernel_log(log: KernelLogObservation, catalog: "XidCatalog", *, spec: CheckSpec,
                     gpus: Sequence[GpuInfo] = (), kind: str = "manual") -> list[Finding]:
    """The gpu.xid findings for the Xid events of a kernel-log observation (`spec`: gpu.xid's, from the registry;
    `gpus`: NVML's, to name GPU indices)."""
    s = spec
    findings: list[Finding] = []
    fatal: list[tuple[XidEvent, "XidInfo"]] = []
    recorded: list[dict[str, object]] = []
    for ev in log.events:
        info = xid_info(ev, catalog)
        entry = {"code": ev.code, "pci": ev.pci, "severity": info.severity, "detail": ev.detail[:160],
                 "catalog": info.source}  # "unknown": a code gpuguard's catalog does not know (alerted, not drained)
        recorded.append(entry)
        if info.severity == "fatal":
            fatal.append((ev, info))
        elif info.severity == "warn":
            g = _gpu_for(ev, gpus)
            findings.append(warn(s, f"Xid {ev.code} ({info.name}) on {ev.pci}", info.nvidia_action_text or "",
                                 keyword=f"XID{ev.code}", gpu=g.index if g else None, xid=entry))
    if fatal:
        # One finding per GPU (the most invasive action wins); the reason names the first fatal Xid.
        by_pci: dict[str, list[tuple[XidEvent, "XidInfo"]]] = {}
        for ev, info in fatal:
            by_pci.setdefault(ev.pci, []).append((ev, info))
        for pci, items in by_pci.items():
            ev, info = max(items, key=lambda x: _ACTIONS.get(x[1].action, Action.DRAIN).rank)
            action = _ACTIONS.get(info.action, Action.DRAIN)
            codes = sorted({e.code for e, _ in items})
            g = _gpu_for(ev, gpus)
            where = f"GPU {g.index} {pci}" if g else pci
            extra = f" (also Xid {','.join(map(str, [c for c in codes if c != ev.code]))})" if len(codes) > 1 else ""
            findings.append(fail(s, f"{info.name} on {where}{extra}",
                                 info.nvidia_action_text or "see `gpuguard xid explain %d`" % ev.code,
                                 action, keyword=f"XID{ev.code}", gpu=g.index if g else None,
                                 xids=[e.code for e, _ in items],
                                 first=ev.raw[:300], nvidia_action=info.nvidia_action))
    if log.rejected_non_kernel:
        findings.append(warn(s, f"{log.rejected_non_kernel} Xid-looking line(s) not from the kernel ignored",
                             "someone wrote fake NVRM lines to the log (logger?); investigate, the node is not drained "
                             "for them", rejected=log.rejected_non_kernel))
    if not log.status.complete:
        findings.append(incomplete(s, f"kernel log {log.source} not fully read: {log.status.error}"))
    if not findings:
        codes = sorted({int(e["code"]) for e in recorded})  # type: ignore[call-overload]
        where = _WHERE.get(kind, "since the last check")
        msg = f"no Xid {where}" if not codes else \
            f"non-fatal Xid {', '.join(map(str, codes))} {where}: recorded, not a node fault"
        findings.append(ok(s, msg, xids=recorded, malformed=log.malformed, source=log.source))
    return findings
