"""What the NVML probe reads from one GPU, by concern: ECC, memory health (retired pages, remapped rows), field
values (recovery action, HBM temperature, NVLink count), temperature and clocks, PCIe, identity (minor number,
persistence, MIG), the NVSwitch fabric, NVLink states, processes. Each reader writes into `q.info` through
`GpuQueries`, which applies NVML's error table to every call (gpuguard.probes.nvml_errors).
"""

from __future__ import annotations

from typing import Any

from gpuguard.model import GpuProcess
from gpuguard.probes.nvml_errors import FUNCTION_NOT_FOUND, INVALID_ARGUMENT, TRY_OLDER, GpuQueries

MIB = 1024 * 1024
NVLINK_PROBE_LINKS = 18  # links probed when the caller does not say how many to expect
FIELD_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (R565+)
FIELD_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP: HBM temperature (read 36 C on an idle H100 SXM, driver 580)
FIELD_NVLINK_LINK_COUNT = 91  # NVML_FI_DEV_NVLINK_LINK_COUNT: how many NVLinks the GPU has
MAX_NVLINKS = 64

# c_nvmlValue_t member for each NVML_VALUE_TYPE_*
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def field_value(value: Any) -> int | float:
    """The number in a c_nvmlFieldValue_t, read through the union member its valueType names."""
    member = _VALUE_MEMBERS[value.valueType] if 0 <= value.valueType < len(_VALUE_MEMBERS) else "ullVal"
    return getattr(value.value, member)


def decode_text(value: str | bytes) -> str:
    """pynvml's structures decode char arrays to str in recent releases, older ones return bytes."""
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def to_mib(n_bytes: int | None) -> int | None:
    return None if n_bytes is None else n_bytes // MIB


def read_ecc(q: GpuQueries, h: Any) -> None:
    nv, info = q.nv, q.info
    mode = q("ecc_mode", nv.nvmlDeviceGetEccMode, h)
    if mode is not None:
        info.ecc_enabled, info.ecc_pending_enabled = bool(mode[0]), bool(mode[1])
    for attr, error_type, counter in (
        ("ecc_volatile_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
        ("ecc_volatile_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
        ("ecc_aggregate_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
        ("ecc_aggregate_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
    ):
        setattr(info, attr, q(attr, nv.nvmlDeviceGetTotalEccErrors, h, error_type, counter))


def read_memory_health(q: GpuQueries, h: Any) -> None:
    """Retired pages (pre-Ampere), remapped rows (Ampere+) and the driver's recovery action (R565+)."""
    nv, info = q.nv, q.info
    for attr, cause in (
        ("retired_pages_sbe", nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
        ("retired_pages_dbe", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
    ):
        pages = q(attr, nv.nvmlDeviceGetRetiredPages, h, cause)
        setattr(info, attr, None if pages is None else len(pages))
    pending = q("retired_pages_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
    info.retired_pages_pending = None if pending is None else bool(pending)

    rows = q("remapped_rows", nv.nvmlDeviceGetRemappedRows, h)
    if rows is not None:
        corr, unc, pending_rows, failure = rows
        info.remapped_rows_correctable, info.remapped_rows_uncorrectable = corr, unc
        info.remapped_rows_pending, info.remapped_rows_failure = bool(pending_rows), bool(failure)


def read_field_values(q: GpuQueries, h: Any) -> int | None:
    """Field values in one call: the recovery action (R565+), HBM temperature, and the NVLink count it returns
    (None when NVML did not say). The call succeeds as a whole; whether each field was readable is in its own
    nvmlReturn."""
    nv, info = q.nv, q.info
    values = q("recovery_action", nv.nvmlDeviceGetFieldValues, h,
               [FIELD_RECOVERY_ACTION, FIELD_MEMORY_TEMP, FIELD_NVLINK_LINK_COUNT])
    if values is None:
        return None
    if values[0].nvmlReturn == 0:
        info.recovery_action = int(field_value(values[0]))
    else:
        q.classify("recovery_action", values[0].nvmlReturn)
    if len(values) > 1 and values[1].nvmlReturn == 0:
        info.memory_temperature_c = int(field_value(values[1]))
    if len(values) > 2 and values[2].nvmlReturn == 0:
        return max(0, min(int(field_value(values[2])), MAX_NVLINKS))
    return None  # an older driver: the links are probed one by one instead


def read_thermal_and_clocks(q: GpuQueries, h: Any) -> None:
    nv, info = q.nv, q.info
    info.temperature_c = q.first("temperature", [
        ("nvmlDeviceGetTemperatureV", (h, nv.NVML_TEMPERATURE_GPU)),
        ("nvmlDeviceGetTemperature", (h, nv.NVML_TEMPERATURE_GPU)),
    ])
    info.temperature_slowdown_c = q("temperature_slowdown", nv.nvmlDeviceGetTemperatureThreshold, h,
                                    nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    info.temperature_shutdown_c = q("temperature_shutdown", nv.nvmlDeviceGetTemperatureThreshold, h,
                                    nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
    # the GPU's own limits (H100 SXM, driver 580: GPU max operating 87 C, slowdown 89, HBM max 95, shutdown 95)
    info.temperature_gpu_max_c = q("temperature_gpu_max", nv.nvmlDeviceGetTemperatureThreshold, h, 3)
    info.temperature_mem_max_c = q("temperature_mem_max", nv.nvmlDeviceGetTemperatureThreshold, h, 2)
    # "Throttle" was renamed "event" in R535; older drivers only have the throttle name.
    info.clock_event_reasons = q.first("clock_event_reasons", [
        ("nvmlDeviceGetCurrentClocksEventReasons", (h,)),
        ("nvmlDeviceGetCurrentClocksThrottleReasons", (h,)),
    ])


def read_pcie(q: GpuQueries, h: Any) -> None:
    nv, info = q.nv, q.info
    info.pcie_gen_current = q("pcie_gen_current", nv.nvmlDeviceGetCurrPcieLinkGeneration, h)
    info.pcie_gen_max = q("pcie_gen_max", nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
    info.pcie_width_current = q("pcie_width_current", nv.nvmlDeviceGetCurrPcieLinkWidth, h)
    info.pcie_width_max = q("pcie_width_max", nv.nvmlDeviceGetMaxPcieLinkWidth, h)
    info.pcie_replay_counter = q("pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, h)


def read_identity(q: GpuQueries, h: Any) -> None:
    """What ties NVML's GPU to Slurm's: the minor number (/dev/nvidiaN in gres.conf), MIG devices (MIG UUIDs in
    CUDA_VISIBLE_DEVICES), and the modes that explain slow or odd answers (persistence)."""
    nv, info = q.nv, q.info
    info.minor_number = q("minor", nv.nvmlDeviceGetMinorNumber, h)
    mode = q("persistence", nv.nvmlDeviceGetPersistenceMode, h)
    info.persistence_mode = None if mode is None else bool(mode)
    mig = q.first("mig_mode", [("nvmlDeviceGetMigMode", (h,))])
    if mig is not None:
        info.mig_enabled = bool(mig[0])
        if info.mig_enabled:
            count = q("mig_count", nv.nvmlDeviceGetMaxMigDeviceCount, h) or 0
            for n in range(min(int(count), 8)):
                try:
                    mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, n)
                except nv.NVMLError:
                    continue  # an empty slot (NOT_FOUND)
                uuid = q("mig_uuid", nv.nvmlDeviceGetUUID, mh)
                if uuid:
                    info.mig_devices.append(decode_text(uuid))


def read_fabric(q: GpuQueries, h: Any) -> None:
    """GPU fabric registration on NVSwitch systems (nvidia-smi -q "Fabric: State Completed, Status Success" once
    Fabric Manager has registered the GPU). Newest struct first; older drivers have only the unversioned call."""
    nv, info = q.nv, q.info
    for ctor, fn in (("c_nvmlGpuFabricInfo_v3_t", "nvmlDeviceGetGpuFabricInfoV"),
                     ("c_nvmlGpuFabricInfo_v2_t", "nvmlDeviceGetGpuFabricInfoV"),
                     ("c_nvmlGpuFabricInfo_t", "nvmlDeviceGetGpuFabricInfo")):
        struct, call = getattr(nv, ctor, None), getattr(nv, fn, None)
        if struct is None or call is None:
            continue
        st = struct()
        try:
            call(h, nv.byref(st))
        except nv.NVMLError as exc:
            if exc.value in TRY_OLDER:
                continue
            q.classify("fabric", exc.value)
            return
        info.fabric_state, info.fabric_status = int(st.state), int(st.status)
        info.fabric_health_mask = int(getattr(st, "healthMask", 0)) if hasattr(st, "healthMask") else None
        return


def read_nvlinks(q: GpuQueries, h: Any, nvlinks: int | None, count: int | None) -> list[bool | None] | None:
    """States of links 0..n-1 (position = link number): True active, False down, None unknown. `count`: NVML's
    own link count when it gave one (0: the GPU has no NVLink, []); otherwise links are probed up to `nvlinks`
    (18 when not given) and INVALID_ARGUMENT ends the list (no such link). NOT_SUPPORTED for a link is *unknown*:
    NVML gives it both for a link the GPU lacks and for a state it cannot read, and "no NVLinks" read from it
    would reboot-drain a node for a driver's limitation. None: the driver has no NVLink API (unknown as well)."""
    nv = q.nv
    if count == 0:
        return []
    states: list[bool | None] = []
    for link in range(count if count is not None else (NVLINK_PROBE_LINKS if nvlinks is None else nvlinks)):
        try:
            states.append(nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED)
        except nv.NVMLError as exc:
            if exc.value == FUNCTION_NOT_FOUND:
                q.classify("nvlink", exc.value)
                return None
            if exc.value == INVALID_ARGUMENT and count is None:
                break  # past the driver's bound: no higher link exists either
            q.classify("nvlink", exc.value)  # NOT_SUPPORTED: listed in `unsupported`; others in `errors`
            states.append(None)
    return states


def read_processes(q: GpuQueries, h: Any) -> list[GpuProcess]:
    procs = q.first("processes", [
        ("nvmlDeviceGetComputeRunningProcesses_v3", (h,)),
        ("nvmlDeviceGetComputeRunningProcesses_v2", (h,)),
    ])
    return [GpuProcess(pid=p.pid, used_memory_mib=to_mib(p.usedGpuMemory)) for p in procs or ()]
