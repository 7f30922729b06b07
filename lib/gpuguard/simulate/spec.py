"""What a scenario may say (see README "Scenarios"), loaded and checked: its top-level keys, the GPU keys, and the
`Scenario` the writers (gpuguard.simulate.nvmlfile, gpuguard.simulate.hostfiles) turn into files."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpuguard.config.yamlutil import load_yaml_file
from gpuguard.profiles import Profile, load_profile

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
TOP_KEYS = {"description", "profile", "instance_type", "boot_id", "driver_version", "gpus", "nvml", "kernel_log",
            "fabric", "system",
            "nccl",  # simulated nccl-tests / collective bandwidth of this node (gpuguard.nccl)
            "dcgm",  # simulated `dcgmi diag` results
            }


class ScenarioError(ValueError):
    pass


@dataclass
class Scenario:
    path: str
    data: dict[str, Any]
    profile: Profile
    digest: str


@dataclass
class SimSources:
    """Where the probes must read for this simulated node."""

    profile: Profile
    nvml_library: str
    nvml_env: dict[str, str]
    kernel_log: str  # source spec for gpuguard.kernellog.sources
    boot_id: str
    sysfs_root: str
    procfs_root: str
    fi_info: str
    workdir: str
    scenario: str
    notes: list[str] = field(default_factory=list)


def load_scenario(path: str, profile_dir: Optional[str] = None) -> Scenario:
    raw = Path(path).read_bytes()
    data = load_yaml_file(path) or {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping")
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise ScenarioError(f"{path}: unknown scenario keys: {', '.join(sorted(map(str, unknown)))}")
    prof_name = data.get("profile") or data.get("instance_type") or "generic"
    profile = load_profile(str(prof_name), profile_dir)
    return Scenario(path, data, profile, hashlib.sha256(raw).hexdigest()[:16])
