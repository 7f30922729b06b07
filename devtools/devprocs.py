"""Finding and killing what a dev cluster started: daemons' process groups, and the stragglers that left them
(slurmstepd calls setsid()), found by the marker variable every daemon and job carries."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

# Environment variable put into every daemon (and every client command, hence every job) so that teardown can
# find stragglers that left the daemons' process groups (slurmstepd, prologs, job tasks).
MARKER_VAR = "GPUGUARD_DEVCLUSTER_ID"


def terminate_group(proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
    """SIGTERM the process group (the daemon and what it forked without a new session), then SIGKILL."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    if proc.poll() is None:
        killpg_quietly(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    killpg_quietly(pgid, signal.SIGKILL)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def killpg_quietly(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def cluster_processes(cluster_id: str) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose environment carries `MARKER_VAR=cluster_id`, plus their descendants."""
    marker = f"{MARKER_VAR}={cluster_id}".encode()
    own = os.getpid()
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    marked: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        pid = int(entry.name)
        try:
            state, ppid = state_and_parent(entry)
            if state in "ZX":
                continue
            cmdlines[pid] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            environ = (entry / "environ").read_bytes()
        except (OSError, ValueError):
            continue  # gone meanwhile, or a kernel thread
        parents[pid] = ppid
        if marker in environ.split(b"\0"):
            marked.add(pid)
    ours = set(marked)
    grew = True
    while grew:
        children = {pid for pid, ppid in parents.items() if ppid in ours} - ours
        ours |= children
        grew = bool(children)
    return sorted((pid, cmdlines[pid]) for pid in ours)


def state_and_parent(proc_dir: Path) -> tuple[str, int]:
    # The command name in /proc/PID/stat may contain spaces and parentheses; fields follow the last ")".
    stat = (proc_dir / "stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])
