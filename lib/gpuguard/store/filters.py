"""History filters, shared by every history source: the node's SQLite store (gpuguard.store.history_sqlite) and the
central PostgreSQL database (gpuguard.fleet.pgquery). Times, the filters an admin types, `SqlBuilder`, which turns
them into SQL parameters for either database, and the filter conditions both dialects build from them (one builder:
`keyword_match`, `finding_conds`, `equal_any`). Pure: no connection is made here.

Time values are epoch seconds in SQLite and `timestamptz` in PostgreSQL; `SqlBuilder.t()` hides that.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

import hostlist

from gpuguard.slurm.reason import parse_reason
from gpuguard.util.timefmt import iso_utc

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
    parsed = parse_reason(reason)
    return parsed.keyword if parsed else None


# --------------------------------------------------------------------------- SQL parameters


class SqlBuilder:
    """Collects named parameters for one statement: `:name` for SQLite, `%(name)s` for psycopg."""

    def __init__(self, dialect: str) -> None:
        if dialect not in ("sqlite", "pg"):
            raise ValueError(f"unknown SQL dialect {dialect!r}")
        self.dialect = dialect
        self.params: dict[str, Any] = {}

    def t(self, value: Optional[float]) -> Any:
        """A time parameter: epoch seconds (SQLite) or an aware datetime (PostgreSQL timestamptz)."""
        if value is None or self.dialect == "sqlite":
            return value
        return datetime.fromtimestamp(value, timezone.utc)

    def add(self, prefix: str, value: Any) -> str:
        name = f"{prefix}{len(self.params)}"
        self.params[name] = value
        return f":{name}" if self.dialect == "sqlite" else f"%({name})s"

    def in_list(self, expr: str, values: tuple[Any, ...], prefix: str) -> str:
        return f"{expr} IN ({', '.join(self.add(prefix, v) for v in values)})"

    def time_range(self, expr: str, since: float, until: Optional[float]) -> list[str]:
        out = [f"{expr} >= {self.add('t', self.t(since))}"]
        if until is not None:
            out.append(f"{expr} < {self.add('t', self.t(until))}")
        return out

    def limit(self, limit: Optional[int]) -> str:
        return f" LIMIT {self.add('lim', int(limit))}" if limit else ""


@dataclass
class Query:
    sql: str
    params: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the conditions both dialects use


def keyword_match(b: SqlBuilder, expr: str, keywords: tuple[str, ...]) -> str:
    """`expr` (an upper-case keyword expression) is one of the keywords; a bare XID also matches XID<code> (a
    prefix: PostgreSQL's index on the keyword walks it)."""
    parts = [b.in_list(expr, keywords, "kw")]
    if "XID" in keywords:
        parts.append(f"{expr} LIKE {b.add('kwp', 'XID%')}")
    return "(" + " OR ".join(parts) + ")"


def finding_conds(b: SqlBuilder, f: Filters, keyword_expr: str = "f.keyword") -> list[str]:
    """The check / keyword / GPU filters over a finding aliased `f`."""
    out = []
    if f.checks:
        out.append(b.in_list("f.check_id", f.checks, "c"))
    if f.keywords:
        out.append(keyword_match(b, keyword_expr, f.keywords))
    if f.gpus:
        out.append(b.in_list("f.gpu", f.gpus, "g"))
    return out


def equal_any(b: SqlBuilder, pairs: list[tuple[str, tuple[Any, ...]]]) -> list[str]:
    """`expr IN (...)` for every (expr, values) whose values are given: the node, verdict and check filters."""
    return [b.in_list(expr, values, expr.rsplit(".", 1)[-1][:1]) for expr, values in pairs if values]
