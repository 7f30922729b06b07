"""Host resources: memory (psutil, honouring a procfs root), online CPUs (sysfs), disk space."""

from __future__ import annotations

import os
from typing import Iterable, Optional

from gpuguard.model import DiskUsage, ProbeStatus, SystemObservation


def parse_cpu_list(text: str) -> int:
    """'0-95,128-223' -> 192 (the kernel's cpulist format)."""
    n = 0
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        n += (int(hi) - int(lo) + 1) if hi else 1
    return n


def read_cpus_online(sysfs_root: str = "/sys") -> Optional[int]:
    try:
        with open(os.path.join(sysfs_root, "devices/system/cpu/online")) as f:
            return parse_cpu_list(f.read())
    except (OSError, ValueError):
        return os.cpu_count()


def read_disk(path: str) -> DiskUsage:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return DiskUsage(path, error=e.strerror or str(e))
    mib = 1024 * 1024
    return DiskUsage(path, total_mib=st.f_blocks * st.f_frsize // mib, free_mib=st.f_bavail * st.f_frsize // mib)


def read_system(paths: Iterable[str] = (), procfs_root: str = "/proc", sysfs_root: str = "/sys") -> SystemObservation:
    """Never raises; an unreadable source leaves its field None and marks the probe incomplete."""
    obs = SystemObservation(status=ProbeStatus())
    try:
        import psutil

        psutil.PROCFS_PATH = procfs_root  # lets simulation and tests point at a fake /proc
        vm = psutil.virtual_memory()
        obs.mem_total_mib = vm.total // (1024 * 1024)
        obs.mem_available_mib = vm.available // (1024 * 1024)
    except Exception as e:  # noqa: BLE001 - a probe never raises
        obs.status = ProbeStatus(complete=False, error=f"memory: {type(e).__name__}: {e}")
    obs.cpus_online = read_cpus_online(sysfs_root)
    # statvfs is used directly (psutil.disk_usage is the same call) so the probe thread can be abandoned
    # on a hung mount without psutil holding anything.
    obs.disks = [read_disk(p) for p in paths]
    return obs
