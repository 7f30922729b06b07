"""The history: one SQLite file with runs, findings, drains and kernel-log cursors.

WAL mode + a busy timeout make it safe under a prolog and a health check running at once. A corrupt
file is moved aside (kept for forensics) and recreated: losing history must never block a prolog.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from gpuguard.model import Finding

SCHEMA_VERSION = 2

# Upgrades of an existing file, in order: version reached -> statements. A fresh file gets _SCHEMA directly.
_MIGRATIONS: list[tuple[int, list[str]]] = [
    (2, ["ALTER TABLE runs ADD COLUMN restart_count INTEGER"]),
]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    started REAL NOT NULL,
    duration_ms REAL,
    node TEXT NOT NULL,
    kind TEXT NOT NULL,
    job_id TEXT,
    restart_count INTEGER,     -- SLURM_JOB_RESTART_COUNT: which attempt of the job this prolog ran for
    profile TEXT,
    verdict TEXT NOT NULL,
    action TEXT,
    reason TEXT,
    exit_code INTEGER,
    error TEXT,
    boot_id TEXT
);
CREATE INDEX IF NOT EXISTS runs_node_time ON runs(node, started);
CREATE TABLE IF NOT EXISTS findings (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    check_id TEXT NOT NULL,
    severity TEXT NOT NULL,
    keyword TEXT,
    gpu INTEGER,
    action TEXT,
    message TEXT,
    remediation TEXT,
    evidence TEXT
);
CREATE INDEX IF NOT EXISTS findings_run ON findings(run_id);
CREATE TABLE IF NOT EXISTS drains (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    node TEXT NOT NULL,
    op TEXT NOT NULL,          -- drain | undrain
    outcome TEXT NOT NULL,     -- done | already | foreign | failed | skipped
    reason TEXT,
    check_id TEXT,
    action TEXT,
    run_id INTEGER,
    detail TEXT
);
CREATE INDEX IF NOT EXISTS drains_node_time ON drains(node, ts);
CREATE TABLE IF NOT EXISTS cursors (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    updated REAL NOT NULL
);
"""


class Store:
    def __init__(self, path: str, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.recreated_from: Optional[str] = None
        self.conn = self._open()

    # ------------------------------------------------------------------ lifecycle
    def _connect(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        conn = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        conn.execute("PRAGMA busy_timeout=%d" % int(self.timeout_s * 1000))
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version < SCHEMA_VERSION:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("BEGIN IMMEDIATE")  # a prolog and a health check may open a new file at once
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                fresh = conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name='runs'").fetchone()[0] == 0
                if fresh:
                    for stmt in _SCHEMA.split(";"):
                        if stmt.strip():
                            conn.execute(stmt)
                else:
                    for target, statements in _MIGRATIONS:
                        if version < target:
                            for stmt in statements:
                                conn.execute(stmt)
                conn.execute("PRAGMA user_version=%d" % SCHEMA_VERSION)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes, cheap
        return conn

    def _open(self) -> sqlite3.Connection:
        try:
            return self._connect()
        except sqlite3.DatabaseError as e:
            if self.path == ":memory:" or "locked" in str(e).lower():
                raise
            aside = f"{self.path}.corrupt-{int(time.time())}"
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
            self.recreated_from = aside
            return self._connect()

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writes
    def record_run(self, *, started: float, duration_ms: Optional[float], node: str, kind: str, job_id: Optional[str],
                   profile: Optional[str], verdict: str, action: Optional[str], reason: Optional[str],
                   exit_code: Optional[int], error: Optional[str], boot_id: Optional[str],
                   findings: Iterable[Finding], restart_count: Optional[int] = None) -> int:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            cur = c.execute(
                "INSERT INTO runs(started,duration_ms,node,kind,job_id,restart_count,profile,verdict,action,reason,"
                "exit_code,error,boot_id) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (started, duration_ms, node, kind, job_id, restart_count, profile, verdict, action, reason, exit_code,
                 error, boot_id))
            run_id = int(cur.lastrowid or 0)
            c.executemany(
                "INSERT INTO findings(run_id,check_id,severity,keyword,gpu,action,message,remediation,evidence) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                [(run_id, f.check_id, f.severity.value, f.keyword, f.gpu, f.action.value, f.message, f.remediation,
                  json.dumps(f.evidence, default=str)) for f in findings])
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        return run_id

    def record_drain(self, *, node: str, op: str, outcome: str, reason: Optional[str], check_id: Optional[str],
                     action: Optional[str], run_id: Optional[int], detail: str = "", ts: Optional[float] = None) -> None:
        self.conn.execute(
            "INSERT INTO drains(ts,node,op,outcome,reason,check_id,action,run_id,detail) VALUES (?,?,?,?,?,?,?,?,?)",
            (ts or time.time(), node, op, outcome, reason, check_id, action, run_id, detail))

    def set_cursor(self, name: str, value: dict[str, Any]) -> None:
        self.conn.execute(
            "INSERT INTO cursors(name,value,updated) VALUES (?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET value=excluded.value, updated=excluded.updated",
            (name, json.dumps(value), time.time()))

    def delete_cursor(self, name: str) -> None:
        self.conn.execute("DELETE FROM cursors WHERE name=?", (name,))

    def prune_cursors(self, prefix: str, older_than: float) -> int:
        """Drop stale cursors (e.g. per-job windows of jobs whose epilog never ran)."""
        cur = self.conn.execute("DELETE FROM cursors WHERE substr(name, 1, ?)=? AND updated<?",
                                (len(prefix), prefix, older_than))
        return cur.rowcount

    # ------------------------------------------------------------------ reads
    def get_cursor(self, name: str) -> Optional[dict[str, Any]]:
        row = self.conn.execute("SELECT value FROM cursors WHERE name=?", (name,)).fetchone()
        if not row:
            return None
        try:
            value = json.loads(row[0])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def incomplete_streaks(self, node: str, check_ids: Iterable[str], limit: int = 20) -> dict[str, int]:
        """check id -> in how many of the latest runs that evaluated it, in a row, it was incomplete. Runs that
        did not evaluate the check (a watch event, an epilog without fabric checks) neither count nor break
        the streak."""
        out: dict[str, int] = {}
        for cid in dict.fromkeys(check_ids):
            rows = self.conn.execute(
                "SELECT f.run_id, MAX(f.severity='incomplete') FROM findings f JOIN runs r ON r.id=f.run_id "
                "WHERE r.node=? AND f.check_id=? GROUP BY f.run_id ORDER BY f.run_id DESC LIMIT ?",
                (node, cid, limit)).fetchall()
            n = 0
            for _, incomplete in rows:
                if not incomplete:
                    break
                n += 1
            if n:
                out[cid] = n
        return out

    # ------------------------------------------------------------------ drain bookkeeping (undrain, escalation)
    def active_drain(self, node: str) -> Optional[dict[str, Any]]:
        """The drain gpuguard put on `node` and has not lifted yet (with the boot id it happened in)."""
        cur = self.conn.execute(
            "SELECT d.*, r.boot_id AS boot_id FROM drains d LEFT JOIN runs r ON r.id = d.run_id "
            "WHERE d.node=? AND d.op='drain' AND d.outcome IN ('done','already') ORDER BY d.id DESC LIMIT 1",
            (node,))
        row = cur.fetchone()
        if row is None:
            return None
        drain = dict(zip([c[0] for c in cur.description], row))
        lifted = self.conn.execute(
            "SELECT 1 FROM drains WHERE node=? AND op='undrain' AND outcome IN ('done','gone') AND id > ? LIMIT 1",
            (node, drain["id"])).fetchone()
        return None if lifted else drain

    def consecutive_passes(self, node: str, check_id: str, since: float, kinds: tuple[str, ...] = ("healthcheck",),
                           limit: int = 50) -> int:
        """How many of the latest runs (after `since`, of these kinds) in a row had `check_id` ok and did not
        end in a drain verdict."""
        marks = ",".join("?" * len(kinds))
        run_ids = [r[0] for r in self.conn.execute(
            f"SELECT id FROM runs WHERE node=? AND started>? AND kind IN ({marks}) AND verdict!='error' "
            f"ORDER BY id DESC LIMIT ?", (node, since, *kinds, limit))]
        n = 0
        for rid in run_ids:
            verdict = self.conn.execute("SELECT verdict FROM runs WHERE id=?", (rid,)).fetchone()[0]
            sev = self.conn.execute("SELECT severity FROM findings WHERE run_id=? AND check_id=?",
                                    (rid, check_id)).fetchall()
            if verdict == "drain" or not sev or any(s[0] not in ("ok", "skip") for s in sev):
                break
            n += 1
        return n

    def count_ops(self, node: str, op: str, since: float, outcomes: tuple[str, ...] = ("done",)) -> int:
        marks = ",".join("?" * len(outcomes))
        return int(self.conn.execute(
            f"SELECT COUNT(*) FROM drains WHERE node=? AND op=? AND ts>=? AND outcome IN ({marks})",
            (node, op, since, *outcomes)).fetchone()[0])

    def previous_fault_boots(self, node: str, check_id: str, keyword: str, current_boot: Optional[str],
                             since: float) -> int:
        """In how many earlier boots gpuguard drained `node` for this same fault (check + keyword)."""
        rows = self.conn.execute(
            "SELECT DISTINCT r.boot_id FROM drains d JOIN runs r ON r.id = d.run_id WHERE d.node=? AND d.op='drain' "
            "AND d.outcome IN ('done','already') AND d.check_id=? AND d.ts>=? AND d.reason LIKE ? "
            "AND r.boot_id IS NOT NULL", (node, check_id, since, f"% {keyword}: %")).fetchall()
        return sum(1 for (b,) in rows if b != current_boot)

    def runs(self, node: Optional[str] = None, since: Optional[float] = None, limit: int = 200) -> list[dict[str, Any]]:
        q = "SELECT * FROM runs WHERE 1=1"
        args: list[Any] = []
        if node:
            q += " AND node=?"
            args.append(node)
        if since:
            q += " AND started>=?"
            args.append(since)
        q += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        cur = self.conn.execute(q, args)
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur]

    def findings_for(self, run_id: int) -> list[dict[str, Any]]:
        cur = self.conn.execute("SELECT * FROM findings WHERE run_id=?", (run_id,))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur]

    def drains(self, node: Optional[str] = None, limit: int = 200) -> list[dict[str, Any]]:
        q = "SELECT * FROM drains" + (" WHERE node=?" if node else "") + " ORDER BY id DESC LIMIT ?"
        cur = self.conn.execute(q, (node, limit) if node else (limit,))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur]
