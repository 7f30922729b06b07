"""`gpuguard history`: drains, problem findings, runs and job requeues over a time range, as text, JSON or CSV,
from the node's SQLite store(s). `gpuguard fleet history` prints the same from the central PostgreSQL database.
This module is the command and its writers; the rows come from a history source (gpuguard.store.history:
`history_sqlite.SqliteHistory` here, `fleet.pgsource.PgHistory` for the fleet), with the same filters
(gpuguard.store.filters).

Every kind of record has its own limit (`--limit`, 200 each; 0 = all): a store full of healthy runs never hides
a drain or an Xid finding. Filtering, ordering and limiting happen in SQL, rows are streamed (generators, even
for `--json`): memory does not grow with the store. Times are UTC ISO 8601 (`2026-11-24T20:06:33Z`).

The store may be one file or one per node (`store.path` with "{node}"): history reads every matching file (only
the named nodes' files with `--node`). Requeues come from the `attempts` table of the job-side store named by
`templates.store_path` (the torchrun template's `gpuguard job-attempt` writes it); without one there are none.
"""

from __future__ import annotations

import csv
import heapq
import json
import re
import sys
from typing import Any, Callable, Iterator, Optional

from gpuguard.siteconfig import load_config
from gpuguard.store.filters import Filters, build_filters, parse_time
from gpuguard.store.history import KINDS, HistorySource, public_fields
from gpuguard.store.history_sqlite import Requeues, SqliteHistory, attempt_store_paths, store_paths
from gpuguard.util.cliargs import add_config_option
from gpuguard.util.timefmt import iso_utc

__all__ = ["attempt_store_paths", "store_paths", "parse_since", "write_history", "add_arguments", "cmd_history"]


def parse_since(text: str, now: Optional[float] = None) -> float:
    """'30m' / '24h' / '7d' / an ISO 8601 time (UTC unless it says otherwise) -> epoch seconds."""
    return parse_time(text, now, "--since")


# --------------------------------------------------------------------------- writers


def _worst(findings: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return next((x for x in findings if x["severity"] == "fail"), findings[0] if findings else None)


def _repeated(r: dict[str, Any], detail: str) -> str:
    """A central row standing for repeats says so (x169, last ...)."""
    return (detail + f" (x{r['repeats'] + 1}, last {r.get('last')})").strip() if r.get("repeats") else detail


def timeline_row(kind: str, r: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: type, time, node, job, what, outcome, check, reason, detail."""
    if kind == "runs":
        worst = _worst(r.get("findings") or [])
        took = f"{r['duration_ms']:.0f} ms" if r.get("duration_ms") is not None else ""
        return {"type": "run", "time": r["started"], "node": r["node"], "job_id": r["job_id"] or "",
                "what": r["kind"], "outcome": r["verdict"], "check": worst["check_id"] if worst else "",
                "reason": r["reason"] or r.get("error") or "", "detail": _repeated(r, took)}
    if kind == "drains":
        return {"type": "drain", "time": r["ts"], "node": r["node"], "job_id": "", "what": r["op"],
                "outcome": r["outcome"], "check": r["check_id"] or "", "reason": r["reason"] or "",
                "detail": _repeated(r, r["detail"] or "")}
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
    if source.healthy_summarized:  # the central database counts healthy runs instead of listing them
        counts["healthy_runs"] = source.healthy_runs(f)
    if fmt == "json":
        head = {"since": iso_utc(f.since), "until": iso_utc(f.until), "filters": f.describe(),
                "stores": source.label, "limit": limit or None, "counts": counts}
        out.write(json.dumps(head, indent=2)[:-2] + ",\n")
        for i, kind in enumerate(KINDS):
            out.write(f'  "{kind}": [')
            for j, r in enumerate(rows(kind)):
                out.write(("," if j else "") + "\n    " + json.dumps(public_fields(r), default=str))
            out.write("\n  ]" + ("," if i < len(KINDS) - 1 else "") + "\n")
        out.write("}\n")
        return
    _write_text(out, rows, counts, f, limit, title)


def _heading(kind: str, shown: int, total: int, limit: Optional[int]) -> str:
    if limit and total > shown:
        return f"{kind} ({shown} of {total}, newest first; --limit N or --limit 0 for more):"
    return f"{kind} ({total}):"


def _summarized_runs_heading(total: int, healthy: int, limit: Optional[int]) -> str:
    """Runs from the central database: healthy ones are counts, a repeated problem is one line (xN)."""
    problems = total - healthy
    more = f"; at most {limit} shown, --limit 0 for all" if limit and problems > limit else ""
    return (f"runs ({total}: {healthy} healthy, counted not listed; {problems} with something to report, newest "
            f"first, a repeat shown once as xN{more}):")


def _write_text(out: Any, rows: Callable[[str], Iterator[dict[str, Any]]], counts: dict[str, int], f: Filters,
                limit: Optional[int], title: str) -> None:
    desc = f.describe()
    extra = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in desc.items()
                     if k not in ("since", "until"))
    out.write(f"{title} since {desc['since']} until {desc['until'] or 'now'}" + (f" [{extra}]" if extra else "") + "\n")
    for kind in KINDS:
        total = counts[kind]
        if kind == "runs" and "healthy_runs" in counts:
            out.write(_summarized_runs_heading(total, counts["healthy_runs"], limit) + "\n")
        else:
            out.write(_heading(kind, min(total, limit) if limit else total, total, limit) + "\n")
        for r in rows(kind):
            out.write(_text_line(kind, r))


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _text_line(kind: str, r: dict[str, Any]) -> str:
    """One line of text output; control characters (a hostile message could carry terminal escapes) shown as
    '?'."""
    line = _raw_text_line(kind, r).rstrip("\n").replace("\n", " ")
    return _CONTROL.sub("?", _repeated(r, line) if r.get("repeats") else line) + "\n"


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
    add_config_option(p)
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
    pattern = cfg.templates.store_path
    return Requeues(pattern) if pattern else None


def cmd_history(args: Any) -> int:
    cfg = load_config(args.config)
    f = filters_from_args(args)
    source = SqliteHistory(store_paths(cfg.store.path, f.nodes))
    try:
        write_history(sys.stdout, output_format(args), source, requeue_source(cfg), f, args.limit or None,
                      f"history ({len(source.conns)} store file(s))")
    finally:
        source.close()
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("history", help="drains, findings, runs and requeues from the history store")
    add_arguments(p)  # filters shared with `fleet history`


def run(args: Any) -> int:
    return cmd_history(args)
