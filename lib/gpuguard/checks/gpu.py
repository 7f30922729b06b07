"""GPU checks over the NVML observation. Pure functions: no I/O, no clock, no Slurm."""

from __future__ import annotations

from gpuguard.checks import CheckInput
from gpuguard.checks._util import (NO_DRIVER, fail, gpu_label, incomplete, job_gpus, mismatch, nvml_unavailable,
                                   ok, skip, warn)
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
    cid = "gpu.nvml"
    nvml = obs.nvml
    expects_gpus = bool(inp.profile.gpu_count)
    if nvml is None:
        return [skip(cid, "NVML not read")]
    if nvml.init_error == "TIMEOUT" or (nvml.status.timed_out and not nvml.gpus):
        return [fail(cid, "TIMEOUT", f"NVML did not answer within the deadline ({nvml.status.error or 'timeout'})",
                     _INIT_REMEDIATION["TIMEOUT"], Action.REBOOT)]
    if nvml.init_error:
        if not expects_gpus and nvml.init_error in NO_DRIVER:
            return [skip(cid, f"no NVIDIA driver ({nvml.init_error}) and the profile expects no GPUs")]
        return [fail(cid, "NVML", f"NVML init failed: {nvml.init_error}",
                     _INIT_REMEDIATION.get(nvml.init_error, "check `nvidia-smi` and the kernel log; reboot"),
                     Action.REBOOT)]
    findings: list[Finding] = []
    for g in nvml.gpus:
        if g.fatal_error in _FATAL_ACTIONS:
            action, remediation = _FATAL_ACTIONS[g.fatal_error]
            findings.append(fail(cid, "NVML", f"{gpu_label(g)}: NVML says {g.fatal_error}", remediation, action,
                                 gpu=g.index, nvml_error=g.fatal_error))
        elif g.errors:
            findings.append(warn(cid, "NVML", f"{gpu_label(g)}: NVML query errors: "
                                 + ", ".join(f"{k}={v}" for k, v in sorted(g.errors.items())),
                                 "check `nvidia-smi -q -i %d`" % g.index, gpu=g.index, errors=dict(g.errors)))
    if nvml.status.timed_out:
        findings.append(fail(cid, "TIMEOUT", "NVML stopped answering part-way through the GPU queries",
                             _INIT_REMEDIATION["TIMEOUT"], Action.REBOOT))
    no_persistence = [g.index for g in nvml.gpus if g.persistence_mode is False]
    slow = nvml.slow_answer_s
    if slow is not None:
        # It answered, only late: a wedged GPU never answers; a driver without persistence mode re-initialises
        # every GPU on each nvmlInit (seconds per GPU). Not a hang: warn and say why.
        why = (f"persistence mode is off on GPU {_indices(no_persistence)}: each NVML start re-initialises the "
               "GPUs" if no_persistence else "persistence mode is on: look for a struggling GPU or driver")
        findings.append(warn(cid, "NVML", f"NVML answered only after {slow:.1f}s (nvmlInit {nvml.init_duration_s or 0:.1f}s); "
                             f"{why}", "enable persistence: `systemctl enable --now nvidia-persistenced` "
                             "(or `nvidia-smi -pm 1`)", answer_s=round(slow, 2), init_s=nvml.init_duration_s,
                             persistence_off=no_persistence))
    if not findings:
        pm = f"; persistence mode off on GPU {_indices(no_persistence)}" if no_persistence else ""
        findings.append(ok(cid, f"NVML answers (driver {nvml.driver_version}, {nvml.device_count} GPUs{pm})",
                           driver=nvml.driver_version, init_s=nvml.init_duration_s, persistence_off=no_persistence))
    return findings


def _indices(idx: list[int]) -> str:
    return ",".join(map(str, idx[:8])) + (f" +{len(idx) - 8} more" if len(idx) > 8 else "")


# NVML_GPU_FABRIC_STATE_* and the NVML_GPU_FABRIC_HEALTH_MASK_* fields (nvml.h, R550+)
FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
_HEALTH_FIELDS = (  # (name, shift, width mask, value that is bad, what it means)
    ("degraded_bw", 0, 0x3, 1, "NVLink bandwidth degraded"),
    ("route_recovery", 2, 0x3, 1, "route recovery in progress"),
    ("route_unhealthy", 4, 0x3, 1, "route unhealthy"),
    ("access_timeout_recovery", 6, 0x3, 1, "access-timeout recovery in progress"),
)


def decode_fabric_health(mask: int) -> dict[str, int]:
    """healthMask -> {field: value}; 0 = not supported, 1 = TRUE (bad), 2 = FALSE; incorrect_configuration (4 bits
    at shift 8): 0 not supported, 1 none, 2.. a reason."""
    out = {name: (mask >> shift) & width for name, shift, width, _, _ in _HEALTH_FIELDS}
    out["incorrect_configuration"] = (mask >> 8) & 0xF
    return out


_INCORRECT_CONFIG = {2: "incorrect SysGUID", 3: "incorrect chassis serial", 4: "no partition",
                     5: "insufficient NVLinks", 6: "incompatible GPU firmware", 7: "invalid location",
                     8: "GPU state invalid"}


def check_fabric(obs: Observations, inp: CheckInput) -> list[Finding]:
    """NVSwitch systems (HGX H100/H200/B200): Fabric Manager must have registered every GPU in the NVLink fabric,
    or CUDA refuses to start ("system not yet initialized"). NVIDIA's Fabric Manager guide checks it with
    `nvidia-smi -q` (Fabric: State Completed, Status Success), which is nvmlDeviceGetGpuFabricInfo."""
    cid = "gpu.fabric"
    if not inp.profile.nvswitch:
        return [skip(cid, "profile is not an NVSwitch system")]
    bad = nvml_unavailable(cid, "FABRIC", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    findings: list[Finding] = []
    judged = False
    remedy = ("check Fabric Manager: `systemctl status nvidia-fabricmanager` (same version as the driver), its log "
              "(/var/log/fabricmanager.log) and `nvidia-smi -q | grep -A3 Fabric`")
    for g in job_gpus(obs.nvml, inp.job_gpus):
        state = g.fabric_state
        if state is None or state == 0:
            continue  # a GPU/driver that does not report fabric state (A100, older drivers)
        judged = True
        name = FABRIC_STATES.get(state, str(state))
        if state == 1:
            findings.append(fail(cid, "FABRIC", f"{gpu_label(g)}: NVLink fabric NOT_STARTED (Fabric Manager not "
                                 "running?)", remedy, Action.DRAIN, gpu=g.index, state=name))
        elif state == 2:
            findings.append(incomplete(cid, "FABRIC", f"{gpu_label(g)}: NVLink fabric registration IN_PROGRESS",
                                       gpu=g.index, state=name))
        elif g.fabric_status not in (None, 0):
            findings.append(fail(cid, "FABRIC", f"{gpu_label(g)}: NVLink fabric registration failed (status "
                                 f"{g.fabric_status})", remedy + "; reset/reboot; replace if it recurs", Action.REBOOT,
                                 gpu=g.index, state=name, status=g.fabric_status))
        elif g.fabric_health_mask:
            health = decode_fabric_health(g.fabric_health_mask)
            bad_fields = [what for name_, _, _, badv, what in _HEALTH_FIELDS if health[name_] == badv]
            conf = health["incorrect_configuration"]
            if conf >= 2:
                findings.append(fail(cid, "FABRIC", f"{gpu_label(g)}: NVLink fabric incorrect configuration: "
                                     f"{_INCORRECT_CONFIG.get(conf, conf)}", remedy, Action.DRAIN, gpu=g.index,
                                     health=health))
            if bad_fields:
                findings.append(fail(cid, "FABRIC", f"{gpu_label(g)}: {', '.join(bad_fields)}", remedy
                                     + "; reset/reboot", Action.REBOOT, gpu=g.index, health=health))
    if not judged:
        return [skip(cid, "no GPU reports an NVLink fabric state (driver or GPU without fabric info)")]
    return findings or [ok(cid, "every GPU registered in the NVLink fabric (state COMPLETED, status success)")]


def check_count(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.count"
    expected = inp.profile.gpu_count
    if expected is None:
        return [skip(cid, "profile sets no gpu_count")]
    bad = nvml_unavailable(cid, "GPUCOUNT", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    seen = obs.nvml.device_count or 0
    findings: list[Finding] = []
    if seen < expected:
        findings.append(fail(cid, "GPUCOUNT", f"{expected} GPUs expected, NVML sees {seen}",
                             "a GPU fell off the bus or is not enumerated: check `lspci | grep -i nvidia` and the "
                             "kernel log; reboot, replace if it stays missing", Action.REBOOT,
                             expected=expected, seen=seen))
    elif seen > expected:
        findings.append(warn(cid, "GPUCOUNT", f"{expected} GPUs expected, NVML sees {seen}",
                             "the node profile looks wrong for this node", expected=expected, seen=seen))
    if inp.unmapped_gpus:
        # Slurm named a GPU NVML does not have (a MIG GRES index, a gres.conf in another order, or a GPU that is
        # gone, which the count above catches as hardware evidence): job-scoped checks lose that GPU, nothing drains.
        findings.append(warn(cid, "GPUCOUNT", f"Slurm GPU id {','.join(inp.unmapped_gpus[:4])} matches no GPU NVML "
                             "reports" + (f" ({'; '.join(inp.gpu_map_notes)})" if inp.gpu_map_notes else ""),
                             "compare gres.conf (File=/dev/nvidiaN is minor number N) with `nvidia-smi -q | grep "
                             "-e Minor -e UUID`; set slurm.gpu_ids: nvml_index if your gres.conf is in NVML order",
                             unmapped=list(inp.unmapped_gpus), notes=list(inp.gpu_map_notes)))
    return findings or [ok(cid, f"{seen} GPUs present", seen=seen)]


def check_model(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.model"
    model = inp.profile.gpu_model
    if not model:
        return [skip(cid, "profile sets no gpu_model")]
    bad = nvml_unavailable(cid, "GPUMODEL", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    findings = [
        mismatch(cid, "GPUMODEL", f"{gpu_label(g)} is {g.name!r}, expected {model!r}",
                 "the node is not the instance type its profile says: fix node.profile",
                 inp.params.get("severity", "warn"), gpu=g.index, name=g.name)
        for g in job_gpus(obs.nvml, inp.job_gpus)
        if g.name is not None and model.lower() not in g.name.lower()
    ]
    return findings or [ok(cid, f"GPU model {model}")]


def check_memory(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.memory"
    expected = inp.profile.gpu_memory_mib
    if not expected:
        return [skip(cid, "profile sets no gpu_memory_mib")]
    bad = nvml_unavailable(cid, "GPUMEM", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    tol = inp.params.get("tolerance_pct")
    tol = inp.profile.gpu_memory_tolerance_pct if tol is None else tol
    floor = expected * (1 - tol / 100.0)
    findings = [
        mismatch(cid, "GPUMEM", f"{gpu_label(g)} has {g.memory_total_mib} MiB, expected {expected} MiB",
                 "framebuffer smaller than the profile says: check the profile, the ECC and MIG modes and the "
                 "driver version; then hardware inspection", inp.params.get("severity", "warn"), gpu=g.index,
                 total_mib=g.memory_total_mib, expected_mib=expected)
        for g in job_gpus(obs.nvml, inp.job_gpus)
        if g.memory_total_mib is not None and g.memory_total_mib < floor
    ]
    return findings or [ok(cid, f"GPU memory >= {int(floor)} MiB")]


def check_ecc(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.ecc"
    bad = nvml_unavailable(cid, "ECC", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    p = inp.params
    findings: list[Finding] = []
    supported = False
    for g in job_gpus(obs.nvml, inp.job_gpus):
        if g.ecc_enabled is None and g.ecc_volatile_uncorrected is None:
            continue
        supported = True
        if g.ecc_enabled is False:
            # A mode someone set, not a fault: a reboot does not enable it (nvidia-smi -e 1 first), so it warns,
            # or drains for an admin where the site requires ECC.
            then = " (enabled after the next reboot)" if g.ecc_pending_enabled else ""
            findings.append(mismatch(cid, "ECC", f"{gpu_label(g)}: ECC is disabled{then}",
                                     "enable ECC (`nvidia-smi -i %d -e 1`) and reboot" % g.index,
                                     "fail" if p.get("require_enabled", False) else "warn", gpu=g.index))
        limit = p.get("max_volatile_uncorrected", 0)
        if g.ecc_volatile_uncorrected is not None and g.ecc_volatile_uncorrected > limit:
            findings.append(fail(cid, "ECC", f"{gpu_label(g)}: {g.ecc_volatile_uncorrected} uncorrectable ECC "
                                 "errors since driver load",
                                 "uncorrectable memory error: reset the GPU or reboot so the bad row/page is "
                                 "remapped/retired; replace if it recurs", Action.RESET, gpu=g.index,
                                 volatile_uncorrected=g.ecc_volatile_uncorrected))
        agg = p.get("max_aggregate_uncorrected")
        if agg is not None and g.ecc_aggregate_uncorrected is not None and g.ecc_aggregate_uncorrected > agg:
            findings.append(fail(cid, "ECC", f"{gpu_label(g)}: {g.ecc_aggregate_uncorrected} uncorrectable ECC "
                                 f"errors over its lifetime (limit {agg})",
                                 "lifetime uncorrectable errors above the site limit: hardware inspection/RMA",
                                 Action.REPLACE, gpu=g.index, aggregate_uncorrected=g.ecc_aggregate_uncorrected))
    if not supported:
        return [skip(cid, "ECC not supported by these GPUs")]
    return findings or [ok(cid, "ECC enabled, no uncorrectable errors")]


def check_retired_pages(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.retired_pages"
    bad = nvml_unavailable(cid, "RETIRED", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    limit = inp.params.get("max_retired", 63)
    findings: list[Finding] = []
    supported = False
    for g in job_gpus(obs.nvml, inp.job_gpus):
        if g.retired_pages_pending is None and g.retired_pages_dbe is None and g.retired_pages_sbe is None:
            continue  # Ampere and newer use row remapping instead
        supported = True
        if g.retired_pages_pending:
            findings.append(fail(cid, "RETIRED", f"{gpu_label(g)}: page retirement pending",
                                 "reset the GPU or reboot to retire the pending pages", Action.RESET, gpu=g.index))
        total = (g.retired_pages_sbe or 0) + (g.retired_pages_dbe or 0)
        if total >= limit:
            findings.append(fail(cid, "RETIRED", f"{gpu_label(g)}: {total} retired pages (limit {limit})",
                                 "retired-page count at NVIDIA's RMA level: replace the GPU", Action.REPLACE,
                                 gpu=g.index, sbe=g.retired_pages_sbe, dbe=g.retired_pages_dbe))
    if not supported:
        return [skip(cid, "page retirement not supported (row remapping GPUs)")]
    return findings or [ok(cid, "no page retirement pending")]


def check_row_remap(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.row_remap"
    bad = nvml_unavailable(cid, "ROWREMAP", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    limit = inp.params.get("max_uncorrectable")
    findings: list[Finding] = []
    supported = False
    for g in job_gpus(obs.nvml, inp.job_gpus):
        if g.remapped_rows_pending is None and g.remapped_rows_failure is None:
            continue
        supported = True
        ev = {"correctable": g.remapped_rows_correctable, "uncorrectable": g.remapped_rows_uncorrectable}
        if g.remapped_rows_failure:
            findings.append(fail(cid, "ROWREMAP", f"{gpu_label(g)}: row remapping failed",
                                 "the GPU has no spare rows left: replace it (RMA)", Action.REPLACE, gpu=g.index, **ev))
        elif g.remapped_rows_pending:
            findings.append(fail(cid, "ROWREMAP", f"{gpu_label(g)}: row remapping pending",
                                 "reset the GPU (nvidia-smi -r) or reboot to apply the remap", Action.RESET,
                                 gpu=g.index, **ev))
        elif limit is not None and (g.remapped_rows_uncorrectable or 0) > limit:
            findings.append(fail(cid, "ROWREMAP", f"{gpu_label(g)}: {g.remapped_rows_uncorrectable} rows remapped "
                                 f"for uncorrectable errors (limit {limit})",
                                 "remapped rows above the site limit: hardware inspection/RMA", Action.REPLACE,
                                 gpu=g.index, **ev))
    if not supported:
        return [skip(cid, "row remapping not supported (pre-Ampere GPUs)")]
    return findings or [ok(cid, "no row remapping pending or failed")]


# NVML_GPU_RECOVERY_ACTION_* -> (name, our action)
RECOVERY_ACTIONS = {
    1: ("GPU_RESET", Action.RESET),
    2: ("NODE_REBOOT", Action.REBOOT),
    3: ("DRAIN_P2P", Action.DRAIN),
    4: ("DRAIN_AND_RESET", Action.RESET),
    5: ("RECOVER_IMEX_DOMAIN", Action.DRAIN),
    6: ("BUS_RESET", Action.RESET),
    7: ("SYSTEM_REBOOT", Action.REBOOT),
}


def check_recovery_action(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.recovery_action"
    bad = nvml_unavailable(cid, "RECOVERY", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    findings: list[Finding] = []
    supported = False
    for g in job_gpus(obs.nvml, inp.job_gpus):
        if g.recovery_action is None:
            continue
        supported = True
        if g.recovery_action != 0:
            name, action = RECOVERY_ACTIONS.get(g.recovery_action, (f"UNKNOWN_{g.recovery_action}", Action.REBOOT))
            findings.append(fail(cid, "RECOVERY", f"{gpu_label(g)}: NVML recovery action {name}",
                                 f"the driver asks for {name.replace('_', ' ').lower()} before this GPU is used again",
                                 action, gpu=g.index, recovery_action=g.recovery_action))
    if not supported:
        return [skip(cid, "recovery action not reported (driver older than R565)")]
    return findings or [ok(cid, "recovery action NONE on every GPU")]


def check_temperature(obs: Observations, inp: CheckInput) -> list[Finding]:
    """GPU and HBM temperature against the GPU's own limits as NVML reports them (slowdown threshold, max
    operating temperature, HBM max), which differ per model and board; the profile's numbers are only a
    fallback for a GPU that reports none, and a site's `fail_c`/`warn_c` can only make them stricter."""
    cid = "gpu.temperature"
    site_warn, site_fail = inp.params.get("warn_c"), inp.params.get("fail_c")
    bad = nvml_unavailable(cid, "THERMAL", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    findings: list[Finding] = []
    judged = False
    for g in job_gpus(obs.nvml, inp.job_gpus):
        t = g.temperature_c
        if t is not None:
            own = g.temperature_slowdown_c
            fail_c = own if own else inp.profile.gpu_temp_fail_c
            if site_fail:
                fail_c = min(fail_c, site_fail) if fail_c else site_fail
            warn_c = min(x for x in (g.temperature_gpu_max_c, inp.profile.gpu_temp_warn_c, site_warn, fail_c) if x) \
                if any((g.temperature_gpu_max_c, inp.profile.gpu_temp_warn_c, site_warn, fail_c)) else None
            judged = judged or bool(fail_c or warn_c)
            source = "the GPU's slowdown temperature" if own and fail_c == own else "configured"
            if fail_c and t >= fail_c:
                findings.append(fail(cid, "THERMAL", f"{gpu_label(g)} at {t}C (limit {fail_c}C, {source})",
                                     "check cooling: fans, airflow, blocked inlets, data-centre temperature",
                                     Action.DRAIN, gpu=g.index, temperature_c=t, limit_c=fail_c,
                                     gpu_max_c=g.temperature_gpu_max_c))
            elif warn_c and t >= warn_c:
                findings.append(warn(cid, "THERMAL", f"{gpu_label(g)} at {t}C (warn {warn_c}C)",
                                     "watch cooling for this node", gpu=g.index, temperature_c=t,
                                     gpu_max_c=g.temperature_gpu_max_c))
        m, mem_max = g.memory_temperature_c, g.temperature_mem_max_c
        if m is not None and mem_max:
            judged = True
            if m >= mem_max:
                findings.append(fail(cid, "THERMAL", f"{gpu_label(g)} HBM at {m}C (its max operating {mem_max}C)",
                                     "memory overheating: check cooling; HBM above its limit corrupts data",
                                     Action.DRAIN, gpu=g.index, memory_temperature_c=m, limit_c=mem_max))
            elif m >= mem_max - inp.params.get("hbm_margin_c", 5):
                findings.append(warn(cid, "THERMAL", f"{gpu_label(g)} HBM at {m}C (max {mem_max}C)",
                                     "watch cooling for this node", gpu=g.index, memory_temperature_c=m))
    if not findings and not judged:
        return [skip(cid, "no temperature limit from NVML, the profile or the config")]
    return findings or [ok(cid, "GPU and HBM temperatures within the GPUs' own limits")]


# nvmlClocksEventReason* bits (nvml.h)
THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}


def decode_throttle(mask: int) -> list[str]:
    return [name for name, bit in THROTTLE_BITS.items() if mask & bit]


def check_throttle(obs: Observations, inp: CheckInput) -> list[Finding]:
    """Hardware clock slowdown. One sample proves little (a power-brake pulse, a transient thermal event), so a
    failure carries a persistence requirement (`persist_s`): the runner drains only when the same GPU showed the
    same reasons in every run for that long (gpud likewise waits minutes), and warns until then."""
    cid = "gpu.throttle"
    bad = nvml_unavailable(cid, "CLOCKS", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    fail_bits = {n for n in inp.params.get("fail_reasons", []) if n in THROTTLE_BITS}
    warn_bits = {n for n in inp.params.get("warn_reasons", []) if n in THROTTLE_BITS}
    findings: list[Finding] = []
    for g in job_gpus(obs.nvml, inp.job_gpus):
        if g.clock_event_reasons is None:
            continue
        active = decode_throttle(g.clock_event_reasons)
        hard = [r for r in active if r in fail_bits]
        soft = [r for r in active if r in warn_bits]
        if hard:
            findings.append(fail(cid, "CLOCKS", f"{gpu_label(g)} clocks throttled: {','.join(hard)}",
                                 "hardware slowdown: check cooling, power supplies and the power brake signal; "
                                 "reboot, replace if it persists", Action.DRAIN, gpu=g.index, reasons=active,
                                 mask=hex(g.clock_event_reasons),
                                 persist={"key": f"{g.uuid or g.index}:{','.join(sorted(hard))}",
                                          "seconds": inp.params.get("persist_s", 240)}))
        elif soft:
            findings.append(warn(cid, "CLOCKS", f"{gpu_label(g)} clocks throttled: {','.join(soft)}",
                                 "check cooling", gpu=g.index, reasons=active))
    return findings or [ok(cid, "no hardware clock throttling")]


GPU_IDLE = 0x1  # nvmlClocksEventReasonGpuIdle


def gpu_busy(g: GpuInfo, min_util_pct: float = 5.0) -> bool:
    """Is the GPU working right now? Its link only shows what it trained to under load: at idle the driver may drop
    the link generation, and the width too (nvidia-smi's documentation says so for both). On a real H100 SXM the
    idle sample shows clock event reason 0x1 (GPU idle) and the loaded one 0x0 at 99-100 % utilisation."""
    if g.clock_event_reasons is not None and g.clock_event_reasons & GPU_IDLE:
        return False
    if g.utilization_gpu_pct is not None:
        return g.utilization_gpu_pct >= min_util_pct
    return False


def check_pcie(obs: Observations, inp: CheckInput) -> list[Finding]:
    """The trained PCIe link, judged only under load (current generation and width), and its error rate (replays
    per minute between two runs; DCGM's limit is 8/min, "the maximum recommended by RM"). An idle reading is
    reported, never drained on. NVML's "max" generation is the most the device *and the system* allow, a
    capability: below the profile it is a BIOS/slot setting, which warns."""
    cid = "gpu.pcie"
    gen, width = inp.profile.pcie_gen, inp.profile.pcie_width
    bad = nvml_unavailable(cid, "PCIE", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    p = inp.params
    findings: list[Finding] = []
    previous = (obs.previous or {}).get("pcie_replay") or {}
    rate_warn, rate_fail = p.get("replay_rate_warn_per_min", 8.0), p.get("replay_rate_fail_per_min")
    idle_low: list[str] = []
    for g in job_gpus(obs.nvml, inp.job_gpus):
        busy = gpu_busy(g, p.get("busy_util_pct", 5.0))
        cur_w, cur_g = g.pcie_width_current, g.pcie_gen_current
        low = []
        if width and cur_w is not None and cur_w < width:
            low.append(f"x{cur_w} (expected x{width})")
        if gen and cur_g is not None and cur_g < gen:
            low.append(f"Gen{cur_g} (expected Gen{gen})")
        if low and busy:
            findings.append(fail(cid, "PCIE", f"{gpu_label(g)} PCIe link at {' '.join(low)} under load "
                                 f"({g.utilization_gpu_pct}% busy)",
                                 "degraded PCIe link: reboot to retrain it; if it persists reseat the GPU/riser or "
                                 "replace", Action.REBOOT, gpu=g.index, width=cur_w, gen=cur_g, expected_width=width,
                                 expected_gen=gen, utilization_pct=g.utilization_gpu_pct))
        elif low:
            idle_low.append(f"GPU {g.index} {' '.join(low)}")
        if gen and g.pcie_gen_max is not None and g.pcie_gen_max < gen:
            findings.append(mismatch(cid, "PCIE", f"{gpu_label(g)} PCIe link can train at most Gen{g.pcie_gen_max} in "
                                     f"this system, expected Gen{gen}",
                                     "a BIOS or slot setting limits the link (NVML's max generation is what device and "
                                     "system allow): check the BIOS PCIe settings", p.get("capability_severity", "warn"),
                                     gpu=g.index, gen_max=g.pcie_gen_max, expected_gen=gen))
        before = previous.get(g.uuid or str(g.index))
        if g.pcie_replay_counter is not None and isinstance(before, list) and len(before) == 2 and obs.now:
            minutes = (obs.now - float(before[1])) / 60.0
            delta = g.pcie_replay_counter - int(before[0])
            if minutes >= 1.0 and delta > 0:
                rate = delta / minutes
                ev = {"replays": delta, "minutes": round(minutes, 1), "rate_per_min": round(rate, 1)}
                if rate_fail is not None and rate > rate_fail:
                    findings.append(fail(cid, "PCIE", f"{gpu_label(g)} {rate:.0f} PCIe replays/min (limit {rate_fail:g})",
                                         "a marginal PCIe link (signal integrity): reseat the GPU/riser; replace if it "
                                         "persists", Action.REBOOT, gpu=g.index, **ev))
                elif rate_warn is not None and rate > rate_warn:
                    findings.append(warn(cid, "PCIE", f"{gpu_label(g)} {rate:.0f} PCIe replays/min over "
                                         f"{minutes:.0f} min (DCGM limit {rate_warn:g}/min)",
                                         "a marginal PCIe link: watch it; reseat the GPU/riser at the next maintenance",
                                         gpu=g.index, **ev))
    if not findings:
        if not (gen or width) and not any(g.pcie_replay_counter for g in obs.nvml.gpus):
            return [skip(cid, "profile sets no pcie_gen/pcie_width")]
        busy = [g.index for g in job_gpus(obs.nvml, inp.job_gpus) if gpu_busy(g, p.get("busy_util_pct", 5.0))]
        idle = f"; idle readings not judged: {', '.join(idle_low[:8])}" if idle_low else ""
        return [ok(cid, f"PCIe links at the expected width and generation ({len(busy)} GPU(s) under load), "
                        f"replay rate normal{idle}", idle_low=idle_low, busy=busy)]
    return findings


def check_nvlink(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.nvlink"
    expected = inp.profile.nvlinks_per_gpu
    if not expected:
        return [skip(cid, "profile sets no nvlinks_per_gpu")]
    bad = nvml_unavailable(cid, "NVLINK", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    findings: list[Finding] = []
    for g in job_gpus(obs.nvml, inp.job_gpus):
        links = g.nvlink_active
        if links is None:
            findings.append(fail(cid, "NVLINK", f"{gpu_label(g)} reports no NVLinks, expected {expected}",
                                 "check fabric manager (`systemctl status nvidia-fabricmanager`) and "
                                 "`nvidia-smi nvlink -s`; reboot", Action.REBOOT, gpu=g.index))
            continue
        down = [i for i, up in enumerate(links[:expected]) if not up]
        missing = max(0, expected - len(links))
        if down or missing:
            what = f"link {','.join(map(str, down))} down" if down else ""
            if missing:
                what = (what + "; " if what else "") + f"{missing} links missing"
            findings.append(fail(cid, "NVLINK", f"{gpu_label(g)} NVLink {what} ({sum(links[:expected])}/{expected} active)",
                                 "check `nvidia-smi nvlink -s` and fabric manager; reset/reboot, replace if it recurs",
                                 Action.REBOOT, gpu=g.index, down=down, active=sum(links[:expected])))
    return findings or [ok(cid, f"all {expected} NVLinks active on every GPU")]


def check_processes(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.processes"
    bad = nvml_unavailable(cid, "GPUPROC", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    severity = inp.params.get("severity", "fail")
    findings: list[Finding] = []
    for g in job_gpus(obs.nvml, inp.job_gpus):
        if not g.processes:
            continue
        desc = ", ".join(f"pid {p.pid}" + (f" {p.name}" if p.name else "")
                         + (f" {p.used_memory_mib} MiB" if p.used_memory_mib is not None else "")
                         for p in g.processes[:3])
        more = f" +{len(g.processes) - 3} more" if len(g.processes) > 3 else ""
        msg = f"{gpu_label(g)} has {len(g.processes)} leftover process(es): {desc}{more}"
        ev = {"pids": [p.pid for p in g.processes]}
        remediation = "a previous job left processes on the GPU: kill them (the epilog should have); check the epilog"
        if severity == "warn":
            findings.append(warn(cid, "GPUPROC", msg, remediation, gpu=g.index, **ev))
        else:
            findings.append(fail(cid, "GPUPROC", msg, remediation, Action.DRAIN, gpu=g.index, **ev))
    if inp.job_gpus == ():
        return [skip(cid, "the job has no GPUs")]
    return findings or [ok(cid, "no processes on the job's GPUs")]



def _procs(ps: list) -> str:  # type: ignore[type-arg]
    return ", ".join(f"pid {p.pid}" + (f" {p.name}" if p.name else "") for p in ps[:4]) + \
        (f" +{len(ps) - 4} more" if len(ps) > 4 else "")


def check_leftovers(obs: Observations, inp: CheckInput) -> list[Finding]:
    """Epilog: the job's processes left on its GPUs were terminated; a survivor is stuck in the driver
    (the GPU needs a reset/reboot); another user's process on the job's GPU is not ours to kill."""
    cid = "gpu.leftovers"
    c = obs.cleanup
    if c is None:
        return [skip(cid, "no cleanup ran")]
    findings: list[Finding] = []
    if c.survivors:
        findings.append(fail(cid, "GPUPROC", f"{len(c.survivors)} process(es) survived SIGKILL on the job's GPUs: "
                             f"{_procs(c.survivors)}",
                             "processes stuck in the driver (D state): the GPU needs a reset, usually a reboot",
                             Action.REBOOT, pids=[p.pid for p in c.survivors]))
    if c.foreign:
        findings.append(fail(cid, "GPUPROC", f"process(es) of another user on the job's GPUs: {_procs(c.foreign)}",
                             "something outside Slurm uses these GPUs: find out what (ps -o user,cmd -p PID)",
                             Action.DRAIN, pids=[p.pid for p in c.foreign]))
    if c.not_killed:
        findings.append(fail(cid, "GPUPROC", f"{len(c.not_killed)} leftover process(es) of the job on its GPUs: "
                             f"{_procs(c.not_killed)}", "kill them (epilog.kill_leftovers is off)", Action.DRAIN,
                             pids=[p.pid for p in c.not_killed]))
    if c.error:
        findings.append(warn(cid, "GPUPROC", f"leftover cleanup incomplete: {c.error}", "check the epilog log"))
    if not findings:
        msg = f"terminated {len(c.killed)} leftover process(es): {_procs(c.killed)}" if c.killed \
            else "no leftover processes on the job's GPUs"
        findings.append(ok(cid, msg, killed=[p.pid for p in c.killed]))
    return findings


def check_memory_released(obs: Observations, inp: CheckInput) -> list[Finding]:
    cid = "gpu.memory_released"
    bad = nvml_unavailable(cid, "GPUMEM", obs.nvml, bool(inp.profile.gpu_count))
    if bad:
        return [bad]
    assert obs.nvml is not None
    limit = inp.params.get("max_used_mib", 2048)
    findings = [
        fail(cid, "GPUMEM", f"{gpu_label(g)} still has {g.memory_used_mib} MiB in use after the job",
             "GPU memory not released (a zombie context): reset the GPU (nvidia-smi -r) or reboot",
             Action.RESET, gpu=g.index, used_mib=g.memory_used_mib)
        for g in job_gpus(obs.nvml, inp.job_gpus)
        if g.memory_used_mib is not None and g.memory_used_mib > limit and not g.processes
    ]
    if inp.job_gpus == ():
        return [skip(cid, "the job had no GPUs")]
    return findings or [ok(cid, "GPU memory released")]
