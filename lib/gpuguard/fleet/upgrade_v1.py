"""Schema version 1 (one row per run, no partitions) -> 2, run by `gpuguard fleet init-db` in one transaction.

The old tables move to schema `gpuguard_v1`; the new ones and the months the old rows need are created; every
row is copied into the shape a version-2 ship would have produced from the same stores: healthy runs become
per-node, per-day counts, and a problem run (or an `already drained` record) that repeats the previous one of its
node and kind the same UTC day becomes a repeat count on the first (gpuguard.fleet.shipbatch, written here as
window functions over the old rows); the old schema is dropped. tests/integration/test_fleet_pg.py checks the
result row for row against a version-2 ship of the same stores.
"""

from __future__ import annotations

from typing import Any

from gpuguard.fleet.partitions import create_month_partitions, months_of_v1
from gpuguard.fleet.tables import HOUR_COLUMNS, TABLES_V2

HEALTHY = ("r.verdict = 'pass' AND r.reason IS NULL AND r.error IS NULL AND NOT EXISTS (SELECT 1 FROM "
           "gpuguard_v1.findings f WHERE f.origin = r.origin AND f.run_local_id = r.local_id)")
_KIND_HOURS = ", ".join(f"COUNT(*) FILTER (WHERE hr = {h}) AS {c}" for h, c in enumerate(HOUR_COLUMNS))
_SUM_HOURS = ", ".join(f"SUM({c})" for c in HOUR_COLUMNS)
_DAY = "(({t}) AT TIME ZONE 'UTC')::date"

MOVE = ["CREATE SCHEMA gpuguard_v1",
        *[f"ALTER TABLE gpuguard.{t} SET SCHEMA gpuguard_v1" for t in ("runs", "findings", "drains")]]

# Each problem run's streak: a new one starts at a healthy run, at a run whose verdict/reason/findings differ from
# the previous run of its node and kind, and at a new UTC day. v1_heads: the first run of each, its repeats.
RUN_STREAKS = f"""
CREATE TEMP TABLE v1_heads ON COMMIT DROP AS
SELECT origin, node, kind, grp, MIN(local_id) AS head, COUNT(*) - 1 AS repeats, MAX(started) AS last,
       MAX(local_id) AS upto
FROM (SELECT s.*, SUM(brk) OVER (PARTITION BY origin, node, kind ORDER BY local_id) AS grp FROM (
        SELECT x.*, CASE WHEN x.healthy OR lag(x.healthy) OVER w IS DISTINCT FROM false
                          OR lag(x.sig) OVER w IS DISTINCT FROM x.sig OR lag(x.day) OVER w IS DISTINCT FROM x.day
                         THEN 1 ELSE 0 END AS brk
        FROM (SELECT r.origin, r.local_id, r.node, r.kind, r.started, {_DAY.format(t="r.started")} AS day,
                     (r.verdict = 'pass' AND r.reason IS NULL AND r.error IS NULL AND f.sig IS NULL) AS healthy,
                     md5(concat_ws('|', r.verdict, r.action, r.reason, r.error, f.sig)) AS sig
              FROM gpuguard_v1.runs r LEFT JOIN (
                SELECT origin, run_local_id,
                       string_agg(concat_ws(',', check_id, severity, keyword, gpu), ';' ORDER BY seq) AS sig
                FROM gpuguard_v1.findings GROUP BY origin, run_local_id) f
              ON f.origin = r.origin AND f.run_local_id = r.local_id) x
        WINDOW w AS (PARTITION BY x.origin, x.node, x.kind ORDER BY x.local_id)) s) g
WHERE NOT healthy
GROUP BY origin, node, kind, grp"""

# An `already drained` record repeats when the node's previous record in the same store is a drain mark with the
# same check and keyword the same day (never a FLAPPING pin).
DRAIN_STREAKS = f"""
CREATE TEMP TABLE v1_drain_heads ON COMMIT DROP AS
SELECT origin, node, grp, MIN(local_id) AS head, COUNT(*) - 1 AS repeats, MAX(ts) AS last, MAX(local_id) AS upto
FROM (SELECT s.*, SUM(brk) OVER (PARTITION BY origin, node ORDER BY local_id) AS grp FROM (
        SELECT d.origin, d.node, d.local_id, d.ts,
               CASE WHEN d.op = 'drain' AND d.outcome = 'already' AND upper(d.keyword) IS DISTINCT FROM 'FLAPPING'
                         AND lag(d.op) OVER w = 'drain' AND lag(d.outcome) OVER w IN ('done', 'already', 'flapping')
                         AND lag(d.check_id) OVER w IS NOT DISTINCT FROM d.check_id
                         AND lag(upper(d.keyword)) OVER w IS NOT DISTINCT FROM upper(d.keyword)
                         AND lag({_DAY.format(t="d.ts")}) OVER w = {_DAY.format(t="d.ts")}
                    THEN 0 ELSE 1 END AS brk
        FROM gpuguard_v1.drains d WINDOW w AS (PARTITION BY d.origin, d.node ORDER BY d.local_id)) s) g
GROUP BY origin, node, grp"""

COPY = [
    """INSERT INTO gpuguard.nodes (node, first_seen, last_seen)
        SELECT node, MIN(started), MAX(started) FROM gpuguard_v1.runs GROUP BY node""",
    """INSERT INTO gpuguard.nodes (node, first_seen, last_seen)
        SELECT node, MIN(ts), MAX(ts) FROM gpuguard_v1.drains GROUP BY node ON CONFLICT (node) DO NOTHING""",
    f"""INSERT INTO gpuguard.run_days (day, origin, node, runs, {", ".join(HOUR_COLUMNS)}, kinds, first_started,
          last_started, duration_ms_sum, duration_ms_max, upto_local_id)
        SELECT day, origin, node, SUM(n), {_SUM_HOURS}, jsonb_object_agg(kind, n), MIN(f), MAX(l), SUM(s), MAX(m),
          MAX(u) FROM (
          SELECT day, origin, node, kind, COUNT(*) AS n, {_KIND_HOURS}, MIN(started) AS f, MAX(started) AS l,
                 SUM(duration_ms) AS s, MAX(duration_ms) AS m, MAX(local_id) AS u FROM (
            SELECT {_DAY.format(t="r.started")} AS day, EXTRACT(HOUR FROM r.started AT TIME ZONE 'UTC')::int AS hr,
                   r.* FROM gpuguard_v1.runs r WHERE {HEALTHY}) healthy
          GROUP BY day, origin, node, kind) per_kind
        GROUP BY day, origin, node""",
    RUN_STREAKS,
    """INSERT INTO gpuguard.runs (origin, local_id, node, started, duration_ms, kind, job_id, restart_count, profile,
          verdict, action, reason, exit_code, error, boot_id, repeats, last_started, upto_local_id, shipped)
        SELECT r.origin, r.local_id, r.node, r.started, r.duration_ms, r.kind, r.job_id, r.restart_count, r.profile,
          r.verdict, r.action, r.reason, r.exit_code, r.error, r.boot_id, h.repeats,
          CASE WHEN h.repeats > 0 THEN h.last END, h.upto, r.shipped
        FROM v1_heads h JOIN gpuguard_v1.runs r ON r.origin = h.origin AND r.local_id = h.head""",
    """INSERT INTO gpuguard.findings (origin, run_local_id, seq, node, started, kind, job_id, run_verdict, check_id,
          severity, keyword, gpu, action, message, remediation, evidence, repeats, last_started)
        SELECT f.origin, f.run_local_id, f.seq, f.node, f.started, r.kind, r.job_id, r.verdict, f.check_id,
          f.severity, upper(f.keyword), f.gpu, f.action, f.message, f.remediation, f.evidence, h.repeats,
          CASE WHEN h.repeats > 0 THEN h.last END
        FROM v1_heads h JOIN gpuguard_v1.runs r ON r.origin = h.origin AND r.local_id = h.head
        JOIN gpuguard_v1.findings f ON f.origin = h.origin AND f.run_local_id = h.head""",
    DRAIN_STREAKS,
    """INSERT INTO gpuguard.drains (origin, local_id, node, ts, op, outcome, reason, check_id, keyword, action,
          run_local_id, detail, repeats, last_ts, upto_local_id)
        SELECT d.origin, d.local_id, d.node, d.ts, d.op, d.outcome, d.reason, d.check_id, upper(d.keyword), d.action,
          d.run_local_id, d.detail, h.repeats, CASE WHEN h.repeats > 0 THEN h.last END, h.upto
        FROM v1_drain_heads h JOIN gpuguard_v1.drains d ON d.origin = h.origin AND d.local_id = h.head""",
    "DROP SCHEMA gpuguard_v1 CASCADE",
]

def upgrade_1_to_2(conn: Any) -> None:
    """Inside the caller's transaction (ensure_schema holds the schema lock)."""
    for stmt in MOVE + TABLES_V2[1:]:
        conn.execute(stmt)
    create_month_partitions(conn, months_of_v1(conn))
    for stmt in COPY:
        conn.execute(stmt)
