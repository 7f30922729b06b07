"""The history-source protocol: where `gpuguard history` and `gpuguard fleet history` read their rows.

Two implementations, one shape of row:
- `gpuguard.store.history_sqlite.SqliteHistory`: the node's own SQLite store(s), every run listed;
- `gpuguard.fleet.pgsource.PgHistory`: the central PostgreSQL database, where healthy runs are kept as per-node,
  per-day counts and a problem that repeats run after run is one row with a repeat count (docs/fleet.md).

A row is a dict with the columns of the node's store (`id`, `node`, `started`/`ts`, ...), times as UTC ISO 8601
text, evidence parsed, and `_t` (epoch seconds) for merging several sources newest first. A PostgreSQL row adds
`origin` (the store it came from) and, for a collapsed repeat, `repeats` and `last` (the last repeat's time).
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional, Protocol

from gpuguard.store.filters import Filters, epoch
from gpuguard.util.timefmt import iso_utc

KINDS = ("drains", "findings", "runs", "requeues")
LISTED = ("runs", "findings", "drains")  # what a HistorySource lists (requeues come from the job-side store)


class HistorySource(Protocol):
    """Runs, problem findings and drain records over a time window, filtered, newest first."""

    label: list[str]  # what was read, for the output's header (store files, or the redacted database URL)
    healthy_summarized: bool  # True: healthy runs are counted (counts()["healthy_runs"]) but not listed

    def count(self, kind: str, f: Filters) -> int:
        """How many records of `kind` match (runs: healthy ones included)."""
        ...

    def healthy_runs(self, f: Filters) -> int:
        """How many of the matching runs passed with nothing to report."""
        ...

    def rows(self, kind: str, f: Filters, limit: Optional[int]) -> Iterator[dict[str, Any]]:
        """Matching records, newest first, at most `limit` (None: all), streamed."""
        ...

    def close(self) -> None: ...


def parse_evidence(value: Any) -> Any:
    """Stored evidence (JSON text in SQLite, jsonb from PostgreSQL) -> a value."""
    if value is None or value == "":
        return {}
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def present_row(kind: str, r: dict[str, Any]) -> dict[str, Any]:
    """A raw row -> the shape every writer prints: times to UTC ISO 8601 (the epoch stays in `_t`), evidence
    parsed, a repeat count only where there is one."""
    repeats = r.pop("repeats", None)
    last = r.pop("last", None)
    if kind == "runs":
        r["_t"] = epoch(r["started"])
        r["started"] = iso_utc(r["started"])
        for f in r.get("findings") or []:
            f["evidence"] = parse_evidence(f.get("evidence"))
    elif kind == "findings":
        t = r.pop("started")
        r = {"time": iso_utc(t), **r, "_t": epoch(t)}
        r["evidence"] = parse_evidence(r.get("evidence"))
    else:
        r["_t"] = epoch(r["ts"])
        r["ts"] = iso_utc(r["ts"])
    if repeats:
        r["repeats"] = int(repeats)
        r["last"] = iso_utc(last)
    return r


def sort_key(r: dict[str, Any]) -> tuple[float, Any]:
    return (r["_t"], r.get("id") or 0)


def public_fields(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if not k.startswith("_")}
