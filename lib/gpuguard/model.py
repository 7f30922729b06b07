"""Plain data shared by every layer: observations (what probes saw) and findings (what checks concluded).

Observations are produced by `gpuguard.probes`, consumed by the pure functions in `gpuguard.checks`.
Nothing here does I/O.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

from gpuguard.util.record import Frozen, Record, as_dict, field, field_names, record


class Severity(str, enum.Enum):
    """Outcome of one check. `skip` = not applicable / no threshold configured."""

    OK = "ok"
    SKIP = "skip"
    WARN = "warn"
    INCOMPLETE = "incomplete"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {
    Severity.OK: 0,
    Severity.SKIP: 0,
    Severity.WARN: 1,
    Severity.INCOMPLETE: 2,
    Severity.FAIL: 3,
}


class Action(str, enum.Enum):
    """What should happen to the node when a check fails (least to most invasive)."""

    NONE = "none"
    DRAIN = "drain"      # take no new jobs until an admin (or the health check) clears it
    RESET = "reset"      # drain; a GPU reset is expected to fix it
    REBOOT = "reboot"    # drain; a node reboot is expected to fix it
    REPLACE = "replace"  # drain; hardware inspection / RMA

    @property
    def rank(self) -> int:
        return _ACTION_RANK[self]


_ACTION_RANK = {Action.NONE: 0, Action.DRAIN: 1, Action.RESET: 2, Action.REBOOT: 3, Action.REPLACE: 4}


@record
class Finding(Record):
    """One conclusion of one check, with what to do about it and the evidence behind it."""

    check_id: str
    severity: Severity
    message: str
    keyword: str = ""
    remediation: str = ""
    action: Action = Action.NONE
    evidence: dict[str, Any] = field(default_factory=dict)
    gpu: Optional[int] = None  # GPU index the finding is about, when it is about one

    def to_dict(self) -> dict[str, Any]:
        d = as_dict(self)
        d["severity"] = self.severity.value
        d["action"] = self.action.value
        return d


@record
class ProbeStatus(Record):
    """How a probe went: `complete` False means its observation is partial or empty."""

    complete: bool = True
    error: Optional[str] = None
    timed_out: bool = False
    duration_s: float = 0.0


# --------------------------------------------------------------------------- NVML


@record
class GpuProcess(Record):
    pid: int
    used_memory_mib: Optional[int] = None
    name: Optional[str] = None  # filled from /proc when the pid is visible


@record
class GpuInfo(Record):
    """One GPU as NVML reports it. None = not supported / not readable (see `errors`)."""

    index: int
    uuid: Optional[str] = None
    pci_bus_id: Optional[str] = None  # normalised "0000:3b:00.0"
    name: Optional[str] = None
    serial: Optional[str] = None
    memory_total_mib: Optional[int] = None
    memory_used_mib: Optional[int] = None
    ecc_enabled: Optional[bool] = None
    ecc_pending_enabled: Optional[bool] = None
    ecc_volatile_uncorrected: Optional[int] = None
    ecc_volatile_corrected: Optional[int] = None
    ecc_aggregate_uncorrected: Optional[int] = None
    ecc_aggregate_corrected: Optional[int] = None
    retired_pages_sbe: Optional[int] = None
    retired_pages_dbe: Optional[int] = None
    retired_pages_pending: Optional[bool] = None
    remapped_rows_correctable: Optional[int] = None
    remapped_rows_uncorrectable: Optional[int] = None
    remapped_rows_pending: Optional[bool] = None
    remapped_rows_failure: Optional[bool] = None
    recovery_action: Optional[int] = None  # NVML_GPU_RECOVERY_ACTION_*; 0 = none
    temperature_c: Optional[int] = None
    temperature_slowdown_c: Optional[int] = None
    temperature_shutdown_c: Optional[int] = None
    temperature_gpu_max_c: Optional[int] = None  # NVML_TEMPERATURE_THRESHOLD_GPU_MAX: max operating temperature
    temperature_mem_max_c: Optional[int] = None  # NVML_TEMPERATURE_THRESHOLD_MEM_MAX: HBM max operating temperature
    memory_temperature_c: Optional[int] = None  # HBM (NVML_FI_DEV_MEMORY_TEMP)
    clock_event_reasons: Optional[int] = None  # bitmask, nvmlClocksEventReason*
    pcie_gen_current: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width_current: Optional[int] = None
    pcie_width_max: Optional[int] = None
    pcie_replay_counter: Optional[int] = None  # link-level retransmissions since the driver loaded
    minor_number: Optional[int] = None  # /dev/nvidia<minor>: what Slurm's gres.conf File= names
    persistence_mode: Optional[bool] = None
    mig_enabled: Optional[bool] = None  # MIG mode currently on
    mig_devices: list[str] = field(default_factory=list)  # MIG device UUIDs (MIG-...) on this GPU
    fabric_state: Optional[int] = None  # NVML_GPU_FABRIC_STATE_*: 0 not supported, 1 not started, 2 in progress,
    #                                     3 completed (NVSwitch systems: Fabric Manager registered the GPU)
    fabric_status: Optional[int] = None  # nvmlReturn of the fabric registration (0 = success)
    fabric_health_mask: Optional[int] = None  # NVML_GPU_FABRIC_HEALTH_MASK_* fields (v2+ drivers)
    # One entry per NVLink the GPU has: True active, False down, None = NVML could not say (NOT_SUPPORTED or an
    # error for that link: unknown, never "no link"). [] = the GPU has no NVLink (NVML's link count is 0, or link 0
    # does not exist). None = not read.
    nvlink_active: Optional[list[Optional[bool]]] = None
    power_mw: Optional[int] = None
    utilization_gpu_pct: Optional[int] = None
    processes: list[GpuProcess] = field(default_factory=list)
    # NVML errors other than NOT_SUPPORTED, by query name -> NVML error name, e.g. {"temperature": "GPU_IS_LOST"}
    errors: dict[str, str] = field(default_factory=dict)
    # queries NVML answered NOT_SUPPORTED (or FUNCTION_NOT_FOUND: an older driver): their values are None. A check
    # whose GPU should have the value (its peers on the node report it, or a mode says it is on) is incomplete.
    unsupported: list[str] = field(default_factory=list)
    # set when NVML says the GPU is gone or needs a reset (GPU_IS_LOST, RESET_REQUIRED, ...)
    fatal_error: Optional[str] = None


@record
class NvmlObservation(Record):
    status: ProbeStatus = field(default_factory=ProbeStatus)
    init_error: Optional[str] = None  # NVML error name when nvmlInit failed, or "TIMEOUT"
    init_duration_s: Optional[float] = None  # how long nvmlInit took (seconds; slow without persistence mode)
    slow_answer_s: Optional[float] = None  # set when the probe only answered in its second wait (gpuguard.pipeline.gather)
    driver_version: Optional[str] = None
    device_count: Optional[int] = None
    gpus: list[GpuInfo] = field(default_factory=list)


# --------------------------------------------------------------------------- kernel log


@record
class XidEvent(Frozen):
    """One `NVRM: Xid (PCI:...): <code>, ...` kernel message."""

    code: int
    pci: str  # "0000:3b:00" as the driver prints it (domain:bus:device), lower-case
    detail: str  # the text after the code
    pid: Optional[int] = None
    process_name: Optional[str] = None
    timestamp: Optional[str] = None  # as printed (wall clock or kernel monotonic seconds)
    monotonic_s: Optional[float] = None
    seq: Optional[int] = None  # /dev/kmsg sequence number when known
    raw: str = ""


@record
class KernelLogObservation(Record):
    status: ProbeStatus = field(default_factory=ProbeStatus)
    source: str = ""
    events: list[XidEvent] = field(default_factory=list)
    lines_scanned: int = 0
    malformed: int = 0  # Xid-looking lines that could not be parsed (skipped, counted)
    rejected_non_kernel: int = 0  # Xid-looking lines that did not come from the kernel (e.g. `logger`)
    cursor: Optional[dict[str, Any]] = None  # where the next scan should start


# --------------------------------------------------------------------------- fabric


@record
class RdmaPort(Record):
    port: int
    state: Optional[str] = None  # "ACTIVE", "DOWN", "INIT", ...
    phys_state: Optional[str] = None  # "LinkUp", "Polling", ...
    rate: Optional[str] = None  # "100 Gb/sec (4X EDR)"
    link_layer: Optional[str] = None  # "InfiniBand", "Ethernet", "Unspecified" (EFA)


@record
class RdmaDevice(Record):
    name: str  # "rdmap16s27", "mlx5_0", "efa_0"
    kind: str  # "efa" | "ib" | "roce" | "other"
    ports: list[RdmaPort] = field(default_factory=list)


@record
class FiInfo(Record):
    """What `fi_info -p efa` said."""

    ran: bool = False
    provider_found: bool = False
    devices: int = 0
    domains: list[str] = field(default_factory=list)
    error: Optional[str] = None


@record
class FabricObservation(Record):
    status: ProbeStatus = field(default_factory=ProbeStatus)
    devices: list[RdmaDevice] = field(default_factory=list)
    fi_info: Optional[FiInfo] = None
    # the sysfs device list was read in full (fi_info may still have failed); None = as status.complete
    devices_complete: Optional[bool] = None

    @property
    def devices_read(self) -> bool:
        return self.status.complete if self.devices_complete is None else self.devices_complete


# --------------------------------------------------------------------------- system


@record
class DiskUsage(Record):
    path: str
    total_mib: Optional[int] = None
    free_mib: Optional[int] = None
    error: Optional[str] = None
    owner_uid: Optional[int] = None  # owner of the path itself (lstat)
    world_writable: Optional[bool] = None  # the path's mode lets every user write (S_IWOTH, e.g. /tmp's 1777)


@record
class SystemObservation(Record):
    status: ProbeStatus = field(default_factory=ProbeStatus)
    cpus_online: Optional[int] = None
    cpus_offline: Optional[str] = None  # the kernel's cpulist of present-but-offline CPUs ("" = none)
    smt_active: Optional[bool] = None  # /sys/devices/system/cpu/smt/active
    smt_control: Optional[str] = None  # on | off | forceoff | notsupported | notimplemented
    mem_total_mib: Optional[int] = None
    mem_available_mib: Optional[int] = None
    disks: list[DiskUsage] = field(default_factory=list)


@record
class JobCleanup(Record):
    """What the epilog found and did about processes left on the job's GPUs."""

    job_id: Optional[str] = None
    job_uid: Optional[int] = None
    killed: list[GpuProcess] = field(default_factory=list)  # leftovers gpuguard terminated
    survivors: list[GpuProcess] = field(default_factory=list)  # still alive after SIGKILL (stuck in the driver)
    foreign: list[GpuProcess] = field(default_factory=list)  # not the job user's: reported, never killed
    not_killed: list[GpuProcess] = field(default_factory=list)  # the job's, left alone (epilog.kill_leftovers off)
    error: Optional[str] = None


@record
class Observations(Record):
    """Everything gathered for one run. A probe that was not planned leaves its field None."""

    nvml: Optional[NvmlObservation] = None
    kernel_log: Optional[KernelLogObservation] = None
    fabric: Optional[FabricObservation] = None
    system: Optional[SystemObservation] = None
    # optional tiers (NCCL / DCGM / EFA counter deltas); their dataclasses live with their probes
    nccl: Optional[Any] = None
    dcgm: Optional[Any] = None
    efa_counters: Optional[Any] = None
    cleanup: Optional[JobCleanup] = None  # epilog only
    # what earlier runs left for checks that judge a change (e.g. {"pcie_replay": {uuid: [count, epoch]}}) and the
    # time of this run's readings: filled by the pipeline, so checks stay pure
    previous: dict[str, Any] = field(default_factory=dict)
    now: Optional[float] = None


# --------------------------------------------------------------------------- verdicts and run results


@record
class Verdict(Record):
    """What a run decided for the node (gpuguard.pipeline.policy.decide)."""

    outcome: str  # "pass" | "warn" | "drain"
    action: Action = Action.NONE
    primary: Optional[Finding] = None
    failing: list[Finding] = field(default_factory=list)
    reason: Optional[str] = None  # drain reason (DESIGN §3 grammar) when outcome == "drain"
    escalated: list[str] = field(default_factory=list)  # checks drained because incomplete too often
    reported_only: bool = False  # a failure seen under policy.on_failure == "report"
    held_by: Optional[str] = None  # why a drain verdict was not applied (storm guard, restricted config)

    @property
    def healthy(self) -> bool:
        return self.outcome != "drain"


@record
class PendingDrain(Record):
    """A drain (or a reboot request) gpuguard decided but Slurm has not taken yet. It stands until applied: kept in
    the node's verdict journal (gpuguard.pipeline.journal), retried first by every later run and the watch daemon,
    and while it is pending the prolog refuses jobs."""

    id: str
    op: str  # "drain" | "reboot"
    reason: str
    action: str  # drain | reset | reboot | replace
    check_id: Optional[str]
    created: float  # epoch seconds the verdict was reached
    origin: str  # run kind that decided it (prolog, healthcheck, watch, ...)
    attempts: int = 0
    last_error: Optional[str] = None
    last_attempt: Optional[float] = None
    run_id: Optional[int] = None  # the store's run that decided it, when the store could record it

    def to_dict(self) -> dict[str, Any]:
        return as_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PendingDrain":
        names = set(field_names(cls))
        return cls(**{k: v for k, v in d.items() if k in names})


@record
class Handoff(Record):
    """What one hook run left to the notification hand-off process (gpuguard.notify.handoff): `wanted` once a
    delivery was deferred to it. The caller owns it (one per run), so nothing about it is process-wide state."""

    wanted: bool = False


@record
class RunResult(Record):
    """One run, end to end: what was seen, concluded, decided and done. `context` is a gpuguard.context.RunContext,
    `profile` a gpuguard.profiles.Profile (typed loosely here: this module imports nothing of gpuguard's)."""

    context: Any
    profile: Any
    observations: Observations
    findings: list[Finding]
    verdict: Verdict
    exit_code: int
    duration_s: float
    started: float
    drain: Optional[dict[str, Any]] = None  # {"outcome", "detail", "reason", "previous_reason", "reboot"?}
    run_id: Optional[int] = None
    simulated: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    boot_id: Optional[str] = None
    undrain: Optional[dict[str, Any]] = None
    store_errors: list[str] = field(default_factory=list)  # the store could not be opened/written this run
    pending: list[PendingDrain] = field(default_factory=list)  # drains still waiting for Slurm after this run
    applied: list[dict[str, Any]] = field(default_factory=list)  # earlier pending drains this run got applied
    config_issues: list[str] = field(default_factory=list)  # config errors this run worked around (last good)
    events: list[Any] = field(default_factory=list)  # extra notifications decided by the run (storm guard, ...)
    conditions: list[Any] = field(default_factory=list)  # the node's conditions after this run (pipeline.conditions)
    agreement: dict[str, Any] = field(default_factory=dict)  # what making Slurm agree with them did (reconcile)
    refused: bool = False  # exit 1 for a condition or drain decided earlier, while this run's own verdict was not
    handoff: bool = False  # notifications were spooled for the hand-off process to deliver after the hook
