"""Which GPUs the node has and whether NVML answers: gpu.nvml, gpu.count, gpu.model, gpu.memory."""

from __future__ import annotations

from gpuguard.checks._util import (NO_DRIVER, fail, gpu_label, incomplete, mismatch, nvml_gpus, nvml_unavailable, ok,
                                   skip, spec_of, warn)
from gpuguard.checks.spec import CheckInput
from gpuguard.model import Action, Finding, GpuInfo, Observations

# NVML errors that mean the GPU is unusable until reset/reboot (DESIGN §6: never fail open on these).
_FATAL_ACTIONS = {
    "GPU_IS_LOST": (Action.REBOOT, "the GPU fell off the bus or stopped answering; reboot, replace if it recurs"),
    "RESET_REQUIRED": (Action.RESET, "reset the GPU (nvidia-smi -r) or reboot the node"),
    "GPU_NOT_FOUND": (Action.REBOOT, "the GPU is not visible to the driver; reboot, replace if it recurs"),
}
_INIT_REMEDIATION = {
    "LIBRARY_NOT_FOUND": "install the NVIDIA driver (libnvidia-ml.so.1 not found)",
    "DRIVER_NOT_LOADED": "load the nvidia kernel module / reboot; check `nvidia-smi` and the kernel log",
    "LIB_RM_VERSION_MISMATCH": "the driver was upgraded without a reboot: reboot the node",
    "TIMEOUT": "NVML hung: a GPU is likely wedged; check the kernel log for Xids and reboot",
}


def check_nvml(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    nvml = obs.nvml
    expects_gpus = bool(inp.profile.gpu_count)
    if nvml is None:
        return [skip(s, "NVML not read")]
    if nvml.init_error == "TIMEOUT" or (nvml.status.timed_out and not nvml.gpus):
        return [fail(s, f"NVML did not answer within the deadline ({nvml.status.error or 'timeout'})",
                     _INIT_REMEDIATION["TIMEOUT"], Action.REBOOT, keyword="TIMEOUT")]
    if nvml.init_error:
        if not expects_gpus and nvml.init_error in NO_DRIVER:
            return [skip(s, f"no NVIDIA driver ({nvml.init_error}) and the profile expects no GPUs")]
        return [fail(s, f"NVML init failed: {nvml.init_error}",
                     _INIT_REMEDIATION.get(nvml.init_error, "check `nvidia-smi` and the kernel log; reboot"),
                     Action.REBOOT)]
    if nvml.device_count is None or (nvml.status.error and not nvml.status.timed_out):
        # NVML started but the probe could not finish (gpuguard's binding missing, nvmlDeviceGetCount refused, a
        # probe bug): nothing says the GPUs are fine, and nothing says they are broken
        return [incomplete(s, f"NVML could not be read: {nvml.status.error or 'no device count'}",
                           remediation="see the error; a missing nvidia-ml-py is gpuguard's install, not the node",
                           error=nvml.status.error)]
    findings: list[Finding] = []
    for g in nvml.gpus:
        if g.fatal_error in _FATAL_ACTIONS:
            action, remediation = _FATAL_ACTIONS[g.fatal_error]
            findings.append(fail(s, f"{gpu_label(g)}: NVML says {g.fatal_error}", remediation, action,
                                 gpu=g.index, nvml_error=g.fatal_error))
        elif g.errors:
            findings.append(warn(s, f"{gpu_label(g)}: NVML query errors: "
                                 + ", ".join(f"{k}={v}" for k, v in sorted(g.errors.items())),
                                 "check `nvidia-smi -q -i %d`" % g.index, gpu=g.index, errors=dict(g.errors)))
    if nvml.status.timed_out:
        findings.append(fail(s, "NVML stopped answering part-way through the GPU queries",
                             _INIT_REMEDIATION["TIMEOUT"], Action.REBOOT, keyword="TIMEOUT"))
    no_persistence = [g.index for g in nvml.gpus if g.persistence_mode is False]
    slow = nvml.slow_answer_s
    if slow is not None:
        # It answered, only late: a wedged GPU never answers; a driver without persistence mode re-initialises
        # every GPU on each nvmlInit (seconds per GPU). Not a hang: warn and say why.
        why = (f"persistence mode is off on GPU {_indices(no_persistence)}: each NVML start re-initialises the "
               "GPUs" if no_persistence else "persistence mode is on: look for a struggling GPU or driver")
        findings.append(warn(s, f"NVML answered only after {slow:.1f}s (nvmlInit {nvml.init_duration_s or 0:.1f}s); "
                             f"{why}", "enable persistence: `systemctl enable --now nvidia-persistenced` "
                             "(or `nvidia-smi -pm 1`)", answer_s=round(slow, 2), init_s=nvml.init_duration_s,
                             persistence_off=no_persistence))
    if not findings:
        pm = f"; persistence mode off on GPU {_indices(no_persistence)}" if no_persistence else ""
        findings.append(ok(s, f"NVML answers (driver {nvml.driver_version}, {nvml.device_count} GPUs{pm})",
                           driver=nvml.driver_version, init_s=nvml.init_duration_s, persistence_off=no_persistence))
    return findings


def _indices(idx: list[int]) -> str:
    return ",".join(map(str, idx[:8])) + (f" +{len(idx) - 8} more" if len(idx) > 8 else "")


def check_count(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    expected = inp.profile.gpu_count
    if expected is None:
        return [skip(s, "profile sets no gpu_count")]
    bad = nvml_unavailable(s, obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    seen = obs.nvml.device_count or 0
    findings: list[Finding] = []
    if seen < expected:
        findings.append(fail(s, f"{expected} GPUs expected, NVML sees {seen}",
                             "a GPU fell off the bus or is not enumerated: check `lspci | grep -i nvidia` and the "
                             "kernel log; reboot, replace if it stays missing", Action.REBOOT,
                             expected=expected, seen=seen))
    elif seen > expected:
        findings.append(warn(s, f"{expected} GPUs expected, NVML sees {seen}",
                             "the node profile looks wrong for this node", expected=expected, seen=seen))
    if inp.unmapped_gpus:
        # Slurm named a GPU NVML does not have (a MIG GRES index, a gres.conf in another order, or a GPU that is
        # gone, which the count above catches as hardware evidence): job-scoped checks lose that GPU, nothing drains.
        findings.append(warn(s, f"Slurm GPU id {','.join(inp.unmapped_gpus[:4])} matches no GPU NVML "
                             "reports" + (f" ({'; '.join(inp.gpu_map_notes)})" if inp.gpu_map_notes else ""),
                             "compare gres.conf (File=/dev/nvidiaN is minor number N) with `nvidia-smi -q | grep "
                             "-e Minor -e UUID`; set slurm.gpu_ids: nvml_index if your gres.conf is in NVML order",
                             unmapped=list(inp.unmapped_gpus), notes=list(inp.gpu_map_notes)))
    return findings or [ok(s, f"{seen} GPUs present", seen=seen)]


def check_model(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    model = inp.profile.gpu_model
    if not model:
        return [skip(s, "profile sets no gpu_model")]
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    severity = inp.params.get("severity", "warn")

    def other_model(g: GpuInfo) -> list[Finding]:
        if g.name is None or model.lower() in g.name.lower():
            return []
        return [mismatch(s, f"{gpu_label(g)} is {g.name!r}, expected {model!r}",
                         "the node is not the instance type its profile says: fix node.profile", severity,
                         gpu=g.index, name=g.name)]

    findings, _ = nv.judge_each([("name", "name")], other_model)
    return findings or [ok(s, f"GPU model {model}")]


def check_memory(obs: Observations, inp: CheckInput) -> list[Finding]:
    s = spec_of(inp)
    expected = inp.profile.gpu_memory_mib
    if not expected:
        return [skip(s, "profile sets no gpu_memory_mib")]
    nv = nvml_gpus(s, obs, inp)
    if nv.stand_in:
        return [nv.stand_in]
    tol = inp.params.get("tolerance_pct")
    tol = inp.profile.gpu_memory_tolerance_pct if tol is None else tol
    floor = expected * (1 - tol / 100.0)
    severity = inp.params.get("severity", "warn")

    def smaller(g: GpuInfo) -> list[Finding]:
        if g.memory_total_mib is None or g.memory_total_mib >= floor:
            return []
        return [mismatch(s, f"{gpu_label(g)} has {g.memory_total_mib} MiB, expected {expected} MiB",
                         "framebuffer smaller than the profile says: check the profile, the ECC and MIG modes and "
                         "the driver version; then hardware inspection", severity, gpu=g.index,
                         total_mib=g.memory_total_mib, expected_mib=expected)]

    findings, _ = nv.judge_each([("memory_total_mib", "memory")], smaller)
    return findings or [ok(s, f"GPU memory >= {int(floor)} MiB")]
