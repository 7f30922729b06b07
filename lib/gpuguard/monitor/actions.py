"""What the monitor does about a hang besides alerting: dump the job's Python stacks with py-spy, ask for a
requeue, and make sure the job's hang pages once (the monitor runs on every node: one node claims the episode in
the job directory with O_EXCL). Every external command is an argv list (never a shell) under a timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from typing import Any, Callable, Iterable, Optional

import psutil

from gpuguard.util.fs import atomic_write
from gpuguard.util.toolrun import run_tool


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


def dump_stacks(py_spy: str, pids: list[int], out_path: str, timeout_s: float) -> tuple[str, Optional[str]]:
    """`py-spy dump --pid P` for each pid into one file. Returns a one-line summary, and the file when it holds at
    least one stack (a page points only at dumps that exist)."""
    if not pids:
        return "no stack dump: no Python process of the job found on this node", None
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
    return f"{ok} of {len(pids)} stack(s) dumped to {out_path}", out_path if ok else None


def requeue(argv_template: list[str], job_id: str, timeout_s: float) -> tuple[Optional[bool], str]:
    """Run the configured requeue command ("{job_id}" substituted in each argument; no shell). (True: done, False:
    refused or not run, None: no answer in time, so it may still have taken effect; what it said.)"""
    argv = [a.replace("{job_id}", str(job_id)) for a in argv_template]
    r = run_tool(argv, timeout_s)
    if r.timed_out:
        return None, f"{' '.join(argv)}: no answer within {timeout_s:g}s (it may still take effect)"
    if r.rc is None:
        return False, f"cannot run {argv[0]}: {r.error}"
    out = (r.err_text() or r.text()).strip()[:300]
    return r.rc == 0, f"{' '.join(argv)} -> exit {r.rc}" + (f": {out}" if out else "")


# --------------------------------------------------------------------------- one hang page per job

_CLAIM_MAX_BYTES = 4096


def hang_claim_path(claims_dir: str, job_id: str, restart: str) -> str:
    """One claim per job attempt (a requeued job keeps its id and, usually, its job directory)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"hang-{job_id}-r{restart}")[:200]
    return os.path.join(claims_dir, safe)


def _read_claim(path: str) -> Optional[dict[str, Any]]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, _CLAIM_MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("node"), str) else None


def _write_new(path: str, payload: dict[str, Any]) -> bool:
    """O_CREAT|O_EXCL: True for exactly one caller (atomic on local filesystems, NFSv3+ and Lustre)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(payload))
    return True


def claim_hang(path: str, node: str, now: float, owner_alive: Callable[[str], bool]) -> str:
    """Which node pages for the job's hang. Returns
    "new"     this node opened the job's hang episode: it pages (and requeues);
    "mine"    this node already owns it;
    "taken"   another node whose monitor is alive owns it: stay quiet (record the event only);
    "adopted" its owner's monitor is gone (no fresh report): this node takes the episode over, without paging
              again, so that someone resolves it. Exactly one node adopts (an O_EXCL marker per stale claim)."""
    if _write_new(path, {"node": node, "ts": now}):
        return "new"
    held = _read_claim(path)
    owner = held.get("node") if held else None
    if owner == node:
        return "mine"
    if owner is not None and owner_alive(owner):
        return "taken"
    if held is None:
        try:
            if time.time() - os.stat(path).st_mtime < 60:
                return "taken"  # just created, its content not written yet
        except FileNotFoundError:
            return claim_hang(path, node, now, owner_alive)  # released meanwhile: try again
    stale = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{owner}-{held.get('ts') if held else 'unreadable'}")[:100]
    if not _write_new(f"{path}.takeover-{stale}", {"node": node, "ts": now}):
        return "taken"  # another node adopted it
    atomic_write(path, json.dumps({"node": node, "ts": now, "adopted_from": owner}))
    return "adopted"


def release_hang(path: str, node: str) -> bool:
    """The owner closes the job's hang episode (the hang ended, or the job did): a later hang pages again."""
    held = _read_claim(path)
    if not held or held.get("node") != node:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
