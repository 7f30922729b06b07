"""The check registry: every check is a pure function `(Observations, CheckInput) -> [Finding]`.

Checks know nothing about Slurm, files or time. Adding a check = one function + its tests + one line
in `REGISTRY`. Each entry names the probe it needs, the run kinds it belongs to and its parameters
(validated config keys under `checks.<id>`, with defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from gpuguard.model import Finding, Observations, Severity

if TYPE_CHECKING:
    from gpuguard.profiles import Profile
    from gpuguard.xid import XidCatalog

ALL_KINDS = frozenset({"prolog", "epilog", "healthcheck", "manual"})
# Node checks that are not about the job: the epilog adds them ("epilog_deep") only when the job died by a
# signal that can point at hardware (SIGKILL by the OOM killer aside, a SIGSEGV/SIGBUS is worth a look).
NODE = frozenset({"prolog", "healthcheck", "manual", "epilog_deep"})
# Right after a job the GPUs are hot and throttling is expected: not judged in the epilog.
IDLE_ONLY = frozenset({"prolog", "healthcheck", "manual"})
# The optional slow tier (single-node NCCL all_reduce, dcgmi diag): added to a prolog/manual run only when
# gpuguard.nccl.tier.tier_due() says so (config, exclusive job, first job after a reboot).
TIER = frozenset({"tier"})


# Checks about the node's hardware, judged over every GPU in every run kind: a row-remap failure or a GPU that
# needs a reset drains the node whether or not the job asked for that GPU, so the verdict does not depend on
# which job happens to run the prolog. The others are about the job's GPUs (leftover processes, temperature and
# clocks, which another job's busy GPUs would distort).
NODE_SCOPE = frozenset({"gpu.nvml", "gpu.count", "gpu.model", "gpu.memory", "gpu.ecc", "gpu.retired_pages",
                        "gpu.row_remap", "gpu.recovery_action", "gpu.xid", "gpu.nvlink", "gpu.fabric"})


@dataclass(frozen=True)
class CheckInput:
    profile: "Profile"
    params: Mapping[str, Any] = field(default_factory=dict)
    job_gpus: Optional[tuple[int, ...]] = None  # None = all GPUs on the node
    kind: str = "manual"
    xid_catalog: Optional["XidCatalog"] = None
    unmapped_gpus: tuple[str, ...] = ()  # Slurm GPU ids that match no GPU NVML reports (gpuguard.gpumap)
    gpu_map_notes: tuple[str, ...] = ()


CheckFn = Callable[[Observations, CheckInput], list[Finding]]


@dataclass(frozen=True)
class CheckSpec:
    id: str
    keyword: str  # default drain keyword (a finding may carry a more precise one)
    needs: str  # probe: nvml | kernel_log | fabric | system
    func: CheckFn
    kinds: frozenset[str]
    params: dict[str, tuple[str, Any]]  # name -> (validator name in config.PARAM_VALIDATORS, default)
    description: str


def _registry() -> list[CheckSpec]:
    from gpuguard.checks import dcgm as dcgm_checks
    from gpuguard.checks import efa_counters as efa_counter_checks
    from gpuguard.checks import fabric, gpu, system, xid
    from gpuguard.checks import nccl as nccl_checks

    S = CheckSpec
    return [
        S("gpu.nvml", "NVML", "nvml", gpu.check_nvml, ALL_KINDS, {},
          "NVML answers, the driver is loaded, no GPU is lost or needs a reset"),
        S("gpu.count", "GPUCOUNT", "nvml", gpu.check_count, ALL_KINDS, {},
          "GPU count matches the profile and every GPU of the job exists"),
        S("gpu.model", "GPUMODEL", "nvml", gpu.check_model, NODE, {"severity": ("severity", "warn")},
          "GPU product name matches the profile"),
        S("gpu.memory", "GPUMEM", "nvml", gpu.check_memory, NODE,
          {"tolerance_pct": ("num?", None), "severity": ("severity", "warn")},
          "GPU framebuffer size matches the profile"),
        S("gpu.ecc", "ECC", "nvml", gpu.check_ecc, ALL_KINDS,
          {"require_enabled": ("bool", False), "max_volatile_uncorrected": ("int", 0),
           "max_aggregate_uncorrected": ("int?", None)},
          "ECC enabled; no uncorrectable ECC errors since the driver loaded"),
        S("gpu.retired_pages", "RETIRED", "nvml", gpu.check_retired_pages, ALL_KINDS,
          {"max_retired": ("int", 63)},  # DCGM's DCGM_LIMIT_MAX_RETIRED_PAGES (63, "to match the field diag")
          "no page retirement pending; retired pages below the RMA limit (pre-Ampere GPUs)"),
        S("gpu.row_remap", "ROWREMAP", "nvml", gpu.check_row_remap, ALL_KINDS,
          {"max_uncorrectable": ("int?", None)},
          "no row remapping pending or failed (Ampere and newer)"),
        S("gpu.recovery_action", "RECOVERY", "nvml", gpu.check_recovery_action, ALL_KINDS, {},
          "NVML's GPU recovery action is NONE (newer drivers)"),
        S("gpu.xid", "XID", "kernel_log", xid.check_xid, ALL_KINDS, {},
          "no fatal Xid in the kernel log since the last check"),
        S("gpu.temperature", "THERMAL", "nvml", gpu.check_temperature, IDLE_ONLY,
          {"warn_c": ("int?", None), "fail_c": ("int?", None), "hbm_margin_c": ("int", 5)},
          "GPU and HBM temperature below the GPU's own limits (NVML slowdown / max operating / HBM max)"),
        S("gpu.throttle", "CLOCKS", "nvml", gpu.check_throttle, IDLE_ONLY,
          {"fail_reasons": ("strlist", ["hw_slowdown", "hw_thermal", "hw_power_brake"]),
           "warn_reasons": ("strlist", ["sw_thermal"]),
           "persist_s": ("num", 240.0)},  # drains only once seen in every run for this long (warns before)
          "no hardware slowdown, thermal or power-brake clock throttling"),
        S("gpu.pcie", "PCIE", "nvml", gpu.check_pcie, NODE,
          {"busy_util_pct": ("num", 5.0), "replay_rate_warn_per_min": ("num?", 8.0),
           "replay_rate_fail_per_min": ("num?", None), "capability_severity": ("severity", "warn")},
          "PCIe link trained at the expected width and generation under load; replay rate below DCGM's limit"),
        S("gpu.nvlink", "NVLINK", "nvml", gpu.check_nvlink, NODE, {},
          "every NVLink of every GPU is active"),
        S("gpu.fabric", "FABRIC", "nvml", gpu.check_fabric, NODE, {},
          "NVSwitch systems: Fabric Manager registered every GPU in the NVLink fabric (NVML fabric state)"),
        S("gpu.processes", "GPUPROC", "nvml", gpu.check_processes, frozenset({"prolog"}),
          {"severity": ("severity", "fail")},
          "no leftover processes on the job's GPUs before it starts"),
        S("gpu.leftovers", "GPUPROC", "nvml", gpu.check_leftovers, frozenset({"epilog"}), {},
          "the epilog terminated the job's leftover GPU processes; none survived, none foreign"),
        S("gpu.memory_released", "GPUMEM", "nvml", gpu.check_memory_released, frozenset({"epilog"}),
          {"max_used_mib": ("int", 2048)},
          "GPU memory released after the job"),
        S("fabric.efa", "EFA", "fabric", fabric.check_efa, NODE,
          {"check_provider": ("bool", True)},
          "EFA device count, ports ACTIVE, libfabric efa provider present"),
        S("fabric.ib", "IB", "fabric", fabric.check_ib, NODE, {},
          "InfiniBand HCA count, ports ACTIVE at the expected rate"),
        S("fabric.efa_counters", "EFA", "efa_counters", efa_counter_checks.check_efa_counters,
          frozenset({"healthcheck", "manual"}),
          {"max_rx_drops": ("int?", None), "max_retrans_pkts": ("int?", None),
           "max_retrans_timeout_events": ("int?", None), "max_unresponsive_remote_events": ("int?", None),
           "max_impaired_remote_conn_events": ("int?", None), "max_rdma_wr_err": ("int?", None)},
          "EFA hardware error counters grew less than the configured limits since the last run"),
        S("nccl.busbw", "NCCL", "nccl", nccl_checks.check_nccl_busbw, TIER,
          {"min_busbw_gbps": ("num?", None), "max_wrong": ("int", 0)},
          "single-node all_reduce busbw of the largest message at or above the profile's floor (optional tier)"),
        S("dcgm.diag", "DCGM", "dcgm", dcgm_checks.check_dcgm_diag, TIER,
          {"warn_is_fail": ("bool", False), "ignore_tests": ("strlist", [])},
          "dcgmi diag -r N passes (optional tier)"),
        S("sys.memory", "MEM", "system", system.check_memory, IDLE_ONLY,
          {"min_available_gib": ("num?", None), "total_severity": ("severity", "warn")},
          "installed memory matches the profile; enough memory available"),
        S("sys.disk", "DISK", "system", system.check_disk, ALL_KINDS,
          {"paths": ("disk_paths", [{"path": "/", "min_free_gib": 1}, {"path": "/tmp", "min_free_gib": 1}])},
          "free space on the configured paths"),
        S("sys.cpu", "CPU", "system", system.check_cpu, NODE, {"severity": ("severity", "warn")},
          "online CPU count matches the profile"),
    ]


_REGISTRY: Optional[list[CheckSpec]] = None


def registry() -> list[CheckSpec]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _registry()
    return _REGISTRY


def get_check(check_id: str) -> CheckSpec:
    for spec in registry():
        if spec.id == check_id:
            return spec
    raise KeyError(check_id)


def param_schema() -> dict[str, dict[str, str]]:
    """check id -> {param: validator name}, for config validation."""
    return {s.id: {k: v[0] for k, v in s.params.items()} for s in registry()}


def param_defaults(spec: CheckSpec) -> dict[str, Any]:
    return {k: v[1] for k, v in spec.params.items()}


def run_check(spec: CheckSpec, obs: Observations, inp: CheckInput) -> list[Finding]:
    """Run one check; a bug in a check becomes an `incomplete` finding, never an exception."""
    try:
        findings = spec.func(obs, inp)
    except Exception as e:  # noqa: BLE001 - a check bug must not take the whole run down
        return [Finding(spec.id, Severity.INCOMPLETE, f"internal error in check: {type(e).__name__}: {e}",
                        keyword="INTERNAL", evidence={"internal_error": True})]
    return findings
