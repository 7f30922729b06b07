"""Epilog: the job's processes left on its GPUs are terminated (SIGTERM, grace, SIGKILL); what survives or
belongs to someone else is reported for the checks to judge. The only place gpuguard kills anything."""

from __future__ import annotations

import os
import time
from typing import Iterable, Optional

from gpuguard.model import GpuProcess, JobCleanup, NvmlObservation


def _leftovers(nvml: NvmlObservation, job_gpus: Optional[Iterable[int]]) -> list[GpuProcess]:
    want = None if job_gpus is None else set(job_gpus)
    seen: dict[int, GpuProcess] = {}
    for g in nvml.gpus:
        if want is not None and g.index not in want:
            continue
        for p in g.processes:
            seen.setdefault(p.pid, p)
    return list(seen.values())


def cleanup_leftovers(nvml: Optional[NvmlObservation], job_gpus: Optional[Iterable[int]], job_id: Optional[str],
                      job_uid: Optional[int], grace_s: float, kill: bool = True) -> JobCleanup:
    """Terminate the job user's processes still on the job's GPUs. Never raises."""
    out = JobCleanup(job_id=job_id, job_uid=job_uid)
    if nvml is None or nvml.init_error:
        out.error = "NVML unavailable: leftover processes not checked"
        return out
    candidates = _leftovers(nvml, job_gpus)
    if not candidates:
        return out
    try:
        import psutil
    except ImportError as e:  # pragma: no cover - psutil is a dependency
        out.error = str(e)
        return out
    mine = {os.getpid(), os.getppid(), 0, 1}
    own: list[tuple[GpuProcess, psutil.Process]] = []
    for gp in candidates:
        try:
            proc = psutil.Process(gp.pid)
            uid = proc.uids().real
            gp.name = gp.name or proc.name()[:32]
        except psutil.NoSuchProcess:
            continue  # gone by itself between NVML's answer and now
        except (psutil.AccessDenied, OSError) as e:
            out.error = f"pid {gp.pid}: {e}"
            out.foreign.append(gp)
            continue
        if gp.pid in mine or job_uid is None or uid != job_uid:
            # root-owned or another user's: not this job's to kill (and never PID 1 or ourselves)
            out.foreign.append(gp)
        else:
            own.append((gp, proc))
    if not kill:
        out.not_killed.extend(gp for gp, _ in own)
        return out
    if not own:
        return out
    procs = [p for _, p in own]
    _signal(procs, "terminate")
    alive = _wait_gone(procs, grace_s)
    _signal(alive, "kill")
    stuck = {p.pid for p in _wait_gone(alive, min(2.0, max(grace_s, 0.5)))}
    for gp, _ in own:
        (out.survivors if gp.pid in stuck else out.killed).append(gp)
    if out.killed:
        time.sleep(0.05)  # let the driver tear the contexts down before NVML is asked again
    return out


def _signal(procs: list, how: str) -> None:  # type: ignore[type-arg]
    import psutil

    for p in procs:
        try:
            getattr(p, how)()
        except psutil.NoSuchProcess:
            pass


def _wait_gone(procs: list, timeout_s: float) -> list:  # type: ignore[type-arg]
    """Processes still running after `timeout_s`. A zombie counts as gone: it has already released its GPU
    context; only its parent's wait() is missing (and they are not our children, so psutil's own wait_procs
    would wait for init to reap them)."""
    import psutil

    until = time.monotonic() + timeout_s
    alive = list(procs)
    while alive:
        still = []
        for p in alive:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    still.append(p)
            except psutil.NoSuchProcess:
                pass
        alive = still
        if not alive or time.monotonic() >= until:
            break
        time.sleep(0.05)
    return alive
