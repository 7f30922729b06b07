"""The central history's tables (PostgreSQL schema `gpuguard`, version 2): their DDL and the names other modules
share (partition keys, hour columns, the drain "marks"). How they are created and upgraded: gpuguard.fleet.schema."""

from __future__ import annotations

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
