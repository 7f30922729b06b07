"""Host resources: memory (/proc/meminfo), online CPUs (sysfs), disk space (statvfs); every root a parameter."""

from __future__ import annotations

import os
import stat
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


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_smt(sysfs_root: str = "/sys") -> tuple[Optional[bool], Optional[str], Optional[str]]:
    """(SMT active, SMT control, offline cpulist). SMT off (BIOS, `nosmt`, or an EC2 instance launched with one
    thread per core, where the guest sees control=notsupported) halves the online CPUs without any fault."""
    cpu = os.path.join(sysfs_root, "devices/system/cpu")
    active = _read_text(os.path.join(cpu, "smt/active"))
    return (None if active is None else active == "1", _read_text(os.path.join(cpu, "smt/control")),
            _read_text(os.path.join(cpu, "offline")))


def read_driver_fingerprint(sysfs_root: str = "/sys") -> Optional[str]:
    """Identity of the loaded nvidia kernel module: its sysfs directory is a new kernfs node (new inode) every time
    the module is loaded, so a changed fingerprint means the driver was unloaded and reloaded (NVIDIA's GPU reset
    procedure does that). None when no nvidia module is loaded."""
    try:
        st = os.stat(os.path.join(sysfs_root, "module", "nvidia"))
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def read_disk(path: str) -> DiskUsage:
    """Free space, and who may write the path itself (its owner, and whether every user may: sys.disk drains only
    for a path the site names root-owned, and checks that claim)."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return DiskUsage(path, error=e.strerror or str(e))
    mib = 1024 * 1024
    usage = DiskUsage(path, total_mib=st.f_blocks * st.f_frsize // mib, free_mib=st.f_bavail * st.f_frsize // mib)
    try:
        owner = os.stat(path)
    except OSError:
        return usage  # removed between the two calls: ownership unknown, the space figures stand
    usage.owner_uid = owner.st_uid
    usage.world_writable = bool(owner.st_mode & stat.S_IWOTH)
    return usage


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> {field: KiB}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0])
    return out


def read_system(paths: Iterable[str] = (), procfs_root: str = "/proc", sysfs_root: str = "/sys") -> SystemObservation:
    """Never raises; an unreadable source leaves its field None and marks the probe incomplete.

    Memory is read from <procfs_root>/meminfo directly rather than through psutil.virtual_memory(): psutil
    only takes its /proc location from a process-wide global (which would also redirect the epilog's process
    handling), and MemTotal/MemAvailable are exactly what psutil reports on Linux anyway.
    """
    obs = SystemObservation(status=ProbeStatus())
    try:
        with open(os.path.join(procfs_root, "meminfo")) as f:
            mem = parse_meminfo(f.read())
        obs.mem_total_mib = mem["MemTotal"] // 1024
        obs.mem_available_mib = mem.get("MemAvailable", mem.get("MemFree", 0)) // 1024
    except (OSError, KeyError) as e:
        obs.status = ProbeStatus(complete=False, error=f"memory: {e}")
    obs.cpus_online = read_cpus_online(sysfs_root)
    obs.smt_active, obs.smt_control, obs.cpus_offline = read_smt(sysfs_root)
    obs.disks = [read_disk(p) for p in paths]
    return obs
