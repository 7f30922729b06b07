"""NVML probe: one pass over the GPUs through nvidia-ml-py (`pynvml`), into an `NvmlObservation`.

Errors are classified per query (DESIGN §6):
  NOT_SUPPORTED, FUNCTION_NOT_FOUND          -> the value is None, not an error (the query is listed in
                                                `gpu.unsupported`: a check decides whether None means "this GPU
                                                has no such feature" or "unknown", never "clear")
  GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND -> `gpu.fatal_error`, and that GPU is not queried further
  anything else                              -> `gpu.errors[<query>] = <NVML error name>`, carry on
The probe never raises and never sleeps; deadlines are the caller's (it runs the probe in a thread).
pynvml (~15 ms to import) is imported inside `read_nvml`, off the prolog's import path.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

from gpuguard.model import GpuInfo, GpuProcess, NvmlObservation

MIB = 1024 * 1024
NVLINK_PROBE_LINKS = 18  # links probed when the caller does not say how many to expect
FIELD_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (R565+)
FIELD_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP: HBM temperature (read 36 C on an idle H100 SXM, driver 580)
FIELD_NVLINK_LINK_COUNT = 91  # NVML_FI_DEV_NVLINK_LINK_COUNT: how many NVLinks the GPU has
MAX_NVLINKS = 64

# nvmlReturn_t codes (nvml.h) the classification depends on.
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_FUNCTION_NOT_FOUND = 13
_ARGUMENT_VERSION_MISMATCH = 25
_SKIPPED = frozenset({_NOT_SUPPORTED, _FUNCTION_NOT_FOUND})
_FATAL = frozenset({15, 16, 28})  # GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND
# A newer entry point missing from an older driver: try the next (older) one instead.
_TRY_OLDER = frozenset({_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH})

# c_nvmlValue_t member for each NVML_VALUE_TYPE_*
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

_error_names: dict[int, str] = {}


class NvmlLibraryInUse(RuntimeError):
    """pynvml holds an open session on a different NVML library than the one asked for."""


class _GpuGone(Exception):
    """Internal: NVML said the GPU is gone or needs a reset; stop querying it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


# --------------------------------------------------------------------------- pure helpers


def normalize_pci_bus_id(bus_id: str) -> str:
    """'00000000:3B:00.0' (NVML) -> '0000:3b:00.0' (sysfs, the kernel log). Unparseable text is kept."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:  # "3b:00.0": domain 0
        parts.insert(0, "0")
    if len(parts) != 3:
        return text
    try:
        return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
    except ValueError:
        return text


def nvml_error_name(nv: Any, code: int) -> str:
    """NVML return code -> name without the NVML_ERROR_ prefix, e.g. 15 -> 'GPU_IS_LOST'."""
    if not _error_names:
        # Built from the binding itself so codes added by newer nvidia-ml-py releases get their names.
        for attr, value in vars(nv).items():
            if attr.startswith("NVML_ERROR_") and isinstance(value, int):
                _error_names.setdefault(value, attr[len("NVML_ERROR_"):])
    return _error_names.get(code, f"ERROR_{code}")


def field_value(value: Any) -> int | float:
    """The number in a c_nvmlFieldValue_t, read through the union member its valueType names."""
    member = _VALUE_MEMBERS[value.valueType] if 0 <= value.valueType < len(_VALUE_MEMBERS) else "ullVal"
    return getattr(value.value, member)


def _text(value: str | bytes) -> str:
    """pynvml's structures decode char arrays to str in recent releases, older ones return bytes."""
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def _mib(n_bytes: int | None) -> int | None:
    return None if n_bytes is None else n_bytes // MIB


# --------------------------------------------------------------------------- library and environment


def install_nvml_library(library_path: str, nv: Any = None) -> None:
    """Make pynvml use the NVML library at `library_path` (e.g. the fake) instead of its own search.

    pynvml keeps the loaded CDLL in the module global `nvmlLib` (guarded by `libLoadLock`) and caches
    function pointers by name, so swapping libraries also empties that cache. Refuses to swap while a
    pynvml session is open on another library. Raises OSError when the file cannot be loaded.
    """
    import ctypes  # here, not at module level: the prolog imports this module on its hot path

    if nv is None:
        import pynvml as nv
    path = os.path.abspath(library_path)
    with nv.libLoadLock:
        current = nv.nvmlLib
        if current is not None and getattr(current, "_name", None) == path:
            return
        if current is not None and getattr(nv, "_nvmlLib_refcount", 0) > 0:
            raise NvmlLibraryInUse(f"pynvml has an open session on {getattr(current, '_name', current)}")
        library = ctypes.CDLL(path)
        nv.nvmlLib = library
        cache = getattr(nv, "_nvmlGetFunctionPointer_cache", None)
        if isinstance(cache, dict):
            cache.clear()  # pointers into the previous library


@contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set `env` for the duration of nvmlInit (which is when NVML reads it), then restore."""
    if not env:
        yield
        return
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# --------------------------------------------------------------------------- per-GPU queries


class _Queries:
    """Runs NVML calls for one GPU and applies the error table to each."""

    def __init__(self, nv: Any, info: GpuInfo) -> None:
        self.nv = nv
        self.info = info

    def classify(self, query: str, code: int) -> None:
        """Record a failed query (or raise _GpuGone); skipped codes leave no trace."""
        if code in _SKIPPED:
            if query not in self.info.unsupported:
                self.info.unsupported.append(query)
            return
        name = nvml_error_name(self.nv, code)
        if code in _FATAL:
            raise _GpuGone(name)
        self.info.errors[query] = name

    def __call__(self, query: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            self.classify(query, exc.value)
            return None

    def first(self, query: str, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> Any:
        """Call the first pynvml wrapper that the binding and the driver both have (newest first)."""
        code = _FUNCTION_NOT_FOUND
        for name, args in calls:
            fn = getattr(self.nv, name, None)
            if fn is None:
                continue
            try:
                return fn(*args)
            except self.nv.NVMLError as exc:
                code = exc.value
                if code not in _TRY_OLDER:
                    break
        self.classify(query, code)
        return None


def _read_ecc(q: _Queries, h: Any) -> None:
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


def _read_memory_health(q: _Queries, h: Any) -> None:
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


def _read_fields(q: _Queries, h: Any) -> int | None:
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


def _read_thermal_and_clocks(q: _Queries, h: Any) -> None:
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


def _read_pcie(q: _Queries, h: Any) -> None:
    nv, info = q.nv, q.info
    info.pcie_gen_current = q("pcie_gen_current", nv.nvmlDeviceGetCurrPcieLinkGeneration, h)
    info.pcie_gen_max = q("pcie_gen_max", nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
    info.pcie_width_current = q("pcie_width_current", nv.nvmlDeviceGetCurrPcieLinkWidth, h)
    info.pcie_width_max = q("pcie_width_max", nv.nvmlDeviceGetMaxPcieLinkWidth, h)
    info.pcie_replay_counter = q("pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, h)


def _read_identity(q: _Queries, h: Any) -> None:
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
                    info.mig_devices.append(_text(uuid))


def _read_fabric(q: _Queries, h: Any) -> None:
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
            if exc.value in _TRY_OLDER:
                continue
            q.classify("fabric", exc.value)
            return
        info.fabric_state, info.fabric_status = int(st.state), int(st.status)
        info.fabric_health_mask = int(getattr(st, "healthMask", 0)) if hasattr(st, "healthMask") else None
        return


def _read_nvlinks(q: _Queries, h: Any, nvlinks: int | None, count: int | None) -> list[bool | None] | None:
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
            if exc.value == _FUNCTION_NOT_FOUND:
                q.classify("nvlink", exc.value)
                return None
            if exc.value == _INVALID_ARGUMENT and count is None:
                break  # past the driver's bound: no higher link exists either
            q.classify("nvlink", exc.value)  # NOT_SUPPORTED: listed in `unsupported`; others in `errors`
            states.append(None)
    return states


def _read_processes(q: _Queries, h: Any) -> list[GpuProcess]:
    procs = q.first("processes", [
        ("nvmlDeviceGetComputeRunningProcesses_v3", (h,)),
        ("nvmlDeviceGetComputeRunningProcesses_v2", (h,)),
    ])
    return [GpuProcess(pid=p.pid, used_memory_mib=_mib(p.usedGpuMemory)) for p in procs or ()]


def _read_gpu(nv: Any, index: int, nvlinks: int | None, with_processes: bool) -> GpuInfo:
    info = GpuInfo(index=index)
    q = _Queries(nv, info)
    try:
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            name = nvml_error_name(nv, exc.value)
            if exc.value in _FATAL:
                info.fatal_error = name
            else:  # even NOT_SUPPORTED is an error here: nothing can be read without a handle
                info.errors["handle"] = name
            return info
        info.uuid = q("uuid", nv.nvmlDeviceGetUUID, h)
        pci = q("pci", nv.nvmlDeviceGetPciInfo, h)
        if pci is not None:
            info.pci_bus_id = normalize_pci_bus_id(_text(pci.busId))
        info.name = q("name", nv.nvmlDeviceGetName, h)
        info.serial = q("serial", nv.nvmlDeviceGetSerial, h)
        memory = q("memory", nv.nvmlDeviceGetMemoryInfo, h)
        if memory is not None:
            info.memory_total_mib, info.memory_used_mib = _mib(memory.total), _mib(memory.used)
        _read_ecc(q, h)
        _read_memory_health(q, h)
        nvlink_count = _read_fields(q, h)
        _read_thermal_and_clocks(q, h)
        _read_pcie(q, h)
        _read_identity(q, h)
        _read_fabric(q, h)
        info.nvlink_active = _read_nvlinks(q, h, nvlinks, nvlink_count)
        info.power_mw = q("power", nv.nvmlDeviceGetPowerUsage, h)
        utilization = q("utilization", nv.nvmlDeviceGetUtilizationRates, h)
        info.utilization_gpu_pct = None if utilization is None else utilization.gpu
        if with_processes:
            info.processes = _read_processes(q, h)
    except _GpuGone as gone:
        info.fatal_error = gone.name
    return info


# --------------------------------------------------------------------------- the probe


def read_nvml(
    gpu_indices: list[int] | None = None,
    nvlinks: int | None = None,
    library_path: str | None = None,
    env: dict[str, str] | None = None,
    with_processes: bool = True,
) -> NvmlObservation:
    """Read every GPU in `gpu_indices` (NVML indices; None = all) and return what NVML said.

    `nvlinks`: how many links to read per GPU (None: probe 0..17 and keep those that exist).
    `library_path`: load this NVML library instead of libnvidia-ml.so.1 (e.g. the fake one).
    `env`: environment set while NVML initialises (e.g. GPUGUARD_FAKE_NVML_FILE), restored after.
    Never raises: failures end up in `init_error`, `status`, or the GPUs' `errors`/`fatal_error`.
    """
    started = time.monotonic()
    obs = NvmlObservation()
    try:
        _read_into(obs, gpu_indices, nvlinks, library_path, env, with_processes)
    except Exception as exc:  # noqa: BLE001 - a probe never raises; the checks see an incomplete read
        obs.status.complete = False
        obs.status.error = f"{type(exc).__name__}: {exc}"
    obs.status.duration_s = time.monotonic() - started
    return obs


def _fail(obs: NvmlObservation, error: str, init_error: str | None = None) -> None:
    obs.status.complete = False
    obs.status.error = error
    obs.init_error = init_error


def _read_into(
    obs: NvmlObservation,
    gpu_indices: list[int] | None,
    nvlinks: int | None,
    library_path: str | None,
    env: Mapping[str, str] | None,
    with_processes: bool,
) -> None:
    try:
        import pynvml as nv
    except ImportError as exc:
        return _fail(obs, f"nvidia-ml-py (pynvml) is not installed: {exc}")
    if library_path is not None:
        try:
            install_nvml_library(library_path, nv)
        except OSError as exc:
            return _fail(obs, f"cannot load {library_path}: {exc}", "LIBRARY_NOT_FOUND")

    with _environment(env):
        t0 = time.monotonic()
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            name = nvml_error_name(nv, exc.value)
            return _fail(obs, f"nvmlInit: {name}", name)
        finally:
            obs.init_duration_s = time.monotonic() - t0
    try:
        _read_devices(nv, obs, gpu_indices, nvlinks, with_processes)
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass  # nothing left to release; the observation is already complete


def _read_devices(
    nv: Any, obs: NvmlObservation, gpu_indices: list[int] | None, nvlinks: int | None, with_processes: bool
) -> None:
    try:
        obs.driver_version = nv.nvmlSystemGetDriverVersion()
    except nv.NVMLError:
        obs.driver_version = None  # informational only
    try:
        obs.device_count = nv.nvmlDeviceGetCount()
    except nv.NVMLError as exc:
        return _fail(obs, f"nvmlDeviceGetCount: {nvml_error_name(nv, exc.value)}")

    wanted = range(obs.device_count) if gpu_indices is None else list(dict.fromkeys(gpu_indices))
    for index in wanted:
        if 0 <= index < obs.device_count:
            obs.gpus.append(_read_gpu(nv, index, nvlinks, with_processes))
        else:
            # the job was given a GPU the driver does not see (fell off the bus, or a bad gres.conf)
            obs.gpus.append(GpuInfo(index=index, fatal_error="NOT_FOUND"))
