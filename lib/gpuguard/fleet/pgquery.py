"""History filters -> SQL over the central PostgreSQL schema (version 2, gpuguard.fleet.schema). Pure.

Every statement bounds its partition key by the window (`started`, `ts`, `day`), so PostgreSQL reads only the
months the window covers, and walks an index that leads with the filtered column (keyword, check, node, verdict,
GPU) or with time; `tests/integration/test_fleet_pg.py` checks the plans with EXPLAIN and `make bench` times every
form on a generated 10,000-node fleet. Runs and drains that repeat are one row with `repeats` more: counts add
them. Healthy runs are counted from `run_days`, by the hour: an hour that overlaps the window counts whole.
"""

from __future__ import annotations

import math
from datetime import date, datetime, timedelta, timezone
from typing import Optional

from gpuguard.store.filters import Filters, Query, SqlBuilder, equal_any, finding_conds, keyword_match
from gpuguard.fleet.tables import HOUR_COLUMNS

RUN_COLS = ("r.local_id AS id, r.origin::text AS origin, r.node, r.started, r.duration_ms, r.kind, r.job_id, "
            "r.restart_count, r.profile, r.verdict, r.action, r.reason, r.exit_code, r.error, r.boot_id, "
            "r.repeats, r.last_started AS last")
FINDING_FIELDS = "f.check_id, f.severity, f.keyword, f.gpu, f.action, f.message, f.remediation, f.evidence"
FINDING_COLS = ("f.run_local_id AS run_id, f.origin::text AS origin, f.node, f.started, f.kind, f.job_id, "
                "f.run_verdict, " + FINDING_FIELDS + ", f.repeats, f.last_started AS last")
DRAIN_COLS = ("d.local_id AS id, d.origin::text AS origin, d.ts, d.node, d.op, d.outcome, d.reason, d.check_id, "
              "d.action, d.run_local_id AS run_id, d.detail, d.repeats, d.last_ts AS last")
RUN_BEFORE_DRAIN_S = 86400.0  # a drain record's run started at most this long before it (the --gpu filter)


def runs_query(f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Runs with something to report, newest first (a check/keyword/GPU filter: those with such a finding).
    count=True: how many runs they stand for (repeats included, healthy runs not: healthy_runs_query)."""
    b = SqlBuilder("pg")
    where = b.time_range("r.started", f.since, f.until) + equal_any(b, [("r.node", f.nodes), ("r.verdict", f.verdicts)])
    conds = finding_conds(b, f)
    if conds:
        window = " AND ".join(b.time_range("f.started", f.since, f.until))
        where.append("(r.origin, r.local_id, r.started) IN (SELECT f.origin, f.run_local_id, f.started FROM "
                     f"gpuguard.findings f WHERE {window} AND " + " AND ".join(conds) + ")")
    body = "FROM gpuguard.runs r WHERE " + " AND ".join(where)
    if count:
        return Query(f"SELECT COALESCE(SUM(1 + r.repeats), 0) {body}", b.params)
    return Query(f"SELECT {RUN_COLS} {body} ORDER BY r.started DESC, r.local_id DESC{b.limit(limit)}", b.params)


def _day(ts: float) -> date:
    return datetime.fromtimestamp(ts, timezone.utc).date()


def _hours(lo: int, hi: int) -> str:
    """The healthy runs of hours lo..hi-1 of a run_days row: a sum of its hour columns."""
    return " + ".join(f"d.{HOUR_COLUMNS[h]}" for h in range(lo, hi)) or "0"


def healthy_runs_query(f: Filters, now: float) -> Optional[Query]:
    """How many healthy runs fall in the window's hours (run_days: whole days from `runs`, the two edge days from
    their per-hour counts). None when the filters exclude healthy runs."""
    if f.problem_filtered or (f.verdicts and "pass" not in f.verdicts):
        return None
    until = f.until if f.until is not None else now
    first, last = _day(f.since), _day(until)
    first_hour = int((f.since - datetime(first.year, first.month, first.day, tzinfo=timezone.utc).timestamp())
                     // 3600)
    last_hours = min(24, math.ceil((until - datetime(last.year, last.month, last.day,
                                                     tzinfo=timezone.utc).timestamp()) / 3600))
    b = SqlBuilder("pg")
    d0, d1 = b.add("d", first) + "::date", b.add("d", last) + "::date"
    where = [f"d.day >= {d0}", f"d.day <= {d1}"]
    if f.nodes:
        where.append(b.in_list("d.node", f.nodes, "n"))
    if first == last:
        per_row = _hours(first_hour, last_hours)
    else:
        per_row = (f"CASE WHEN d.day = {d0} THEN {_hours(first_hour, 24)} WHEN d.day = {d1} THEN "
                   f"{_hours(0, last_hours)} ELSE d.runs END")
    sql = f"SELECT COALESCE(SUM({per_row}), 0) FROM gpuguard.run_days d WHERE " + " AND ".join(where)
    return Query(sql, b.params)


def findings_query(f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Problem findings with their run's time, node, kind, job and verdict (kept on the finding), newest first."""
    b = SqlBuilder("pg")
    where = b.time_range("f.started", f.since, f.until) + equal_any(b, [("f.node", f.nodes),
                                                                        ("f.run_verdict", f.verdicts)])
    where += finding_conds(b, f)
    body = "FROM gpuguard.findings f WHERE " + " AND ".join(where)
    if count:
        return Query(f"SELECT COALESCE(SUM(1 + f.repeats), 0) {body}", b.params)
    return Query(f"SELECT {FINDING_COLS} {body} ORDER BY f.started DESC, f.run_local_id DESC, f.seq{b.limit(limit)}",
                 b.params)


def drains_query(f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Drain and undrain records, newest first (not filtered by verdict: a drain record is its own outcome)."""
    b = SqlBuilder("pg")
    where = b.time_range("d.ts", f.since, f.until) + equal_any(b, [("d.node", f.nodes), ("d.check_id", f.checks)])
    if f.keywords:
        where.append(keyword_match(b, "d.keyword", f.keywords))
    if f.gpus:
        window = " AND ".join(b.time_range("f.started", f.since - RUN_BEFORE_DRAIN_S, f.until))
        where.append(f"(d.origin, d.run_local_id) IN (SELECT f.origin, f.run_local_id FROM gpuguard.findings f "
                     f"WHERE {window} AND " + b.in_list("f.gpu", f.gpus, "g") + ")")
    body = "FROM gpuguard.drains d WHERE " + " AND ".join(where)
    if count:
        return Query(f"SELECT COALESCE(SUM(1 + d.repeats), 0) {body}", b.params)
    return Query(f"SELECT {DRAIN_COLS} {body} ORDER BY d.ts DESC, d.local_id DESC{b.limit(limit)}", b.params)


def run_findings_query(runs: list[tuple[str, int, datetime]]) -> Query:
    """The findings of a page of listed runs: (origin, local id, started) each, so only their months are read."""
    b = SqlBuilder("pg")
    lo = min(r[2] for r in runs) - timedelta(seconds=1)
    hi = max(r[2] for r in runs) + timedelta(seconds=1)
    keys = ", ".join(f"({b.add('o', o)}::uuid, {b.add('r', i)}::bigint)" for o, i, _ in runs)
    return Query(f"SELECT f.origin::text AS origin, f.run_local_id AS run_key, {FINDING_FIELDS} "
                 f"FROM gpuguard.findings f WHERE f.started >= {b.add('lo', lo)} AND f.started <= {b.add('hi', hi)} "
                 f"AND (f.origin, f.run_local_id) IN ({keys}) ORDER BY f.origin, f.run_local_id, f.seq", b.params)
