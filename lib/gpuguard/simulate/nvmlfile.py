"""The fake NVML's flat file (read by fakenvml.c) from a scenario: every GPU's values, its profile's healthy
defaults overridden by what the scenario says."""

from __future__ import annotations

import hashlib
from typing import Any

from gpuguard.profiles import Profile
from gpuguard.simulate.spec import GPU_KEYS, Scenario, ScenarioError

# NVML return codes by name (nvml.h) for `errors:` and `init_error:` in scenarios.
NVML_ERRORS = {
    "UNINITIALIZED": 1, "INVALID_ARGUMENT": 2, "NOT_SUPPORTED": 3, "NO_PERMISSION": 4, "NOT_FOUND": 6,
    "INSUFFICIENT_SIZE": 7, "INSUFFICIENT_POWER": 8, "DRIVER_NOT_LOADED": 9, "TIMEOUT": 10, "IRQ_ISSUE": 11,
    "LIBRARY_NOT_FOUND": 12, "FUNCTION_NOT_FOUND": 13, "CORRUPTED_INFOROM": 14, "GPU_IS_LOST": 15,
    "RESET_REQUIRED": 16, "OPERATING_SYSTEM": 17, "LIB_RM_VERSION_MISMATCH": 18, "IN_USE": 19, "MEMORY": 20,
    "NO_DATA": 21, "GPU_NOT_FOUND": 28, "UNKNOWN": 999,
}

# Bus ids as a real 8-GPU HGX board enumerates them (p5.48xlarge).
DEFAULT_BUS_IDS = ["53", "64", "75", "86", "97", "a8", "b9", "ca"]

THROTTLE_BITS = {
    "gpu_idle": 0x1, "applications_clocks": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8, "sync_boost": 0x10,
    "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80, "display_clocks": 0x100,
}

# `field_errors:` names -> NVML field ids (nvml.h NVML_FI_DEV_*)
NVML_FIELDS = {"memory_temperature": 82, "nvlink_count": 91, "pcie_replay": 94, "recovery_action": 230}
FABRIC_STATES = {"not_supported": 0, "not_started": 1, "in_progress": 2, "completed": 3}


def _as_int(v: Any, what: str) -> int:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    raise ScenarioError(f"{what}: expected an integer, got {v!r}")


def _gpu_defaults(profile: Profile, i: int) -> dict[str, Any]:
    model = profile.gpu_model or "NVIDIA H100 80GB HBM3"
    name = model if model.upper().startswith("NVIDIA") else f"NVIDIA {model}"
    bus = DEFAULT_BUS_IDS[i] if i < len(DEFAULT_BUS_IDS) else f"{0x10 + i:02x}"
    warn = profile.gpu_temp_warn_c or 80
    return {
        "name": name,
        "uuid": f"GPU-{hashlib.md5(f'{profile.name}-{i}'.encode()).hexdigest()[:8]}-sim0-4000-8000-{i:012d}",
        "serial": f"16520{i:08d}",
        "pci_bus_id": f"00000000:{bus}:00.0",
        "memory_mib": profile.gpu_memory_mib or 81559,
        "memory_used_mib": 0,
        "ecc_enabled": True,
        "ecc_volatile_uncorrected": 0, "ecc_volatile_corrected": 0,
        "ecc_aggregate_uncorrected": 0, "ecc_aggregate_corrected": 0,
        "row_remap_supported": True,
        "remap_correctable": 0, "remap_uncorrectable": 0, "remap_pending": False, "remap_failure": False,
        "recovery_action": 0,
        "temperature_c": max(25, warn - 45),
        # the limits NVML reports on a real H100 SXM (driver 580): slowdown 89, shutdown 95, max operating 87,
        # HBM max 95 (tests/fixtures/nvml/); a profile's fail limit (A100: 85 C) shifts them
        "temp_slowdown_c": (profile.gpu_temp_fail_c + 4) if profile.gpu_temp_fail_c else 89,
        "temp_shutdown_c": (profile.gpu_temp_fail_c + 7) if profile.gpu_temp_fail_c else 95,
        "temp_gpu_max_c": profile.gpu_temp_fail_c or 87,
        "temp_mem_max_c": 95,
        "memory_temperature_c": max(25, warn - 44),
        "pcie_replay": 0,
        "persistence_mode": True,
        "minor": i,
        "mig_enabled": False,
        "mig_devices": [],
        "fabric_state": "completed" if profile.nvswitch else None,
        "fabric_status": 0,
        "fabric_health_mask": 0,
        "throttle": ["gpu_idle"],
        "pcie_gen": profile.pcie_gen or 4,
        "pcie_gen_max": profile.pcie_gen or 4,
        "pcie_width": profile.pcie_width or 16,
        "pcie_width_max": profile.pcie_width or 16,
        "nvlinks": profile.nvlinks_per_gpu or 0,
        "nvlink_down": [],
        "power_w": 70,
        "clock_sm_mhz": 1980, "clock_sm_max_mhz": 1980, "clock_mem_mhz": 2619,  # H100 SXM max SM / HBM3 clocks
        "utilization_pct": 0,
        "processes": [],
    }


def _gpu_lines(i: int, g: dict[str, Any]) -> list[str]:
    p = f"gpu.{i}."
    return _gpu_basics(p, i, g) + _gpu_memory(p, g) + _gpu_state(p, i, g)


def _gpu_basics(p: str, i: int, g: dict[str, Any]) -> list[str]:
    """Identity, memory size, temperatures and limits, PCIe, power, utilisation, clocks."""
    mib = 1024 * 1024
    return [
        f"{p}name={g['name']}", f"{p}uuid={g['uuid']}", f"{p}serial={g['serial']}",
        f"{p}pci_bus_id={g['pci_bus_id']}", f"{p}pci_device_id=0x233010DE",
        f"{p}minor={_as_int(g.get('minor', i), 'minor')}",
        f"{p}memory_total={_as_int(g['memory_mib'], 'memory_mib') * mib}",
        f"{p}memory_used={_as_int(g['memory_used_mib'], 'memory_used_mib') * mib}",
        f"{p}temperature={_as_int(g['temperature_c'], 'temperature_c')}",
        f"{p}temp_slowdown={g['temp_slowdown_c']}", f"{p}temp_shutdown={g['temp_shutdown_c']}",
        f"{p}temp_gpu_max={g['temp_gpu_max_c']}", f"{p}temp_mem_max={g['temp_mem_max_c']}",
        f"{p}temp_memory={_as_int(g['memory_temperature_c'], 'memory_temperature_c')}",
        f"{p}pcie.replay={_as_int(g['pcie_replay'], 'pcie_replay')}",
        f"{p}persistence_mode={int(bool(g['persistence_mode']))}",
        f"{p}mig_current={int(bool(g['mig_enabled']))}", f"{p}mig_pending={int(bool(g['mig_enabled']))}",
        f"{p}pcie.gen_current={g['pcie_gen']}", f"{p}pcie.gen_max={g['pcie_gen_max']}",
        f"{p}pcie.gpu_gen_max={g['pcie_gen_max']}",
        f"{p}pcie.width_current={g['pcie_width']}", f"{p}pcie.width_max={g['pcie_width_max']}",
        f"{p}power_usage={int(g['power_w']) * 1000}", f"{p}power_limit=700000",
        f"{p}utilization.gpu={g['utilization_pct']}", f"{p}utilization.memory=0",
        f"{p}clock.sm={int(g['clock_sm_mhz'])}", f"{p}clock.mem={int(g['clock_mem_mhz'])}",
        f"{p}max_clock.sm={int(g['clock_sm_max_mhz'])}", f"{p}max_clock.mem=2619",
    ]


def _gpu_memory(p: str, g: dict[str, Any]) -> list[str]:
    """ECC, retired pages, remapped rows, MIG devices, NVSwitch fabric state, recovery action."""
    out: list[str] = []
    if g.get("ecc_enabled") is not None:
        out += [f"{p}ecc_current={int(bool(g['ecc_enabled']))}",
                f"{p}ecc_pending={int(bool(g.get('ecc_pending', g['ecc_enabled'])))}"]
        for k in ("volatile.uncorrected", "volatile.corrected", "aggregate.uncorrected", "aggregate.corrected"):
            out.append(f"{p}ecc.{k}={_as_int(g['ecc_' + k.replace('.', '_')], 'ecc_' + k.replace('.', '_'))}")
    if g.get("retired_pages_supported") or any(k in g for k in ("retired_sbe", "retired_dbe", "retired_pending")):
        out += [f"{p}retired.sbe={int(g.get('retired_sbe', 0))}", f"{p}retired.dbe={int(g.get('retired_dbe', 0))}",
                f"{p}retired.pending={int(bool(g.get('retired_pending', False)))}"]
    if g.get("row_remap_supported"):
        out += [f"{p}remap.correctable={int(g['remap_correctable'])}",
                f"{p}remap.uncorrectable={int(g['remap_uncorrectable'])}",
                f"{p}remap.pending={int(bool(g['remap_pending']))}", f"{p}remap.failure={int(bool(g['remap_failure']))}"]
    for n, uuid in enumerate((g.get("mig_devices") or [])[:7]):
        out.append(f"{p}mig.{n}={uuid}")
    if g.get("fabric_state") is not None:
        state = g["fabric_state"]
        state = FABRIC_STATES.get(str(state), state)
        status = NVML_ERRORS.get(str(g.get("fabric_status", 0)), g.get("fabric_status", 0))
        out += [f"{p}fabric.state={_as_int(state, 'fabric_state')}", f"{p}fabric.status={_as_int(status, 'fabric_status')}",
                f"{p}fabric.health_mask={_as_int(g.get('fabric_health_mask', 0), 'fabric_health_mask')}"]
    if g.get("recovery_action") is not None:
        out.append(f"{p}recovery_action={_as_int(g['recovery_action'], 'recovery_action')}")
    return out


def _gpu_state(p: str, i: int, g: dict[str, Any]) -> list[str]:
    """Throttle reasons, NVLinks, processes, and the faults a scenario injects (lost, NVML errors, hangs)."""
    mib = 1024 * 1024
    out: list[str] = []
    throttle = g.get("throttle", [])
    if isinstance(throttle, int):
        mask = throttle
    else:
        unknown = [t for t in throttle if t not in THROTTLE_BITS]
        if unknown:
            raise ScenarioError(f"GPU {i}: unknown throttle reasons {unknown}; known: {sorted(THROTTLE_BITS)}")
        mask = sum(THROTTLE_BITS[t] for t in throttle)
    out.append(f"{p}clocks_event_reasons={hex(mask)}")
    if g.get("nvlinks") is not None:  # 0: the GPU has no NVLink (field 91 says 0)
        out.append(f"{p}nvlink_count={_as_int(g['nvlinks'], 'nvlinks')}")
        if g.get("nvlink_down"):
            out.append(f"{p}nvlink_down={','.join(str(int(x)) for x in g['nvlink_down'])}")
    for n, proc in enumerate(g.get("processes") or []):
        live = ":live" if proc.get("live") else ""  # listed only while that pid runs
        out.append(f"{p}process.{n}={int(proc['pid'])}:{int(proc.get('used_mib', 1024)) * mib}{live}")
    if g.get("lost"):
        out.append(f"{p}error.*={NVML_ERRORS['GPU_IS_LOST']}")
    for fn, err in (g.get("errors") or {}).items():
        code = NVML_ERRORS.get(str(err), err)
        out.append(f"{p}error.{fn}={_as_int(code, f'errors.{fn}')}")
    for fn, secs in (g.get("hang") or {}).items():
        out.append(f"{p}hang.{fn}={_as_int(secs, f'hang.{fn}')}")
    for name, err in (g.get("field_errors") or {}).items():
        if name not in NVML_FIELDS:
            raise ScenarioError(f"GPU {i}: unknown field_errors entry {name!r}; known: {sorted(NVML_FIELDS)}")
        out.append(f"{p}field_error.{NVML_FIELDS[name]}={_as_int(NVML_ERRORS.get(str(err), err), f'field_errors.{name}')}")
    return out


def nvml_flat_file(sc: Scenario) -> str:
    d = sc.data
    gspec = d.get("gpus") or {}
    if not isinstance(gspec, dict):
        raise ScenarioError(f"{sc.path}: gpus must be a mapping")
    count = gspec.get("count", sc.profile.gpu_count or 0)
    defaults = gspec.get("defaults") or {}
    overrides = gspec.get("overrides") or {}
    for key in list(defaults) + [k for o in overrides.values() for k in (o or {})]:
        if key not in GPU_KEYS:
            raise ScenarioError(f"{sc.path}: unknown GPU key {key!r}; known: {', '.join(sorted(GPU_KEYS))}")
    lines = [f"# generated from {sc.path}", f"driver_version={d.get('driver_version', '550.90.07')}",
             f"nvml_version=12.{d.get('driver_version', '550.90.07')}", "cuda_driver_version=12040"]
    nvml = d.get("nvml") or {}
    if nvml.get("init_error"):
        lines.append(f"init_error={NVML_ERRORS.get(nvml['init_error'], nvml['init_error'])}")
    for fn, secs in (nvml.get("hang") or {}).items():
        lines.append(f"hang.{fn}={_as_int(secs, f'nvml.hang.{fn}')}")
    # `missing: [3]` removes GPUs from enumeration (a GPU that fell off the bus is not counted)
    missing = set(gspec.get("missing") or [])
    visible = [i for i in range(int(count)) if i not in missing]
    lines.append(f"device_count={len(visible)}")
    for new_index, i in enumerate(visible):
        g = _gpu_defaults(sc.profile, i)
        g.update(defaults)
        g.update(overrides.get(i) or {})
        lines += _gpu_lines(new_index, g)
    return "\n".join(lines) + "\n"
