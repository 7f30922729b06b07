"""The central history schema (PostgreSQL schema `gpuguard`), its version and its upgrades.

Version 2 holds at fleet scale (docs/fleet.md, "Schema"):
- `runs`: runs with something to report, in full. A run that repeats the previous run of its node and kind the
  same UTC day (same verdict, reason and problem findings: a drained node's health check every 5 minutes) is
  counted on that first run (`repeats`, `last_started`) instead of being stored again;
- `findings`: the problem findings of those runs, with their run's kind, job and verdict (no join to list them);
- `drains`: drain and undrain records; an `already drained` record repeating the node's drain the same day is
  counted on it the same way;
- `run_days`: healthy runs (verdict pass, nothing to report) as counts per node and UTC day, with a count per
  hour and per kind, so storage grows with nodes x days, not with how often the health check runs;
- `nodes`: one row per node that ever shipped (the report's list of nodes).
The tables' DDL is in gpuguard.fleet.tables. The four history tables are partitioned by month
(gpuguard.fleet.partitions), so retention drops whole months.
Every row keeps the `origin` store it came from and its id there: shipping is idempotent.

A fresh database gets version 2 from whoever connects first with the right to create it. An existing version-1
database is upgraded only by `gpuguard fleet init-db` (it copies every row: minutes on a big database), never by a
node's ship: until then ships are refused with a message saying so, and the rows wait in the nodes' stores.
"""

from __future__ import annotations

from typing import Any

from gpuguard.fleet.partitions import ensure_partitions
from gpuguard.fleet.pg import FleetDBError, clean_error, connect
from gpuguard.fleet.tables import LATEST, LOCK_KEY, TABLES_V2
from gpuguard.fleet.upgrade_v1 import upgrade_1_to_2
from gpuguard.fleet.url import redact_url


def schema_version(conn: Any) -> int:
    row = conn.execute("SELECT to_regclass('gpuguard.schema_version') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    row = conn.execute("SELECT max(version) FROM gpuguard.schema_version").fetchone()
    return int(row[0] or 0)


def _set_version(conn: Any, version: int) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS gpuguard.schema_version (version integer NOT NULL)")
    conn.execute("DELETE FROM gpuguard.schema_version")
    conn.execute("INSERT INTO gpuguard.schema_version (version) VALUES (%s)", (version,))


def ensure_schema(conn: Any, upgrade: bool = False, now: float | None = None) -> tuple[int, int]:
    """Create the schema (a fresh database) or, with `upgrade` (`fleet init-db`), upgrade an older one, under an
    advisory lock; returns (version before, version now). Cheap when up to date (one query, plus the monthly
    partitions ahead once a month). A database newer than this gpuguard is left alone (its columns are a
    superset). Raises FleetDBError when an upgrade is due and `upgrade` is False."""
    before = schema_version(conn)
    conn.commit()
    if before >= LATEST:
        ensure_partitions(conn, now=now, quiet=True)
        return before, before
    if before and not upgrade:
        raise FleetDBError(f"the central database has gpuguard schema version {before}; this gpuguard needs "
                           f"{LATEST}: run `gpuguard fleet init-db` as the database owner to upgrade it (the rows "
                           "wait in the nodes' stores until then)")
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        current = schema_version(conn)  # someone else may have done it while we waited for the lock
        if current == 0:
            conn.execute("CREATE SCHEMA IF NOT EXISTS gpuguard")
            for stmt in TABLES_V2:
                conn.execute(stmt)
        elif current == 1:
            upgrade_1_to_2(conn)
        if current < LATEST:
            _set_version(conn, LATEST)
    ensure_partitions(conn, now=now, quiet=False)
    return before, max(before, LATEST)


def open_fleet_db(url: str, timeout_s: float = 5.0, migrate: bool = True, **kw: Any) -> Any:
    """connect() + ensure_schema() (creating a fresh schema, never upgrading an old one); raises FleetDBError (with
    a hint when the role may not create the schema)."""
    conn = connect(url, timeout_s, **kw)
    if not migrate:
        return conn
    try:
        ensure_schema(conn)
    except FleetDBError as e:
        conn.close()
        raise FleetDBError(f"{redact_url(url)}: {e}") from None
    except Exception as e:  # noqa: BLE001 - psycopg errors: permissions, timeouts
        conn.close()
        hint = ""
        if "permission denied" in str(e).lower():
            hint = " (the role cannot create the schema: run `gpuguard fleet init-db` as the database owner once)"
        raise FleetDBError(f"{redact_url(url)}: creating the gpuguard schema: {clean_error(e, url)}{hint}") from None
    return conn
