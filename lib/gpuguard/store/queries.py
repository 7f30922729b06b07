"""The store's queries for shipping and retention (gpuguard.fleet.ship, gpuguard.fleet.shipbatch) and for the
reports (gpuguard.cli.status, gpuguard.metrics.node): the store's SQL stays in the store. Mixins of
gpuguard.store.sqlite.Store, on its one connection."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any, Optional

from gpuguard.util.sqltx import rollback_if_active


class ShippingQueries:
    """The outbox the shipper reads, its watermarks, the healthy-day aggregates, and retention."""

    conn: sqlite3.Connection
    get_cursor: Any  # Store.get_cursor

    # A run that passed with nothing to report (runs aliased `r`): the central database keeps these as per-day
    # counts (gpuguard.fleet.ship). The same rule in Python: fleet.shipbatch.is_healthy.
    HEALTHY_RUN = ("r.verdict = 'pass' AND r.reason IS NULL AND r.error IS NULL AND NOT EXISTS (SELECT 1 FROM "
                   "findings hf WHERE hf.run_id = r.id AND hf.severity NOT IN ('ok','skip'))")

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
            rollback_if_active(c)
            raise
        return {"runs": len(run_ids), "drains": len(drain_ids)}

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


class StatusQueries:
    """What `gpuguard status` and the node metrics ask about a node's latest run and drains."""

    conn: sqlite3.Connection

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
            "SELECT id, ts, check_id, reason, run_id FROM drains WHERE node=? AND op='drain' AND outcome='done' "
            "AND id<=? "
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
