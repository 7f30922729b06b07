"""What the notify spool(s) still hold, for `gpuguard status` (gpuguard.cli.status): messages that did not go out.
Read-only: each spool through a read-only SQLite connection, never created or migrated here; the spool's tables
are notify's (gpuguard.notify.state), so their SQL stays in this package."""

from __future__ import annotations

import glob
import sqlite3
from typing import Any


def spool_paths(pattern: str) -> list[str]:
    """The spool files `notify.state_path` (or the store's path) names: one, or one per node for "{node}"."""
    if "{node}" not in pattern:
        return [pattern]
    return sorted(glob.glob(glob.escape(pattern).replace(glob.escape("{node}"), "*")))


def _connect_ro(path: str) -> sqlite3.Connection:
    """A read-only connection; raises sqlite3.Error when the file is missing or unreadable."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
    conn.execute("PRAGMA query_only=1")
    return conn


def _has_spool(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='notify_spool'").fetchone() is not None


def _count(out: dict[str, Any], conn: sqlite3.Connection) -> None:
    rows = conn.execute(
        "SELECT COALESCE(node, '?'), status, COUNT(*), MIN(created) FROM notify_spool "
        "WHERE status IN ('pending','held','expired') GROUP BY 1, 2").fetchall()
    for node, status, count, oldest in rows:
        out[status] += count
        per = out["by_node"].setdefault(node, {"pending": 0, "held": 0, "expired": 0})
        per[status] += count
        if status != "expired" and oldest is not None and (out["oldest"] is None or oldest < out["oldest"]):
            out["oldest"] = oldest
    for node, title, error, attempts in conn.execute(
            "SELECT COALESCE(node, '?'), title, last_error, attempts FROM notify_spool "
            "WHERE status='pending' AND last_error IS NOT NULL ORDER BY id DESC LIMIT 3"):
        out["last_errors"].append({"node": node, "title": title, "error": error, "attempts": attempts})


def undelivered_notifications(pattern: str) -> dict[str, Any]:
    """Messages in the notify spool(s) that have not gone out: pending (being retried), held (rate-limited,
    waiting for a digest) and expired (given up after notify.spool_max_age_h), in all and per node; the oldest
    waiting one; the last three errors of pending ones; the spools that could not be read."""
    out: dict[str, Any] = {"pending": 0, "held": 0, "expired": 0, "oldest": None, "by_node": {}, "last_errors": [],
                           "errors": []}
    for path in spool_paths(pattern):
        try:
            conn = _connect_ro(path)
        except sqlite3.Error:
            continue  # no spool file: nothing was ever spooled there
        try:
            if _has_spool(conn):
                _count(out, conn)
        except sqlite3.Error as e:
            out["errors"].append(f"{path}: {type(e).__name__}: {e}")
        finally:
            conn.close()
    return out
