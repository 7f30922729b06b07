"""Rendering a run for humans (terminal, logs) and machines (--json). Times are UTC ISO 8601
(`2026-11-24T20:06:33Z`): a fleet spans time zones, and Slurm, the kernel log and alerts are compared side by side."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, TextIO

from gpuguard.model import Severity
from gpuguard.model import RunResult
from gpuguard.util.timefmt import iso_utc

_ORDER = {Severity.FAIL: 0, Severity.INCOMPLETE: 1, Severity.WARN: 2, Severity.OK: 3, Severity.SKIP: 4}
_COLORS = {Severity.FAIL: "31", Severity.INCOMPLETE: "33", Severity.WARN: "33", Severity.OK: "32", Severity.SKIP: "90"}


def to_dict(r: RunResult, with_observations: bool = True) -> dict[str, Any]:
    d: dict[str, Any] = {
        "node": r.context.node,
        "kind": r.context.kind,
        "started": iso_utc(r.started),
        "job_id": r.context.job_id,
        "gpus": list(r.context.gpu_indices) if r.context.gpu_indices is not None else None,
        "profile": r.profile.name,
        "simulated": r.simulated,
        "verdict": r.verdict.outcome,
        "action": r.verdict.action.value,
        "reason": r.verdict.reason,
        "reported_only": r.verdict.reported_only,
        "exit_code": r.exit_code,
        "duration_s": round(r.duration_s, 4),
        "drain": r.drain,
        "run_id": r.run_id,
        "findings": [f.to_dict() for f in r.findings],
    }
    if with_observations:
        d["observations"] = dataclasses.asdict(r.observations)
    return d


def render_json(r: RunResult) -> str:
    return json.dumps(to_dict(r), indent=2, default=str)


def _color(text: str, code: str, enabled: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if enabled else text


def render_text(r: RunResult, verbose: bool = False, color: bool = False) -> str:
    ctx = r.context
    gpus = "all GPUs" if ctx.gpu_indices is None else ("no GPUs" if not ctx.gpu_indices else
                                                      "GPUs " + ",".join(map(str, ctx.gpu_indices)))
    job = f"job {ctx.job_id}, " if ctx.job_id else ""
    sim = f" [simulated: {os.path.relpath(r.simulated) if r.simulated else ''}]" if r.simulated else ""
    lines = [f"gpuguard {ctx.kind} on {ctx.node} ({job}{gpus}) at {iso_utc(r.started)} - profile {r.profile.name}{sim}"]
    shown = sorted(r.findings, key=lambda f: (_ORDER[f.severity], f.check_id))
    for f in shown:
        if f.severity is Severity.SKIP and not verbose:
            continue
        tag = _color(f"{f.severity.value.upper():<10}", _COLORS[f.severity], color)
        lines.append(f"  {tag} {f.check_id:<20} {f.message}")
        if f.severity in (Severity.FAIL, Severity.INCOMPLETE, Severity.WARN) and f.remediation:
            act = f"{f.action.value}: " if f.action.value not in ("none", "drain") else ""
            lines.append(f"  {'':<10} {'':<20} -> {act}{f.remediation}")
    skipped = sum(1 for f in r.findings if f.severity is Severity.SKIP)
    if skipped and not verbose:
        lines.append(f"  ({skipped} checks skipped: nothing to compare against; -v shows them)")
    v = r.verdict
    head = {"pass": "PASS", "warn": "WARN", "drain": "DRAIN"}[v.outcome]
    if v.outcome == "drain" or v.reported_only:
        act = f" ({v.action.value})" if v.action.value not in ("drain", "none") else ""
        extra = " - reported only (policy.on_failure: report)" if v.reported_only else ""
        lines.append(f"verdict: {_color(head, '31', color)}{act}{extra}")
        lines.append(f"reason:  {v.reason}")
    else:
        lines.append(f"verdict: {_color(head, '32' if head == 'PASS' else '33', color)}")
    if r.drain:
        prev = f" (existing reason: {r.drain['previous_reason']})" if r.drain.get("previous_reason") else ""
        lines.append(f"drain:   {r.drain['outcome']}{' - ' + r.drain['detail'] if r.drain.get('detail') else ''}{prev}")
    lines.append(f"took {r.duration_s:.3f}s")
    return "\n".join(lines)


def print_report(r: RunResult, as_json: bool, verbose: bool = False, stream: TextIO = sys.stdout) -> None:
    if as_json:
        stream.write(render_json(r) + "\n")
    else:
        stream.write(render_text(r, verbose=verbose, color=stream.isatty()) + "\n")
