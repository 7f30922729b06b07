"""The sweep end to end: measure and isolate (gpuguard.nccl.sweep, gpuguard.nccl.isolate), drain the convicted
nodes, record it all in the history store, and format the report table an admin reads."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from gpuguard.nccl import history
from gpuguard.nccl.baseline import samples_from_result
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.nccl.isolate import Measure, Progress, SweepOutcome, drain_reason, isolate
from gpuguard.nccl.sweep import SweepError
from gpuguard.slurm.client import drain_node


@dataclass
class SweepRecord:
    outcome: SweepOutcome
    sweep_id: Optional[int]
    duration_s: float
    drained: list[str]


def run_fleet_sweep(nodes: list[str], measure: Measure, *, method: str = "pairwise", partition: Optional[str] = None,
                    profile: str = "generic", store: Any = None, slurm_client: Any = None, drain: bool = True,
                    max_drain_fraction: float = 0.5, record_samples: bool = True,
                    progress: Optional[Progress] = None) -> SweepRecord:
    """Sweep `nodes`; drain the slow ones through `slurm_client` (gpuguard.slurm.client.drain_node's ownership rules);
    record sweep, runs, drains and busbw samples in `store` (a gpuguard Store, or None)."""
    t0 = time.monotonic()
    sweep_id = None
    if store is not None:
        sweep_id = history.start_sweep(store, partition=partition, nodes=compress_hostlist(nodes), method=method,
                                       profile=profile, threshold_gbps=None)
    try:
        outcome = isolate(nodes, measure, method=method, max_drain_fraction=max_drain_fraction, progress=progress)
    except SweepError as e:  # a job that can never start (JobCannotStart): the sweep ends, recorded as an error
        if store is not None and sweep_id is not None:
            history.finish_sweep(store, sweep_id, conclusion="error", slow_nodes=[], report={"message": str(e)})
        raise
    drained: list[str] = []
    for node in outcome.slow:
        v = outcome.verdicts[node]
        reason = drain_reason(v)
        if not drain or slurm_client is None:
            v.drain = {"outcome": "skipped", "detail": "--no-drain" if not drain else "no Slurm client", "reason": reason}
            continue
        res = drain_node(slurm_client, node, reason)
        v.drain = {"outcome": res.outcome, "detail": res.detail, "reason": reason,
                   "previous_reason": res.previous_reason}
        if res.outcome == "done":
            drained.append(node)
        if store is not None:
            store.record_drain(node=node, op="drain", outcome=res.outcome, reason=reason, check_id="nccl.sweep",
                               action="drain", run_id=None, detail=res.detail or v.evidence)
        if progress:
            progress(f"drain    {node:20} {res.outcome}: {reason}")
    if store is not None and sweep_id is not None:
        for m in outcome.measurements:
            history.record_run(store, sweep_id=sweep_id, stage=m.stage, nodes=compress_hostlist(list(m.nodes)),
                               n_nodes=len(m.nodes), job_id=m.job_id, job_state=m.job_state, busbw_gbps=m.busbw_gbps,
                               size_bytes=m.size_bytes,
                               peak_busbw_gbps=m.result.peak_busbw_gbps if m.result else None,
                               avg_busbw_gbps=m.result.avg_busbw_gbps if m.result else None,
                               threshold_gbps=m.threshold_gbps, verdict=m.verdict, error=m.error, output=m.output_path)
            if record_samples and m.result is not None and m.verdict in ("ok", "slow") and m.result.rows:
                history.record_samples(store, samples_from_result(m.result, profile, len(m.nodes),
                                                                  compress_hostlist(list(m.nodes)), "sweep", m.job_id))
        first = outcome.measurements[0] if outcome.measurements else None
        store.conn.execute("UPDATE nccl_sweeps SET threshold_gbps=? WHERE id=?",
                           (first.threshold_gbps if first else None, sweep_id))
        history.finish_sweep(store, sweep_id, conclusion=outcome.conclusion, slow_nodes=outcome.slow,
                             report=outcome.to_dict())
    return SweepRecord(outcome, sweep_id, time.monotonic() - t0, drained)


def _f(v: Optional[float], nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def per_switch(o: Any, switches: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """{leaf switch: {nodes, ok, slow, other, drained}} over the swept nodes under it (Slurm's topology). Pure."""
    out: dict[str, dict[str, Any]] = {}
    for sw, members in switches.items():
        mine = [n for n in o.nodes if n in members]
        if not mine:
            continue
        status = [o.verdicts[n].status if n in o.verdicts else "-" for n in mine]
        out[sw] = {"nodes": compress_hostlist(mine), "count": len(mine), "ok": status.count("ok"),
                   "slow": status.count("slow"), "other": len(mine) - status.count("ok") - status.count("slow"),
                   "drained": sum(1 for n in mine if n in o.verdicts and o.verdicts[n].drain)}
    return out


def switch_lines(o: Any, switches: dict[str, list[str]]) -> list[str]:
    groups = per_switch(o, switches)
    if not groups:
        return []
    lines = ["", f"{'switch':16} {'nodes':>5} {'ok':>4} {'slow':>5} {'other':>6} {'drained':>8}  hostlist"]
    for sw, g in groups.items():
        note = "  <- most of its nodes slow: suspect the switch" if g["slow"] * 2 > g["count"] >= 2 else ""
        lines.append(f"{sw:16} {g['count']:>5} {g['ok']:>4} {g['slow']:>5} {g['other']:>6} {g['drained']:>8}  "
                     f"{g['nodes']}{note}")
    return lines


def format_report(rec: SweepRecord, partition: Optional[str] = None, method: str = "pairwise",
                  switches: Optional[dict[str, list[str]]] = None) -> str:
    """The tables `gpuguard nccl sweep` prints: every run, then every node, then every leaf switch (when Slurm has
    a topology)."""
    o = rec.outcome
    lines = [f"NCCL sweep of {len(o.nodes)} nodes ({compress_hostlist(o.nodes)})"
             + (f", partition {partition}" if partition else "") + f", {method}"
             + (f", sweep #{rec.sweep_id}" if rec.sweep_id else ""), ""]
    lines.append(f"{'stage':8} {'nodes':22} {'job':>7} {'busbw GB/s':>11} {'threshold':>10}  verdict")
    for m in o.measurements:
        verdict = m.verdict.upper() if m.verdict != "ok" else "ok"
        if m.verdict == "error":
            verdict += f" ({(m.error or m.job_state or '')[:60]})"
        elif m.verdict == "wrong":
            verdict += f" ({m.wrong} wrong values)"
        lines.append(f"{m.stage:8} {compress_hostlist(list(m.nodes)):22} {m.job_id or '-':>7} "
                     f"{_f(m.busbw_gbps):>11} {_f(m.threshold_gbps, 0) if m.threshold_gbps is not None else '-':>10}  "
                     f"{verdict}")
    lines += ["", f"{'node':16} {'verdict':8} {'busbw GB/s':>11}  evidence / action"]
    for n in o.nodes:
        v = o.verdicts.get(n)
        if v is None:
            lines.append(f"{n:16} {'-':8} {'-':>11}")
            continue
        action = ""
        if v.drain:
            action = f"  -> {v.drain['outcome']}" + (f" ({v.drain['detail']})" if v.drain.get("detail") else "")
        status = v.status.upper() if v.status != "ok" else "ok"
        lines.append(f"{n:16} {status:8} {_f(v.busbw_gbps):>11}  {v.evidence}"
                     + (f", job {v.job_id}" if v.job_id else "") + action)
    lines += switch_lines(o, switches or {})
    jobs = len([m for m in o.measurements if m.job_id])
    lines += ["", f"Result: {o.conclusion}: {o.message} ({jobs} jobs, {rec.duration_s:.1f}s)"]
    return "\n".join(lines) + "\n"
