"""Message text: one event (title and body) or a digest of many. Pure."""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from gpuguard.notify.event import DEFAULT_ACTIONS, RESOLVING_KINDS, SEVERITY_RANK, Event, dedupe_key
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.util.timefmt import iso_utc as fmt

TITLES = {"drain": "DRAINED", "undrain": "undrained", "prolog_failure": "prolog failed", "straggler": "straggler",
          "hang": "job hang", "requeue": "job requeue requested", "internal_error": "internal error",
          "flapping": "flapping node", "resource": "resource alarm", "unknown_xid": "unknown Xid",
          "storm": "drain storm held", "mismatch": "config mismatch", "gave_up": "job GAVE UP",
          "network": "NETWORK"}


def iso_utc(ts: float) -> str:
    """2026-11-24T20:06:33Z."""
    return str(fmt(ts))


def duration_text(seconds: float) -> str:
    """`4m05s`, `1h02m05s`, `2d3h00m00s`."""
    s = max(0, int(round(seconds)))
    d, rest = divmod(s, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{d}d" if d else "") + (f"{h}h" if h or d else "") + (f"{m:02d}m{s:02d}s" if h or d else f"{m}m{s:02d}s")


def evidence_text(evidence: dict, limit: int = 1200) -> str:  # type: ignore[type-arg]
    text = "; ".join(f"{k}={json.dumps(v, default=str, separators=(',', ':'))}" for k, v in evidence.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gpu_identities(nvml: Any, indices: Iterable[Optional[int]]) -> list[dict[str, Any]]:
    """UUID, serial and PCI address of the GPUs with these NVML indices, from the run's NVML observation
    (`observations.nvml`; anything with `.gpus[*].index/.uuid/.serial/.pci_bus_id`). A GPU NVML no longer sees
    (fallen off the bus) is listed by index alone."""
    by_index = {getattr(g, "index", None): g for g in (getattr(nvml, "gpus", None) or [])}
    out = []
    for i in dict.fromkeys(i for i in indices if i is not None):
        g = by_index.get(i)
        ident: dict[str, Any] = {"index": i}
        for attr in ("uuid", "serial", "pci_bus_id"):
            value = getattr(g, attr, None) if g is not None else None
            if value:
                ident[attr] = str(value)
        out.append(ident)
    return out


def gpu_line(g: dict[str, Any]) -> str:
    bits = [f"GPU {g.get('index', '?')}"]
    for attr, label in (("uuid", "uuid"), ("serial", "serial"), ("pci_bus_id", "pci")):
        if g.get(attr):
            bits.append(f"{label}={g[attr]}")
    if len(bits) == 1:
        bits.append("(not visible to NVML: no UUID/serial)")
    return " ".join(bits)


def action_text(event: Event) -> str:
    if event.action:
        return event.action
    if event.resolved and event.kind not in RESOLVING_KINDS:
        return "none: the condition cleared"
    return DEFAULT_ACTIONS.get(event.kind, "see the gpuguard log")


def title_of(event: Event, prefix: str = "gpuguard") -> str:
    what = TITLES.get(event.kind, event.kind)
    if event.kind == "drain" and (event.evidence or {}).get("drain") == "pending":
        what = "DRAIN PENDING"  # decided, Slurm has not taken it yet (slurmctld unreachable)
    about = f"{event.component_kind} {event.component}" if event.component and event.component_kind else event.node
    return f"{prefix}: {'RESOLVED ' if event.resolved else ''}{what} {about}" + \
        (f" {event.check_id}" if event.check_id else "")


def render(event: Event, prefix: str = "gpuguard", repeats: int = 0, since: Optional[float] = None,
           opened: Optional[float] = None) -> tuple[str, str]:
    """(title, body) naming the node, the check, the GPUs (UUID, serial), the evidence, the suggested action and
    the dedupe key; a resolved message also says since when it fired and how often."""
    lines = [
        f"node:     {event.node}",
        f"event:    {event.kind} ({event.severity})",
        f"status:   {'resolved' if event.resolved else 'firing'}",
        f"check:    {event.check_id or '-'}",
        f"what:     {event.message}",
    ]
    if event.reason:
        lines.append(f"reason:   {event.reason}")
    if event.job_id:
        lines.append(f"job:      {event.job_id}")
    for g in event.gpus or []:
        if isinstance(g, dict):
            lines.append(f"gpu:      {gpu_line(g)}")
    lines.append(f"evidence: {evidence_text(event.evidence) if event.evidence else '-'}")
    lines.append(f"action:   {action_text(event)}")
    lines.append(f"when:     {iso_utc(event.ts)}")
    if event.resolved and opened is not None:
        lines.append(f"fired:    {iso_utc(opened)} (lasted {duration_text(event.ts - opened)})")
    lines.append(f"dedup:    {dedupe_key(event, prefix)}")
    if repeats:
        first = iso_utc(since) if since else "earlier"
        lines.append(f"(also happened {repeats} more time(s) since {first}; those were not sent separately)")
    return title_of(event, prefix), "\n".join(lines)


def _label(e: dict[str, Any]) -> str:
    kind = str(e.get("kind") or "?")
    return f"{kind} resolved" if e.get("state") == "resolved" and kind not in RESOLVING_KINDS else kind


def worst_severity(events: list[dict[str, Any]]) -> str:
    return max((str(e.get("severity", "warning")) for e in events), key=lambda s: SEVERITY_RANK.get(s, 1))


def render_digest(events: list[dict[str, Any]], prefix: str, why: str) -> tuple[str, str]:
    """One message for many events (those the rate limit held back)."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in events:
        by.setdefault((_label(e), e.get("check_id") or "-"), []).append(e)
    nodes = sorted({str(e.get("node")) for e in events})
    title = f"{prefix}: {len(events)} events on {len(nodes)} node(s): {compress_hostlist(nodes)}"
    lines = [f"{why}", ""]
    for (kind, check), evs in sorted(by.items()):
        worst = max(evs, key=lambda e: SEVERITY_RANK.get(e.get("severity", "warning"), 1))
        lines.append(f"{kind} {check} x{len(evs)} on {compress_hostlist(str(e.get('node')) for e in evs)} "
                     f"({worst.get('severity', 'warning')})")
        lines.append(f"  e.g. {worst.get('node')}: {worst.get('message')}")
        if worst.get("reason"):
            lines.append(f"  reason: {worst['reason']}")
        base_kind = str(worst.get("kind"))
        lines.append(f"  action: {worst.get('action') or DEFAULT_ACTIONS.get(base_kind, 'see the gpuguard log')}")
    return title, "\n".join(lines)
