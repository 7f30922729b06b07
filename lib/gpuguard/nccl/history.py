"""NCCL results in the history store: sweeps, their runs, and busbw samples for baselines.

The tables live in the same SQLite file as gpuguard's runs and drains (`gpuguard.store.sqlite.Store`), under its
schema and version (`gpuguard.store.schema`: a fresh file gets them, an older one the migrations to version 4, which
adds them, and 5, which gives each sample the collective it was measured with: `backend`).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Optional

from gpuguard.store.sqlite import Store



def open_history(path: str, timeout_s: float = 5.0) -> Store:
    """The store at `path`, its NCCL tables present (the store's schema has them)."""
    return Store(path, timeout_s=timeout_s)


def start_sweep(store: Store, *, partition: Optional[str], nodes: str, method: str, profile: str,
                threshold_gbps: Optional[float]) -> int:
    cur = store.conn.execute(
        "INSERT INTO nccl_sweeps(started,partition,nodes,method,profile,threshold_gbps) VALUES (?,?,?,?,?,?)",
        (time.time(), partition, nodes, method, profile, threshold_gbps))
    return int(cur.lastrowid or 0)


def finish_sweep(store: Store, sweep_id: int, *, conclusion: str, slow_nodes: list[str], report: dict[str, Any]) -> None:
    store.conn.execute("UPDATE nccl_sweeps SET finished=?, conclusion=?, slow_nodes=?, report=? WHERE id=?",
                       (time.time(), conclusion, json.dumps(slow_nodes), json.dumps(report, default=str), sweep_id))


def record_run(store: Store, *, sweep_id: Optional[int], stage: str, nodes: str, n_nodes: int,
               job_id: Optional[str], job_state: Optional[str], busbw_gbps: Optional[float],
               size_bytes: Optional[int], peak_busbw_gbps: Optional[float], avg_busbw_gbps: Optional[float],
               threshold_gbps: Optional[float], verdict: str, error: Optional[str], output: Optional[str]) -> int:
    cur = store.conn.execute(
        "INSERT INTO nccl_runs(sweep_id,ts,stage,nodes,n_nodes,job_id,job_state,busbw_gbps,size_bytes,"
        "peak_busbw_gbps,avg_busbw_gbps,threshold_gbps,verdict,error,output) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (sweep_id, time.time(), stage, nodes, n_nodes, job_id, job_state, busbw_gbps, size_bytes, peak_busbw_gbps,
         avg_busbw_gbps, threshold_gbps, verdict, error, output))
    return int(cur.lastrowid or 0)


Sample = tuple[str, int, int, float, str, str, Optional[str], str]


def record_samples(store: Store, samples: Iterable[Sample]) -> int:
    """(profile, n_nodes, size_bytes, busbw_gbps, nodes, source, job_id, backend) rows; returns how many. `backend`:
    the collective measured (nccl-tests | nccl | gloo)."""
    rows = [(time.time(), *s) for s in samples]
    if any(len(r) != 9 for r in rows):
        raise ValueError("a sample is (profile, n_nodes, size_bytes, busbw_gbps, nodes, source, job_id, backend)")
    store.conn.executemany(
        "INSERT INTO nccl_samples(ts,profile,n_nodes,size_bytes,busbw_gbps,nodes,source,job_id,backend) "
        "VALUES (?,?,?,?,?,?,?,?,?)", rows)
    return len(rows)


def samples(store: Store, profile: Optional[str] = None, n_nodes: Optional[int] = None,
            size_bytes: Optional[int] = None, since: Optional[float] = None,
            backend: Optional[str] = None) -> list[dict[str, Any]]:
    q = "SELECT * FROM nccl_samples WHERE 1=1"
    args: list[Any] = []
    for col, val in (("profile", profile), ("n_nodes", n_nodes), ("size_bytes", size_bytes), ("backend", backend)):
        if val is not None:
            q += f" AND {col}=?"
            args.append(val)
    if since is not None:
        q += " AND ts>=?"
        args.append(since)
    cur = store.conn.execute(q + " ORDER BY id", args)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur]


def sweeps(store: Store, limit: int = 20) -> list[dict[str, Any]]:
    cur = store.conn.execute("SELECT * FROM nccl_sweeps ORDER BY id DESC LIMIT ?", (limit,))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur]


def runs_of(store: Store, sweep_id: int) -> list[dict[str, Any]]:
    cur = store.conn.execute("SELECT * FROM nccl_runs WHERE sweep_id=? ORDER BY id", (sweep_id,))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur]
