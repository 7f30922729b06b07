"""What a scenario may say (see README "Scenarios"), loaded and checked: its top-level keys, the GPU keys, and the
`Scenario` the writers (gpuguard.simulate.nvmlfile, gpuguard.simulate.hostfiles) turn into files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpuguard.config.yamlutil import load_yaml_file
from gpuguard.profiles import Profile, load_profile
from gpuguard.simulate.materialized import ScenarioError, SimSources, scenario_digest

__all__ = ["GPU_KEYS", "TOP_KEYS", "Scenario", "ScenarioError", "SimSources", "load_scenario"]

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
