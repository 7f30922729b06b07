"""Small constructors shared by the checks, so every finding is built the same way: from the check's own spec
(its id, and its default keyword unless a finding names a more precise one it declares)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from gpuguard.model import Action, Finding, GpuInfo, NvmlObservation, Observations, Severity
from gpuguard.util.record import Frozen, field, record

if TYPE_CHECKING:
    from gpuguard.checks.spec import CheckInput, CheckSpec


def spec_of(inp: "CheckInput") -> "CheckSpec":
    """The spec of the check being run (set by CheckSpec.__call__)."""
    if inp.spec is None:
        raise ValueError("check run without its spec: call it through its CheckSpec (spec(obs, inp))")
    return inp.spec


def ok(spec: "CheckSpec", message: str, **evidence: Any) -> Finding:
    return Finding(spec.id, Severity.OK, message, evidence=evidence)


def skip(spec: "CheckSpec", message: str, **evidence: Any) -> Finding:
    return Finding(spec.id, Severity.SKIP, message, evidence=evidence)


def warn(spec: "CheckSpec", message: str, remediation: str = "", *, keyword: Optional[str] = None,
         gpu: Optional[int] = None, **evidence: Any) -> Finding:
    return Finding(spec.id, Severity.WARN, message, keyword=keyword or spec.keyword, remediation=remediation,
                   gpu=gpu, evidence=evidence)


def fail(spec: "CheckSpec", message: str, remediation: str, action: Action = Action.DRAIN, *,
         keyword: Optional[str] = None, gpu: Optional[int] = None, **evidence: Any) -> Finding:
    return Finding(spec.id, Severity.FAIL, message, keyword=keyword or spec.keyword, remediation=remediation,
                   action=action, gpu=gpu, evidence=evidence)


def mismatch(spec: "CheckSpec", message: str, remediation: str, severity: str = "warn", *,
             gpu: Optional[int] = None, **evidence: Any) -> Finding:
    """The node is not configured as its profile says (CPU count, memory size, GPU model, ECC mode, ...). Applied to
    a whole fleet at once, a wrong profile or a deliberate setting would drain every node, so this warns by default
    and, when a site asks for `severity: fail`, drains for an admin: never a reboot or replace, which cannot fix a
    setting and would escalate."""
    if severity == "fail":
        return fail(spec, message, remediation, Action.DRAIN, gpu=gpu, mismatch=True, **evidence)
    return warn(spec, message, remediation, gpu=gpu, mismatch=True, **evidence)


def incomplete(spec: "CheckSpec", message: str, *, keyword: Optional[str] = None, unsupported: bool = False,
               gpu: Optional[int] = None, remediation: str = "", **evidence: Any) -> Finding:
    """The check could not judge. `unsupported`: because the driver or GPU answered NOT_SUPPORTED, which is the
    same on every node of a platform: it never counts as clear and never escalates to a drain (evidence
    {"unsupported": true}); any other reason may escalate when it repeats (policy.decide)."""
    if unsupported:
        evidence["unsupported"] = True
    return Finding(spec.id, Severity.INCOMPLETE, message, keyword=keyword or spec.keyword,
                   remediation=remediation or "see why the probe could not finish (timeout, missing tool, "
                                              "permissions)", gpu=gpu, evidence=evidence)


NO_DRIVER = ("LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED")


def nvml_unavailable(spec: "CheckSpec", nvml: Optional[NvmlObservation],
                     expects_gpus: bool = True) -> Optional[Finding]:
    """A finding that stands in for the check when NVML gave no usable data: `skip` on a node that has no
    NVIDIA driver and is not expected to have GPUs (a CPU node), else `incomplete` (gpu.nvml reports why)."""
    if nvml is None:
        return incomplete(spec, "NVML was not read")
    if nvml.init_error in NO_DRIVER and not expects_gpus:
        return skip(spec, "no NVIDIA driver on a node that is not expected to have GPUs")
    if nvml.init_error or (not nvml.gpus and not nvml.status.complete):
        return incomplete(spec, f"NVML unavailable ({nvml.init_error or nvml.status.error}); see gpu.nvml")
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


# --------------------------------------------------------------------------- values NVML could not read


def unread_fields(g: GpuInfo, fields: Iterable[tuple[str, str]], peers: Sequence[GpuInfo],
                  present: bool = False) -> dict[str, str]:
    """The values a check needs from GPU `g` that NVML did not give although the GPU has them: query -> why (the
    NVML error, or NOT_SUPPORTED). `fields` = (GpuInfo attribute, probe query name). A value counts as one the GPU
    has when NVML answered an error for it, when `present` says so (a mode that is on), or when another GPU of the
    node (`peers`) reports it; a value no GPU of the node reports and no query failed for is a feature these GPUs
    lack (an H100 retires no pages): not listed, the check skips it."""
    handle = g.errors.get("handle")
    out: dict[str, str] = {}
    for attr, query in fields:
        if getattr(g, attr) is not None:
            continue
        err = g.errors.get(query) or handle
        if err:
            out[query] = err
        elif present or any(getattr(p, attr) is not None for p in peers if p is not g):
            out[query] = "NOT_SUPPORTED"
    return out


def unread_finding(spec: "CheckSpec", g: GpuInfo, unread: dict[str, str]) -> Finding:
    """The check cannot judge this GPU: incomplete, never ok. Only NOT_SUPPORTED answers are marked `unsupported`
    (never escalated to a drain); an error (UNKNOWN, TIMEOUT, ...) may escalate when it keeps coming back."""
    what = ", ".join(f"{q} ({why})" for q, why in unread.items())
    return incomplete(spec, f"{gpu_label(g)}: NVML could not read {what}: not judged",
                      unsupported=all(why == "NOT_SUPPORTED" for why in unread.values()), gpu=g.index,
                      unread=dict(unread),
                      remediation=f"`nvidia-smi -q -i {g.index}`; an error that persists points at the GPU or "
                                  "the driver (reset or reboot); NOT_SUPPORTED on one GPU only: compare the GPUs' "
                                  "driver, MIG and ECC modes")


# --------------------------------------------------------------------------- the GPUs an NVML check judges


@record
class NvmlGpus(Frozen):
    """What an NVML check judges: the job's GPUs NVML answered for (`gpus`), beside every GPU it reported (`peers`:
    a value one GPU lacks while a peer reports it was not read, it is not absent). `stand_in`: the finding that
    replaces the check's own when NVML gave no usable data (then there is nothing to judge)."""

    spec: "CheckSpec"
    gpus: list[GpuInfo] = field(default_factory=list)
    peers: list[GpuInfo] = field(default_factory=list)
    stand_in: Optional[Finding] = None

    def unread(self, g: GpuInfo, fields: Iterable[tuple[str, str]], present: bool = False) -> Optional[Finding]:
        """The incomplete finding for the `fields` NVML did not give on `g` although it has them (see
        unread_fields); None when every one was read."""
        missing = unread_fields(g, fields, self.peers, present)
        return unread_finding(self.spec, g, missing) if missing else None

    def judge_each(self, fields: Sequence[tuple[str, str]],
                   judge: Callable[[GpuInfo], Optional[list[Finding]]]) -> tuple[list[Finding], bool]:
        """Each GPU: the incomplete finding when NVML could not read its `fields`, else `judge(g)` (None: this GPU
        lacks the feature and is not judged). Returns the findings and whether any GPU was judged (an unread one
        counts: unknown is never "not supported")."""
        findings: list[Finding] = []
        judged = False
        for g in self.gpus:
            unread = self.unread(g, fields)
            verdict = [unread] if unread else judge(g)
            if verdict is not None:
                judged = True
                findings += verdict
        return findings, judged


def nvml_gpus(spec: "CheckSpec", obs: Observations, inp: "CheckInput") -> NvmlGpus:
    """The GPUs an NVML check judges, or its stand-in finding when NVML gave no usable data (nvml_unavailable)."""
    stand_in = nvml_unavailable(spec, obs.nvml, bool(inp.profile.gpu_count))
    if stand_in is not None or obs.nvml is None:
        return NvmlGpus(spec, stand_in=stand_in)
    return NvmlGpus(spec, job_gpus(obs.nvml, inp.job_gpus), obs.nvml.gpus)
