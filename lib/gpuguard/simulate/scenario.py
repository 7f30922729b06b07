"""Simulated hardware: a scenario (YAML) becomes the files the real probes read.

The same code path runs on a real node and in simulation: NVML through the real nvidia-ml-py binding
over a fake `libnvidia-ml.so.1` (fakenvml.c) fed a flat file, the kernel log as a /dev/kmsg-format file,
EFA/IB devices as a fake sysfs tree, `fi_info` as a stub printing a recorded output, memory as a fake
/proc/meminfo. Healthy values are derived from the node's profile, so a scenario only states what is
different (see README "Scenarios").
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpuguard.config.yamlutil import load_yaml_file
from gpuguard.profiles import Profile, load_profile
from gpuguard.simulate.build import build_fake_nvml
from gpuguard.simulate.materialized import (RECORD, ScenarioError, SimSources, record_for, scenario_digest,
                                            scenario_for_node, sim_sources)
from gpuguard.simulate.sysfs import write_fake_infiniband
from gpuguard.util.fs import atomic_write

__all__ = ["ScenarioError", "SimSources", "Scenario", "load_scenario", "scenario_for_node", "materialize", "inject",
           "nvml_flat_file"]

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

GPU_KEYS = {
    "name", "uuid", "serial", "pci_bus_id", "memory_mib", "memory_used_mib", "ecc_enabled", "ecc_pending",
    "ecc_volatile_uncorrected", "ecc_volatile_corrected", "ecc_aggregate_uncorrected", "ecc_aggregate_corrected",
    "retired_sbe", "retired_dbe", "retired_pending", "remap_correctable", "remap_uncorrectable", "remap_pending",
    "remap_failure", "recovery_action", "temperature_c", "temp_slowdown_c", "temp_shutdown_c", "throttle",
    "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max", "nvlinks", "nvlink_down", "power_w",
    "utilization_pct", "processes", "lost", "errors", "hang", "retired_pages_supported", "row_remap_supported",
    "clock_sm_mhz", "clock_sm_max_mhz", "clock_mem_mhz",
    # issue 9: the GPU's own limits, HBM, PCIe replays, identity (minor number, MIG) and NVSwitch fabric state
    "temp_gpu_max_c", "temp_mem_max_c", "memory_temperature_c", "pcie_replay", "persistence_mode", "minor",
    "mig_enabled", "mig_devices", "fabric_state", "fabric_status", "fabric_health_mask",
    # issue 14: one nvmlDeviceGetFieldValues field answering an error while the call itself succeeds
    "field_errors",
}
# `field_errors:` names -> NVML field ids (nvml.h NVML_FI_DEV_*)
NVML_FIELDS = {"memory_temperature": 82, "nvlink_count": 91, "pcie_replay": 94, "recovery_action": 230}
FABRIC_STATES = {"not_supported": 0, "not_started": 1, "in_progress": 2, "completed": 3}
TOP_KEYS = {"description", "profile", "instance_type", "boot_id", "driver_version", "gpus", "nvml", "kernel_log",
            "fabric", "system",
            "nccl",  # simulated nccl-tests / collective bandwidth of this node (gpuguard.nccl)
            "dcgm",  # simulated `dcgmi diag` results
            }


@dataclass
class Scenario:
    path: str
    data: dict[str, Any]
    profile: Profile
    digest: str
    profile_name: str = "generic"  # what the scenario asked for (a profile or an instance type)


def load_scenario(path: str, profile_dir: Optional[str] = None, cache_dir: Optional[str] = None) -> Scenario:
    """`cache_dir`: where the profile's compiled copy is kept (the node's workdir)."""
    raw = Path(path).read_bytes()
    data = load_yaml_file(path) or {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise ScenarioError(f"{path}: unknown scenario keys: {', '.join(sorted(map(str, unknown)))}")
    prof_name = str(data.get("profile") or data.get("instance_type") or "generic")
    profile = load_profile(prof_name, profile_dir, cache_dir=cache_dir)
    return Scenario(path, data, profile, scenario_digest(raw), prof_name)


# --------------------------------------------------------------------------- NVML flat file


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
    mib = 1024 * 1024
    out = [
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


# --------------------------------------------------------------------------- kernel log (kmsg format)

_FACILITY = {"kern": 0, "user": 1, "daemon": 3, "syslog": 5}


def _kmsg_entries(sc: Scenario) -> list[tuple[int, str]]:
    """(priority, text) for each scenario kernel line; `{text, facility}` forms forge non-kernel lines."""
    out = []
    for item in sc.data.get("kernel_log") or []:
        if isinstance(item, str):
            out.append((4, item))
        elif isinstance(item, dict) and "text" in item:
            fac = _FACILITY.get(item.get("facility", "kern"), 1)
            out.append((fac * 8 + int(item.get("level", 4)), str(item["text"])))
        else:
            raise ScenarioError(f"{sc.path}: kernel_log entries are strings or {{text, facility}}")
    return out


def _sync_kmsg(workdir: Path, sc: Scenario, boot_id: str) -> Path:
    """Append scenario lines not yet in the node's fake kmsg: like a real kernel log, it only grows
    (until the boot id changes), so cursors behave as on a real node."""
    kmsg = workdir / "kmsg"
    state_path = workdir / "kmsg.state.json"
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        state = {}
    if state.get("boot_id") != boot_id or not kmsg.exists():
        state = {"boot_id": boot_id, "next_seq": 1, "written": []}
        kmsg.write_text("")
    written = set(state["written"])
    new = []
    for idx, (pri, text) in enumerate(_kmsg_entries(sc)):
        key = hashlib.sha1(f"{idx}\0{text}".encode()).hexdigest()[:16]
        if key in written:
            continue
        seq = state["next_seq"]
        state["next_seq"] += 1
        clean = re.sub(r"[\x00-\x1f]", " ", text)
        new.append(f"{pri},{seq},{1_000_000 * (100 + seq)},-;{clean}\n")
        written.add(key)
        state["written"].append(key)
    if new:
        with kmsg.open("a") as f:
            f.writelines(new)
    state_path.write_text(json.dumps(state))
    return kmsg


# --------------------------------------------------------------------------- fabric and system


def _fi_info_output(devices: list[str]) -> str:
    blocks = []
    for dev in devices:
        for suffix, ep in (("rdm", "FI_EP_RDM"), ("dgrm", "FI_EP_DGRAM")):
            blocks.append(f"provider: efa\n    fabric: efa\n    domain: {dev}-{suffix}\n    version: 122.0\n"
                          f"    type: {ep}\n    protocol: FI_PROTO_EFA\n")
    return "".join(blocks)


def _write_fabric(root: Path, sc: Scenario) -> None:
    fab = sc.data.get("fabric") or {}
    efa = fab.get("efa") or {}
    ib = fab.get("ib") or {}
    efa_count = int(efa.get("count", sc.profile.efa_devices or 0))
    ib_count = int(ib.get("count", sc.profile.ib_devices or 0))
    efa_down = set(efa.get("down") or [])
    ib_down = set(ib.get("down") or [])
    devices: list[dict[str, Any]] = []
    for i in range(efa_count):
        devices.append({"name": f"rdmap{16 + i}s27", "kind": "efa", "ports": [{
            "port": 1, "state": "DOWN" if i in efa_down else "ACTIVE",
            "phys_state": "Disabled" if i in efa_down else "LinkUp", "rate": "100 Gb/sec (4X EDR)",
            "link_layer": "Unspecified"}]})
    rate = f"{sc.profile.ib_rate_gbps or 400} Gb/sec (4X NDR)"
    for i in range(ib_count):
        devices.append({"name": f"mlx5_{i}", "kind": "ib", "ports": [{
            "port": 1, "state": "DOWN" if i in ib_down else "ACTIVE",
            "phys_state": "Polling" if i in ib_down else "LinkUp", "rate": rate, "link_layer": "InfiniBand"}]})
    write_fake_infiniband(root / "sys", devices)
    fi = fab.get("fi_info") or {}
    bindir = root / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    out = bindir / "fi_info.out"
    if fi.get("error"):
        out.write_text("fi_getinfo: -61 (No data available)\n")
        rc = 61
    else:
        n = int(fi.get("devices", efa_count))
        out.write_text(_fi_info_output([f"rdmap{16 + i}s27" for i in range(n)]))
        rc = 0
    hang = int(fi.get("hang_s", 0))
    stub = bindir / "fi_info"
    stub.write_text("#!/bin/sh\n# gpuguard simulation: prints a recorded `fi_info -p efa` output\n"
                    + (f"sleep {hang}\n" if hang else "")
                    + (f"exec cat '{out}'\n" if rc == 0 else f"cat '{out}'\nexit {rc}\n"))
    stub.chmod(0o755)


def _write_system(root: Path, sc: Scenario) -> None:
    s = sc.data.get("system") or {}
    # the loaded nvidia module (created once: a new directory = a driver reload, see read_driver_fingerprint)
    (root / "sys/module/nvidia").mkdir(parents=True, exist_ok=True)
    cpus = int(s.get("cpus", sc.profile.cpus or os.cpu_count() or 1))
    cpu_dir = root / "sys/devices/system/cpu"
    cpu_dir.mkdir(parents=True, exist_ok=True)
    (cpu_dir / "online").write_text(f"0-{cpus - 1}\n" if cpus > 1 else "0\n")
    (cpu_dir / "offline").write_text(f"{s.get('offline', '')}\n")
    smt = str(s.get("smt", "on"))  # on | off | notsupported (an EC2 instance launched with one thread per core)
    (cpu_dir / "smt").mkdir(exist_ok=True)
    (cpu_dir / "smt" / "control").write_text(f"{smt}\n")
    (cpu_dir / "smt" / "active").write_text("1\n" if smt == "on" else "0\n")
    total_kib = int(float(s.get("memory_gib", sc.profile.memory_gib or 64)) * 1024 * 1024)
    avail_kib = int(float(s.get("mem_available_gib", total_kib / 1024 / 1024 * 0.95)) * 1024 * 1024)
    proc = root / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {total_kib} kB\nMemFree:        {avail_kib} kB\nMemAvailable:   {avail_kib} kB\n"
        f"Buffers:        0 kB\nCached:         0 kB\nSwapCached:     0 kB\nActive:         0 kB\n"
        f"Inactive:       0 kB\nShmem:          0 kB\nSlab:           0 kB\nSReclaimable:   0 kB\n"
        f"SwapTotal:      0 kB\nSwapFree:       0 kB\n")


# --------------------------------------------------------------------------- materialise


def materialize(scenario_path: str, workdir: str, fake_nvml: Optional[str] = None,
                profile_dir: Optional[str] = None) -> SimSources:
    """Write (or reuse) the simulated node's files under `workdir` and say where the probes must look. A hook on a
    node whose scenario did not change takes gpuguard.simulate.materialized.current instead (no YAML)."""
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    sc = load_scenario(scenario_path, profile_dir, cache_dir=str(root))
    boot_id = str(sc.data.get("boot_id") or "00000000-0000-4000-8000-00000000b001")
    if fake_nvml is None:
        fake_nvml = str(build_fake_nvml())
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a prolog and a health check may materialise at once
        stamp = root / ".scenario"
        key = f"{sc.digest}:{os.path.abspath(scenario_path)}"
        if not stamp.exists() or stamp.read_text() != key:
            (root / RECORD).unlink(missing_ok=True)  # no fast path to half-written files
            atomic_write(root / "nvml.txt", nvml_flat_file(sc))
            _write_fabric(root, sc)
            _write_system(root, sc)
            stamp.write_text(key)
        _sync_kmsg(root, sc, boot_id)
        # last: the fast path trusts the files only once they are all written
        atomic_write(root / RECORD, json.dumps(record_for(scenario_path, sc.digest, sc.profile_name, boot_id,
                                                          fake_nvml)))
    return sim_sources(str(root), scenario_path, sc.profile, fake_nvml, boot_id)


# --------------------------------------------------------------------------- injecting faults at run time


def inject(scenario_path: str, *, kernel_lines: list[str] = (), processes: list[tuple[int, int]] = (),  # type: ignore[assignment]
           set_gpu: Optional[tuple[int, str, Any]] = None) -> None:
    """Change a scenario file in place (atomically), as hardware changes under a running job: append kernel
    log lines, attach live processes to GPUs (`(gpu, pid)`), or set one GPU field."""
    import yaml

    data = load_yaml_file(scenario_path) or {}
    if kernel_lines:
        data.setdefault("kernel_log", [])
        data["kernel_log"] = list(data["kernel_log"] or []) + list(kernel_lines)
    gpus = data.setdefault("gpus", {}) if (processes or set_gpu) else data.get("gpus")
    if processes or set_gpu:
        overrides = gpus.setdefault("overrides", {}) or {}
        gpus["overrides"] = overrides
        for gpu, pid in processes:
            entry = overrides.setdefault(gpu, {}) or {}
            overrides[gpu] = entry
            entry.setdefault("processes", [])
            entry["processes"] = list(entry["processes"] or []) + [{"pid": pid, "used_mib": 4096, "live": True}]
        if set_gpu:
            gpu, key, value = set_gpu
            if key not in GPU_KEYS:
                raise ScenarioError(f"unknown GPU key {key!r}")
            entry = overrides.setdefault(gpu, {}) or {}
            overrides[gpu] = entry
            entry[key] = value
    atomic_write(scenario_path, yaml.safe_dump(data, sort_keys=False))
