"""Who is delivering a spooled message right now: a claim on its spool row, so that each message leaves once.

Several processes deliver from one node's spool: a hook's hand-off process, the health check's, the watch daemon,
`gpuguard` commands. Before sending a row a worker claims it in one short IMMEDIATE transaction (the row must still
be pending and not claimed by a live worker); each target it reached is taken off the row at once; the row is
marked sent, or released with what is left, only by the claim that holds it. A worker that died mid-row (its
process is gone) or whose claim is older than `LEASE_S` has lost it: the next flush takes the row over, with the
targets it had not reached yet.

A claim names its process by boot id, pid and the process's start time (`/proc/<pid>/stat`), so a recycled pid is
not mistaken for the worker, plus a nonce per delivery job (two jobs of one process never release each other's)."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from gpuguard.util.sqltx import rollback_if_active

LEASE_S = 300.0  # a claim this old is taken over even if its process lives (a worker stuck past every timeout)
_PROC: dict[int, str] = {}  # pid -> this process's identity (computed once per process, again after a fork)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    stat = _read(f"/proc/{pid}/stat")
    # the command name (field 2) is in parentheses and may hold spaces: the fields after its closing one
    rest = stat[stat.rfind(")") + 2:].split() if ")" in stat else []
    return rest[19] if len(rest) > 19 else ""  # field 22: start time, clock ticks after boot


def process_identity() -> str:
    """`<boot id>:<pid>:<start time>` of this process."""
    pid = os.getpid()
    if pid not in _PROC:
        _PROC.clear()
        _PROC[pid] = f"{_read('/proc/sys/kernel/random/boot_id')}:{pid}:{_start_time(pid)}"
    return _PROC[pid]


def new_token() -> str:
    """A claim token for one delivery job of this process."""
    return f"{process_identity()}/{os.urandom(4).hex()}"


def holder_alive(token: str) -> bool:
    """Whether the process that made `token` still runs (a process of another boot does not). Unknown (no
    /proc): alive, and the lease decides."""
    ident = token.split("/", 1)[0]
    parts = ident.split(":")
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    boot, pid, start = parts
    here = _read("/proc/sys/kernel/random/boot_id")
    if not here:
        return True
    if boot != here:
        return False
    now_start = _start_time(int(pid))
    return bool(now_start) and now_start == start


def claim(conn: Any, row_id: int, token: str, now: float) -> Optional[list[str]]:
    """Claim spool row `row_id` for `token`: the targets it still owes (read under the claim), or None when it is
    no longer pending or a live worker holds it."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute("SELECT status, targets, claimed_by, claimed_at FROM notify_spool WHERE id=?",
                           (row_id,)).fetchone()
        if row is None or row[0] != "pending":
            conn.execute("COMMIT")
            return None
        holder, since = row[2], row[3]
        if holder and holder != token and holder_alive(holder) and since is not None and now - since < LEASE_S:
            conn.execute("COMMIT")
            return None
        conn.execute("UPDATE notify_spool SET claimed_by=?, claimed_at=? WHERE id=?", (token, now, row_id))
        conn.execute("COMMIT")
    except BaseException:
        rollback_if_active(conn)
        raise
    return list(json.loads(row[1]))


def reached(conn: Any, row_id: int, token: str, left: list[str]) -> None:
    """One target took the message: only `left` are still owed (a worker lost after this re-sends to none of the
    others)."""
    conn.execute("UPDATE notify_spool SET targets=? WHERE id=? AND claimed_by=?", (json.dumps(left), row_id, token))


def finish(conn: Any, row_id: int, token: str, left: list[str], error: Optional[str], now: float) -> bool:
    """Release the claim: the row is sent (nothing left) or waits for its back-off with what is left. False when
    the claim was lost meanwhile (taken over after the lease): the row is then the other worker's."""
    if left:
        cur = conn.execute("UPDATE notify_spool SET targets=?, attempts=attempts+1, last_error=?, "
                           "next_try=? + MIN(3600, 30 * (1 << MIN(attempts, 7))), claimed_by=NULL "
                           "WHERE id=? AND claimed_by=?", (json.dumps(left), error, now, row_id, token))
    else:
        cur = conn.execute("UPDATE notify_spool SET status='sent', targets='[]', attempts=attempts+1, last_error=?, "
                           "claimed_by=NULL WHERE id=? AND claimed_by=?", (error, row_id, token))
    return bool(cur.rowcount)
