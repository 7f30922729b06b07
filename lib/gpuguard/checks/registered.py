"""The registered checks, in the order the runs list them, and every table derived from them (node scope, priority
order, reset-only checks, the keyword vocabulary, the config parameters, what each probe must read).

A check is registered by one `CheckSpec` in the group below that fits it (gpuguard.checks.spec says what each field
means); `registry()` is all of them. This module imports the check modules; they import
`gpuguard.checks.spec` and `gpuguard.checks._util`, never this module or the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

from gpuguard.checks import dcgm as dcgm_checks
from gpuguard.checks import efa_counters as efa_counter_checks
from gpuguard.checks import fabric, system, xid
from gpuguard.checks import nccl as nccl_checks
from gpuguard.checks.gpu import identity, links, memory_errors, processes, thermal
from gpuguard.checks.spec import ALL_KINDS, IDLE_ONLY, NODE, TIER, CheckInput, CheckSpec
from gpuguard.model import Finding, Observations, Severity

if TYPE_CHECKING:
    from gpuguard.profiles import Profile


def _build() -> list[CheckSpec]:
    return [*_gpu_identity_checks(), *_gpu_fault_checks(), *_gpu_thermal_and_link_checks(), *_gpu_process_checks(),
            *_fabric_and_tier_checks(), *_system_checks()]


def _gpu_identity_checks() -> list[CheckSpec]:
    """Whether NVML answers and the GPUs are the ones the profile says."""
    return [
        CheckSpec("gpu.nvml", ("NVML", "TIMEOUT"), "nvml", identity.check_nvml, ALL_KINDS, {},
                  "NVML answers, the driver is loaded, no GPU is lost or needs a reset", priority=20,
                  hardware_evidence=True),
        CheckSpec("gpu.count", ("GPUCOUNT",), "nvml", identity.check_count, ALL_KINDS, {},
                  "GPU count matches the profile and every GPU of the job exists", priority=30, hardware_evidence=True),
        CheckSpec("gpu.model", ("GPUMODEL",), "nvml", identity.check_model, NODE, {"severity": ("severity", "warn")},
                  "GPU product name matches the profile", priority=180),
        CheckSpec("gpu.memory", ("GPUMEM",), "nvml", identity.check_memory, NODE,
                  {"tolerance_pct": ("num?", None), "severity": ("severity", "warn")},
                  "GPU framebuffer size matches the profile", priority=190),
    ]


def _gpu_fault_checks() -> list[CheckSpec]:
    """Memory errors, what only a reset clears, fatal Xids: unambiguous hardware evidence."""
    return [
        CheckSpec("gpu.ecc", ("ECC",), "nvml", memory_errors.check_ecc, ALL_KINDS,
                  {"require_enabled": ("bool", False), "max_volatile_uncorrected": ("int", 0),
                   "max_aggregate_uncorrected": ("int?", None)},
                  "ECC enabled; no uncorrectable ECC errors since the driver loaded", priority=70,
                  reset_evidence="the volatile ECC error count cleared",  # volatile counters reset with the GPU
                  hardware_evidence=True),
        CheckSpec("gpu.retired_pages", ("RETIRED",), "nvml", memory_errors.check_retired_pages, ALL_KINDS,
                  {"max_retired": ("int", 63)},  # DCGM's DCGM_LIMIT_MAX_RETIRED_PAGES (63, "to match the field diag")
                  "no page retirement pending; retired pages below the RMA limit (pre-Ampere GPUs)", priority=60,
                  reset_evidence="the pending page retirement applied", hardware_evidence=True),
        CheckSpec("gpu.row_remap", ("ROWREMAP",), "nvml", memory_errors.check_row_remap, ALL_KINDS,
                  {"max_uncorrectable": ("int?", None)},
                  "no row remapping pending or failed (Ampere and newer)", priority=50,
                  reset_evidence="the pending row remap applied", hardware_evidence=True),
        CheckSpec("gpu.recovery_action", ("RECOVERY",), "nvml", memory_errors.check_recovery_action, ALL_KINDS, {},
                  "NVML's GPU recovery action is NONE (newer drivers)", priority=40,
                  reset_evidence="the recovery action back to NONE", hardware_evidence=True),
        CheckSpec("gpu.xid", ("XID",), "kernel_log", xid.check_xid, ALL_KINDS, {},
                  "no fatal Xid in the kernel log since the last check", priority=10, hardware_evidence=True),
    ]


def _gpu_thermal_and_link_checks() -> list[CheckSpec]:
    """Temperature, clocks, PCIe, NVLink and the NVSwitch fabric (the job's GPUs, or the node's)."""
    return [
        CheckSpec("gpu.temperature", ("THERMAL",), "nvml", thermal.check_temperature, IDLE_ONLY,
                  {"warn_c": ("int?", None), "fail_c": ("int?", None), "hbm_margin_c": ("int", 5)},
                  "GPU and HBM temperature below the GPU's own limits (NVML slowdown / max operating / HBM max)",
                  priority=110, scope="job"),
        CheckSpec("gpu.throttle", ("CLOCKS",), "nvml", thermal.check_throttle, IDLE_ONLY,
                  {"fail_reasons": ("strlist", ["hw_slowdown", "hw_thermal", "hw_power_brake"]),
                   "warn_reasons": ("strlist", ["sw_thermal"]),
                   "persist_s": ("num", 240.0)},  # drains only once seen in every run for this long (warns before)
                  "no hardware slowdown, thermal or power-brake clock throttling", priority=120, scope="job"),
        CheckSpec("gpu.pcie", ("PCIE",), "nvml", links.check_pcie, NODE,
                  {"busy_util_pct": ("num", 5.0), "replay_rate_warn_per_min": ("num?", 8.0),
                   "replay_rate_fail_per_min": ("num?", None), "capability_severity": ("severity", "warn")},
                  "PCIe link trained at the expected width and generation under load; replay rate below DCGM's limit",
                  priority=100, scope="job"),
        CheckSpec("gpu.nvlink", ("NVLINK",), "nvml", links.check_nvlink, NODE, {},
                  "every NVLink of every GPU is active", priority=80),
        CheckSpec("gpu.fabric", ("FABRIC",), "nvml", links.check_fabric, NODE, {},
                  "NVSwitch systems: Fabric Manager registered every GPU in the NVLink fabric (NVML fabric state)",
                  priority=90),
    ]


def _gpu_process_checks() -> list[CheckSpec]:
    """Processes and memory on the job's GPUs before (prolog) and after (epilog) it."""
    return [
        CheckSpec("gpu.processes", ("GPUPROC",), "nvml", processes.check_processes, frozenset({"prolog"}),
                  {"severity": ("severity", "fail")},
                  "no leftover processes on the job's GPUs before it starts", priority=220, scope="job",
                  probe_options=_reads_processes),
        CheckSpec("gpu.leftovers", ("GPUPROC",), "nvml", processes.check_leftovers, frozenset({"epilog"}), {},
                  "the epilog terminated the job's leftover GPU processes; none survived, none foreign", priority=200,
                  scope="job", probe_options=_reads_processes),
        CheckSpec("gpu.memory_released", ("GPUMEM",), "nvml", processes.check_memory_released, frozenset({"epilog"}),
                  {"max_used_mib": ("int", 2048)},
                  "GPU memory released after the job", priority=210, scope="job", probe_options=_reads_processes),
    ]


def _fabric_and_tier_checks() -> list[CheckSpec]:
    """EFA/InfiniBand devices and counters; the optional slow tier (NCCL, DCGM)."""
    return [
        CheckSpec("fabric.efa", ("EFA",), "fabric", fabric.check_efa, NODE,
                  {"check_provider": ("bool", True)},
                  "EFA device count (against the node's own history), ports ACTIVE, libfabric efa provider present",
                  priority=130, probe_options=_reads_fi_info),
        CheckSpec("fabric.ib", ("IB",), "fabric", fabric.check_ib, NODE, {},
                  "InfiniBand HCA count (against the node's own history), ports ACTIVE at the expected rate",
                  priority=140),
        CheckSpec("fabric.efa_counters", ("EFA",), "efa_counters", efa_counter_checks.check_efa_counters,
                  frozenset({"healthcheck", "manual"}),
                  {"max_rx_drops": ("int?", None), "max_retrans_pkts": ("int?", None),
                   "max_retrans_timeout_events": ("int?", None), "max_unresponsive_remote_events": ("int?", None),
                   "max_impaired_remote_conn_events": ("int?", None), "max_rdma_wr_err": ("int?", None)},
                  "EFA hardware error counters grew less than the configured limits since the last run", priority=170),
        CheckSpec("nccl.busbw", ("NCCL",), "nccl", nccl_checks.check_nccl_busbw, TIER,
                  {"min_busbw_gbps": ("num?", None), "max_wrong": ("int", 0)},
                  "single-node all_reduce busbw of the largest message at or above the profile's floor (optional tier)",
                  priority=160),
        CheckSpec("dcgm.diag", ("DCGM",), "dcgm", dcgm_checks.check_dcgm_diag, TIER,
                  {"warn_is_fail": ("bool", False), "ignore_tests": ("strlist", [])},
                  "dcgmi diag -r N passes (optional tier)", priority=150),
    ]


def _system_checks() -> list[CheckSpec]:
    """Memory, disks and CPUs of the node."""
    return [
        CheckSpec("sys.memory", ("MEM",), "system", system.check_memory, IDLE_ONLY,
                  {"min_available_gib": ("num?", None), "total_severity": ("severity", "warn")},
                  "installed memory matches the profile; enough memory available", priority=230),
        CheckSpec("sys.disk", ("DISK",), "system", system.check_disk, ALL_KINDS,
                  {"paths": ("disk_paths", [{"path": "/", "min_free_gib": 1}, {"path": "/tmp", "min_free_gib": 1}])},
                  "free space on the configured paths (drains only for paths the site marks root_owned)", priority=240,
                  probe_options=_reads_disk_paths),
        CheckSpec("sys.cpu", ("CPU",), "system", system.check_cpu, NODE, {"severity": ("severity", "warn")},
                  "online CPU count matches the profile", priority=250),
    ]


# --------------------------------------------------------------------------- what a check asks of its probe


def _reads_processes(params: Mapping[str, Any], profile: "Profile") -> Mapping[str, Any]:
    return {"with_processes": True}


def _reads_fi_info(params: Mapping[str, Any], profile: "Profile") -> Mapping[str, Any]:
    return {"fi_info": bool(profile.libfabric_provider) and bool(params.get("check_provider", True))}


def _reads_disk_paths(params: Mapping[str, Any], profile: "Profile") -> Mapping[str, Any]:
    return {"disk_paths": [p["path"] for p in params.get("paths") or []]}


def _merge_option(old: Any, new: Any) -> Any:
    """Two checks asking the same probe: a flag is on if either wants it, lists are joined, numbers the larger."""
    if old is None:
        return new
    if isinstance(old, bool) or isinstance(new, bool):
        return bool(old) or bool(new)
    if isinstance(old, list):
        return old + [x for x in new if x not in old]
    return max(old, new)


def probe_options(specs: list[CheckSpec], cfg: Any, profile: "Profile") -> dict[str, dict[str, Any]]:
    """probe name -> the options the planned checks need from it (e.g. {"nvml": {"with_processes": True},
    "system": {"disk_paths": ["/", "/tmp"]}, "fabric": {"fi_info": True}}). `cfg` is anything with
    `check_params(check_id, defaults)` (gpuguard.config.schema.Config). Every planned probe has an entry."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        opts = out.setdefault(spec.needs, {})
        if spec.probe_options is None:
            continue
        for key, value in spec.probe_options(cfg.check_params(spec.id, param_defaults(spec)), profile).items():
            opts[key] = _merge_option(opts.get(key), value)
    return out


# --------------------------------------------------------------------------- the registry and derived tables


_REGISTRY: Optional[list[CheckSpec]] = None


def registry() -> list[CheckSpec]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _build()
    return _REGISTRY


def get_check(check_id: str) -> CheckSpec:
    for spec in registry():
        if spec.id == check_id:
            return spec
    raise KeyError(check_id)


def find_check(check_id: str) -> Optional[CheckSpec]:
    try:
        return get_check(check_id)
    except KeyError:
        return None


def node_scope() -> frozenset[str]:
    """Checks judged over every GPU of the node in every run kind."""
    return frozenset(s.id for s in registry() if s.scope == "node")


def check_priority() -> list[str]:
    """Check ids, most actionable (root causes) first."""
    return [s.id for s in sorted(registry(), key=lambda s: s.priority)]


def priority_of(check_id: str) -> int:
    """A check's rank for naming the drain reason; unregistered ids (nccl.sweep, gpuguard) come last."""
    spec = find_check(check_id)
    return spec.priority if spec else 1_000_000


def cleared_only_by_reset() -> dict[str, str]:
    """check id -> the words for the evidence that a GPU reset cleared what it found."""
    return {s.id: s.reset_evidence for s in registry() if s.reset_evidence}


def check_keywords() -> frozenset[str]:
    """Every keyword a registered check may emit (reason.keywords() adds the ones no check owns)."""
    return frozenset(k for s in registry() for k in s.keywords)


def is_hardware_evidence(finding: Finding) -> bool:
    """A failing finding that is unambiguous per-node hardware evidence (see CheckSpec.hardware_evidence)."""
    spec = find_check(finding.check_id)
    return bool(spec and spec.hardware_evidence and finding.severity is Severity.FAIL
                and not finding.evidence.get("mismatch") and not finding.evidence.get("launch_choice"))


def param_schema() -> dict[str, dict[str, str]]:
    """check id -> {param: validator name}, for config validation."""
    return {s.id: {k: v[0] for k, v in s.params.items()} for s in registry()}


def param_defaults(spec: CheckSpec) -> dict[str, Any]:
    return {k: v[1] for k, v in spec.params.items()}


def run_check(spec: CheckSpec, obs: Observations, inp: CheckInput) -> list[Finding]:
    """Run one check; a bug in a check becomes an `incomplete` finding, never an exception."""
    try:
        findings = spec(obs, inp)
    except Exception as e:  # noqa: BLE001 - a check bug must not take the whole run down
        return [Finding(spec.id, Severity.INCOMPLETE, f"internal error in check: {type(e).__name__}: {e}",
                        keyword="INTERNAL", evidence={"internal_error": True})]
    return findings
