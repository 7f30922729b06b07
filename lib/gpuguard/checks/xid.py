"""gpu.xid: fatal Xids in the kernel log since the last check drain the node.

`judge_kernel_log` is the one Xid verdict: the hooks (through `check_xid`), the watch daemon and `gpuguard xid scan`
all judge their kernel-log observations with it, and `xid_info` is how it reads one event (the catalog entry,
with the driver's own Fatal/Nonfatal token for NVLink5 Xids 144-150 and Xid 154's recovery action)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from gpuguard.checks._util import fail, incomplete, ok, spec_of, warn
from gpuguard.checks.inventory import known_pci
from gpuguard.checks.spec import CheckInput, CheckSpec
from gpuguard.model import Action, Finding, GpuInfo, KernelLogObservation, Observations, XidEvent
from gpuguard.util.pci import pci_key

if TYPE_CHECKING:
    from gpuguard.xid.catalog import XidCatalog, XidInfo

_ACTIONS = {"none": Action.DRAIN, "drain": Action.DRAIN, "reset": Action.RESET, "reboot": Action.REBOOT,
            "replace": Action.REPLACE}


# what "recorded, not a node fault" is about, per run kind
_WHERE = {"epilog": "during the job", "watch": "in the kernel log", "scan": "in the log"}


def _gpu_for(event: XidEvent, gpus: Sequence[GpuInfo]) -> Optional[GpuInfo]:
    """NVML's GPU at the Xid line's PCI address (the kernel writes `0000:86:00`, NVML `00000000:86:00.0`)."""
    want = pci_key(event.pci)
    for g in gpus:
        if g.pci_bus_id and pci_key(g.pci_bus_id) == want:
            return g
    return None


def _gpu_index(event: XidEvent, gpus: Sequence[GpuInfo], known: Mapping[str, Any]) -> Optional[int]:
    """The GPU index of the Xid's PCI address: from NVML, else (a GPU fallen off the bus is missing from NVML) from
    the addresses this node's GPUs had in earlier runs (the inventory in the store, `known`)."""
    g = _gpu_for(event, gpus)
    if g is not None:
        return g.index
    idx = known.get(pci_key(event.pci))
    return int(idx) if isinstance(idx, (int, str)) and str(idx).isdigit() else None


def xid_info(event: XidEvent, catalog: "XidCatalog") -> "XidInfo":
    """What one Xid event is: its catalog entry, resolved with the event's own message (Xid 154 names its recovery
    action, Xids 144-150 carry the driver's Fatal/Nonfatal verdict)."""
    return catalog.resolve(event.code, event.detail)


def check_xid(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    if obs.kernel_log is None:
        return [incomplete(s, "kernel log not read")]
    if inp.xid_catalog is None and obs.kernel_log.events:
        return [incomplete(s, "Xid catalog not loaded")]
    return judge_kernel_log(obs.kernel_log, inp.xid_catalog, gpus=obs.nvml.gpus if obs.nvml else [], kind=inp.kind,
                            spec=s, known=known_pci(obs))


def judge_kernel_log(log: KernelLogObservation, catalog: Optional["XidCatalog"], *, spec: CheckSpec,
                     gpus: Sequence[GpuInfo] = (), kind: str = "manual",
                     known: Mapping[str, Any] = {}) -> list[Finding]:  # noqa: B006 - read only
    """The gpu.xid findings for the Xid events of a kernel-log observation (`spec`: gpu.xid's, from the registry;
    `gpus`: NVML's, to name GPU indices; `known`: {PCI address: index} the node's GPUs had before, for a GPU NVML
    no longer sees). A finding whose GPU has no known index keeps its PCI address (evidence `pci`)."""
    s = spec
    findings: list[Finding] = []
    fatal: list[tuple[XidEvent, "XidInfo"]] = []
    recorded: list[dict[str, object]] = []
    if log.events and catalog is None:  # None only for a log without events (gpuguard.pipeline.evaluate)
        raise ValueError("judging Xid events needs the Xid catalog")
    for ev in log.events:
        info = xid_info(ev, catalog)  # type: ignore[arg-type]
        entry = {"code": ev.code, "pci": ev.pci, "severity": info.severity, "detail": ev.detail[:160],
                 "catalog": info.source}  # "unknown": a code gpuguard's catalog does not know (alerted, not drained)
        recorded.append(entry)
        if info.severity == "fatal":
            fatal.append((ev, info))
        elif info.severity == "warn":
            findings.append(warn(s, f"Xid {ev.code} ({info.name}) on {ev.pci}", info.nvidia_action_text or "",
                                 keyword=f"XID{ev.code}", gpu=_gpu_index(ev, gpus, known), xid=entry, pci=ev.pci))
    if fatal:
        # One finding per GPU (the most invasive action wins); the reason names the first fatal Xid.
        by_pci: dict[str, list[tuple[XidEvent, "XidInfo"]]] = {}
        for ev, info in fatal:
            by_pci.setdefault(ev.pci, []).append((ev, info))
        for pci, items in by_pci.items():
            ev, info = max(items, key=lambda x: _ACTIONS.get(x[1].action, Action.DRAIN).rank)
            action = _ACTIONS.get(info.action, Action.DRAIN)
            codes = sorted({e.code for e, _ in items})
            index = _gpu_index(ev, gpus, known)
            where = f"GPU {index} {pci}" if index is not None else pci
            extra = f" (also Xid {','.join(map(str, [c for c in codes if c != ev.code]))})" if len(codes) > 1 else ""
            findings.append(fail(s, f"{info.name} on {where}{extra}",
                                 info.nvidia_action_text or "see `gpuguard xid explain %d`" % ev.code,
                                 action, keyword=f"XID{ev.code}", gpu=index, pci=pci,
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
