"""The history: one SQLite file with runs, findings, drains and kernel-log cursors.

WAL mode + a busy timeout make it safe under a prolog and a health check running at once.

Errors are told apart, because they call for opposite things:
- real corruption (SQLite says CORRUPT / NOTADB, or `PRAGMA quick_check` fails): the file is moved aside (kept,
  with its -wal/-shm, for forensics), a new one is created and `recreated_from` says so. The caller must treat
  its cursors as lost (the verdict journal still holds the kernel-log position: gpuguard.pipeline.journal);
- anything else (disk full, read-only filesystem, I/O error, permissions, a lock held too long): nothing is
  moved or overwritten, `StoreUnavailable` is raised. Drains, undrain counters and cursors stay on disk for the
  next run that can reach them.
`GuardedStore` is the pipeline's view: a store that cannot be opened or written never changes a verdict.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from gpuguard.model import Finding

SCHEMA_VERSION = 3

# Upgrades of an existing file, in order: version reached -> statements. A fresh file gets _SCHEMA directly.
_MIGRATIONS: list[tuple[int, list[str]]] = [
    (2, ["ALTER TABLE runs ADD COLUMN restart_count INTEGER"]),
    # history filtered in SQL over a big store (time ranges without a node, problem findings only), retention
    (3, ["CREATE INDEX IF NOT EXISTS runs_time ON runs(started)",
         "CREATE INDEX IF NOT EXISTS drains_time ON drains(ts)",
         "CREATE INDEX IF NOT EXISTS findings_problems ON findings(run_id) WHERE severity NOT IN ('ok','skip')"]),
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
CREATE INDEX IF NOT EXISTS runs_time ON runs(started);
CREATE INDEX IF NOT EXISTS drains_time ON drains(ts);
CREATE INDEX IF NOT EXISTS findings_problems ON findings(run_id) WHERE severity NOT IN ('ok','skip');
CREATE TABLE IF NOT EXISTS cursors (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    updated REAL NOT NULL
);
"""


# sqlite3 result codes (sqlite3.h); Python >= 3.11 exposes them on the exception as `sqlite_errorcode`.
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26
# Errors about the environment, never about the file's contents: full, read-only, I/O, permissions, locks, memory.
_NOT_CORRUPTION = {3, 5, 6, 7, 8, 10, 13, 14, 15, 23}  # PERM BUSY LOCKED NOMEM READONLY IOERR FULL CANTOPEN
#                                                       PROTOCOL AUTH


class StoreUnavailable(sqlite3.OperationalError):
    """The store cannot be opened or used right now (full disk, read-only, I/O error, lock). Nothing was moved."""


def is_corruption(path: str, error: sqlite3.DatabaseError) -> bool:
    """True only when the file itself is damaged: SQLite said CORRUPT/NOTADB, or an integrity check on a
    read-only connection fails. Environmental errors (disk full, read-only, I/O, locks) are never corruption."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        primary = code & 0xFF  # extended result codes carry the primary code in the low byte
        if primary in (SQLITE_CORRUPT, SQLITE_NOTADB):
            return True
        if primary in _NOT_CORRUPTION:
            return False
    elif "locked" in str(error).lower() or "disk is full" in str(error).lower():
        return False
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return False  # cannot even open it read-only: an environment problem, keep the file
    try:
        rows = conn.execute("PRAGMA quick_check(1)").fetchall()
        return not (rows and rows[0][0] == "ok")
    except sqlite3.DatabaseError as e:
        code = getattr(e, "sqlite_errorcode", 0) & 0xFF
        return code in (SQLITE_CORRUPT, SQLITE_NOTADB) or "malformed" in str(e) or "not a database" in str(e)
    finally:
        conn.close()


class Store:
    def __init__(self, path: str, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.recreated_from: Optional[str] = None  # where a corrupt file was moved (cursors are lost)
        self.corruption_error: Optional[str] = None
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
        except OSError as e:  # the directory cannot be created (read-only filesystem, permissions)
            raise StoreUnavailable(f"{self.path}: {e}") from e
        except sqlite3.DatabaseError as e:
            if self.path == ":memory:" or not is_corruption(self.path, e):
                raise StoreUnavailable(f"{self.path}: {e}") from e
            self.corruption_error = f"{type(e).__name__}: {e}"
        aside = f"{self.path}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
        try:
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
            self.recreated_from = aside
            return self._connect()
        except (OSError, sqlite3.DatabaseError) as e:
            raise StoreUnavailable(f"{self.path}: corrupt, and could not be replaced: {e}") from e

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
        cols = [c[0] for c in cur.description]
        drain = dict(zip(cols, row))
        lifted = self.conn.execute(
            "SELECT 1 FROM drains WHERE node=? AND op='undrain' AND outcome IN ('done','gone') AND id > ? LIMIT 1",
            (node, drain["id"])).fetchone()
        if lifted:
            return None
        if drain["outcome"] == "already":
            # Slurm keeps the first reason: the drain in place is the one that set it (a later run found it there),
            # unless that record is gone (a recreated store)
            setter = self.conn.execute(
                "SELECT d.*, r.boot_id AS boot_id FROM drains d LEFT JOIN runs r ON r.id = d.run_id WHERE d.node=? "
                "AND d.op='drain' AND d.outcome='done' AND d.id < ? AND NOT EXISTS (SELECT 1 FROM drains u WHERE "
                "u.node=d.node AND u.op='undrain' AND u.outcome IN ('done','gone') AND u.id > d.id) "
                "ORDER BY d.id DESC LIMIT 1", (node, drain["id"])).fetchone()
            if setter is not None:
                return dict(zip(cols, setter))
        return drain

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
            # only a value read and OK counts: a check skipped now (every GPU NOT_SUPPORTED) proves nothing
            if verdict == "drain" or not sev or any(s[0] != "ok" for s in sev):
                break
            n += 1
        return n

    def count_ops(self, node: str, op: str, since: float, outcomes: tuple[str, ...] = ("done",),
                  check_id: Optional[str] = None, exclude_admin: bool = False) -> int:
        """Drain operations on `node` since `since`; only those of `check_id` when given; `exclude_admin` leaves
        out what an admin did through `gpuguard undrain` (recorded with detail "admin...")."""
        marks = ",".join("?" * len(outcomes))
        sql = f"SELECT COUNT(*) FROM drains WHERE node=? AND op=? AND ts>=? AND outcome IN ({marks})"
        args: list[Any] = [node, op, since, *outcomes]
        if check_id is not None:
            sql += " AND check_id=?"
            args.append(check_id)
        if exclude_admin:
            sql += " AND COALESCE(detail, '') NOT LIKE 'admin%'"
        return int(self.conn.execute(sql, args).fetchone()[0])

    def previous_fault_boots(self, node: str, check_id: str, keyword: str, current_boot: Optional[str],
                             since: float) -> int:
        """In how many earlier boots gpuguard drained `node` for this same fault (check + keyword)."""
        rows = self.conn.execute(
            "SELECT DISTINCT r.boot_id FROM drains d JOIN runs r ON r.id = d.run_id WHERE d.node=? AND d.op='drain' "
            "AND d.outcome IN ('done','already') AND d.check_id=? AND d.ts>=? "
            "AND (d.reason LIKE ? OR d.reason LIKE ?) AND r.boot_id IS NOT NULL",  # reason grammar, new or old
            (node, check_id, since, f"gpuguard: {keyword} %", f"% {keyword}: %")).fetchall()
        return sum(1 for (b,) in rows if b != current_boot)

    def persist_streak_start(self, node: str, check_id: str, key: str, max_gap_s: float,
                             limit: int = 50) -> Optional[float]:
        """When the condition `key` of `check_id` (a finding whose evidence carries {"persist": {"key": key}})
        was first seen in the unbroken run of recent runs that evaluated the check and all saw it; None when the
        latest such run did not see it. A gap longer than `max_gap_s` between two runs breaks the streak (nobody
        looked in between)."""
        rows = self.conn.execute(
            "SELECT r.id, r.started, MAX(CASE WHEN f.severity IN ('warn','fail') AND json_extract(f.evidence, "
            "'$.persist.key')=? THEN 1 ELSE 0 END) FROM findings f JOIN runs r ON r.id=f.run_id "
            "WHERE r.node=? AND f.check_id=? AND r.verdict!='error' GROUP BY r.id ORDER BY r.id DESC LIMIT ?",
            (key, node, check_id, limit)).fetchall()
        start: Optional[float] = None
        for _, started, seen in rows:
            if not seen or (start is not None and start - started > max_gap_s):
                break
            start = started
        return start

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

    # ------------------------------------------------------------------ outbox and retention (gpuguard.fleet)
    def rows_after(self, table: str, after_id: int, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` runs or drains with an id above `after_id`, oldest first: the shipper's outbox."""
        if table not in ("runs", "drains"):
            raise ValueError(f"not a shipped table: {table!r}")
        cur = self.conn.execute(f"SELECT * FROM {table} WHERE id>? ORDER BY id LIMIT ?", (after_id, limit))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur]

    def problem_findings(self, first_run: int, last_run: int) -> list[dict[str, Any]]:
        """The non-ok findings of runs first_run..last_run, in the order they were recorded."""
        cur = self.conn.execute(
            "SELECT rowid AS rowid_, * FROM findings WHERE run_id BETWEEN ? AND ? AND severity NOT IN ('ok','skip') "
            "ORDER BY run_id, rowid", (first_run, last_run))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur]

    def count_after(self, table: str, after_id: int) -> int:
        if table not in ("runs", "drains"):
            raise ValueError(f"not a shipped table: {table!r}")
        return int(self.conn.execute(f"SELECT COUNT(*) FROM {table} WHERE id>?", (after_id,)).fetchone()[0])

    def advance_watermark(self, name: str, value: dict[str, Any]) -> None:
        """Set cursor `name` to `value` ({"id": N, "db": ...}) unless it already stands further for the same
        database: two shippers racing never move a watermark back."""
        self.conn.execute(
            "INSERT INTO cursors(name,value,updated) VALUES (?,?,?) ON CONFLICT(name) DO UPDATE SET "
            "value=excluded.value, updated=excluded.updated WHERE json_valid(cursors.value)=0 "
            "OR json_extract(cursors.value,'$.db') IS NOT json_extract(excluded.value,'$.db') "
            "OR COALESCE(json_extract(cursors.value,'$.id'),-1) < json_extract(excluded.value,'$.id')",
            (name, json.dumps(value), time.time()))

    def setdefault_cursor(self, name: str, value: dict[str, Any]) -> dict[str, Any]:
        """Cursor `name`, set to `value` first if it does not exist yet (the first writer wins a race)."""
        self.conn.execute("INSERT INTO cursors(name,value,updated) VALUES (?,?,?) ON CONFLICT(name) DO NOTHING",
                          (name, json.dumps(value), time.time()))
        return self.get_cursor(name) or value

    def prune_history(self, before: float, batch: int, shipped: Optional[dict[str, int]] = None) -> dict[str, int]:
        """Delete at most `batch` runs (with their findings) and `batch` drains recorded before `before`, in one
        short transaction. Kept whatever their age: the newest row of each table (row ids never go back, the
        shipper's watermarks rely on it), each node's latest drain and everything after it (undrain and
        escalation read them), the runs those drains point to, and with `shipped` ({"runs": id, "drains": id})
        every row not shipped yet."""
        c = self.conn
        run_cap = shipped["runs"] if shipped is not None else None
        drain_cap = shipped["drains"] if shipped is not None else None
        run_ids = [r[0] for r in c.execute(
            "SELECT id FROM runs WHERE started<? AND id<(SELECT MAX(id) FROM runs) AND id<=COALESCE(?, id) "
            "AND id NOT IN (SELECT run_id FROM drains WHERE run_id IS NOT NULL) ORDER BY started LIMIT ?",
            (before, run_cap, batch))]
        drain_ids = [r[0] for r in c.execute(
            "SELECT id FROM drains d WHERE ts<? AND id<(SELECT MAX(id) FROM drains) AND id<=COALESCE(?, id) "
            "AND id<COALESCE((SELECT MAX(k.id) FROM drains k WHERE k.node=d.node AND k.op='drain' "
            "AND k.outcome IN ('done','already')), 9e18) ORDER BY id LIMIT ?", (before, drain_cap, batch))]
        if not run_ids and not drain_ids:
            return {"runs": 0, "drains": 0}
        c.execute("BEGIN IMMEDIATE")
        try:
            if drain_ids:
                c.execute(f"DELETE FROM drains WHERE id IN ({','.join('?' * len(drain_ids))})", drain_ids)
            if run_ids:
                marks = ",".join("?" * len(run_ids))
                c.execute(f"DELETE FROM findings WHERE run_id IN ({marks})", run_ids)
                c.execute(f"DELETE FROM runs WHERE id IN ({marks}) "
                          "AND id NOT IN (SELECT run_id FROM drains WHERE run_id IS NOT NULL)", run_ids)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        return {"runs": len(run_ids), "drains": len(drain_ids)}

    # ================================================================== reads for status, metrics, history and
    # shipping (gpuguard.cli.status, gpuguard.metrics.node, gpuguard.store.history_sqlite, gpuguard.fleet.ship): the store's SQL
    # stays here. Added by the fleet-scale work (issue 15); nothing above this line changed.

    # A run that passed with nothing to report (runs aliased `r`): the central database keeps these as per-day
    # counts (gpuguard.fleet.ship). The same rule in Python: fleet.ship.is_healthy.
    HEALTHY_RUN = ("r.verdict = 'pass' AND r.reason IS NULL AND r.error IS NULL AND NOT EXISTS (SELECT 1 FROM "
                   "findings hf WHERE hf.run_id = r.id AND hf.severity NOT IN ('ok','skip'))")

    @classmethod
    def open_read_only(cls, path: str, timeout_s: float = 2.0) -> "Store":
        """A Store on a read-only connection: never creates, migrates or moves the file (status, history).
        Raises sqlite3.Error when the file is missing, unreadable, or not a store."""
        if not os.path.exists(path):
            raise sqlite3.OperationalError(f"no such file: {path}")
        conn = sqlite3.connect(Path(path).absolute().as_uri() + "?mode=ro", uri=True, timeout=timeout_s)
        try:
            conn.execute("PRAGMA query_only=1")
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not {"runs", "findings", "drains"} <= tables:
                raise sqlite3.DatabaseError("no history yet")
        except BaseException:
            conn.close()
            raise
        st = cls.__new__(cls)
        st.path, st.timeout_s, st.conn = path, timeout_s, conn
        st.recreated_from = st.corruption_error = None
        return st

    def last_run(self, node: str, kind: Optional[str] = None) -> Optional[dict[str, Any]]:
        """The node's latest run (of this kind): kind, verdict, started, reason."""
        sql = "SELECT kind, verdict, started, reason FROM runs WHERE node=?" + (" AND kind=?" if kind else "")
        row = self.conn.execute(sql + " ORDER BY started DESC LIMIT 1", (node, kind) if kind else (node,)).fetchone()
        return None if row is None else {"kind": row[0], "verdict": row[1], "started": row[2], "reason": row[3]}

    def drain_ops_after(self, node: str, after_id: int) -> list[tuple[int, str, str]]:
        """(id, op, outcome) of the node's drain records after `after_id`, oldest first."""
        return [(int(i), str(op), str(outcome)) for i, op, outcome in self.conn.execute(
            "SELECT id, op, outcome FROM drains WHERE node=? AND id>? ORDER BY id", (node, after_id))]

    def drain_that_set(self, node: str, up_to_id: int) -> Optional[dict[str, Any]]:
        """The drain gpuguard applied (outcome done) at or before record `up_to_id` that no undrain lifted since:
        the one whose reason Slurm keeps."""
        cur = self.conn.execute(
            "SELECT id, ts, check_id, reason FROM drains WHERE node=? AND op='drain' AND outcome='done' AND id<=? "
            "AND NOT EXISTS (SELECT 1 FROM drains u WHERE u.node=? AND u.op='undrain' AND u.outcome IN "
            "('done','gone') AND u.id>drains.id AND u.id<=?) ORDER BY id DESC LIMIT 1",
            (node, up_to_id, node, up_to_id))
        row = cur.fetchone()
        return None if row is None else dict(zip([c[0] for c in cur.description], row))

    def flapping_pin_after(self, node: str, after_id: int) -> Optional[dict[str, Any]]:
        """The latest FLAPPING pin the health check put on the node after drain record `after_id`."""
        row = self.conn.execute("SELECT check_id, reason FROM drains WHERE node=? AND op='drain' AND "
                                "outcome='flapping' AND id>? ORDER BY id DESC LIMIT 1", (node, after_id)).fetchone()
        return None if row is None else {"check_id": row[0], "reason": row[1]}

    def write_transaction(self) -> Any:
        """`with store.write_transaction():` one IMMEDIATE transaction (a prolog, the watch daemon and admin
        commands write the same store), rolled back on any exception."""
        import contextlib

        @contextlib.contextmanager
        def tx() -> Any:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

        return tx()

    def healthy_day(self, node: str, day_start: float, upto_id: int) -> Optional[dict[str, Any]]:
        """The node's healthy runs in the UTC day starting at `day_start`, up to row `upto_id`, as the central
        database keeps them: count, count per hour (24), per kind, first/last start, duration sum/max, last id."""
        rows = self.conn.execute(
            "SELECT CAST((r.started - ?) / 3600 AS INTEGER), r.kind, COUNT(*), MIN(r.started), MAX(r.started), "
            "SUM(r.duration_ms), MAX(r.duration_ms), MAX(r.id) FROM runs r WHERE r.node=? AND r.started>=? "
            f"AND r.started<? AND r.id<=? AND {self.HEALTHY_RUN} GROUP BY 1, 2",
            (day_start, node, day_start, day_start + 86400, upto_id)).fetchall()
        if not rows:
            return None
        hours, kinds = [0] * 24, {}
        for hr, kind, n, *_ in rows:
            hours[min(max(int(hr), 0), 23)] += int(n)
            kinds[str(kind)] = kinds.get(str(kind), 0) + int(n)
        durations = [r[5] for r in rows if r[5] is not None]
        maxima = [r[6] for r in rows if r[6] is not None]
        return {"runs": sum(hours), "hour_runs": hours, "kinds": kinds, "first": min(r[3] for r in rows),
                "last": max(r[4] for r in rows), "duration_ms_sum": sum(durations) if durations else None,
                "duration_ms_max": max(maxima) if maxima else None, "upto": max(int(r[7]) for r in rows)}


class GuardedStore:
    """The pipeline's view of the store: every call that fails (the store could not be opened, the disk is full,
    the filesystem is read-only, a lock was held too long) returns a neutral value and is remembered in
    `errors`, so that what the hardware showed decides the verdict and the exit code, never the store.

    Neutral values are chosen to fail closed: no cursor (the kernel log is judged again rather than skipped), no
    active drain (nothing is undrained), no history (nothing escalates or is forgiven)."""

    _DEFAULTS: dict[str, Any] = {
        "get_cursor": None, "incomplete_streaks": {}, "active_drain": None, "consecutive_passes": 0,
        "count_ops": 0, "previous_fault_boots": 0, "runs": [], "drains": [], "findings_for": [],
        "record_run": None, "persist_streak_start": None,
    }

    # After one failed write the others are skipped for the rest of the run: a locked store would make every one
    # of them wait its full busy timeout, and a run has a deadline (reads go on: WAL readers are never blocked).
    _WRITES = frozenset({"record_run", "record_drain", "set_cursor", "delete_cursor", "prune_cursors",
                         "advance_watermark", "setdefault_cursor", "prune_history"})

    def __init__(self, opener: Callable[[], "Store"]) -> None:
        self.errors: list[str] = []
        self.writes_failed = False
        self.store: Optional[Store] = None
        try:
            self.store = opener()
        except (sqlite3.Error, OSError) as e:
            self.errors.append(f"open: {e}")

    @property
    def available(self) -> bool:
        return self.store is not None

    @property
    def recreated_from(self) -> Optional[str]:
        return self.store.recreated_from if self.store is not None else None

    @property
    def corruption_error(self) -> Optional[str]:
        return self.store.corruption_error if self.store is not None else None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        default = self._DEFAULTS.get(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.store is None or (self.writes_failed and name in self._WRITES):
                return default() if callable(default) else _copy(default)
            try:
                return getattr(self.store, name)(*args, **kwargs)
            except (sqlite3.Error, OSError) as e:
                if name in self._WRITES:
                    self.writes_failed = True
                if self.store.conn.in_transaction:
                    try:
                        self.store.conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                self.errors.append(f"{name}: {e}")
                return _copy(default)

        return call

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except sqlite3.Error:
                pass


def _copy(value: Any) -> Any:
    return type(value)() if isinstance(value, (dict, list)) else value

