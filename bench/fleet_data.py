"""A generated fleet in the central history database (schema version 2), written by PostgreSQL itself
(generate_series): `make bench` times every `fleet history` / `fleet report` form on 10,000 nodes x 30 days, and
tests/integration/test_fleet_pg.py checks the query plans on 1,000 nodes.

Rows are written in time order, as shipping writes them (a day's rows lie together on disk). What a node does,
every day of the window (deterministic: setseed):
- 288 health checks (every 5 minutes), 6 prologs and 6 epilogs, all healthy unless below: one run_days row per
  node and day, as the shipper writes them (a count per hour and per kind);
- a failure with probability 1/60 per node-day (an MTBF of 60 days: ~5,000 drains a month on 10,000 nodes, ~1.7 %
  of the fleet drained at any time): the health check that drains it (a drain record `done` and a run with verdict
  drain and its findings), then a health check every 5 minutes while drained, each finding the same fault (one run
  per UTC day with `repeats`, and the `already drained` records counted on one drain record per day, as the
  shipper collapses them), then an undrain 2 to 48 hours later (unless that is after now). Faults: XID79/48/94/95,
  ECC, ROWREMAP, GPUCOUNT, NVLINK, PCIE, THERMAL, EFA, DISK with their checks, a GPU index 0-7;
- 2 % of nodes a day have one warning (a warm GPU, a slow PCIe link), and 0.5 % of nodes warn on and off every
  hour of the day (a run with verdict warn and its finding each time, never collapsed: a pass lies between);
- one node in 200 flaps: pinned FLAPPING by the undrain policy once in the window.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

from gpuguard.fleet.tables import HOUR_COLUMNS

FAULTS = [  # keyword, check id, weight
    ("XID79", "gpu.xid", 15), ("XID48", "gpu.xid", 10), ("XID94", "gpu.xid", 10), ("XID95", "gpu.xid", 5),
    ("ECC", "gpu.ecc", 10), ("ROWREMAP", "gpu.row_remap", 10), ("GPUCOUNT", "gpu.count", 10),
    ("NVLINK", "gpu.nvlink", 10), ("PCIE", "gpu.pcie", 5), ("THERMAL", "gpu.temperature", 5), ("EFA", "net.efa", 5),
    ("DISK", "sys.disk", 5)]
WARNS = [("THERMAL", "gpu.temperature"), ("CLOCKS", "gpu.clocks"), ("PCIE", "gpu.pcie")]


def _fault_table() -> str:
    rows, lo = [], 0
    for kw, check, w in FAULTS:
        rows.append(f"({lo}, {lo + w}, '{kw}', '{check}')")
        lo += w
    return f"(VALUES {', '.join(rows)}) AS fault(lo, hi, kw, check_id)", lo


def _warn_table() -> str:
    values = ", ".join(f"({i}, '{kw}', '{c}')" for i, (kw, c) in enumerate(WARNS))
    return f"(VALUES {values}) AS w(i, kw, check_id)"


def window_end(now: float) -> float:
    """The generated window ends at the start of today (UTC): whole days, nothing in the future."""
    return datetime.fromtimestamp(now, timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


def statements(nodes: int, days: int, end_ts: float) -> list[tuple[str, str]]:
    """(what, SQL) in order: `days` whole UTC days ending at `end_ts` (window_end())."""
    end = datetime.fromtimestamp(end_ts, timezone.utc)
    first_day = (end - timedelta(days=days)).date()
    faults, total = _fault_table()
    v = SimpleNamespace(
        nodes=nodes, days=days, first_day=first_day, faults=faults, total=total,
        node="'gpu-' || lpad(n::text, 5, '0')", origin="md5('origin-' || n)::uuid",
        day_ts=f"('{first_day.isoformat()}'::date + d)::timestamp AT TIME ZONE 'UTC'",
        hours=", ".join(f"12 + CASE WHEN {h} % 4 = n % 4 THEN 2 ELSE 0 END" for h in range(24)),  # + prolog, epilog
        now_sql=f"'{end.isoformat()}'::timestamptz",
        reason="'gpuguard: ' || kw || ' ' || check_id || ': generated fault on GPU ' || gpu || ' [healthcheck reboot]'")
    return _fleet_rows(v) + _episode_rows(v) + _warning_rows(v)


def _fleet_rows(v: SimpleNamespace) -> list[tuple[str, str]]:
    """The nodes, their stores, and every node-day's healthy runs."""
    return [
        ("seed", "SELECT setseed(0.4242)"),
        ("nodes", f"INSERT INTO gpuguard.nodes SELECT {v.node}, {v.now_sql} - interval '400 days', {v.now_sql} "
                  f"FROM generate_series(1, {v.nodes}) n"),
        ("origins", f"INSERT INTO gpuguard.origins (origin, host, store_path) SELECT {v.origin}, {v.node}, "
                    f"'/var/lib/gpuguard/state.db' FROM generate_series(1, {v.nodes}) n"),
        ("healthy run_days", f"""
            INSERT INTO gpuguard.run_days (day, origin, node, runs, {", ".join(HOUR_COLUMNS)}, kinds, first_started,
                                           last_started, duration_ms_sum, duration_ms_max, upto_local_id)
            SELECT ('{v.first_day.isoformat()}'::date + d), {v.origin}, {v.node}, 300, {v.hours},
              '{{"healthcheck": 288, "prolog": 6, "epilog": 6}}'::jsonb,
              {v.day_ts} + make_interval(secs => 60 + n % 240), {v.day_ts} + interval '23 hours 55 minutes',
              300 * 140.0, 400.0, (d + 1) * 300
            FROM generate_series(1, {v.nodes}) n, generate_series(0, {v.days - 1}) d
            ORDER BY d, n"""),
    ]


def _episode_rows(v: SimpleNamespace) -> list[tuple[str, str]]:
    """Failures: the drain, a run and an `already drained` record a day while drained, the undrain."""
    return [
        ("episodes", f"""
            CREATE TEMP TABLE ep AS
            SELECT row_number() OVER () AS e, n, {v.node} AS node, {v.origin} AS origin, t0,
                   t0 + make_interval(hours => 2 + (random() * 46)::int) AS t1, fault.kw, fault.check_id,
                   (random() * 7)::int AS gpu
            FROM (SELECT n, {v.day_ts} + make_interval(secs => (random() * 86399)::int) AS t0,
                         (random() * {v.total})::int AS pick, random() AS p
                  FROM generate_series(1, {v.nodes}) n, generate_series(0, {v.days - 1}) d) x
            JOIN {v.faults} ON x.pick >= fault.lo AND x.pick < fault.hi
            WHERE x.p < 1.0 / 60 AND x.t0 < {v.now_sql}"""),
        ("episode days", f"""
            CREATE TEMP TABLE epd AS
            SELECT e.*, k, GREATEST(e.t0, date_trunc('day', e.t0 AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                                   + make_interval(days => k)) AS s,
                   LEAST(e.t1, {v.now_sql}, date_trunc('day', e.t0 AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                         + make_interval(days => k + 1)) AS f
            FROM ep e, generate_series(0, 2) k
            WHERE date_trunc('day', e.t0 AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + make_interval(days => k)
                  < LEAST(e.t1, {v.now_sql})"""),
        ("drained runs", f"""
            INSERT INTO gpuguard.runs (origin, local_id, node, started, duration_ms, kind, job_id, verdict, action,
                                       reason, exit_code, boot_id, repeats, last_started, upto_local_id)
            SELECT origin, e * 10 + k, node, s, 900.0, 'healthcheck', NULL, 'drain', 'reboot',
                   {v.reason},
                   0, 'b' || n, GREATEST(0, floor(extract(epoch FROM f - s) / 300)::int - 1),
                   f - interval '5 minutes', e * 10 + k
            FROM epd ORDER BY s"""),
        ("drained findings", """
            INSERT INTO gpuguard.findings (origin, run_local_id, seq, node, started, kind, job_id, run_verdict,
                   check_id, severity, keyword, gpu, action, message, remediation, evidence, repeats, last_started)
            SELECT r.origin, r.local_id, s.seq, r.node, r.started, r.kind, NULL, r.verdict,
                   CASE s.seq WHEN 0 THEN ep.check_id ELSE 'gpu.temperature' END,
                   CASE s.seq WHEN 0 THEN 'fail' ELSE 'warn' END, CASE s.seq WHEN 0 THEN ep.kw ELSE 'THERMAL' END,
                   ep.gpu, 'reboot', 'generated finding', 'see the runbook', jsonb_build_object('gpu', ep.gpu),
                   r.repeats, r.last_started
            FROM gpuguard.runs r JOIN ep ON r.local_id / 10 = ep.e AND r.origin = ep.origin,
                 generate_series(0, 1) s(seq)
            WHERE s.seq = 0 OR ep.e % 3 = 0 ORDER BY r.started"""),
        ("drains", f"""
            INSERT INTO gpuguard.drains (origin, local_id, node, ts, op, outcome, reason, check_id, keyword, action,
                                         run_local_id, detail, repeats, last_ts, upto_local_id)
            SELECT origin, e * 10 + k, node, s, 'drain', CASE k WHEN 0 THEN 'done' ELSE 'already' END,
                   {v.reason},
                   check_id, kw, 'reboot', e * 10 + k, '', GREATEST(0, floor(extract(epoch FROM f - s) / 300)::int - 1),
                   f - interval '5 minutes', e * 10 + k
            FROM epd
            UNION ALL
            SELECT origin, e * 10 + 9, node, t1, 'undrain', 'done',
                   {v.reason},
                   check_id, kw, 'reboot', NULL, 'passed again', 0, NULL, e * 10 + 9
            FROM ep WHERE t1 < {v.now_sql}
            UNION ALL
            SELECT origin, e * 10 + 8, node, t0 + interval '1 hour', 'drain', 'flapping',
                   'gpuguard: FLAPPING ' || check_id || ': drained again after 2 undrains [healthcheck replace]',
                   check_id, 'FLAPPING', 'replace', NULL, '', 0, NULL, e * 10 + 8
            FROM ep WHERE n % 200 = 0 AND t0 + interval '1 hour' < {v.now_sql}
            ORDER BY 4"""),
    ]


def _warning_rows(v: SimpleNamespace) -> list[tuple[str, str]]:
    """Warnings on 2 % of node-days, and 0.5 % of nodes warning every hour."""
    return [
        ("warn runs", f"""
            CREATE TEMP TABLE warns AS
            SELECT {v.origin} AS origin, 1000000000 + row_number() OVER () AS id, {v.node} AS node,
                   {v.day_ts} + make_interval(hours => h, mins => 5 * (n % 12)) AS t, (n + d + h) % 3 AS i
            FROM generate_series(1, {v.nodes}) n, generate_series(0, {v.days - 1}) d, generate_series(0, 23) h
            WHERE ((n * 31 + d * 7) % 50 = 0 AND h = n % 24) OR (n % 200 = 7)"""),
        ("warn run rows", f"""
            INSERT INTO gpuguard.runs (origin, local_id, node, started, duration_ms, kind, verdict, action, exit_code,
                                       boot_id, upto_local_id)
            SELECT origin, id, node, t, 150.0, 'healthcheck', 'warn', 'none', 0, 'b', id FROM warns
            WHERE t < {v.now_sql} ORDER BY t"""),
        ("warn findings", f"""
            INSERT INTO gpuguard.findings (origin, run_local_id, seq, node, started, kind, run_verdict, check_id,
                   severity, keyword, gpu, action, message, remediation, evidence)
            SELECT warns.origin, warns.id, 0, warns.node, warns.t, 'healthcheck', 'warn', w.check_id, 'warn', w.kw,
                   (warns.id % 8)::int, 'none', 'generated warning', 'watch it', '{{}}'::jsonb
            FROM warns JOIN {_warn_table()} ON w.i = warns.i WHERE warns.t < {v.now_sql} ORDER BY warns.t"""),
    ]


def generate(conn: Any, nodes: int, days: int, now: float | None = None, log: Any = None) -> tuple[float, dict]:
    """Fill an empty version-2 database: `days` whole days up to the start of today. Returns (the window's end,
    which queries should take as "now"; seconds per step)."""
    from gpuguard.fleet.partitions import add_months, create_month_partitions, month_of

    now = window_end(time.time() if now is None else now)
    first = month_of(now - (days + 1) * 86400)
    months, m = [], first
    while m <= month_of(now):
        months.append(m)
        m = add_months(m, 1)
    with conn.transaction():
        create_month_partitions(conn, months)
    took: dict[str, float] = {}
    for what, sql in statements(nodes, days, now):
        t0 = time.monotonic()
        with conn.transaction():
            conn.execute(sql)
        took[what] = time.monotonic() - t0
        if log:
            log(f"    {what}: {took[what]:.1f} s")
    t0 = time.monotonic()
    conn.autocommit = True  # what autovacuum does soon after a load: visibility map, statistics
    try:
        conn.execute("VACUUM (ANALYZE) gpuguard.runs, gpuguard.findings, gpuguard.drains, gpuguard.run_days, "
                     "gpuguard.nodes")
    finally:
        conn.autocommit = False
    took["vacuum"] = time.monotonic() - t0
    return now, took


def sizes(conn: Any) -> dict[str, Any]:
    """Rows and bytes (tables + indexes) per history table."""
    out: dict[str, Any] = {}
    for table in ("runs", "findings", "drains", "run_days"):
        stands_for = "runs" if table == "run_days" else "1 + repeats"
        rows = conn.execute(f"SELECT COUNT(*), COALESCE(SUM({stands_for}), 0) FROM gpuguard.{table}").fetchone()
        size = conn.execute("SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_inherits i "
                            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass",
                            (f"gpuguard.{table}",)).fetchone()[0]
        out[table] = {"rows": int(rows[0]), "stands_for": int(rows[1]), "bytes": int(size)}
    conn.rollback()
    return out
