"""What the monitor reads each sample: the job's GPUs through NVML (one session for the life of the monitor:
nvmlInit once, handles once, ~10 cheap queries per GPU per sample) and the node through psutil (rates are deltas
between two samples). I/O only; every failure ends up in the sample, never as an exception."""

from __future__ import annotations

import os
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Mapping, Optional

import psutil

from gpuguard.probes.nvml import install_nvml_library, normalize_pci_bus_id, nvml_error_name

# nvmlClocksEventReason* bits that slow a GPU down against the job's will (SW power cap is normal under load)
THROTTLE_BITS = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}
ALL_THROTTLE_NAMES = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                      0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                      0x100: "display_clocks"}


def throttle_names(mask: Optional[int], only_bad: bool = False) -> list[str]:
    if not mask:
        return []
    names = THROTTLE_BITS if only_bad else ALL_THROTTLE_NAMES
    return [name for bit, name in sorted(names.items()) if mask & bit]


@dataclass
class GpuSample:
    index: int
    uuid: Optional[str] = None
    pci_bus_id: Optional[str] = None  # "0000:3b:00.0", as the kernel log and the hooks name the GPU
    util_pct: Optional[int] = None
    mem_used_mib: Optional[int] = None
    mem_total_mib: Optional[int] = None
    temp_c: Optional[int] = None
    temp_slowdown_c: Optional[int] = None
    power_w: Optional[float] = None
    sm_clock_mhz: Optional[int] = None
    sm_clock_max_mhz: Optional[int] = None
    mem_clock_mhz: Optional[int] = None
    throttle_mask: Optional[int] = None
    ecc_uncorrected: Optional[int] = None  # volatile (since the driver loaded)
    ecc_corrected: Optional[int] = None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class HostSample:
    cpu_pct: Optional[float] = None
    mem_pct: Optional[float] = None
    mem_available_mib: Optional[int] = None
    disk_used_pct: dict[str, float] = field(default_factory=dict)
    disk_read_bps: Optional[float] = None
    disk_write_bps: Optional[float] = None
    net_rx_bps: Optional[float] = None
    net_tx_bps: Optional[float] = None
    errors: dict[str, str] = field(default_factory=dict)


def to_dict(obj: Any) -> dict[str, Any]:
    return asdict(obj)


@contextmanager
def _environment(env: Optional[Mapping[str, str]]) -> Iterator[None]:
    """NVML reads its environment (e.g. the fake library's scenario file) at nvmlInit only."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class GpuSampler:
    """An NVML session for the monitor's lifetime. `init_error` is set (and samples are empty) when NVML cannot
    start; the monitor reports that instead of crashing."""

    def __init__(self, indices: Optional[list[int]] = None, library_path: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None) -> None:
        self.init_error: Optional[str] = None
        self.handles: list[tuple[int, Any]] = []
        self.nv: Any = None
        try:
            import pynvml as nv  # here, not at the top: a node without the binding still samples the rest

            self._error_name = lambda code: nvml_error_name(nv, code)
            if library_path:
                install_nvml_library(library_path, nv)
            with _environment(env):
                nv.nvmlInit()
            self.nv = nv
            count = nv.nvmlDeviceGetCount()
            for i in (range(count) if indices is None else indices):
                if 0 <= i < count:
                    self.handles.append((i, nv.nvmlDeviceGetHandleByIndex(i)))
                else:
                    self.init_error = f"GPU {i} not visible to NVML ({count} GPUs)"
        except Exception as e:  # noqa: BLE001 - NVMLError, ImportError, OSError
            name = getattr(e, "value", None)
            self.init_error = (self._error_name(name) if isinstance(name, int) and hasattr(self, "_error_name")
                               else f"{type(e).__name__}: {e}")

    @classmethod
    def unavailable(cls, why: str) -> "GpuSampler":
        self = cls.__new__(cls)
        self.init_error, self.handles, self.nv = why, [], None
        return self

    def _q(self, s: GpuSample, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nv.NVMLError as e:
            if e.value not in (3, 13):  # NOT_SUPPORTED / FUNCTION_NOT_FOUND: simply absent on this GPU
                s.errors[what] = self._error_name(e.value)
            return None

    def sample(self) -> list[GpuSample]:
        out = []
        nv = self.nv
        for index, h in self.handles:
            s = GpuSample(index=index)
            s.uuid = self._q(s, "uuid", nv.nvmlDeviceGetUUID, h)
            pci = self._q(s, "pci", nv.nvmlDeviceGetPciInfo, h)
            if pci is not None:
                bus = pci.busId
                s.pci_bus_id = normalize_pci_bus_id(bus.decode() if isinstance(bus, bytes) else bus)
            u = self._q(s, "utilization", nv.nvmlDeviceGetUtilizationRates, h)
            s.util_pct = None if u is None else int(u.gpu)
            m = self._q(s, "memory", nv.nvmlDeviceGetMemoryInfo, h)
            if m is not None:
                s.mem_used_mib, s.mem_total_mib = m.used // 2**20, m.total // 2**20
            s.temp_c = self._q(s, "temperature", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            s.temp_slowdown_c = self._q(s, "temp_slowdown", nv.nvmlDeviceGetTemperatureThreshold, h,
                                        nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
            p = self._q(s, "power", nv.nvmlDeviceGetPowerUsage, h)
            s.power_w = None if p is None else p / 1000.0
            s.sm_clock_mhz = self._q(s, "sm_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            s.sm_clock_max_mhz = self._q(s, "sm_clock_max", nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
            s.mem_clock_mhz = self._q(s, "mem_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
            fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nv.nvmlDeviceGetCurrentClocksThrottleReasons  # renamed in R535
            s.throttle_mask = self._q(s, "throttle", fn, h)
            s.ecc_uncorrected = self._q(s, "ecc_uncorrected", nv.nvmlDeviceGetTotalEccErrors, h,
                                        nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            s.ecc_corrected = self._q(s, "ecc_corrected", nv.nvmlDeviceGetTotalEccErrors, h,
                                      nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)
            out.append(s)
        return out

    def gpu_pids(self) -> set[int]:
        """Compute processes on the monitored GPUs (for stack dumps)."""
        pids: set[int] = set()
        for _, h in self.handles:
            for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses"):
                fn = getattr(self.nv, name, None)
                if fn is None:
                    continue
                try:
                    pids.update(p.pid for p in fn(h))
                    break
                except self.nv.NVMLError:
                    continue
        return pids

    def close(self) -> None:
        if self.nv is not None:
            try:
                self.nv.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self.nv = None


class HostSampler:
    """CPU, memory, disk space, disk I/O and network rates (bytes/s since the previous sample)."""

    def __init__(self, disk_paths: list[str], procfs_root: str = "/proc") -> None:
        self.psutil = psutil
        self.disk_paths = disk_paths
        self._last: Optional[tuple[float, Any, Any]] = None
        psutil.cpu_percent(None)  # primes the counter: the next call returns usage since now

    def sample(self) -> HostSample:
        ps = self.psutil
        s = HostSample()
        try:
            s.cpu_pct = ps.cpu_percent(None)
            vm = ps.virtual_memory()
            s.mem_pct, s.mem_available_mib = vm.percent, vm.available // 2**20
        except Exception as e:  # noqa: BLE001
            s.errors["cpu_mem"] = f"{type(e).__name__}: {e}"
        for path in self.disk_paths:
            try:
                st = os.statvfs(path)  # what `df` shows: used / (used + available to users)
                used = (st.f_blocks - st.f_bfree) * st.f_frsize
                avail = st.f_bavail * st.f_frsize
                s.disk_used_pct[path] = round(100.0 * used / (used + avail), 2) if used + avail else 0.0
            except OSError as e:
                s.errors[f"disk:{path}"] = e.strerror or str(e)
        now = time.monotonic()
        try:
            disk, net = ps.disk_io_counters(), ps.net_io_counters()
        except Exception as e:  # noqa: BLE001 - containers may hide them
            disk = net = None
            s.errors["io"] = f"{type(e).__name__}: {e}"
        if self._last is not None:
            t0, d0, n0 = self._last
            dt = max(1e-6, now - t0)
            if disk is not None and d0 is not None:
                s.disk_read_bps = max(0.0, (disk.read_bytes - d0.read_bytes) / dt)
                s.disk_write_bps = max(0.0, (disk.write_bytes - d0.write_bytes) / dt)
            if net is not None and n0 is not None:
                s.net_rx_bps = max(0.0, (net.bytes_recv - n0.bytes_recv) / dt)
                s.net_tx_bps = max(0.0, (net.bytes_sent - n0.bytes_sent) / dt)
        self._last = (now, disk, net)
        return s


def self_cost() -> tuple[float, int]:
    """(CPU seconds used by this process so far, resident memory in bytes now)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = ru.ru_maxrss * 1024
    return ru.ru_utime + ru.ru_stime, rss
