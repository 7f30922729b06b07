"""The job directory's files and the user-side store, for `gpuguard job-attempt` (gpuguard.templates.jobattempt):
the ledger (`attempts.jsonl`, one JSON line per attempt), the attempt's state file, its output and torchrun's error
files, the monitor's events, and the `attempts` table of `templates.store_path`. Readers skip what is torn or
unreadable; writers never fail the job."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from gpuguard.templates.attempts import WorkerExit
from gpuguard.templates.fabric import read_attempt, summary
from gpuguard.templates.torchrun_report import parse_error_file, parse_torchrun_failures
from gpuguard.util.fs import atomic_write

LEDGER = "attempts.jsonl"
STATE = "attempt.json"
LOG_TAIL_BYTES = 256 * 1024
ERROR_FILE_MAX_BYTES = 1024 * 1024
ERROR_FILES_MAX = 4096

ATTEMPTS_SCHEMA = ("CREATE TABLE IF NOT EXISTS attempts (id INTEGER PRIMARY KEY, ts REAL NOT NULL, "
                   "job_id TEXT NOT NULL, attempt INTEGER NOT NULL, nodes TEXT, exit_code INTEGER, signal INTEGER, "
                   "reason TEXT, action TEXT, excluded TEXT)")


def warn(msg: str) -> None:
    print(f"gpuguard job-attempt: {msg}", file=sys.stderr)


def attempt_dir(job_dir: Path, attempt: int) -> Path:
    """Where the batch script keeps one attempt's files (torchrun's error files, NCCL's debug files)."""
    return job_dir / f"attempt-{attempt}"


def read_ledger(job_dir: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = (job_dir / LEDGER).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line from a killed writer: skip it, keep the rest
        if isinstance(rec, dict):
            out.append(rec)
    return out


def append_ledger(job_dir: Path, record: Mapping[str, Any]) -> None:
    line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
    fd = os.open(job_dir / LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write with O_APPEND: lines from concurrent writers never interleave
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    atomic_write(path, json.dumps(data, default=str))


def read_log_since(path: Optional[str], offset: int, limit: int = LOG_TAIL_BYTES) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(offset, size - limit) if offset <= size else max(0, size - limit))
            return fh.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def record_store(store_path: Optional[str], rec: Mapping[str, Any]) -> Optional[str]:
    """Append the attempt to the user-side store's `attempts` table (a plain SQLite file the job's user owns;
    `gpuguard history` reads it); returns an error text instead of raising. No store configured: None."""
    if not store_path:
        return None
    try:
        Path(store_path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(store_path, timeout=5.0)
        try:
            with conn:
                conn.execute(ATTEMPTS_SCHEMA)
                conn.execute("CREATE INDEX IF NOT EXISTS attempts_job ON attempts(job_id, attempt)")
                conn.execute(
                    "INSERT INTO attempts(ts,job_id,attempt,nodes,exit_code,signal,reason,action,excluded) "
                    "VALUES (?,?,?,?,?,?,?,?,?)",
                    (rec["ts"], rec["job_id"], rec["attempt"], rec.get("nodes"), rec.get("exit_code"),
                     rec.get("signal"), rec.get("reason"), rec.get("action"),
                     ",".join(rec.get("excluded") or []) or None))
        finally:
            conn.close()
        return None
    except Exception as e:  # noqa: BLE001 - the ledger file is the primary record; never fail the job for this
        return f"{type(e).__name__}: {e}"


def worker_exits(job_dir: Path, attempt: int, log_tail: str) -> list[WorkerExit]:
    """The failed workers of this attempt: torchrun's error files (TORCHELASTIC_ERROR_FILE of each node's torchrun,
    written when the worker used @record: its message and exit code), then the root causes of torchrun's
    failure reports in the attempt's output (every worker's own exit code, always there)."""
    from_files: list[WorkerExit] = []
    adir = attempt_dir(job_dir, attempt)
    try:
        files = sorted(adir.glob("torchrun-node*.json"))[:ERROR_FILES_MAX]
    except OSError:
        files = []
    for path in files:
        try:
            with open(path, "rb") as fh:
                data = json.loads(fh.read(ERROR_FILE_MAX_BYTES).decode("utf-8", errors="replace"))
        except (OSError, ValueError):
            continue
        w = parse_error_file(data, host=path.stem.replace("torchrun-", ""))
        if w:
            from_files.append(w)
    # the report has every root cause's rank, host and real exit code; an error file adds the exception's message
    found: list[WorkerExit] = []
    for r in parse_torchrun_failures(log_tail):
        match = next((w for w in from_files if w.exit_code == r.exit_code), None)
        if match:
            from_files.remove(match)
            r = replace(r, message=match.message, source="error_file")
        found.append(r)
    return found + from_files


def user_store_path(cfg: Any, node: str, user: str) -> Optional[str]:
    """`templates.store_path` with {node} and {user} filled in; None when unset or when it names the hooks' own
    store (the root hooks' database must never be writable by users). Pure apart from path normalisation."""
    if cfg is None:
        return None
    raw = cfg.templates.store_path
    if not raw:
        return None
    path = raw.replace("{node}", node).replace("{user}", user)
    hooks = cfg.store.path_for(node)
    if hooks and os.path.normpath(os.path.abspath(path)) == os.path.normpath(os.path.abspath(hooks)):
        warn(f"templates.store_path ({raw}) is the hooks' own store (store.path): not writing job attempts there "
              "(users must not write the root hooks' database); only the ledger in the job directory is written")
        return None
    return path


def fabric_summary(job_dir: Path, attempt: int) -> Optional[dict[str, Any]]:
    try:
        inits = read_attempt(attempt_dir(job_dir, attempt) / "nccl")
    except Exception as e:  # noqa: BLE001 - a summary is a nicety; never fail the bookkeeping for it
        warn(f"NCCL debug files not read: {e}")
        return None
    return summary(inits) if inits else None


def monitor_requeue_since(job_dir: Path, since: Optional[float]) -> Optional[str]:
    """The latest requeue `gpuguard monitor` asked for during this attempt (it records its events in
    <job dir>/gpuguard/events.jsonl), as "check, stuck: nodes (asked by node)"; None when there was none."""
    events = []
    try:
        with open(job_dir / "gpuguard" / "events.jsonl", errors="replace") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    events.append(ev)
    except OSError:
        return None
    return requeue_asked(events, since)


def requeue_asked(events: Sequence[Mapping[str, Any]], since: Optional[float]) -> Optional[str]:
    """Of the monitor's events, its latest requeue since `since` that may have reached the job. The monitor records
    its intent ("phase": "asking") before it runs the requeue command and the outcome after, so a stop that
    overtakes the command (or a command with no answer in time) is still the monitor's; only an ask whose
    outcome says it failed does not count. Records without a phase (older monitors) count when ok. Pure."""
    asks: dict[tuple[str, str], Mapping[str, Any]] = {}
    for ev in events:
        if ev.get("kind") != "requeue":
            continue
        try:
            ts = float(ev.get("ts") or 0)
        except (TypeError, ValueError):
            continue
        if since is not None and ts < float(since):
            continue
        key = (str(ev.get("node")), str(ev.get("ts")))
        phase = ev.get("phase")
        if phase == "asking" or (phase is None and ev.get("ok")):
            asks.pop(key, None)
            asks[key] = ev  # the latest ask last
        elif ev.get("ok") is False:
            asks.pop(key, None)  # refused, or never ran: the stop came from someone else
    if not asks:
        return None
    ev = list(asks.values())[-1]
    stuck = ev.get("stuck")
    names = ", ".join(str(n) for n in stuck) if isinstance(stuck, list) and stuck else None
    return f"{ev.get('check') or 'hang'}" + (f", stuck: {names}" if names else "") + \
        f" (asked by {ev.get('node') or '?'})"
