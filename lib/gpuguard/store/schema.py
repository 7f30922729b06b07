"""The node store's SQLite schema and its upgrades. A fresh file gets SCHEMA; an older one the MIGRATIONS it
has not seen, in order; `PRAGMA user_version` says which version a file is at."""

from __future__ import annotations

import sqlite3

from gpuguard.util.sqltx import rollback_if_active

SCHEMA_VERSION = 4

# NCCL validation's results (gpuguard.nccl.history): sweeps, their runs, busbw samples for baselines. Before version
# 4 `gpuguard nccl` created them itself, outside the version (hence IF NOT EXISTS: a store may have them already).
NCCL_TABLES = """
CREATE TABLE IF NOT EXISTS nccl_sweeps (
    id INTEGER PRIMARY KEY,
    started REAL NOT NULL,
    finished REAL,
    partition TEXT,
    nodes TEXT NOT NULL,          -- compressed hostlist of the nodes swept
    method TEXT,
    profile TEXT,
    threshold_gbps REAL,          -- the all-node run's threshold
    conclusion TEXT,              -- pass | isolated | fabric | inconclusive | error
    slow_nodes TEXT,              -- JSON list
    report TEXT                   -- JSON: measurements + verdicts
);
CREATE TABLE IF NOT EXISTS nccl_runs (
    id INTEGER PRIMARY KEY,
    sweep_id INTEGER,
    ts REAL NOT NULL,
    stage TEXT,                   -- all | pair | bisect | cross | confirm | baseline
    nodes TEXT NOT NULL,
    n_nodes INTEGER NOT NULL,
    job_id TEXT,
    job_state TEXT,
    busbw_gbps REAL,              -- bus bandwidth of the largest message
    size_bytes INTEGER,
    peak_busbw_gbps REAL,
    avg_busbw_gbps REAL,
    threshold_gbps REAL,
    verdict TEXT,                 -- ok | slow | error
    error TEXT,
    output TEXT
);
CREATE INDEX IF NOT EXISTS nccl_runs_sweep ON nccl_runs(sweep_id);
CREATE TABLE IF NOT EXISTS nccl_samples (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    profile TEXT NOT NULL,
    n_nodes INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    busbw_gbps REAL NOT NULL,
    nodes TEXT,
    source TEXT,                  -- sweep | measure | file
    job_id TEXT
);
CREATE INDEX IF NOT EXISTS nccl_samples_key ON nccl_samples(profile, n_nodes, size_bytes);
"""

# Upgrades of an existing file, in order: version reached -> statements. A fresh file gets SCHEMA directly.
MIGRATIONS: list[tuple[int, list[str]]] = [
    (2, ["ALTER TABLE runs ADD COLUMN restart_count INTEGER"]),
    # history filtered in SQL over a big store (time ranges without a node, problem findings only), retention
    (3, ["CREATE INDEX IF NOT EXISTS runs_time ON runs(started)",
         "CREATE INDEX IF NOT EXISTS drains_time ON drains(ts)",
         "CREATE INDEX IF NOT EXISTS findings_problems ON findings(run_id) WHERE severity NOT IN ('ok','skip')"]),
    (4, [stmt for stmt in NCCL_TABLES.split(";") if stmt.strip()]),
]

SCHEMA = """
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
""" + NCCL_TABLES


def upgrade_schema(conn: sqlite3.Connection) -> None:
    """Create the tables of a new file, or migrate an older one, to SCHEMA_VERSION (WAL mode on)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version < SCHEMA_VERSION:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("BEGIN IMMEDIATE")  # a prolog and a health check may open a new file at once
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            fresh = conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name='runs'").fetchone()[0] == 0
            if fresh:
                for stmt in SCHEMA.split(";"):
                    if stmt.strip():
                        conn.execute(stmt)
            else:
                for target, statements in MIGRATIONS:
                    if version < target:
                        for stmt in statements:
                            conn.execute(stmt)
            conn.execute("PRAGMA user_version=%d" % SCHEMA_VERSION)
            conn.execute("COMMIT")
        except BaseException:
            rollback_if_active(conn)
            raise
