"""NVML probe: one pass over the GPUs through nvidia-ml-py (`pynvml`), into an `NvmlObservation`.

This module opens the session and enumerates the devices; what is read from each GPU is in `nvml_fields`, the
library it talks to in `nvml_library`. Errors are classified per query by `nvml_errors` (DESIGN §6):
  NOT_SUPPORTED, FUNCTION_NOT_FOUND          -> the value is None, not an error (the query is listed in
                                                `gpu.unsupported`: a check decides whether None means "this GPU
                                                has no such feature" or "unknown", never "clear")
  GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND -> `gpu.fatal_error`, and that GPU is not queried further
  anything else                              -> `gpu.errors[<query>] = <NVML error name>`, carry on
The probe never raises and never sleeps; deadlines are the caller's (it runs the probe in a thread).
pynvml (~15 ms to import) is imported inside `read_nvml`, off the prolog's import path.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from gpuguard.model import GpuInfo, NvmlObservation
from gpuguard.probes import nvml_fields as fields
from gpuguard.probes.nvml_errors import FATAL, GpuGone, GpuQueries, nvml_error_name
from gpuguard.probes.nvml_fields import decode_text, to_mib
from gpuguard.probes.nvml_library import NvmlLibraryInUse, import_pynvml, install_nvml_library, nvml_environment

# The probe's public face (the monitor's sampler and the tests import these from here).
__all__ = ["NvmlLibraryInUse", "install_nvml_library", "normalize_pci_bus_id", "nvml_error_name", "read_gpu",
           "read_nvml"]


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


def read_gpu(nv: Any, index: int, nvlinks: int | None, with_processes: bool) -> GpuInfo:
    """Everything the probe reads of one GPU (NVML initialised by the caller)."""
    info = GpuInfo(index=index)
    q = GpuQueries(nv, info)
    try:
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            name = nvml_error_name(nv, exc.value)
            if exc.value in FATAL:
                info.fatal_error = name
            else:  # even NOT_SUPPORTED is an error here: nothing can be read without a handle
                info.errors["handle"] = name
            return info
        info.uuid = q("uuid", nv.nvmlDeviceGetUUID, h)
        pci = q("pci", nv.nvmlDeviceGetPciInfo, h)
        if pci is not None:
            info.pci_bus_id = normalize_pci_bus_id(decode_text(pci.busId))
        info.name = q("name", nv.nvmlDeviceGetName, h)
        info.serial = q("serial", nv.nvmlDeviceGetSerial, h)
        memory = q("memory", nv.nvmlDeviceGetMemoryInfo, h)
        if memory is not None:
            info.memory_total_mib, info.memory_used_mib = to_mib(memory.total), to_mib(memory.used)
        fields.read_ecc(q, h)
        fields.read_memory_health(q, h)
        nvlink_count = fields.read_field_values(q, h)
        fields.read_thermal_and_clocks(q, h)
        fields.read_pcie(q, h)
        fields.read_identity(q, h)
        fields.read_fabric(q, h)
        info.nvlink_active = fields.read_nvlinks(q, h, nvlinks, nvlink_count)
        info.power_mw = q("power", nv.nvmlDeviceGetPowerUsage, h)
        utilization = q("utilization", nv.nvmlDeviceGetUtilizationRates, h)
        info.utilization_gpu_pct = None if utilization is None else utilization.gpu
        if with_processes:
            info.processes = fields.read_processes(q, h)
    except GpuGone as gone:
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
        nv = import_pynvml()
    except ImportError as exc:
        return _fail(obs, f"nvidia-ml-py (pynvml) is not installed: {exc}")
    if library_path is not None:
        try:
            install_nvml_library(library_path, nv)
        except OSError as exc:
            return _fail(obs, f"cannot load {library_path}: {exc}", "LIBRARY_NOT_FOUND")

    with nvml_environment(env):
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
            obs.gpus.append(read_gpu(nv, index, nvlinks, with_processes))
        else:
            # the job was given a GPU the driver does not see (fell off the bus, or a bad gres.conf)
            obs.gpus.append(GpuInfo(index=index, fatal_error="NOT_FOUND"))
