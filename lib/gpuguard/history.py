"""`gpuguard history`: drains, problem findings, runs and job requeues over a time range, as text, JSON or CSV,
from the node's SQLite store(s). `gpuguard fleet history` prints the same from the central PostgreSQL database
(gpuguard.fleet); both share the filters and SQL (gpuguard.fleet.query) and the writers below.

Every kind of record has its own limit (`--limit`, 200 each; 0 = all): a store full of healthy runs never hides
a drain or an Xid finding. Filtering, ordering and limiting happen in SQL, rows are streamed (generators, even
for `--json`): memory does not grow with the store. Times are UTC ISO 8601 (`2026-11-24T20:06:33Z`).

The store may be one file or one per node (`store.path` with "{node}"): history reads every matching file (only
the named nodes' files with `--node`). Requeues come from the `attempts` table of the job-side store named by
`templates.store_path` (the torchrun template's `gpuguard job-attempt` writes it); without one there are none.
"""

from __future__ import annotations

import csv
import glob
import heapq
import itertools
import json
import os
import re
import sqlite3
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

from gpuguard.fleet.query import (SQLITE, Filters, Query, build_filters, drains_query, findings_query, iso_utc,
                                  keyword_of_reason, parse_time, run_findings_query, runs_query)

KINDS = ("drains", "findings", "runs", "requeues")
PAGE = 500  # runs whose findings are fetched in one query


def parse_since(text: str, now: Optional[float] = None) -> float:
    """'30m' / '24h' / '7d' / an ISO 8601 time (UTC unless it says otherwise) -> epoch seconds."""
    return parse_time(text, now, "--since")


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


# --------------------------------------------------------------------------- sources


class HistorySource(Protocol):
    """Where history rows come from: the SQLite stores here, PostgreSQL in gpuguard.fleet.pgsource."""

    label: list[str]

    def count(self, kind: str, f: Filters) -> int: ...

    def rows(self, kind: str, f: Filters, limit: Optional[int]) -> Iterator[dict[str, Any]]: ...

    def close(self) -> None: ...


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


def _evidence(value: Any) -> Any:
    """Stored evidence (JSON text in SQLite, jsonb from PostgreSQL) -> a value."""
    if value is None or value == "":
        return {}
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _finding_row(r: dict[str, Any]) -> dict[str, Any]:
    r["evidence"] = _evidence(r.get("evidence"))
    return r


def _cursor_rows(conn: Any, q: Query) -> Iterator[dict[str, Any]]:
    cur = conn.execute(q.sql, q.params)
    cols = [c[0] for c in cur.description]
    for row in cur:
        yield dict(zip(cols, row))


class SqliteHistory:
    """History over one or more SQLite store files, merged newest first."""

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

    def count(self, kind: str, f: Filters) -> int:
        build = {"runs": runs_query, "findings": findings_query, "drains": drains_query}[kind]
        total = 0
        for path, conn in self.conns:
            q = build(SQLITE, f, None, count=True)
            try:
                total += int(conn.execute(q.sql, q.params).fetchone()[0])
            except sqlite3.DatabaseError as e:
                print(f"gpuguard history: {path}: {e}", file=sys.stderr)
        return total

    def _one(self, path: str, conn: sqlite3.Connection, kind: str, f: Filters,
             limit: Optional[int]) -> Iterator[dict[str, Any]]:
        build = {"runs": runs_query, "findings": findings_query, "drains": drains_query}[kind]
        try:
            rows = _cursor_rows(conn, build(SQLITE, f, limit))
            if kind == "runs":
                rows = self._with_findings(conn, rows)
            for r in rows:
                yield _present(kind, r)
        except sqlite3.DatabaseError as e:
            print(f"gpuguard history: {path}: {e}", file=sys.stderr)

    @staticmethod
    def _with_findings(conn: sqlite3.Connection, rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        while True:
            page = list(itertools.islice(rows, PAGE))
            if not page:
                return
            by_run: dict[Any, list[dict[str, Any]]] = {}
            for fr in _cursor_rows(conn, run_findings_query(SQLITE, [r["id"] for r in page])):
                by_run.setdefault(fr.pop("run_key"), []).append(_finding_row(fr))
            for r in page:
                r["findings"] = by_run.get(r["id"], [])
                yield r

    def rows(self, kind: str, f: Filters, limit: Optional[int]) -> Iterator[dict[str, Any]]:
        gens = [self._one(p, c, kind, f, limit) for p, c in self.conns]
        merged = heapq.merge(*gens, key=_sort_key, reverse=True) if len(gens) > 1 else (gens[0] if gens else iter(()))
        return itertools.islice(merged, limit) if limit else merged


def _room_for_files(stores: int) -> None:
    """Per-node stores read at once keep a few descriptors each (database, -wal, -shm): raise the soft limit."""
    if stores < 100:
        return
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 4 * stores + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                                        hard))
    except (ImportError, ValueError, OSError):
        pass


def _sort_key(r: dict[str, Any]) -> tuple[float, Any]:
    return (r["_t"], r.get("id") or 0)


def _present(kind: str, r: dict[str, Any]) -> dict[str, Any]:
    """Times to UTC ISO 8601 (the epoch stays in `_t` for merging), evidence parsed."""
    from gpuguard.fleet.query import epoch

    if kind == "runs":
        r["_t"] = epoch(r["started"])
        r["started"] = iso_utc(r["started"])
    elif kind == "findings":
        t = r.pop("started")
        r = {"time": iso_utc(t), **_finding_row(r), "_t": epoch(t)}
    else:
        r["_t"] = epoch(r["ts"])
        r["ts"] = iso_utc(r["ts"])
    return r


# --------------------------------------------------------------------------- requeues (job-side ledger store)


class Requeues:
    """Job attempts from the `attempts` table of the stores named by templates.store_path ({node} = batch host).
    The attempts' `nodes` column is a Slurm hostlist; a node filter matches it or the excluded list."""

    def __init__(self, pattern: Optional[str]) -> None:
        self.paths = attempt_store_paths(pattern) if pattern else []

    def _all(self, f: Filters) -> Iterator[dict[str, Any]]:
        import hostlist

        want = set(f.nodes)
        gens = []
        for path in self.paths:
            gens.append(self._one(path, f))
        seen: set[tuple[Any, ...]] = set()
        for r in heapq.merge(*gens, key=_sort_key, reverse=True):
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
            sql = "SELECT * FROM attempts WHERE ts >= ?" + (" AND ts < ?" if f.until else "") + " ORDER BY ts DESC"
            for r in _cursor_rows(conn, Query(sql, [f.since] + ([f.until] if f.until else []))):  # type: ignore[arg-type]
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


# --------------------------------------------------------------------------- writers


def _public(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if not k.startswith("_")}


def _worst(findings: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return next((x for x in findings if x["severity"] == "fail"), findings[0] if findings else None)


def timeline_row(kind: str, r: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: type, time, node, job, what, outcome, check, reason, detail."""
    if kind == "runs":
        worst = _worst(r.get("findings") or [])
        return {"type": "run", "time": r["started"], "node": r["node"], "job_id": r["job_id"] or "",
                "what": r["kind"], "outcome": r["verdict"], "check": worst["check_id"] if worst else "",
                "reason": r["reason"] or r.get("error") or "",
                "detail": f"{r['duration_ms']:.0f} ms" if r.get("duration_ms") is not None else ""}
    if kind == "drains":
        return {"type": "drain", "time": r["ts"], "node": r["node"], "job_id": "", "what": r["op"],
                "outcome": r["outcome"], "check": r["check_id"] or "", "reason": r["reason"] or "",
                "detail": r["detail"] or ""}
    return {"type": "requeue", "time": r["ts"], "node": r.get("nodes") or "", "job_id": r.get("job_id") or "",
            "what": f"attempt {r.get('attempt')}", "outcome": r.get("action") or "", "check": "",
            "reason": r.get("reason") or "",
            "detail": f"exit={r.get('exit_code')} signal={r.get('signal')} excluded={r.get('excluded') or ''}"}


CSV_FIELDS = ["type", "time", "node", "job_id", "what", "outcome", "check", "reason", "detail"]


def _tagged(kind: str, rows: Iterator[dict[str, Any]]) -> Iterator[tuple[float, str, dict[str, Any]]]:
    for r in rows:
        yield (r["_t"], kind, r)


def write_history(out: Any, fmt: str, source: HistorySource, requeues: Optional[Requeues], f: Filters,
                  limit: Optional[int], title: str) -> None:
    """Print history from `source` as text, json or csv; rows are streamed from the source to `out`."""
    def rows(kind: str) -> Iterator[dict[str, Any]]:
        if kind == "requeues":
            return requeues.rows(f, limit) if requeues else iter(())
        if kind == "findings" and fmt == "csv":
            return iter(())
        return source.rows(kind, f, limit)

    if fmt == "csv":
        w = csv.DictWriter(out, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        streams = [_tagged(k, rows(k)) for k in ("runs", "drains", "requeues")]
        for _, kind, r in heapq.merge(*streams, key=lambda x: x[0], reverse=True):
            w.writerow(timeline_row(kind, r))
        return
    counts = {k: (requeues.count(f) if requeues else 0) if k == "requeues" else source.count(k, f) for k in KINDS}
    if fmt == "json":
        head = {"since": iso_utc(f.since), "until": iso_utc(f.until), "filters": f.describe(),
                "stores": source.label, "limit": limit or None, "counts": counts}
        out.write(json.dumps(head, indent=2)[:-2] + ",\n")
        for i, kind in enumerate(KINDS):
            out.write(f'  "{kind}": [')
            for j, r in enumerate(rows(kind)):
                out.write(("," if j else "") + "\n    " + json.dumps(_public(r), default=str))
            out.write("\n  ]" + ("," if i < len(KINDS) - 1 else "") + "\n")
        out.write("}\n")
        return
    _write_text(out, rows, counts, f, limit, title)


def _heading(kind: str, shown: int, total: int, limit: Optional[int]) -> str:
    if limit and total > shown:
        return f"{kind} ({shown} of {total}, newest first; --limit N or --limit 0 for more):"
    return f"{kind} ({total}):"


def _write_text(out: Any, rows: Callable[[str], Iterator[dict[str, Any]]], counts: dict[str, int], f: Filters,
                limit: Optional[int], title: str) -> None:
    desc = f.describe()
    extra = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in desc.items()
                     if k not in ("since", "until"))
    out.write(f"{title} since {desc['since']} until {desc['until'] or 'now'}" + (f" [{extra}]" if extra else "") + "\n")
    for kind in KINDS:
        total = counts[kind]
        out.write(_heading(kind, min(total, limit) if limit else total, total, limit) + "\n")
        for r in rows(kind):
            out.write(_text_line(kind, r))


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _text_line(kind: str, r: dict[str, Any]) -> str:
    """One line of text output; control characters (a hostile message could carry terminal escapes) shown as
    '?'."""
    return _CONTROL.sub("?", _raw_text_line(kind, r).rstrip("\n").replace("\n", " ")) + "\n"


def _raw_text_line(kind: str, r: dict[str, Any]) -> str:
    if kind == "drains":
        return (f"  {r['ts']} {r['node']:<12} {r['op']:<8} {r['outcome']:<8} {r['reason'] or ''} "
                f"{r['detail'] or ''}".rstrip() + "\n")
    if kind == "findings":
        gpu = f"gpu={r['gpu']}" if r.get("gpu") is not None else "node"
        return (f"  {r['time']} {r['node']:<12} {r['kind']:<11} job={r['job_id'] or '-':<8} {r['severity']:<10} "
                f"{r['check_id']:<18} {r['keyword'] or '-':<9} {gpu:<6} {r['message']}\n")
    if kind == "runs":
        took = f"{r['duration_ms']:.0f}ms" if r.get("duration_ms") is not None else "-"
        worst = _worst(r.get("findings") or [])
        what = r["reason"] or r.get("error") or (f"{worst['check_id']}: {worst['message']}" if worst else "")
        return (f"  {r['started']} {r['node']:<12} {r['kind']:<11} job={r['job_id'] or '-':<8} "
                f"{r['verdict']:<6} {took:>7} {what}".rstrip() + "\n")
    return (f"  {r['ts']} job={r.get('job_id')} attempt={r.get('attempt')} {r.get('action') or '':<9} "
            f"nodes={r.get('nodes') or '-'} exit={r.get('exit_code')} reason={r.get('reason') or '-'}"
            + (f" excluded={r['excluded']}" if r.get("excluded") else "") + "\n")


# --------------------------------------------------------------------------- command line


def add_arguments(p: Any, default_since: str = "24h") -> None:
    """The filters and formats `gpuguard history` and `gpuguard fleet history` share."""
    p.add_argument("--config", help="config file")
    p.add_argument("--node", help="only these nodes: a Slurm hostlist, e.g. node[1-4,7]")
    p.add_argument("--since", default=default_since,
                   help=f"from: 30m, 24h, 7d, or an ISO 8601 time (UTC unless it says; default {default_since})")
    p.add_argument("--until", help="up to (same forms as --since; default now)")
    p.add_argument("--check", action="append", metavar="ID", help="only this check, e.g. gpu.xid (repeatable)")
    p.add_argument("--keyword", action="append", metavar="KW",
                   help="only this drain keyword, e.g. XID79, ECC; XID = any Xid (repeatable)")
    p.add_argument("--verdict", action="append", metavar="V", help="runs with this verdict: pass, warn, drain, error")
    p.add_argument("--gpu", action="append", metavar="N", help="only findings on this GPU index (repeatable)")
    p.add_argument("--limit", type=int, default=200,
                   help="at most this many rows of each kind (drains, findings, runs, requeues); 0 = all (default 200)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true", help="one timeline of runs, drains and requeues")


def filters_from_args(args: Any) -> Filters:
    if args.limit < 0:
        raise ValueError(f"--limit: expected a number >= 0, got {args.limit}")
    return build_filters(since=args.since, until=args.until, node=args.node, check=args.check, keyword=args.keyword,
                         verdict=args.verdict, gpu=args.gpu)


def output_format(args: Any) -> str:
    return "json" if args.json else "csv" if args.csv else "text"


def requeue_source(cfg: Any) -> Optional[Requeues]:
    """templates.store_path names the job-side store the torchrun template writes attempts to; none, none."""
    pattern = cfg.sections.get("templates", {}).get("store_path")
    return Requeues(pattern) if pattern else None


def cmd_history(args: Any) -> int:
    from gpuguard.config import load_config

    cfg = load_config(args.config)
    f = filters_from_args(args)
    source = SqliteHistory(store_paths(cfg.sections["store"]["path"], f.nodes))
    try:
        write_history(sys.stdout, output_format(args), source, requeue_source(cfg), f, args.limit or None,
                      f"history ({len(source.conns)} store file(s))")
    finally:
        source.close()
    return 0
