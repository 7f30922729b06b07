"""What a dev cluster needs from this host and its shared names: the binaries, free ports, a clean environment for
client commands, the job states and node flags the cluster waits on, its error type."""

from __future__ import annotations

import os
import shutil
import socket
from typing import Optional

# Binaries a cluster needs; client commands are looked up on PATH like an admin would.
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("scontrol", "sinfo", "sbatch", "squeue", "scancel")

# Job states after which a job will not change by itself (COMPLETING is not one of them).
TERMINAL_JOB_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)

# Node state flags under which the scheduler will not use a node.
UNUSABLE = frozenset({"DRAIN", "DOWN", "NOT_RESPONDING", "FAIL", "INVALID_REG", "INVAL", "UNKNOWN"})


class DevClusterError(RuntimeError):
    """The cluster did not boot or did not do what was asked; the message includes the daemons' log tails."""


def missing_requirements() -> list[str]:
    """Why a DevCluster cannot boot here (empty list = it can): not root, or binaries missing."""
    problems = []
    if os.geteuid() != 0:
        problems.append("needs root (slurmd runs prologs as root, mknod for fake GPUs)")
    for name in DAEMONS + CLIENTS:
        if which(name) is None:
            problems.append(f"{name} not found (apt-get install slurm-wlm munge)")
    return problems


def which(name: str) -> Optional[str]:
    # Debian installs the daemons in /usr/sbin, which a non-login PATH may lack.
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin:/usr/local/sbin"
    return shutil.which(name, path=path)


def free_tcp_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that are free now; all sockets stay bound until every port is picked, so no
    port is handed out twice."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def clean_environ() -> dict[str, str]:
    """This process's environment without SLURM_* (a pytest run inside a Slurm job must not leak its job into the
    dev cluster's commands)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    return env
