"""Monthly partitions of the central history tables, and retention by dropping whole months.

Each of runs, findings, drains and run_days has one partition per UTC month (`gpuguard.runs_p2026_11`) and a
DEFAULT partition that catches a row whose month does not exist yet (a node's clock far off, or nobody created
the month), so a ship never fails for want of a partition. Months are created ahead: by `fleet init-db`,
`fleet prune`, and by the first ship of a role allowed to create tables that finds next month missing. Creating
a month moves its rows out of the DEFAULT partition first, so nothing is lost.

Retention (`store.fleet_retention_days`) is `gpuguard fleet prune`: months that ended before the cutoff are
dropped (instant, no dead rows to vacuum), older rows in the DEFAULT partitions are deleted in bounded batches.
"""

from __future__ import annotations

import re
import time
from datetime import date, datetime, timezone
from typing import Any, Iterable, Optional

from gpuguard.fleet.tables import HISTORY_TABLES, LOCK_KEY

AHEAD = 2  # months created ahead of the current one
PRUNE_BATCH = 50000  # rows deleted from a DEFAULT partition per `fleet prune`
_NAME = re.compile(r"^(runs|findings|drains|run_days)_p(\d{4})_(\d{2})$")


def month_of(ts: float) -> date:
    d = datetime.fromtimestamp(ts, timezone.utc)
    return date(d.year, d.month, 1)


def add_months(m: date, n: int) -> date:
    y, mo = divmod(m.year * 12 + m.month - 1 + n, 12)
    return date(y, mo + 1, 1)


def partition_name(table: str, month: date) -> str:
    return f"{table}_p{month.year:04d}_{month.month:02d}"


def _bound(table: str, month: date) -> str:
    return f"'{month.isoformat()}'" if HISTORY_TABLES[table] == "day" else f"'{month.isoformat()} 00:00:00+00'"


def existing_months(conn: Any) -> dict[str, set[date]]:
    """table -> the months that have a partition."""
    out: dict[str, set[date]] = {t: set() for t in HISTORY_TABLES}
    rows = conn.execute("SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                        "JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace "
                        "WHERE n.nspname = 'gpuguard'").fetchall()
    for (name,) in rows:
        m = _NAME.match(name)
        if m:
            out[m.group(1)].add(date(int(m.group(2)), int(m.group(3)), 1))
    return out


def _create_one(conn: Any, table: str, month: date) -> None:
    """A month's partition: created detached, the DEFAULT partition's rows of that month moved in, attached
    (ATTACH builds the partitioned indexes on it)."""
    key, name = HISTORY_TABLES[table], partition_name(table, month)
    lo, hi = _bound(table, month), _bound(table, add_months(month, 1))
    conn.execute(f"CREATE TABLE gpuguard.{name} (LIKE gpuguard.{table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
    conn.execute(f"WITH moved AS (DELETE FROM gpuguard.{table}_default WHERE {key} >= {lo} AND {key} < {hi} "
                 f"RETURNING *) INSERT INTO gpuguard.{name} SELECT * FROM moved")
    conn.execute(f"ALTER TABLE gpuguard.{table} ATTACH PARTITION gpuguard.{name} FOR VALUES FROM ({lo}) TO ({hi})")


def create_month_partitions(conn: Any, months: Iterable[date]) -> list[str]:
    """Create the missing partitions of these months (inside the caller's transaction); returns their names."""
    have = existing_months(conn)
    made = []
    for month in sorted(set(months)):
        for table in HISTORY_TABLES:
            if month not in have[table]:
                _create_one(conn, table, month)
                made.append(partition_name(table, month))
    return made


def ensure_partitions(conn: Any, now: Optional[float] = None, quiet: bool = False) -> list[str]:
    """This month and AHEAD more exist. Cheap when they do (one catalog query). `quiet`: a role that may not
    create tables (a least-privilege shipper) or a concurrent creator is not an error: rows go to the DEFAULT
    partition meanwhile."""
    current = month_of(time.time() if now is None else now)
    wanted = [add_months(current, i) for i in range(AHEAD + 1)]
    have = existing_months(conn)
    owner = conn.execute("SELECT pg_has_role((SELECT relowner FROM pg_class WHERE oid = 'gpuguard.runs'::regclass), "
                         "'MEMBER')").fetchone()[0]
    conn.commit()
    if all(m in have[t] for t in HISTORY_TABLES for m in wanted):
        return []
    if quiet and not owner:  # a least-privilege shipper: the owner's `fleet prune` creates them
        return []
    try:
        with conn.transaction():
            if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (LOCK_KEY,)).fetchone()[0]:
                return []  # someone else is changing the schema right now
            return create_month_partitions(conn, wanted)
    except Exception:  # noqa: BLE001 - psycopg errors: no CREATE privilege, lock timeout
        if not quiet:
            raise
        return []


def months_of_v1(conn: Any) -> list[date]:
    """The months the rows of a version-1 database (moved to schema gpuguard_v1) fall in, and the next AHEAD."""
    row = conn.execute("SELECT LEAST((SELECT MIN(started) FROM gpuguard_v1.runs), (SELECT MIN(ts) FROM "
                       "gpuguard_v1.drains)), GREATEST((SELECT MAX(started) FROM gpuguard_v1.runs), "
                       "(SELECT MAX(ts) FROM gpuguard_v1.drains))").fetchone()
    first = month_of(row[0].timestamp()) if row and row[0] else month_of(time.time())
    last = add_months(month_of(max(row[1].timestamp() if row and row[1] else 0, time.time())), AHEAD)
    out = []
    while first <= last:
        out.append(first)
        first = add_months(first, 1)
    return out


def prune(conn: Any, keep_days: float, now: Optional[float] = None, batch: int = PRUNE_BATCH) -> dict[str, Any]:
    """Retention: drop every month that ended more than `keep_days` ago, delete at most `batch` older rows per
    DEFAULT partition, forget nodes and stores not heard of since; then create the months ahead."""
    now = time.time() if now is None else now
    cutoff = now - keep_days * 86400
    cutoff_dt = datetime.fromtimestamp(cutoff, timezone.utc)
    dropped: list[str] = []
    deleted: dict[str, int] = {}
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        for table, months in existing_months(conn).items():
            for month in sorted(months):
                end = add_months(month, 1)
                if datetime(end.year, end.month, 1, tzinfo=timezone.utc) <= cutoff_dt:
                    conn.execute(f"DROP TABLE gpuguard.{partition_name(table, month)}")
                    dropped.append(partition_name(table, month))
        for table, key in HISTORY_TABLES.items():
            value: Any = cutoff_dt.date() if key == "day" else cutoff_dt
            cur = conn.execute(f"DELETE FROM gpuguard.{table}_default WHERE ctid IN (SELECT ctid FROM "
                               f"gpuguard.{table}_default WHERE {key} < %s LIMIT %s)", (value, batch))
            deleted[table] = cur.rowcount
        deleted["nodes"] = conn.execute("DELETE FROM gpuguard.nodes WHERE last_seen < %s", (cutoff_dt,)).rowcount
        deleted["origins"] = conn.execute("DELETE FROM gpuguard.origins WHERE last_ship < %s", (cutoff_dt,)).rowcount
    created = ensure_partitions(conn, now=now)
    return {"cutoff": cutoff, "dropped": dropped, "deleted": deleted, "created": created}
