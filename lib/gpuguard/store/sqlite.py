"""The history: one SQLite file with runs, findings, drains and kernel-log cursors.

WAL mode + a busy timeout make it safe under a prolog and a health check running at once, as long as nothing in
the process opens the file (or its -wal/-shm) outside SQLite: closing such a descriptor drops every POSIX lock the
process holds on the file, SQLite's included (gpuguard.notify.state.ensure_trusted_state only lstats it).

Errors are told apart, because they call for opposite things:
- real corruption (SQLite says CORRUPT / NOTADB, or `PRAGMA quick_check` fails): the file is moved aside (kept,
  with its -wal/-shm, for forensics), a new one is created and `recreated_from` says so. The caller must treat
  its cursors as lost (the verdict journal still holds the kernel-log position: gpuguard.pipeline.journal). It
  is loud: a syslog line at error level, the metric and a page (gpuguard.store.replaced);
- anything else (disk full, read-only filesystem, I/O error, permissions, a lock held too long): nothing is
  moved or overwritten, `StoreUnavailable` is raised. Drains, undrain counters and cursors stay on disk for the
  next run that can reach them.
`GuardedStore` (gpuguard.store.guarded) is the pipeline's view: a store that cannot be opened or written never
changes a verdict.

The schema and its upgrades live in gpuguard.store.schema, the corruption rules in gpuguard.store.corruption, the
queries for shipping and reports in gpuguard.store.queries.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from typing import Any, Iterable, Optional

from gpuguard.model import Finding
from gpuguard.store import replaced
from gpuguard.store.corruption import StoreUnavailable, is_corruption
from gpuguard.store.queries import ShippingQueries, StatusQueries
from gpuguard.store.schema import upgrade_schema
from gpuguard.util.sqltx import rollback_if_active


class Store(ShippingQueries, StatusQueries):
    """One node's history on one connection: its writes, its cursors and the pipeline's reads (drain bookkeeping
    for undrain and escalation, incomplete streaks); shipping and report queries come from gpuguard.store.queries."""

    def __init__(self, path: str, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.recreated_from: Optional[str] = None  # where a corrupt file was moved (cursors are lost)
        self.corruption_error: Optional[str] = None
        self.conn = self._open()
        if self.recreated_from:
            self._note_replaced(self.recreated_from)

    # ------------------------------------------------------------------ lifecycle
    def _connect(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o755, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        conn.execute("PRAGMA busy_timeout=%d" % int(self.timeout_s * 1000))
        upgrade_schema(conn)
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

    def _note_replaced(self, aside: str) -> None:
        """Loud (gpuguard.store.replaced): syslog now, a note in the new store for the metrics and the page."""
        n = replaced.note(aside, self.corruption_error, time.time())
        try:
            self.set_cursor(replaced.CURSOR, n)
        except sqlite3.Error:
            pass  # the log line below still says it
        replaced.log_replaced(self.path, n)

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
            rollback_if_active(c)
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

    @classmethod
    def open_read_only(cls, path: str, timeout_s: float = 2.0) -> "Store":
        """A Store on a read-only connection: never creates, migrates or moves the file (status, history).
        Raises sqlite3.Error when the file is missing, unreadable, or not a store."""
        if not os.path.exists(path):
            raise sqlite3.OperationalError(f"no such file: {path}")
        from pathlib import Path  # here: the hooks never open a store read-only (pathlib: ~13M instructions)

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

    def write_transaction(self) -> Any:
        """`with store.write_transaction():` one IMMEDIATE transaction (a prolog, the watch daemon and admin
        commands write the same store), rolled back on any exception."""

        @contextlib.contextmanager
        def tx() -> Any:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                rollback_if_active(self.conn)
                raise
            self.conn.execute("COMMIT")

        return tx()
