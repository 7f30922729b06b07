"""The node store's SQLite schema and its upgrades. A fresh file gets SCHEMA; an older one the MIGRATIONS it
has not seen, in order; `PRAGMA user_version` says which version a file is at."""

from __future__ import annotations

import re
import sqlite3

from gpuguard.util.sqltx import rollback_if_active

SCHEMA_VERSION = 5

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
    source TEXT,                  -- sweep | measure | file | preflight
    job_id TEXT
);
CREATE INDEX IF NOT EXISTS nccl_samples_key ON nccl_samples(profile, n_nodes, size_bytes);
"""

# Version 5: the collective each sample was measured with (nccl-tests | nccl | gloo: torch.distributed's): a busbw
# from nccl-tests and one from torch's gloo are not comparable, and a floor is judged only against its own kind.
# The sweep's, `baseline measure`'s and recorded files' samples were always nccl-tests; a pre-flight's before this
# version is unknown (NULL: it gives no floor to any backend).
SAMPLES_BACKEND = ["ALTER TABLE nccl_samples ADD COLUMN backend TEXT",
                   "UPDATE nccl_samples SET backend='nccl-tests' WHERE source IN ('sweep','measure','file')"]

# Upgrades of an existing file, in order: version reached -> statements. A fresh file gets SCHEMA directly.
MIGRATIONS: list[tuple[int, list[str]]] = [
    (2, ["ALTER TABLE runs ADD COLUMN restart_count INTEGER"]),
    # history filtered in SQL over a big store (time ranges without a node, problem findings only), retention
    (3, ["CREATE INDEX IF NOT EXISTS runs_time ON runs(started)",
         "CREATE INDEX IF NOT EXISTS drains_time ON drains(ts)",
         "CREATE INDEX IF NOT EXISTS findings_problems ON findings(run_id) WHERE severity NOT IN ('ok','skip')"]),
    (4, [stmt for stmt in NCCL_TABLES.split(";") if stmt.strip()]),
    (5, SAMPLES_BACKEND),
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
""" + NCCL_TABLES + ";\n".join(SAMPLES_BACKEND)


_ADD_COLUMN = re.compile(r"^\s*ALTER TABLE (\w+) ADD COLUMN (\w+)", re.I)


def _has_column_already(conn: sqlite3.Connection, stmt: str) -> bool:
    """An `ALTER TABLE t ADD COLUMN c` whose column is there already (tables created outside the version, as the
    NCCL ones were before version 4, may have it): nothing to add."""
    m = _ADD_COLUMN.match(stmt)
    if m is None:
        return False
    return any(row[1] == m.group(2) for row in conn.execute(f"PRAGMA table_info({m.group(1)})"))


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
                            if not _has_column_already(conn, stmt):
                                conn.execute(stmt)
            conn.execute("PRAGMA user_version=%d" % SCHEMA_VERSION)
            conn.execute("COMMIT")
        except BaseException:
            rollback_if_active(conn)
            raise
