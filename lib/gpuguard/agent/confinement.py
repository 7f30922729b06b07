"""Whether this process may run hooks for slurmd: the agent's children must see and be allowed what a hook started by
slurmd is (root, the node's file systems and devices, every capability: NVML opens /dev/nvidia*, the epilog kills
other users' processes, the optional NCCL tier needs the node's memory). A process inside a systemd sandbox (the
hardened gpuguard-watch.service: ProtectSystem=strict, PrivateTmp=, DevicePolicy=closed, CapabilityBoundingSet=,
MemoryMax=) is not: a hook run there could reach another verdict, so the agent refuses to start and the hooks keep
running in their own processes. gpuguard-watch-agent.service is the unit that hosts the agent.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

CGROUP_LIMITS = ("memory.max", "pids.max")


def parse_status(text: str) -> dict[str, str]:
    """/proc/PID/status as {field: value}. Pure."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def cgroup_v2_path(text: str) -> Optional[str]:
    """The unified hierarchy's path from /proc/PID/cgroup (`0::/system.slice/x.service`), or None. Pure."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def issues_from(read: Callable[[str], Optional[str]], same_mount_ns: Optional[bool], euid: int) -> list[str]:
    """What keeps this process from running hooks as slurmd would. `read(path)`: a /proc or /sys file's text or
    None. Pure given its inputs."""
    issues = []
    if euid != 0:
        issues.append(f"runs as uid {euid}, the hooks run as root")
    # None: PID 1's namespace cannot be read here (a container's init); the sandboxes this guards against also set
    # NoNewPrivileges= or CapabilityBoundingSet=, checked below
    if same_mount_ns is False:
        issues.append("runs in a mount namespace of its own (systemd ProtectSystem=/PrivateTmp=/ReadWritePaths=...): "
                      "a hook must see the node's file systems as slurmd's hooks do")
    me, init = parse_status(read("/proc/self/status") or ""), parse_status(read("/proc/1/status") or "")
    if me.get("NoNewPrivs") == "1":
        issues.append("NoNewPrivileges= is set")
    if not me.get("CapBnd") or me.get("CapBnd") != init.get("CapBnd"):
        issues.append(f"capability bounding set {me.get('CapBnd', '?')} differs from PID 1's {init.get('CapBnd', '?')} "
                      "(CapabilityBoundingSet=)")
    cg = cgroup_v2_path(read("/proc/self/cgroup") or "")
    if cg is not None:
        for name in CGROUP_LIMITS:
            value = read(f"/sys/fs/cgroup{cg.rstrip('/')}/{name}")
            if value is not None and value.strip() != "max":
                issues.append(f"its cgroup limits {name} to {value.strip()} (MemoryMax=/TasksMax=)")
    return issues


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read(1 << 16)
    except OSError:
        return None


def _same_mount_ns() -> Optional[bool]:
    try:
        return os.stat("/proc/self/ns/mnt").st_ino == os.stat("/proc/1/ns/mnt").st_ino
    except OSError:
        return None


def confinement_issues() -> list[str]:
    """Empty when this process may host the agent."""
    return issues_from(_read, _same_mount_ns(), os.geteuid())
