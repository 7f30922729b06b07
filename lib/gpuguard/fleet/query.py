"""History filters and the SQL they become, for the node's SQLite store and for the central PostgreSQL database.

Everything is filtered, ordered and limited in SQL, per kind of record: runs, problem findings (severity other
than ok/skip) and drains each get their own LIMIT, so a week of healthy health checks can never push a drain or
an Xid finding out of view. Rows come back through cursors and are consumed as generators: memory does not grow
with the store.

Time values are epoch seconds in SQLite and `timestamptz` in PostgreSQL; `Dialect` hides that, the table names and
the run key (SQLite: `runs.id`; PostgreSQL: `(origin, local_id)`, see gpuguard.fleet.pg). Pure: no connection is
made here.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

from gpuguard.timefmt import iso_utc  # noqa: F401 - also imported from here by history and report

PROBLEM = "f.severity NOT IN ('ok','skip')"  # the same text as the store's partial index findings_problems
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# --------------------------------------------------------------------------- times


def parse_time(text: str, now: Optional[float] = None, flag: str = "--since") -> float:
    """'30m' / '24h' / '7d' / '2w' (that long ago) or an ISO 8601 date/time ('2026-03-02', '2026-03-02T10:00',
    '2026-11-24T20:06:33Z', with an offset or not: no offset means UTC, like every time gpuguard prints) ->
    epoch seconds. Raises ValueError naming the flag."""
    now = time.time() if now is None else now
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    iso = (text or "").strip()
    if iso[-1:] in ("Z", "z"):  # Python < 3.11 fromisoformat does not take the Z gpuguard prints
        iso = iso[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError(f"{flag}: expected a duration like 30m, 24h, 7d or an ISO 8601 time like "
                         f"2026-11-24T20:06:33Z, got {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def epoch(value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
    return float(value)


def duration_text(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 90:
        return f"{s:.0f}s"
    if s < 90 * 60:
        return f"{s / 60:.0f}m"
    if s < 48 * 3600:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


# --------------------------------------------------------------------------- filters


@dataclass(frozen=True)
class Filters:
    """What `gpuguard history` / `gpuguard fleet history|report` select. Empty tuples mean "any"."""

    since: float
    until: Optional[float] = None
    nodes: tuple[str, ...] = ()  # expanded from a Slurm hostlist
    checks: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()  # upper case; "XID" also matches XID79, XID48, ...
    verdicts: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    node_text: str = ""  # the hostlist as given, for messages

    @property
    def problem_filtered(self) -> bool:
        """Filters that only findings (and drains) can satisfy."""
        return bool(self.checks or self.keywords or self.gpus)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"since": iso_utc(self.since), "until": iso_utc(self.until)}
        if self.nodes:
            out["node"] = self.node_text or ",".join(self.nodes)
        for key in ("checks", "keywords", "verdicts", "gpus"):
            if getattr(self, key):
                out[key[:-1]] = list(getattr(self, key))
        return out


VERDICTS = ("pass", "warn", "drain", "error")


def _split(values: Optional[list[str]]) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [p.strip() for p in str(v).split(",") if p.strip()]
    return out


def build_filters(*, since: str, until: Optional[str] = None, node: Optional[str] = None,
                  check: Optional[list[str]] = None, keyword: Optional[list[str]] = None,
                  verdict: Optional[list[str]] = None, gpu: Optional[list[str]] = None,
                  now: Optional[float] = None) -> Filters:
    """Command-line values -> Filters. Raises ValueError with a message naming the bad flag."""
    import hostlist

    now = time.time() if now is None else now
    t0 = parse_time(since, now, "--since")
    t1 = parse_time(until, now, "--until") if until else None
    if t1 is not None and t1 <= t0:
        raise ValueError(f"--until ({iso_utc(t1)}) is not after --since ({iso_utc(t0)})")
    nodes: tuple[str, ...] = ()
    if node:
        try:
            nodes = tuple(dict.fromkeys(hostlist.expand_hostlist(node)))
        except hostlist.BadHostlist as e:
            raise ValueError(f"--node: not a Slurm hostlist ({e}): {node!r}") from None
        if len(nodes) > 20000:
            raise ValueError(f"--node: {node!r} names {len(nodes)} nodes; at most 20000")
    checks = _split(check)
    for c in checks:
        if not re.fullmatch(r"[a-z0-9_.]+", c):
            raise ValueError(f"--check: not a check id like gpu.xid: {c!r}")
    keywords = [k.upper() for k in _split(keyword)]
    for k in keywords:
        if not re.fullmatch(r"[A-Z]+\d*", k):
            raise ValueError(f"--keyword: not a drain keyword like XID79 or ECC: {k!r}")
    verdicts = [v.lower() for v in _split(verdict)]
    for v in verdicts:
        if v not in VERDICTS:
            raise ValueError(f"--verdict: expected one of {', '.join(VERDICTS)}, got {v!r}")
    gpus: list[int] = []
    for g in _split(gpu):
        if not g.isdigit() or int(g) > 4096:
            raise ValueError(f"--gpu: expected a GPU index like 3, got {g!r}")
        gpus.append(int(g))
    return Filters(since=t0, until=t1, nodes=nodes, checks=tuple(checks), keywords=tuple(keywords),
                   verdicts=tuple(verdicts), gpus=tuple(gpus), node_text=node or "")


def keyword_of_reason(reason: Optional[str]) -> Optional[str]:
    """The KEYWORD of a drain reason gpuguard wrote (either grammar), else None. Registered as the SQL function
    gg_keyword() on SQLite connections; the PostgreSQL drains table stores it at ship time."""
    if not reason:
        return None
    from gpuguard.reason import parse_reason

    parsed = parse_reason(reason)
    return parsed.keyword if parsed else None


# --------------------------------------------------------------------------- dialects


@dataclass(frozen=True)
class Dialect:
    name: str
    runs: str
    findings: str
    drains: str
    run_cols: str  # SELECT list of a run, aliased to the SQLite column names
    drain_cols: str
    finding_cols: str
    find_join: str  # findings f -> runs r
    run_key: str  # the run's key, to compare with a findings subquery
    find_run_key: str  # the select list of that subquery
    drain_run_key: str
    drain_keyword: str
    run_order: str
    drain_order: str
    finding_order: str

    def p(self, name: str) -> str:
        return f":{name}" if self.name == "sqlite" else f"%({name})s"

    def t(self, value: Optional[float]) -> Any:
        """A time parameter: epoch seconds (SQLite) or an aware datetime (PostgreSQL timestamptz)."""
        if value is None or self.name == "sqlite":
            return value
        return datetime.fromtimestamp(value, timezone.utc)


_RUN_FIELDS = "node, started, duration_ms, kind, job_id, restart_count, profile, verdict, action, reason, exit_code, " \
              "error, boot_id"
_FINDING_FIELDS = "check_id, severity, keyword, gpu, action, message, remediation, evidence"

SQLITE = Dialect(
    name="sqlite", runs="runs", findings="findings", drains="drains",
    run_cols="r.id, " + ", ".join(f"r.{c.strip()}" for c in _RUN_FIELDS.split(",")),
    drain_cols="d.id, d.ts, d.node, d.op, d.outcome, d.reason, d.check_id, d.action, d.run_id, d.detail",
    finding_cols="r.id AS run_id, r.node, r.started, r.kind, r.job_id, r.verdict AS run_verdict, "
                 + ", ".join(f"f.{c.strip()}" for c in _FINDING_FIELDS.split(",")),
    find_join="f.run_id = r.id", run_key="r.id", find_run_key="f.run_id", drain_run_key="d.run_id",
    drain_keyword="gg_keyword(d.reason)",
    run_order="r.started DESC, r.id DESC", drain_order="d.ts DESC, d.id DESC",
    finding_order="r.started DESC, r.id DESC, f.rowid")

PG = Dialect(
    name="pg", runs="gpuguard.runs", findings="gpuguard.findings", drains="gpuguard.drains",
    run_cols="r.local_id AS id, r.origin::text AS origin, "
             + ", ".join(f"r.{c.strip()}" for c in _RUN_FIELDS.split(",")),
    drain_cols="d.local_id AS id, d.origin::text AS origin, d.ts, d.node, d.op, d.outcome, d.reason, d.check_id, "
               "d.action, d.run_local_id AS run_id, d.detail",
    finding_cols="r.local_id AS run_id, r.origin::text AS origin, r.node, r.started, r.kind, r.job_id, "
                 "r.verdict AS run_verdict, " + ", ".join(f"f.{c.strip()}" for c in _FINDING_FIELDS.split(",")),
    find_join="f.origin = r.origin AND f.run_local_id = r.local_id", run_key="(r.origin, r.local_id)",
    find_run_key="f.origin, f.run_local_id", drain_run_key="(d.origin, d.run_local_id)",
    drain_keyword="d.keyword",
    run_order="r.started DESC, r.local_id DESC", drain_order="d.ts DESC, d.local_id DESC",
    finding_order="r.started DESC, r.local_id DESC, f.seq")


@dataclass
class Query:
    sql: str
    params: dict[str, Any] = field(default_factory=dict)


class _Builder:
    def __init__(self, d: Dialect) -> None:
        self.d = d
        self.params: dict[str, Any] = {}

    def add(self, prefix: str, value: Any) -> str:
        name = f"{prefix}{len(self.params)}"
        self.params[name] = value
        return self.d.p(name)

    def in_list(self, expr: str, values: tuple[Any, ...], prefix: str) -> str:
        return f"{expr} IN ({', '.join(self.add(prefix, v) for v in values)})"

    def keyword_match(self, expr: str, keywords: tuple[str, ...]) -> str:
        """upper(expr) is one of the keywords; a bare XID also matches XID<code>."""
        parts = [self.in_list(f"upper({expr})", keywords, "kw")]
        for k in keywords:
            if k == "XID":
                parts.append(f"upper({expr}) LIKE {self.add('kwp', 'XID%')}")
        return "(" + " OR ".join(parts) + ")"

    def time_range(self, expr: str, f: Filters) -> list[str]:
        out = [f"{expr} >= {self.add('t', self.d.t(f.since))}"]
        if f.until is not None:
            out.append(f"{expr} < {self.add('t', self.d.t(f.until))}")
        return out

    def finding_conds(self, f: Filters) -> list[str]:
        out = []
        if f.checks:
            out.append(self.in_list("f.check_id", f.checks, "c"))
        if f.keywords:
            out.append(self.keyword_match("f.keyword", f.keywords))
        if f.gpus:
            out.append(self.in_list("f.gpu", f.gpus, "g"))
        return out

    def limit(self, limit: Optional[int]) -> str:
        return f" LIMIT {self.add('lim', int(limit))}" if limit else ""


def runs_query(d: Dialect, f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Runs in the window, newest first. A check/keyword/GPU filter keeps the runs with such a problem finding."""
    b = _Builder(d)
    where = b.time_range("r.started", f)
    if f.nodes:
        where.append(b.in_list("r.node", f.nodes, "n"))
    if f.verdicts:
        where.append(b.in_list("r.verdict", f.verdicts, "v"))
    conds = b.finding_conds(f)
    if conds:
        where.append(f"{d.run_key} IN (SELECT {d.find_run_key} FROM {d.findings} f WHERE {PROBLEM} AND "
                     + " AND ".join(conds) + ")")
    body = f"FROM {d.runs} r WHERE " + " AND ".join(where)
    if count:
        return Query(f"SELECT COUNT(*) {body}", b.params)
    return Query(f"SELECT {d.run_cols} {body} ORDER BY {d.run_order}{b.limit(limit)}", b.params)


def findings_query(d: Dialect, f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Problem findings (warn, fail, incomplete) with their run's time, node, kind and job, newest first."""
    b = _Builder(d)
    where = [PROBLEM] + b.time_range("r.started", f)
    if f.nodes:
        where.append(b.in_list("r.node", f.nodes, "n"))
    if f.verdicts:
        where.append(b.in_list("r.verdict", f.verdicts, "v"))
    where += b.finding_conds(f)
    join = "CROSS JOIN" if d.name == "sqlite" else "JOIN"  # SQLite: walk the (small) problem index first
    body = f"FROM {d.findings} f {join} {d.runs} r ON {d.find_join} WHERE " + " AND ".join(where)
    if count:
        return Query(f"SELECT COUNT(*) {body}", b.params)
    return Query(f"SELECT {d.finding_cols} {body} ORDER BY {d.finding_order}{b.limit(limit)}", b.params)


def drains_query(d: Dialect, f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Drain and undrain records, newest first. Not filtered by verdict (a drain record is its own outcome)."""
    b = _Builder(d)
    where = b.time_range("d.ts", f)
    if f.nodes:
        where.append(b.in_list("d.node", f.nodes, "n"))
    if f.checks:
        where.append(b.in_list("d.check_id", f.checks, "c"))
    if f.keywords:
        where.append(b.keyword_match(d.drain_keyword, f.keywords))
    if f.gpus:
        where.append(f"{d.drain_run_key} IN (SELECT {d.find_run_key} FROM {d.findings} f WHERE {PROBLEM} AND "
                     + b.in_list("f.gpu", f.gpus, "g") + ")")
    body = f"FROM {d.drains} d WHERE " + " AND ".join(where)
    if count:
        return Query(f"SELECT COUNT(*) {body}", b.params)
    return Query(f"SELECT {d.drain_cols} {body} ORDER BY {d.drain_order}{b.limit(limit)}", b.params)


def run_findings_query(d: Dialect, run_ids: list[Any]) -> Query:
    """The problem findings of a page of listed runs (SQLite: ids; PostgreSQL: (origin, local_id) pairs)."""
    b = _Builder(d)
    if d.name == "sqlite":
        cond = b.in_list("f.run_id", tuple(run_ids), "r")
        key = "f.run_id AS run_key"
        order = "f.run_id, f.rowid"
    else:
        pairs = ", ".join(f"({b.add('o', o)}::uuid, {b.add('r', i)}::bigint)" for o, i in run_ids)
        cond = f"(f.origin, f.run_local_id) IN ({pairs})"
        key = "f.origin::text AS origin, f.run_local_id AS run_key"
        order = "f.origin, f.run_local_id, f.seq"
    return Query(f"SELECT {key}, {_FINDING_FIELDS} FROM {d.findings} f WHERE {PROBLEM} AND {cond} ORDER BY {order}",
                 b.params)
