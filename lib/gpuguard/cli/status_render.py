"""What `gpuguard status` prints (pure): the summary by fault, each drained node's details, the nodes someone
else drained, the notify spool, gpuguard's own health, and the same as JSON. The facts come from
gpuguard.cli.status."""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.config.lastgood import describe
from gpuguard.pipeline.conditions import CLEARS
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.slurm.parse import slurm_time
from gpuguard.util.timefmt import iso_utc

DETAIL_AUTO = 20  # up to this many drained nodes, details are shown without --details
OLDEST = 5  # oldest drains in the summary
HOSTLIST_WIDTH = 60


def format_duration(seconds: Optional[float]) -> str:
    """45 -> '45s', 7980 -> '2h13m', 273600 -> '3d4h'. Two units at most: it is read at a glance."""
    if seconds is None:
        return "-"
    s = max(int(seconds), 0)
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d{h}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


def group_nodes(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpuguard's drains grouped by fault (keyword + check), each with its nodes as a Slurm hostlist; the biggest
    group first. A gpuguard reason that does not parse (hand-edited) is its own group, keyword '?'. Pure."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for n in nodes:
        if n["ours"]:
            groups.setdefault((n.get("keyword") or "?", n.get("check_id") or "?"), []).append(n)
    out = []
    for (keyword, check_id), members in groups.items():
        out.append({"keyword": keyword, "check_id": check_id, "nodes": [m["node"] for m in members],
                    "hostlist": compress_hostlist(m["node"] for m in members),
                    "actions": sorted({m.get("action") or "drain" for m in members})})
    return sorted(out, key=lambda g: (-len(g["nodes"]), g["keyword"], g["check_id"]))


def state_class(n: dict[str, Any]) -> str:
    """drained (idle, out of service), draining (jobs still running on it) or down. Pure."""
    flags = set(str(n.get("state") or "").upper().split("+"))
    if "DOWN" in flags:
        return "down"
    if flags & {"ALLOCATED", "ALLOC", "MIXED", "COMPLETING"}:
        return "draining"
    return "drained"


def _clip_hostlist(names: list[str], width: int = HOSTLIST_WIDTH) -> str:
    """A hostlist that fits one line: the first nodes' hostlist and how many more."""
    text = compress_hostlist(names)
    if len(text) <= width:
        return text
    lo, hi = 1, len(names)
    while lo < hi:  # the most leading nodes whose hostlist still fits
        mid = (lo + hi + 1) // 2
        if len(compress_hostlist(names[:mid])) <= width - 14:
            lo = mid
        else:
            hi = mid - 1
    return f"{compress_hostlist(names[:lo])} (+{len(names) - lo} more)"


def summarize(nodes: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """Counts by state and by fault, and the oldest drains, of gpuguard's drains. Pure."""
    ours = [n for n in nodes if n["ours"]]
    by_state = {k: 0 for k in ("drained", "draining", "down")}
    for n in ours:
        by_state[state_class(n)] += 1
    faults = [{"keyword": g["keyword"], "check_id": g["check_id"], "count": len(g["nodes"]),
               "hostlist": _clip_hostlist(g["nodes"]), "actions": g["actions"]} for g in group_nodes(nodes)]
    dated = sorted((n for n in ours if n.get("drained_since")), key=lambda n: (n["drained_since"], n["node"]))
    oldest = [{"node": n["node"], "drained_for_s": round(now - n["drained_since"]), "keyword": n.get("keyword") or "?",
               "check_id": n.get("check_id") or "?"} for n in dated[:OLDEST]]
    return {"drained_by_gpuguard": len(ours), "other": len(nodes) - len(ours), "by_state": by_state,
            "by_fault": faults, "oldest": oldest}


def _last_check_text(n: dict[str, Any]) -> str:
    hc = n.get("last_healthcheck")
    if not hc:
        return "no store" if n.get("store_missing") else ("?" if n.get("store_error") else "never")
    return f"{iso_utc(hc['started'])} {hc['verdict']}"


def _summary_lines(summary: dict[str, Any], show_foreign: bool) -> list[str]:
    st = summary["by_state"]
    lines = [f"  state: {st['drained']} drained (idle), {st['draining']} draining (jobs still running), "
             f"{st['down']} down"]
    if summary["by_fault"]:
        lines.append(f"  {'FAULT':<10} {'CHECK':<18} {'NODES':>6}  {'HOSTLIST':<{HOSTLIST_WIDTH}}  ACTION")
        for f in summary["by_fault"]:
            lines.append(f"  {f['keyword']:<10} {f['check_id']:<18} {f['count']:>6}  "
                         f"{f['hostlist']:<{HOSTLIST_WIDTH}}  {'/'.join(f['actions'])}")
    if summary["oldest"]:
        lines.append("  oldest drains:")
        for o in summary["oldest"]:
            lines.append(f"    {format_duration(o['drained_for_s']):<8} {o['node']:<12} {o['keyword']} {o['check_id']}")
    return lines


def _detail_lines(nodes: list[dict[str, Any]], now: float) -> list[str]:
    lines: list[str] = []
    by_name = {n["node"]: n for n in nodes}
    for g in group_nodes(nodes):
        lines.append("")
        lines.append(f"{g['keyword']} {g['check_id']}  {g['hostlist']}  {'/'.join(g['actions'])}")
        lines.append(f"  {'NODE':<12} {'STATE':<16} {'DRAINED FOR':<12} {'SINCE':<20}  {'LAST HEALTH CHECK':<28} "
                     "DETAIL")
        for name in g["nodes"]:
            n = by_name[name]
            since = n.get("drained_since")
            detail = n.get("detail") or n.get("reason") or ""
            if n.get("legacy_reason"):
                detail += "  (reason from an older gpuguard)"
            if n.get("switch"):
                detail += f"  (switch {n['switch']})"
            lines.append(f"  {name:<12} {n['state']:<16} {format_duration(now - since if since else None):<12} "
                         f"{iso_utc(since) or '-':<20}  {_last_check_text(n):<28} {detail}")
            if n.get("passes_since") is not None and n.get("last_healthcheck"):
                lines.append(f"  {'':<12} health check: {n['passes_since']} passing run(s) of {n['drain_check']} "
                             "since the drain")
            if n.get("store_error"):
                lines.append(f"  {'':<12} store unreadable: {n['store_error']}")
    missing = [n["node"] for n in nodes if n["ours"] and n.get("store_missing")]
    if missing:
        lines.append("")
        first = next(n["store_missing"] for n in nodes if n["ours"] and n.get("store_missing"))
        lines.append(f"no history store here for {_clip_hostlist(missing)} (no {first}); put store.path "
                     "(with {node}) on a shared filesystem to see their health checks from here")
    return lines


def _foreign_lines(foreign: list[dict[str, Any]], now: float) -> list[str]:
    lines = ["", "not gpuguard's (gpuguard never lifts these):"]
    for n in foreign:
        since = n.get("drained_since")
        lines.append(f"  {n['node']:<12} {n['state']:<16} {format_duration(now - since if since else None):<12} "
                     f"{iso_utc(since) or '-':<20}  {n.get('reason') or '-'}  [{n.get('reason_user') or '?'}]")
    return lines


def _spool_lines(spool: dict[str, Any]) -> list[str]:
    lines = [""]
    waiting = spool["pending"] + spool["held"]
    if not waiting and not spool["expired"]:
        lines.append("notifications: none undelivered")
    else:
        oldest = f", oldest {iso_utc(spool['oldest'])}" if spool.get("oldest") else ""
        lines.append(f"notifications: {waiting} undelivered ({spool['pending']} retrying, {spool['held']} held "
                     f"for a digest{oldest}), {spool['expired']} expired (given up)")
        by_node = sorted(spool["by_node"].items())
        for node, c in by_node[:DETAIL_AUTO]:
            lines.append(f"  {node:<12} {c['pending']} retrying, {c['held']} held, {c['expired']} expired")
        if len(by_node) > DETAIL_AUTO:
            lines.append(f"  ... {len(by_node) - DETAIL_AUTO} more node(s) (--json for all)")
        for e in spool["last_errors"]:  # one line per receiver that did not take the message
            failed = str(e["error"]).splitlines() or ["-"]
            lines.append(f"  last error ({e['node']}, {e['attempts']} attempt(s), '{e['title']}'): {failed[0]}")
            lines.extend(f"    {more}" for more in failed[1:])
    for err in spool.get("errors", []):
        lines.append(f"  spool unreadable: {err}")
    return lines


def render_status(nodes: list[dict[str, Any]], spool: Optional[dict[str, Any]], now: float,
                  show_foreign: bool, details: Optional[bool] = None) -> str:
    """The human view: the summary, then the details (`details` None: only when few nodes are drained), other
    people's drains (`show_foreign`), undelivered notifications. Pure: `nodes` already carry their store facts."""
    ours = [n for n in nodes if n["ours"]]
    foreign = [n for n in nodes if not n["ours"]]
    summary = summarize(nodes, now)
    lines = [f"gpuguard status at {iso_utc(now)}: {len(ours)} node(s) drained by gpuguard"
             + (f", {len(foreign)} drained or down by someone else" if show_foreign else "")]
    if not ours:
        lines.append("no node is drained by gpuguard" + ("" if show_foreign else " (--all: also other drains)"))
    else:
        lines += _summary_lines(summary, show_foreign)
    show = len(ours) <= DETAIL_AUTO if details is None else details
    if show:
        lines += _detail_lines(nodes, now)
    elif ours:
        lines.append(f"  per node: gpuguard status --details (all {len(ours)}), or --node HOSTLIST")
    if show_foreign and foreign:
        lines += _foreign_lines(foreign if show or len(foreign) <= DETAIL_AUTO else foreign[:DETAIL_AUTO], now)
        if not show and len(foreign) > DETAIL_AUTO:
            lines.append(f"  ... {len(foreign) - DETAIL_AUTO} more (--details for all)")
    if spool is not None:
        lines += _spool_lines(spool)
    return "\n".join(lines)


def to_json(nodes: list[dict[str, Any]], spool: Optional[dict[str, Any]], now: float) -> dict[str, Any]:
    """The machine view: the summary and every node, every time as UTC ISO 8601, durations in seconds."""
    out_nodes = []
    for n in nodes:
        m = dict(n)
        since = m.pop("drained_since", None)
        m["drained_at"] = iso_utc(since)
        m["drained_for_s"] = round(now - since) if since else None
        m.pop("reason_time", None)
        m["reason_time"] = iso_utc(slurm_time(n.get("reason_time")))
        for key in ("last_run", "last_healthcheck"):
            if m.get(key):
                m[key] = {**m[key], "started": iso_utc(m[key]["started"])}
        out_nodes.append(m)
    doc: dict[str, Any] = {"time": iso_utc(now), "summary": summarize(nodes, now), "groups": group_nodes(nodes),
                           "nodes": out_nodes}
    if spool is not None:
        doc["notifications"] = {**spool, "oldest": iso_utc(spool["oldest"]) if spool.get("oldest") else None}
    return doc


def render_own_health(local_cfg: Any, health: dict[str, Any], now: float) -> list[str]:
    """The lines an admin must see first: gpuguard itself is not working as configured."""
    lines: list[str] = []
    if local_cfg.issues:
        lines.append(f"CONFIG BROKEN here: {describe(local_cfg)}")
    by_text: dict[str, list[str]] = {}
    for c in health["config"]:
        by_text.setdefault("; ".join(c["issues"][:3]) + f" ({c.get('mode')})", []).append(c["node"])
    for text, nodes in by_text.items():
        lines.append(f"CONFIG BROKEN on {compress_hostlist(nodes)}: {text}")
    for p in sorted(health["pending"], key=lambda p: p.get("created") or 0):
        lines.append(f"PENDING {p.get('op', 'drain')} on {p['node']} for {format_duration(now - (p.get('created') or now))}"
                     f" ({p.get('attempts', 0)} attempt(s), last error: {p.get('last_error') or '-'}): "
                     f"{p.get('reason')}  [jobs refused until Slurm takes it]")
    for c in sorted(health.get("conditions") or [], key=lambda c: (c["node"], c.get("first_seen") or 0)):
        lines.append(f"CONDITION on {c['node']} since {iso_utc(c.get('first_seen') or now)}: {c['keyword']} "
                     f"{c.get('check_id')} ({c.get('action')}) {c.get('message', '')[:80]}  [jobs refused until "
                     f"{CLEARS.get(c.get('action') or '', 'it clears')}]")
    return lines
