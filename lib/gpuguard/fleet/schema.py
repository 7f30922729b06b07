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
The four history tables are partitioned by month (gpuguard.fleet.partitions), so retention drops whole months.
Every row keeps the `origin` store it came from and its id there: shipping is idempotent.

A fresh database gets version 2 from whoever connects first with the right to create it. An existing version-1
database is upgraded only by `gpuguard fleet init-db` (it copies every row: minutes on a big database), never by a
node's ship: until then ships are refused with a message saying so, and the rows wait in the nodes' stores.
"""

from __future__ import annotations

from typing import Any

from gpuguard.fleet.pg import FleetDBError, clean_error, connect
from gpuguard.fleet.url import redact_url

SCHEMA = "gpuguard"
LATEST = 2
LOCK_KEY = 0x67707567756172  # pg_advisory_xact_lock key for schema changes ("gpuguar")
HISTORY_TABLES = {"runs": "started", "findings": "started", "drains": "ts", "run_days": "day"}  # -> partition key
C = 'COLLATE "C"'  # node names, check ids and keywords compare byte-wise, as in SQLite (and LIKE 'XID%' uses the index)

# Healthy runs per hour of the day: one column each (h00..h23), so a window's edge hours are a sum of columns.
HOUR_COLUMNS = [f"h{h:02d}" for h in range(24)]
HOUR_COLUMNS_DDL = ",\n        ".join(f"{c} integer NOT NULL DEFAULT 0" for c in HOUR_COLUMNS)

# A drain record that moves a node's drain episode (the report's "marks").
DRAIN_MARK = ("((op = 'drain' AND outcome IN ('done', 'already', 'flapping')) OR "
              "(op = 'undrain' AND outcome IN ('done', 'gone')))")

TABLES_V2 = [
    """CREATE TABLE IF NOT EXISTS gpuguard.origins (
        origin uuid PRIMARY KEY,
        host text,
        store_path text,
        first_ship timestamptz NOT NULL DEFAULT now(),
        last_ship timestamptz NOT NULL DEFAULT now())""",
    f"""CREATE TABLE gpuguard.nodes (
        node text {C} PRIMARY KEY,
        first_seen timestamptz NOT NULL,
        last_seen timestamptz NOT NULL)""",
    f"""CREATE TABLE gpuguard.runs (
        origin uuid NOT NULL,
        local_id bigint NOT NULL,
        node text {C} NOT NULL,
        started timestamptz NOT NULL,
        duration_ms double precision,
        kind text {C} NOT NULL,
        job_id text,
        restart_count integer,
        profile text,
        verdict text {C} NOT NULL,
        action text,
        reason text,
        exit_code integer,
        error text,
        boot_id text,
        repeats integer NOT NULL DEFAULT 0,
        last_started timestamptz,
        upto_local_id bigint NOT NULL,
        shipped timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (origin, local_id, started)) PARTITION BY RANGE (started)""",
    "CREATE INDEX runs_started ON gpuguard.runs (started)",
    "CREATE INDEX runs_node_started ON gpuguard.runs (node, started)",
    "CREATE INDEX runs_verdict_started ON gpuguard.runs (verdict, started)",
    f"""CREATE TABLE gpuguard.findings (
        origin uuid NOT NULL,
        run_local_id bigint NOT NULL,
        seq integer NOT NULL,
        node text {C} NOT NULL,
        started timestamptz NOT NULL,
        kind text {C},
        job_id text,
        run_verdict text {C},
        check_id text {C} NOT NULL,
        severity text {C} NOT NULL,
        keyword text {C},
        gpu integer,
        action text,
        message text,
        remediation text,
        evidence jsonb,
        repeats integer NOT NULL DEFAULT 0,
        last_started timestamptz,
        PRIMARY KEY (origin, run_local_id, seq, started)) PARTITION BY RANGE (started)""",
    "CREATE INDEX findings_started ON gpuguard.findings (started)",
    "CREATE INDEX findings_keyword_started ON gpuguard.findings (keyword, started)",
    "CREATE INDEX findings_check_started ON gpuguard.findings (check_id, started)",
    "CREATE INDEX findings_node_started ON gpuguard.findings (node, started)",
    "CREATE INDEX findings_gpu_started ON gpuguard.findings (gpu, started)",
    f"""CREATE TABLE gpuguard.drains (
        origin uuid NOT NULL,
        local_id bigint NOT NULL,
        node text {C} NOT NULL,
        ts timestamptz NOT NULL,
        op text {C} NOT NULL,
        outcome text {C} NOT NULL,
        reason text,
        check_id text {C},
        keyword text {C},
        action text,
        run_local_id bigint,
        detail text,
        repeats integer NOT NULL DEFAULT 0,
        last_ts timestamptz,
        upto_local_id bigint NOT NULL,
        PRIMARY KEY (origin, local_id, ts)) PARTITION BY RANGE (ts)""",
    "CREATE INDEX drains_ts ON gpuguard.drains (ts)",
    "CREATE INDEX drains_node_ts ON gpuguard.drains (node, ts)",
    "CREATE INDEX drains_keyword_ts ON gpuguard.drains (keyword, ts)",
    "CREATE INDEX drains_check_ts ON gpuguard.drains (check_id, ts)",
    f"CREATE INDEX drains_marks ON gpuguard.drains (node, ts, local_id) WHERE {DRAIN_MARK}",
    f"""CREATE TABLE gpuguard.run_days (
        day date NOT NULL,
        origin uuid NOT NULL,
        node text {C} NOT NULL,
        runs integer NOT NULL,
        {HOUR_COLUMNS_DDL},
        kinds jsonb NOT NULL,
        first_started timestamptz NOT NULL,
        last_started timestamptz NOT NULL,
        duration_ms_sum double precision,
        duration_ms_max double precision,
        upto_local_id bigint NOT NULL,
        PRIMARY KEY (day, origin, node)) PARTITION BY RANGE (day)""",
    "CREATE INDEX run_days_node_day ON gpuguard.run_days (node, day)",
    "CREATE TABLE gpuguard.runs_default PARTITION OF gpuguard.runs DEFAULT",
    "CREATE TABLE gpuguard.findings_default PARTITION OF gpuguard.findings DEFAULT",
    "CREATE TABLE gpuguard.drains_default PARTITION OF gpuguard.drains DEFAULT",
    "CREATE TABLE gpuguard.run_days_default PARTITION OF gpuguard.run_days DEFAULT",
]

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
    from gpuguard.fleet.partitions import ensure_partitions

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
            from gpuguard.fleet.upgrade_v1 import upgrade_1_to_2

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
