"""What the monitor does about a hang besides alerting: dump the job's Python stacks with py-spy, and ask for a
requeue. Every external command is an argv list (never a shell) under a timeout."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Iterable, Optional

from gpuguard.tools import run_tool


def find_py_spy(name: Optional[str]) -> Optional[str]:
    """`name` on PATH, or next to this Python (a venv's bin/ has py-spy when `pip install py-spy` put it there)."""
    if not name:
        return None
    found = shutil.which(name)
    if found:
        return found
    sibling = os.path.join(os.path.dirname(sys.executable), os.path.basename(name))
    return sibling if os.access(sibling, os.X_OK) else None


def job_python_pids(job_id: Optional[str], gpu_pids: Iterable[int], limit: int = 16) -> list[int]:
    """The job's Python processes on this node: those using the GPUs, plus Python processes whose environment
    says they belong to the job (reading another user's environ fails quietly: those are not ours)."""
    import psutil

    me = os.getpid()
    pids: list[int] = [p for p in dict.fromkeys(gpu_pids) if p != me]
    if job_id:
        for proc in psutil.process_iter(["pid", "name"]):
            if len(pids) >= limit:
                break
            try:
                if proc.info["pid"] == me or proc.info["pid"] in pids or "python" not in (proc.info["name"] or ""):
                    continue
                if proc.environ().get("SLURM_JOB_ID") == str(job_id):
                    pids.append(proc.info["pid"])
            except (psutil.Error, OSError):
                continue
    return pids[:limit]


def dump_stacks(py_spy: Optional[str], pids: list[int], out_path: str, timeout_s: float) -> str:
    """`py-spy dump --pid P` for each pid into one file. Returns a one-line summary."""
    if not py_spy:
        return "py-spy not available (pip install py-spy, or set monitor.py_spy)"
    if not pids:
        return "no Python process of the job found on this node"
    deadline = time.monotonic() + max(timeout_s, 1.0) * 2
    parts, ok = [], 0
    for pid in pids:
        left = deadline - time.monotonic()
        if left <= 0:
            parts.append(f"=== pid {pid}: skipped (time budget spent)\n")
            continue
        r = run_tool([py_spy, "dump", "--pid", str(pid)], min(timeout_s, left))
        if r.timed_out:
            body = f"py-spy did not finish within {min(timeout_s, left):.0f}s"
        elif r.rc is None:
            body = f"cannot run {py_spy}: {r.error}"
        elif r.rc == 0:
            body = r.text()
            ok += 1
        else:
            body = f"py-spy failed ({r.rc}): {r.err_text().strip()[:2000]}"
            if "ermission" in r.err_text():
                body += ("\n(py-spy needs ptrace rights on the job's processes: same user and "
                         "kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE)")
        parts.append(f"=== pid {pid}\n{body}\n")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        f.write("".join(parts))
    return f"{ok} of {len(pids)} stack(s) dumped to {out_path}"


def requeue(argv_template: list[str], job_id: str, timeout_s: float) -> tuple[bool, str]:
    """Run the configured requeue command ("{job_id}" substituted in each argument; no shell)."""
    argv = [a.replace("{job_id}", str(job_id)) for a in argv_template]
    r = run_tool(argv, timeout_s)
    if r.timed_out:
        return False, f"{' '.join(argv)}: no answer within {timeout_s:g}s"
    if r.rc is None:
        return False, f"cannot run {argv[0]}: {r.error}"
    out = (r.err_text() or r.text()).strip()[:300]
    return r.rc == 0, f"{' '.join(argv)} -> exit {r.rc}" + (f": {out}" if out else "")
