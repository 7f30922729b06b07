"""The SQLite history source: runs, problem findings and drains from the node's store file(s), and job requeues
from the job-side attempt store(s). Read-only connections: reading history never creates, migrates or moves a
store.

Everything is filtered, ordered and limited in SQL, per kind of record (each gets its own LIMIT, so a week of
healthy health checks can never push a drain or an Xid finding out of view); rows are streamed through cursors
and several per-node files are merged newest first, so memory does not grow with the store.
"""

from __future__ import annotations

import glob
import heapq
import itertools
import os
import resource
import sqlite3
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import hostlist

from gpuguard.store.filters import (PROBLEM, Filters, Query, SqlBuilder, equal_any, finding_conds, keyword_match,
                                    keyword_of_reason)
from gpuguard.store.history import present_row, sort_key
from gpuguard.store.sqlite import Store
from gpuguard.util.timefmt import iso_utc

PAGE = 500  # runs whose findings are fetched in one query

RUN_COLS = ("r.id, r.node, r.started, r.duration_ms, r.kind, r.job_id, r.restart_count, r.profile, r.verdict, "
            "r.action, r.reason, r.exit_code, r.error, r.boot_id")
FINDING_FIELDS = "f.check_id, f.severity, f.keyword, f.gpu, f.action, f.message, f.remediation, f.evidence"
FINDING_COLS = "r.id AS run_id, r.node, r.started, r.kind, r.job_id, r.verdict AS run_verdict, " + FINDING_FIELDS
DRAIN_COLS = "d.id, d.ts, d.node, d.op, d.outcome, d.reason, d.check_id, d.action, d.run_id, d.detail"


# --------------------------------------------------------------------------- which files


def store_paths(pattern: str, nodes: Iterable[str] = ()) -> list[str]:
    """The store file(s) to read: the named nodes' files, or every per-node file when none is named. Only files
    that exist (history never creates a store)."""
    if "{node}" not in pattern:
        return [pattern] if os.path.exists(pattern) else []
    nodes = list(nodes)
    if nodes:
        return [p for p in (pattern.replace("{node}", n) for n in nodes) if os.path.exists(p)]
    return sorted(glob.glob(glob.escape(pattern).replace(glob.escape("{node}"), "*")))


def attempt_store_paths(pattern: str) -> list[str]:
    """The job-side attempt stores: templates.store_path with its {node} (batch host) and {user} placeholders
    expanded over what exists. Never created here."""
    if "{node}" not in pattern and "{user}" not in pattern:
        return [pattern] if os.path.exists(pattern) else []
    g = glob.escape(pattern)
    for placeholder in ("{node}", "{user}"):
        g = g.replace(glob.escape(placeholder), "*")
    return sorted(glob.glob(g))


def open_store_ro(path: str, timeout_s: float = 5.0) -> Optional[sqlite3.Connection]:
    """A read-only connection to a store file with gg_keyword() registered; None when it is not a store."""
    try:
        conn = sqlite3.connect(Path(path).absolute().as_uri() + "?mode=ro", uri=True, timeout=timeout_s)
    except sqlite3.Error as e:
        print(f"gpuguard history: {path}: {e}", file=sys.stderr)
        return None
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as e:
        print(f"gpuguard history: {path}: {e}", file=sys.stderr)
        conn.close()
        return None
    if not {"runs", "findings", "drains"} <= tables:
        conn.close()
        return None
    conn.create_function("gg_keyword", 1, keyword_of_reason, deterministic=True)
    return conn


# --------------------------------------------------------------------------- SQL over one store


def _run_conds(b: SqlBuilder, f: Filters) -> list[str]:
    return b.time_range("r.started", f.since, f.until) + equal_any(b, [("r.node", f.nodes), ("r.verdict", f.verdicts)])


def runs_query(f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Runs in the window, newest first. A check/keyword/GPU filter keeps the runs with such a problem finding."""
    b = SqlBuilder("sqlite")
    where = _run_conds(b, f)
    conds = finding_conds(b, f, keyword_expr="upper(f.keyword)")
    if conds:
        where.append(f"r.id IN (SELECT f.run_id FROM findings f WHERE {PROBLEM} AND " + " AND ".join(conds) + ")")
    body = "FROM runs r WHERE " + " AND ".join(where)
    if count:
        return Query(f"SELECT COUNT(*) {body}", b.params)
    return Query(f"SELECT {RUN_COLS} {body} ORDER BY r.started DESC, r.id DESC{b.limit(limit)}", b.params)


def healthy_runs_query(f: Filters) -> Query:
    """How many runs in the window passed with nothing to report (Store.HEALTHY_RUN)."""
    b = SqlBuilder("sqlite")
    where = _run_conds(b, f) + [Store.HEALTHY_RUN]
    return Query("SELECT COUNT(*) FROM runs r WHERE " + " AND ".join(where), b.params)


def findings_query(f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Problem findings (warn, fail, incomplete) with their run's time, node, kind and job, newest first."""
    b = SqlBuilder("sqlite")
    where = [PROBLEM] + _run_conds(b, f) + finding_conds(b, f, keyword_expr="upper(f.keyword)")
    body = "FROM findings f CROSS JOIN runs r ON f.run_id = r.id WHERE " + " AND ".join(where)  # problems first
    if count:
        return Query(f"SELECT COUNT(*) {body}", b.params)
    return Query(f"SELECT {FINDING_COLS} {body} ORDER BY r.started DESC, r.id DESC, f.rowid{b.limit(limit)}",
                 b.params)


def drains_query(f: Filters, limit: Optional[int], count: bool = False) -> Query:
    """Drain and undrain records, newest first. Not filtered by verdict (a drain record is its own outcome)."""
    b = SqlBuilder("sqlite")
    where = b.time_range("d.ts", f.since, f.until) + equal_any(b, [("d.node", f.nodes), ("d.check_id", f.checks)])
    if f.keywords:
        where.append(keyword_match(b, "upper(gg_keyword(d.reason))", f.keywords))
    if f.gpus:
        where.append(f"d.run_id IN (SELECT f.run_id FROM findings f WHERE {PROBLEM} AND "
                     + b.in_list("f.gpu", f.gpus, "g") + ")")
    body = "FROM drains d WHERE " + " AND ".join(where)
    if count:
        return Query(f"SELECT COUNT(*) {body}", b.params)
    return Query(f"SELECT {DRAIN_COLS} {body} ORDER BY d.ts DESC, d.id DESC{b.limit(limit)}", b.params)


def run_findings_query(run_ids: list[int]) -> Query:
    """The problem findings of a page of listed runs."""
    b = SqlBuilder("sqlite")
    cond = b.in_list("f.run_id", tuple(run_ids), "r")
    return Query(f"SELECT f.run_id AS run_key, {FINDING_FIELDS} FROM findings f WHERE {PROBLEM} AND {cond} "
                 "ORDER BY f.run_id, f.rowid", b.params)


_BUILD = {"runs": runs_query, "findings": findings_query, "drains": drains_query}


def cursor_rows(conn: Any, q: Query) -> Iterator[dict[str, Any]]:
    cur = conn.execute(q.sql, q.params)
    cols = [c[0] for c in cur.description]
    for row in cur:
        yield dict(zip(cols, row))


# --------------------------------------------------------------------------- the source


class SqliteHistory:
    """History over one or more SQLite store files, merged newest first. Every run is listed."""

    healthy_summarized = False

    def __init__(self, paths: list[str]) -> None:
        self.label = list(paths)
        self.conns: list[tuple[str, sqlite3.Connection]] = []
        _room_for_files(len(paths))
        for p in paths:
            conn = open_store_ro(p)
            if conn is not None:
                self.conns.append((p, conn))

    def close(self) -> None:
        for _, c in self.conns:
            c.close()

    def _sum(self, q: Query) -> int:
        total = 0
        for path, conn in self.conns:
            try:
                total += int(conn.execute(q.sql, q.params).fetchone()[0])
            except sqlite3.DatabaseError as e:
                print(f"gpuguard history: {path}: {e}", file=sys.stderr)
        return total

    def count(self, kind: str, f: Filters) -> int:
        return self._sum(_BUILD[kind](f, None, count=True))

    def healthy_runs(self, f: Filters) -> int:
        if f.problem_filtered or (f.verdicts and "pass" not in f.verdicts):
            return 0
        return self._sum(healthy_runs_query(f))

    def _one(self, path: str, conn: sqlite3.Connection, kind: str, f: Filters,
             limit: Optional[int]) -> Iterator[dict[str, Any]]:
        try:
            rows = cursor_rows(conn, _BUILD[kind](f, limit))
            if kind == "runs":
                rows = self._with_findings(conn, rows)
            for r in rows:
                yield present_row(kind, r)
        except sqlite3.DatabaseError as e:
            print(f"gpuguard history: {path}: {e}", file=sys.stderr)

    @staticmethod
    def _with_findings(conn: sqlite3.Connection, rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        while True:
            page = list(itertools.islice(rows, PAGE))
            if not page:
                return
            by_run: dict[Any, list[dict[str, Any]]] = {}
            for fr in cursor_rows(conn, run_findings_query([r["id"] for r in page])):
                by_run.setdefault(fr.pop("run_key"), []).append(fr)
            for r in page:
                r["findings"] = by_run.get(r["id"], [])
                yield r

    def rows(self, kind: str, f: Filters, limit: Optional[int]) -> Iterator[dict[str, Any]]:
        gens = [self._one(p, c, kind, f, limit) for p, c in self.conns]
        merged = heapq.merge(*gens, key=sort_key, reverse=True) if len(gens) > 1 else (gens[0] if gens else iter(()))
        return itertools.islice(merged, limit) if limit else merged


def _room_for_files(stores: int) -> None:
    """Per-node stores read at once keep a few descriptors each (database, -wal, -shm): raise the soft limit."""
    if stores < 100:
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 4 * stores + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                                        hard))
    except (ValueError, OSError):
        pass


# --------------------------------------------------------------------------- requeues (job-side ledger store)


class Requeues:
    """Job attempts from the `attempts` table of the stores named by templates.store_path ({node} = batch host).
    The attempts' `nodes` column is a Slurm hostlist; a node filter matches it or the excluded list."""

    def __init__(self, pattern: Optional[str]) -> None:
        self.paths = attempt_store_paths(pattern) if pattern else []

    def _all(self, f: Filters) -> Iterator[dict[str, Any]]:
        want = set(f.nodes)
        seen: set[tuple[Any, ...]] = set()
        for r in heapq.merge(*(self._one(p, f) for p in self.paths), key=sort_key, reverse=True):
            key = (r.get("job_id"), r.get("attempt"), r["_t"])
            if key in seen:
                continue
            seen.add(key)
            if want:
                try:
                    nodes = set(hostlist.expand_hostlist(r.get("nodes") or ""))
                except hostlist.BadHostlist:
                    nodes = set()
                excluded = {n.strip() for n in (r.get("excluded") or "").split(",")}
                if not (want & (nodes | excluded)):
                    continue
            yield r

    def _one(self, path: str, f: Filters) -> Iterator[dict[str, Any]]:
        try:
            conn = sqlite3.connect(Path(path).absolute().as_uri() + "?mode=ro", uri=True, timeout=5.0)
        except sqlite3.Error as e:
            print(f"gpuguard history: {path}: {e}", file=sys.stderr)
            return
        try:
            if not conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='attempts'").fetchone():
                return
            b = SqlBuilder("sqlite")
            sql = "SELECT * FROM attempts WHERE " + " AND ".join(b.time_range("ts", f.since, f.until))
            for r in cursor_rows(conn, Query(sql + " ORDER BY ts DESC", b.params)):
                r["_t"] = float(r["ts"])
                r["ts"] = iso_utc(r["ts"])
                yield r
        except sqlite3.DatabaseError as e:
            print(f"gpuguard history: {path}: {e}", file=sys.stderr)
        finally:
            conn.close()

    def count(self, f: Filters) -> int:
        return 0 if f.problem_filtered or f.verdicts else sum(1 for _ in self._all(f))

    def rows(self, f: Filters, limit: Optional[int]) -> Iterator[dict[str, Any]]:
        if f.problem_filtered or f.verdicts:  # requeues carry no check, keyword, GPU or verdict
            return iter(())
        rows = self._all(f)
        return itertools.islice(rows, limit) if limit else rows
