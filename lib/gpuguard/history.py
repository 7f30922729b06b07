"""`gpuguard history`: runs, findings, drains and job requeues over a time range, as text, JSON or CSV
(`gpuguard status` lives in gpuguard.status).

The store may be one file or one per node (`store.path` with "{node}", e.g. on a shared filesystem): history
reads every matching file, so an admin sees the fleet in one place. Requeues come from the `attempts` table the
torchrun template's ledger writes; an older store without it simply has no requeues.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import re
import sqlite3
import sys
import time
from datetime import datetime
from typing import Any, Optional

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: Optional[float] = None) -> float:
    """'30m' / '24h' / '7d' / '2026-03-02' / '2026-03-02T10:00' -> an epoch timestamp. Raises ValueError."""
    now = time.time() if now is None else now
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValueError(f"--since: expected a duration like 30m, 24h, 7d or an ISO date, got {text!r}") from None


def store_paths(pattern: str, node: Optional[str]) -> list[str]:
    """The store file(s) to read: the node's, or every per-node file when no node is given."""
    if "{node}" not in pattern:
        return [pattern]
    if node:
        return [pattern.replace("{node}", node)]
    return sorted(glob.glob(glob.escape(pattern).replace(glob.escape("{node}"), "*")))


def _iso(ts: Optional[float]) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) if ts else "-"


def _rows(conn: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    cur = conn.execute(sql, args)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur]


def read_history(path: str, since: float, node: Optional[str], limit: int) -> dict[str, list[dict[str, Any]]]:
    """Runs (with their non-ok findings), drains and requeues since `since` from one store file. Read-only."""
    out: dict[str, list[dict[str, Any]]] = {"runs": [], "drains": [], "requeues": []}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error:
        return out
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        node_sql, node_args = (" AND node=?", (node,)) if node else ("", ())
        if "runs" in tables:
            out["runs"] = _rows(conn, f"SELECT * FROM runs WHERE started>=?{node_sql} ORDER BY started DESC LIMIT ?",
                                (since, *node_args, limit))
            for r in out["runs"]:
                r["findings"] = _rows(conn, "SELECT check_id, severity, keyword, gpu, action, message, remediation, "
                                      "evidence FROM findings WHERE run_id=? AND severity NOT IN ('ok','skip')",
                                      (r["id"],))
                for f in r["findings"]:
                    try:
                        f["evidence"] = json.loads(f["evidence"]) if f["evidence"] else {}
                    except ValueError:
                        pass
        if "drains" in tables:
            out["drains"] = _rows(conn, f"SELECT * FROM drains WHERE ts>=?{node_sql} ORDER BY ts DESC LIMIT ?",
                                  (since, *node_args, limit))
        if "attempts" in tables:  # written by the torchrun template's ledger (issue 4)
            reqs = _rows(conn, "SELECT * FROM attempts WHERE ts>=? ORDER BY ts DESC LIMIT ?", (since, limit))
            if node:
                reqs = [r for r in reqs if node in _expand_nodes(r.get("nodes") or "")
                        or node in (r.get("excluded") or "")]
            out["requeues"] = reqs
    except sqlite3.DatabaseError as e:
        print(f"gpuguard history: {path}: {e}", file=sys.stderr)
    finally:
        conn.close()
    return out


def _expand_nodes(text: str) -> set[str]:
    """'node[1-3,5],gpu7' -> {'node1','node2','node3','node5','gpu7'} (enough for filtering by node)."""
    out: set[str] = set()
    for prefix, body, plain in re.findall(r"([^,\[\]]+)\[([^\]]+)\]|([^,\[\]]+)", text):
        if plain:
            out.add(plain.strip())
            continue
        for part in body.split(","):
            lo, _, hi = part.partition("-")
            if hi and lo.isdigit() and hi.isdigit():
                out.update(f"{prefix}{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1))
            else:
                out.add(prefix + lo)
    return out


def merge(parts: list[dict[str, list[dict[str, Any]]]], limit: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"runs": [], "drains": [], "requeues": []}
    seen_requeues: set[tuple[Any, ...]] = set()
    for p in parts:
        out["runs"] += p["runs"]
        out["drains"] += p["drains"]
        for r in p["requeues"]:  # the same ledger line may be in several per-node stores
            key = (r.get("job_id"), r.get("attempt"), r.get("ts"))
            if key not in seen_requeues:
                seen_requeues.add(key)
                out["requeues"].append(r)
    out["runs"] = sorted(out["runs"], key=lambda r: r["started"], reverse=True)[:limit]
    out["drains"] = sorted(out["drains"], key=lambda r: r["ts"], reverse=True)[:limit]
    out["requeues"] = sorted(out["requeues"], key=lambda r: r["ts"], reverse=True)[:limit]
    return out


def timeline(h: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One flat list of events (newest first) for CSV: type, time, node, job, what, outcome, check, reason, detail."""
    rows = []
    for r in h["runs"]:
        worst = next((f for f in r["findings"] if f["severity"] == "fail"), r["findings"][0] if r["findings"] else None)
        rows.append({"type": "run", "time": _iso(r["started"]), "ts": r["started"], "node": r["node"],
                     "job_id": r["job_id"] or "", "what": r["kind"], "outcome": r["verdict"],
                     "check": worst["check_id"] if worst else "", "reason": r["reason"] or r.get("error") or "",
                     "detail": f"{r['duration_ms']:.0f} ms" if r.get("duration_ms") is not None else ""})
    for d in h["drains"]:
        rows.append({"type": "drain", "time": _iso(d["ts"]), "ts": d["ts"], "node": d["node"], "job_id": "",
                     "what": d["op"], "outcome": d["outcome"], "check": d["check_id"] or "",
                     "reason": d["reason"] or "", "detail": d["detail"] or ""})
    for q in h["requeues"]:
        rows.append({"type": "requeue", "time": _iso(q["ts"]), "ts": q["ts"], "node": q.get("nodes") or "",
                     "job_id": q.get("job_id") or "", "what": f"attempt {q.get('attempt')}",
                     "outcome": q.get("action") or "", "check": "", "reason": q.get("reason") or "",
                     "detail": f"exit={q.get('exit_code')} signal={q.get('signal')} excluded={q.get('excluded') or ''}"})
    return sorted(rows, key=lambda r: r["ts"], reverse=True)


def cmd_history(args: Any) -> int:
    from gpuguard.config import load_config

    cfg = load_config(args.config)
    since = parse_since(args.since)
    paths = store_paths(cfg.sections["store"]["path"], args.node)
    parts = [read_history(p, since, args.node, args.limit) for p in paths]
    h = merge(parts, args.limit)
    if args.json:
        print(json.dumps({"since": _iso(since), "stores": paths, **h}, indent=2, default=str))
        return 0
    if args.csv:
        buf = io.StringIO()
        fields = ["type", "time", "node", "job_id", "what", "outcome", "check", "reason", "detail"]
        w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(timeline(h))
        sys.stdout.write(buf.getvalue())
        return 0
    print(f"since {_iso(since)} ({len(paths)} store file(s))")
    print(f"runs ({len(h['runs'])}):")
    for r in h["runs"]:
        took = f"{r['duration_ms']:.0f}ms" if r.get("duration_ms") is not None else "-"
        print(f"  {_iso(r['started'])} {r['node']:<12} {r['kind']:<11} job={r['job_id'] or '-':<8} "
              f"{r['verdict']:<6} {took:>7} {r['reason'] or r.get('error') or ''}")
        for f in r["findings"]:
            print(f"      {f['severity']:<10} {f['check_id']:<18} {f['message']}")
    print(f"drains ({len(h['drains'])}):")
    for d in h["drains"]:
        print(f"  {_iso(d['ts'])} {d['node']:<12} {d['op']:<8} {d['outcome']:<8} {d['reason'] or ''} "
              f"{d['detail'] or ''}".rstrip())
    print(f"requeues ({len(h['requeues'])}):")
    for q in h["requeues"]:
        print(f"  {_iso(q['ts'])} job={q.get('job_id')} attempt={q.get('attempt')} {q.get('action') or '':<9} "
              f"nodes={q.get('nodes') or '-'} exit={q.get('exit_code')} reason={q.get('reason') or '-'}"
              + (f" excluded={q['excluded']}" if q.get("excluded") else ""))
    return 0

