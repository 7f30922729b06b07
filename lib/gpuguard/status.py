"""`gpuguard status`: what is drained right now, by whom, why, since when, and how far the health check is towards
lifting it."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from typing import Any, Optional


def _iso(ts: Optional[float]) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) if ts else "-"


def drained_nodes(scontrol_output: str) -> list[dict[str, Any]]:
    """Nodes that are drained or down, from `scontrol show node -o`. Pure."""
    from gpuguard.reason import is_ours, parse_reason
    from gpuguard.slurm import node_state_from_fields, parse_node_lines

    out = []
    for name, fields in parse_node_lines(scontrol_output).items():
        st = node_state_from_fields(fields)
        if not (st.drained or st.down):
            continue
        parsed = parse_reason(st.reason) if is_ours(st.reason) else None
        out.append({"node": name, "state": "+".join(sorted(st.states)), "reason": st.reason,
                    "ours": is_ours(st.reason), "reason_time": st.reason_time, "reason_user": st.reason_user,
                    "check_id": parsed.check_id if parsed else None, "keyword": parsed.keyword if parsed else None,
                    "action": parsed.action if parsed else None})
    return sorted(out, key=lambda n: n["node"])


def _store_facts(cfg: Any, node: str) -> dict[str, Any]:
    """Since when gpuguard has this node drained (its own record), and how far the health check is towards
    lifting it."""
    from gpuguard.store import Store

    path = cfg.sections["store"]["path"].replace("{node}", node)
    facts: dict[str, Any] = {}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
        conn.close()
    except sqlite3.Error:
        return facts
    try:
        with Store(path, timeout_s=2.0) as st:
            drain = st.active_drain(node) if hasattr(st, "active_drain") else None
            if drain:
                facts["drained_at"] = drain["ts"]
                facts["drain_check"] = drain.get("check_id")
                if drain.get("check_id") and hasattr(st, "consecutive_passes"):
                    facts["passes_since"] = st.consecutive_passes(node, drain["check_id"], drain["ts"])
            last = st.runs(node=node, limit=1)
            if last:
                facts["last_run"] = {"kind": last[0]["kind"], "verdict": last[0]["verdict"],
                                     "started": last[0]["started"]}
    except Exception as e:  # noqa: BLE001 - status must show Slurm's view even when a store is unreadable
        facts["store_error"] = f"{type(e).__name__}: {e}"
    return facts


def cmd_status(args: Any) -> int:
    from gpuguard.config import load_config
    from gpuguard.slurm import CliSlurmClient, SlurmError

    cfg = load_config(args.config)
    s = cfg.sections["slurm"]
    client = CliSlurmClient(s["scontrol"], cfg.sections["deadlines"]["scontrol_s"], s["conf"])
    try:
        text = client.run(["show", "node", "-o"])
    except SlurmError as e:
        print(f"gpuguard status: cannot ask Slurm: {e}", file=sys.stderr)
        return 2
    nodes = [n for n in drained_nodes(text) if args.all or n["ours"]]
    for n in nodes:
        if n["ours"]:
            n.update(_store_facts(cfg, n["node"]))
    if args.json:
        print(json.dumps({"nodes": nodes}, indent=2, default=str))
        return 0
    if not nodes:
        print("no node is drained by gpuguard" + ("" if args.all else " (--all: also other drains)"))
        return 0
    print(f"{'NODE':<14} {'STATE':<18} {'SINCE':<20} {'CHECK':<16} {'ACTION':<8} REASON")
    for n in nodes:
        since = _iso(n["drained_at"]) if n.get("drained_at") else (n.get("reason_time") or "-")
        print(f"{n['node']:<14} {n['state']:<18} {since:<20} {n.get('check_id') or '-':<16} "
              f"{n.get('action') or ('drain' if n['ours'] else '-'):<8} {n['reason'] or '-'}"
              + ("" if n["ours"] else f"  [not gpuguard's: {n.get('reason_user') or '?'}]"))
        if n.get("passes_since") is not None:
            print(f"{'':<14} health check: {n['passes_since']} passing run(s) of {n['drain_check']} since the drain")
    return 0
