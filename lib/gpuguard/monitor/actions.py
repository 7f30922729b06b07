"""What the monitor does about a hang besides alerting: dump the job's Python stacks with py-spy, and ask for a
requeue. Every external command is an argv list (never a shell) under a timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Iterable, Optional


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
        try:
            p = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                               timeout=min(timeout_s, left), stdin=subprocess.DEVNULL, errors="replace")
            body = p.stdout if p.returncode == 0 else f"py-spy failed ({p.returncode}): {p.stderr.strip()[:2000]}"
            if p.returncode == 0:
                ok += 1
            elif "ermission" in p.stderr:
                body += ("\n(py-spy needs ptrace rights on the job's processes: same user and "
                         "kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE)")
        except subprocess.TimeoutExpired:
            body = f"py-spy did not finish within {min(timeout_s, left):.0f}s"
        except OSError as e:
            body = f"cannot run {py_spy}: {e}"
        parts.append(f"=== pid {pid}\n{body}\n")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        f.write("".join(parts))
    return f"{ok} of {len(pids)} stack(s) dumped to {out_path}"


def requeue(argv_template: list[str], job_id: str, timeout_s: float) -> tuple[bool, str]:
    """Run the configured requeue command ("{job_id}" substituted in each argument; no shell)."""
    argv = [a.replace("{job_id}", str(job_id)) for a in argv_template]
    exe = shutil.which(argv[0]) or argv[0]
    try:
        p = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        return False, f"{' '.join(argv)}: no answer within {timeout_s:g}s"
    except OSError as e:
        return False, f"cannot run {argv[0]}: {e.strerror or e}"
    out = (p.stderr or p.stdout).strip()[:300]
    return p.returncode == 0, f"{' '.join(argv)} -> exit {p.returncode}" + (f": {out}" if out else "")
