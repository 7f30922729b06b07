"""Small constructors shared by the checks, so every finding is built the same way."""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.model import Action, Finding, GpuInfo, NvmlObservation, Severity


def ok(check_id: str, message: str, **evidence: Any) -> Finding:
    return Finding(check_id, Severity.OK, message, evidence=evidence)


def skip(check_id: str, message: str) -> Finding:
    return Finding(check_id, Severity.SKIP, message)


def warn(check_id: str, keyword: str, message: str, remediation: str = "", gpu: Optional[int] = None,
         **evidence: Any) -> Finding:
    return Finding(check_id, Severity.WARN, message, keyword=keyword, remediation=remediation, gpu=gpu,
                   evidence=evidence)


def fail(check_id: str, keyword: str, message: str, remediation: str, action: Action = Action.DRAIN,
         gpu: Optional[int] = None, **evidence: Any) -> Finding:
    return Finding(check_id, Severity.FAIL, message, keyword=keyword, remediation=remediation, action=action,
                   gpu=gpu, evidence=evidence)


def mismatch(check_id: str, keyword: str, message: str, remediation: str, severity: str = "warn",
             gpu: Optional[int] = None, **evidence: Any) -> Finding:
    """The node is not configured as its profile says (CPU count, memory size, GPU model, ECC mode, ...). Applied to
    a whole fleet at once, a wrong profile or a deliberate setting would drain every node, so this warns by default
    and, when a site asks for `severity: fail`, drains for an admin: never a reboot or replace, which cannot fix a
    setting and would escalate."""
    if severity == "fail":
        return fail(check_id, keyword, message, remediation, Action.DRAIN, gpu=gpu, mismatch=True, **evidence)
    return warn(check_id, keyword, message, remediation, gpu=gpu, mismatch=True, **evidence)


def incomplete(check_id: str, keyword: str, message: str, **evidence: Any) -> Finding:
    return Finding(check_id, Severity.INCOMPLETE, message, keyword=keyword,
                   remediation="see why the probe could not finish (timeout, missing tool, permissions)",
                   evidence=evidence)


NO_DRIVER = ("LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED")


def nvml_unavailable(check_id: str, keyword: str, nvml: Optional[NvmlObservation],
                     expects_gpus: bool = True) -> Optional[Finding]:
    """A finding that stands in for the check when NVML gave no usable data: `skip` on a node that has no
    NVIDIA driver and is not expected to have GPUs (a CPU node), else `incomplete` (gpu.nvml reports why)."""
    if nvml is None:
        return incomplete(check_id, keyword, "NVML was not read")
    if nvml.init_error in NO_DRIVER and not expects_gpus:
        return skip(check_id, "no NVIDIA driver on a node that is not expected to have GPUs")
    if nvml.init_error or (not nvml.gpus and not nvml.status.complete):
        return incomplete(check_id, keyword, f"NVML unavailable ({nvml.init_error or nvml.status.error}); see gpu.nvml")
    return None


def job_gpus(nvml: NvmlObservation, wanted: Optional[tuple[int, ...]]) -> list[GpuInfo]:
    """The GPUs a check should look at: the job's (by index) or all; GPUs NVML lost are left out."""
    gpus = [g for g in nvml.gpus if g.fatal_error is None]
    if wanted is None:
        return gpus
    want = set(wanted)
    return [g for g in gpus if g.index in want]


def gpu_label(g: GpuInfo) -> str:
    return f"GPU {g.index} ({g.pci_bus_id})" if g.pci_bus_id else f"GPU {g.index}"
