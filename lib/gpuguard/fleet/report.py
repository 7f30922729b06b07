"""Fleet reports: drains per check per week, MTBF per node, flapping nodes, time drained per node.

The aggregations are SQL over two relations:
- `ev`: drain records (node, t epoch seconds, seq, op, outcome, check_id, keyword, week) up to the window's end
  (earlier ones too: a node drained before the window is drained at its start);
- `seen`: per node, its first run in the window.
On PostgreSQL both are CTEs that read only what the window needs (`pg_ctes`). Over SQLite stores (the embedded
default, the demo) the few drain rows and one first-seen row per node are copied from each store into an in-memory
database (rows streamed, runs aggregated in each store), so the same SQL answers across per-node files.

Definitions (also in docs/fleet.md):
- a *failure* is a drain gpuguard applied (op=drain, outcome=done) in the window;
- a node is *drained* from a drain until the next undrain (done by gpuguard or an admin, or `gone`: someone else
  lifted it); open episodes run to the window's end;
- *MTBF* = (time observed in the window - time drained) / failures; observed from the node's first record in the
  window (or the window's start if it was drained then) to the window's end;
- *flapping*: pinned as FLAPPING by the undrain policy, or at least `--flap-min` (3) failures in the window.
"""

from __future__ import annotations

import re
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from gpuguard.fleet.components import NODE_WEEKLY, component_lines, per_component
from gpuguard.fleet.pgquery import keyword_match
from gpuguard.store.filters import Filters, SqlBuilder, duration_text
from gpuguard.fleet.tables import DRAIN_MARK
from gpuguard.store.history_sqlite import open_store_ro
from gpuguard.util.timefmt import iso_utc

WEEKLY = """
SELECT week, COALESCE(check_id, '-') AS check_id, COUNT(*) AS drains, COUNT(DISTINCT node) AS nodes
FROM ev WHERE op = 'drain' AND outcome = 'done' AND t >= :since AND t < :until
GROUP BY week, COALESCE(check_id, '-') ORDER BY week, drains DESC, check_id
"""

NODE_CTES = """
marks AS (
  SELECT node, t, op,
    COALESCE(SUM(CASE WHEN op = 'undrain' THEN 1 ELSE 0 END) OVER (PARTITION BY node ORDER BY t, seq
             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS grp
  FROM ev
  WHERE (op = 'drain' AND outcome IN ('done', 'already', 'flapping')) OR (op = 'undrain' AND outcome IN ('done', 'gone'))
), episodes AS (
  SELECT node, grp, MIN(CASE WHEN op = 'drain' THEN t END) AS start_t, MAX(CASE WHEN op = 'undrain' THEN t END) AS end_t
  FROM marks GROUP BY node, grp
), clipped AS (
  SELECT node, CASE WHEN start_t > :since THEN start_t ELSE :since END AS s,
         CASE WHEN end_t IS NULL OR end_t > :until THEN :until ELSE end_t END AS e,
         CASE WHEN end_t IS NULL THEN 1 ELSE 0 END AS still
  FROM episodes WHERE start_t IS NOT NULL
), drained AS (
  SELECT node, SUM(CASE WHEN e > s THEN e - s ELSE 0 END) AS drained_s, MAX(still) AS drained_now
  FROM clipped WHERE e > s GROUP BY node
), win AS (
  SELECT node,
    SUM(CASE WHEN op = 'drain' AND outcome = 'done' THEN 1 ELSE 0 END) AS failures,
    SUM(CASE WHEN op = 'undrain' AND outcome = 'done' THEN 1 ELSE 0 END) AS undrains,
    SUM(CASE WHEN op = 'drain' AND (outcome = 'flapping' OR keyword = 'FLAPPING') THEN 1 ELSE 0 END) AS pins,
    MIN(t) AS first_t
  FROM ev WHERE t >= :since AND t < :until GROUP BY node
), starts AS (
  SELECT node, first_t AS s FROM seen
  UNION ALL SELECT node, first_t FROM win
  UNION ALL SELECT node, s FROM clipped WHERE e > s
), observed AS (
  SELECT node, MIN(s) AS start_t FROM starts GROUP BY node
)
"""

NODES = """
SELECT o.node, COALESCE(w.failures, 0) AS failures, COALESCE(w.undrains, 0) AS undrains, COALESCE(w.pins, 0) AS pins,
  COALESCE(d.drained_s, 0) AS drained_s, COALESCE(d.drained_now, 0) AS drained_now, :until - o.start_t AS observed_s,
  CASE WHEN COALESCE(w.failures, 0) > 0 THEN (:until - o.start_t - COALESCE(d.drained_s, 0)) / w.failures END AS mtbf_s,
  CASE WHEN COALESCE(w.pins, 0) > 0 OR COALESCE(w.failures, 0) >= :flap_min THEN 1 ELSE 0 END AS flapping
FROM observed o LEFT JOIN win w ON w.node = o.node LEFT JOIN drained d ON d.node = o.node
ORDER BY failures DESC, drained_s DESC, o.node
"""

NODE_CHECKS = """
SELECT node, COALESCE(check_id, '-') AS check_id, COUNT(*) AS drains
FROM ev WHERE op = 'drain' AND outcome IN ('done', 'flapping') AND t >= :since AND t < :until
GROUP BY node, COALESCE(check_id, '-') ORDER BY node, drains DESC, check_id
"""


@dataclass
class FleetReport:
    since: float
    until: float
    source: str
    filters: dict[str, Any]
    flap_min: int
    weekly: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    node_weekly: list[dict[str, Any]] = field(default_factory=list)  # drains per node per week (for components)
    components: list[dict[str, Any]] = field(default_factory=list)  # drains per switch/component per week
    has_components: bool = False  # a topology or site file was there to group by

    def group_by(self, components: list[Any]) -> None:
        """Drains per shared component per week (gpuguard.fleet.components); nothing without components."""
        self.has_components = bool(components)
        self.components = per_component(self.node_weekly, components)

    @property
    def flapping(self) -> list[dict[str, Any]]:
        return [n for n in self.nodes if n["flapping"]]

    def as_dict(self) -> dict[str, Any]:
        return {"since": iso_utc(self.since), "until": iso_utc(self.until), "source": self.source,
                "filters": self.filters, "flap_min": self.flap_min, "drains_per_check_per_week": self.weekly,
                "nodes": self.nodes, "flapping": self.flapping,
                **({"drains_per_component_per_week": self.components} if self.has_components else {})}


def _pg_params(sql: str) -> str:
    """:name -> %(name)s for psycopg (the shared report SQL has no casts and no literal %)."""
    return re.sub(r"(?<![:\w]):([a-z_]+)\b", r"%(\1)s", sql)


def _drain_filters(b: SqlBuilder, f: Filters, keyword_expr: str) -> list[str]:
    where = []
    if f.nodes:
        where.append(b.in_list("d.node", f.nodes, "n"))
    if f.checks:
        where.append(b.in_list("d.check_id", f.checks, "c"))
    if f.keywords:
        where.append(keyword_match(b, keyword_expr, f.keywords))
    return where


def _rows(cur: Any) -> list[dict[str, Any]]:
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def _finish(rep: FleetReport, weekly: list[dict[str, Any]], nodes: list[dict[str, Any]],
            checks: list[dict[str, Any]]) -> FleetReport:
    by_node: dict[str, list[str]] = {}
    for c in checks:
        by_node.setdefault(c["node"], []).append(f"{c['check_id']}:{c['drains']}")
    rep.weekly = [{"week": w["week"], "check": w["check_id"], "drains": int(w["drains"]), "nodes": int(w["nodes"])}
                  for w in weekly]
    for n in nodes:
        observed = float(n["observed_s"] or 0)
        drained = float(n["drained_s"] or 0)
        rep.nodes.append({
            "node": n["node"], "failures": int(n["failures"]), "undrains": int(n["undrains"]),
            "flapping_pins": int(n["pins"]), "drained_s": round(drained, 1),
            "drained_pct": round(100 * drained / observed, 2) if observed > 0 else 0.0,
            "drained_now": bool(n["drained_now"]), "observed_s": round(observed, 1),
            "mtbf_s": None if n["mtbf_s"] is None else round(float(n["mtbf_s"]), 1),
            "flapping": bool(n["flapping"]), "checks": by_node.get(n["node"], [])})
    return rep


_EV_COLS = ("d.node, EXTRACT(EPOCH FROM d.ts)::float8 AS t, d.local_id AS seq, d.op, d.outcome, d.check_id, "
            "d.keyword, to_char(date_trunc('week', d.ts AT TIME ZONE 'UTC'), 'YYYY-MM-DD') AS week")


def pg_ctes(f: Filters, until: float, episodes: bool) -> tuple[str, dict[str, Any]]:
    """`ev` (and `seen`) over the central database, reading only what the window needs. Without `episodes` (the
    weekly and per-check counts): the window's drain records. With: also each node's latest episode mark before
    the window (a node drained then is drained at its start; one index probe per node) and `seen`, each node's
    first run in the window: the window's first day from `run_days` and `runs`, and index probes only for the few
    nodes without a healthy run that day."""
    b = SqlBuilder("pg")
    since_t, until_t = b.add("t", b.t(f.since)), b.add("t", b.t(until))
    extra = "".join(f" AND {c}" for c in _drain_filters(b, f, "d.keyword"))
    window = f"SELECT {_EV_COLS} FROM gpuguard.drains d WHERE d.ts >= {since_t} AND d.ts < {until_t}{extra}"
    if not episodes:
        return f"ev AS ({window})", b.params
    node_in = (lambda col: f" AND {b.in_list(col, f.nodes, 'n')}") if f.nodes else (lambda col: "")
    nodes = f"(SELECT node FROM gpuguard.nodes WHERE TRUE{node_in('node')}) n"
    ev = (f"ev AS ({window} UNION ALL SELECT p.* FROM {nodes} CROSS JOIN LATERAL (SELECT {_EV_COLS} "
          f"FROM gpuguard.drains d WHERE d.node = n.node AND d.ts < {since_t} AND {DRAIN_MARK}{extra} "
          "ORDER BY d.ts DESC, d.local_id DESC LIMIT 1) p)")
    first_day, last_day = b.add("d", b.t(f.since).date()) + "::date", b.add("d", b.t(until).date()) + "::date"
    day_end = b.add("t", b.t(min(until, (f.since // 86400 + 1) * 86400)))  # the end of the window's first UTC day
    in_window = f"h.last_started >= {since_t} AND h.first_started < {until_t}"
    on_first_day = (f"SELECT h.node, MIN(GREATEST(h.first_started, {since_t})) AS first FROM gpuguard.run_days h "
                    f"WHERE h.day = {first_day} AND {in_window}{node_in('h.node')} GROUP BY h.node")
    problems_first_day = (f"SELECT r.node, MIN(r.started) FROM gpuguard.runs r WHERE r.started >= {since_t} "
                          f"AND r.started < {day_end}{node_in('r.node')} GROUP BY r.node")
    later_healthy = (f"(SELECT GREATEST(h.first_started, {since_t}) FROM gpuguard.run_days h WHERE h.node = n.node "
                     f"AND h.day > {first_day} AND h.day <= {last_day} AND {in_window} "
                     "ORDER BY h.day, h.first_started LIMIT 1)")
    later_problem = (f"(SELECT r.started FROM gpuguard.runs r WHERE r.node = n.node AND r.started >= {since_t} "
                     f"AND r.started < {until_t} ORDER BY r.started LIMIT 1)")
    later = (f"SELECT n.node, LEAST({later_healthy}, {later_problem}) FROM {nodes} WHERE NOT EXISTS (SELECT 1 FROM "
             f"gpuguard.run_days h WHERE h.node = n.node AND h.day = {first_day} AND {in_window})")
    seen = (f"seen AS (SELECT node, EXTRACT(EPOCH FROM MIN(first))::float8 AS first_t FROM ({on_first_day} "
            f"UNION ALL {problems_first_day} UNION ALL {later}) s GROUP BY node HAVING MIN(first) IS NOT NULL)")
    return f"{ev}, {seen}", b.params


def report_statements(f: Filters, until: float, flap_min: int) -> list[tuple[str, dict[str, Any]]]:
    """The report's three statements over the central database (weekly, per node, checks per node)."""
    out = []
    for sql, episodes in ((WEEKLY, False), (f"{NODE_CTES} {NODES}", True), (NODE_CHECKS, False),
                          (NODE_WEEKLY, False)):
        base, params = pg_ctes(f, until, episodes)
        params = {**params, "since": float(f.since), "until": float(until), "flap_min": int(flap_min)}
        joiner = ", " if sql.lstrip().startswith("marks AS") else " "
        out.append((f"WITH {base}{joiner}{_pg_params(sql)}", params))
    return out


def report_pg(conn: Any, f: Filters, label: str, flap_min: int = 3, now: Optional[float] = None) -> FleetReport:
    until = f.until if f.until is not None else (time.time() if now is None else now)
    rep = FleetReport(f.since, until, label, f.describe(), flap_min)
    with conn.cursor() as cur:
        weekly, nodes, checks, rep.node_weekly = (_rows(cur.execute(sql, params)) for sql, params in
                                                  report_statements(f, until, flap_min))
    conn.rollback()  # read-only: end the transaction
    return _finish(rep, weekly, nodes, checks)


def report_sqlite(paths: list[str], f: Filters, flap_min: int = 3, now: Optional[float] = None) -> FleetReport:
    """The same report over SQLite store files (per-node or one)."""
    until = f.until if f.until is not None else (time.time() if now is None else now)
    mem = sqlite3.connect(":memory:")
    mem.execute("CREATE TABLE ev (node TEXT, t REAL, seq INTEGER, op TEXT, outcome TEXT, check_id TEXT, "
                "keyword TEXT, week TEXT)")
    mem.execute("CREATE TABLE seen_raw (node TEXT, first_t REAL)")
    used = []
    for path in paths:
        conn = open_store_ro(path)
        if conn is None:
            continue
        used.append(path)
        try:
            b = SqlBuilder("sqlite")
            where = [f"d.ts < {b.add('t', until)}"] + _drain_filters(b, f, "upper(gg_keyword(d.reason))")
            cur = conn.execute(
                "SELECT d.node, d.ts, d.id, d.op, d.outcome, d.check_id, upper(gg_keyword(d.reason)), "
                "date(d.ts, 'unixepoch', 'weekday 0', '-6 days') FROM drains d WHERE " + " AND ".join(where),
                b.params)
            mem.executemany("INSERT INTO ev VALUES (?,?,?,?,?,?,?,?)", cur)
            b = SqlBuilder("sqlite")
            where = b.time_range("r.started", f.since, until) + ([b.in_list("r.node", f.nodes, "n")] if f.nodes else [])
            cur = conn.execute(f"SELECT r.node, MIN(r.started) FROM runs r WHERE {' AND '.join(where)} "
                               "GROUP BY r.node", b.params)
            mem.executemany("INSERT INTO seen_raw VALUES (?,?)", cur)
        finally:
            conn.close()
    seen = "seen AS (SELECT node, MIN(first_t) AS first_t FROM seen_raw GROUP BY node)"
    params = {"since": float(f.since), "until": float(until), "flap_min": int(flap_min)}
    label = f"SQLite: {len(used)} store file(s)"
    rep = FleetReport(f.since, until, label, f.describe(), flap_min)
    weekly = _rows(mem.execute(f"WITH {seen} {WEEKLY}", params))
    nodes = _rows(mem.execute(f"WITH {seen}, {NODE_CTES} {NODES}", params))
    checks = _rows(mem.execute(f"WITH {seen} {NODE_CHECKS}", params))
    rep.node_weekly = _rows(mem.execute(f"WITH {seen} {NODE_WEEKLY}", params))
    mem.close()
    return _finish(rep, weekly, nodes, checks)


# --------------------------------------------------------------------------- text


def format_report(rep: FleetReport, max_nodes: int = 50) -> str:
    out = [f"fleet report {iso_utc(rep.since)} .. {iso_utc(rep.until)} ({rep.source})"]
    extra = {k: v for k, v in rep.filters.items() if k not in ("since", "until")}
    if extra:
        out.append("filters: " + " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                                          for k, v in extra.items()))
    out.append("")
    out.append("drains per check per week (weeks start Monday, UTC):")
    if rep.weekly:
        out.append(f"  {'week':<11} {'check':<20} {'drains':>6} {'nodes':>6}")
        for w in rep.weekly:
            out.append(f"  {w['week']:<11} {w['check']:<20} {w['drains']:>6} {w['nodes']:>6}")
    else:
        out.append("  none")
    out.append("")
    failing = [n for n in rep.nodes if n["failures"] or n["drained_s"]]
    out.append("MTBF and time drained per node:")
    if failing:
        out.append(f"  {'node':<14} {'failures':>8} {'drained':>9} {'of time':>8} {'now':>4} {'MTBF':>8}  checks")
        for n in failing[:max_nodes]:
            out.append(f"  {n['node']:<14} {n['failures']:>8} {duration_text(n['drained_s']):>9} "
                       f"{n['drained_pct']:>7.1f}% {'yes' if n['drained_now'] else 'no':>4} "
                       f"{duration_text(n['mtbf_s']):>8}  {' '.join(n['checks'])}")
        if len(failing) > max_nodes:
            out.append(f"  ... {len(failing) - max_nodes} more (--json for all)")
    healthy = len(rep.nodes) - len(failing)
    out.append(f"  {healthy} node(s) without a failure" if failing else f"  no failures on {healthy} node(s)")
    out.append("")
    out.append(f"flapping nodes (pinned FLAPPING, or >= {rep.flap_min} failures):")
    flapping = rep.flapping
    if not flapping:
        out.append("  none")
    for n in flapping:
        out.append(f"  {n['node']:<14} failures={n['failures']} undrains={n['undrains']} pinned={n['flapping_pins']} "
                   f"checks={' '.join(n['checks']) or '-'}")
    if rep.has_components:
        out += component_lines(rep.components)
    return "\n".join(out) + "\n"
