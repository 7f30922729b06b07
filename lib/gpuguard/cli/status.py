"""`gpuguard status`: what is drained right now, for an admin woken at 3 am. A summary first, whatever the size of
the cluster:

    gpuguard status at 2026-11-24T20:06:33Z: 412 node(s) drained by gpuguard
      state: 380 drained (idle), 30 draining (jobs still running), 2 down
      fault          check            nodes  hostlist                                    action
      XID79          gpu.xid            301  gpu-[0012,0088-0090,...] (+287 more)       reboot
      oldest drains:
        3d4h     gpu-0012     XID79 gpu.xid

then, for a few drained nodes (up to DETAIL_AUTO), with `--details`, or for `--node HOSTLIST`, each fault with its
nodes: how long each has been drained, the last health check its store recorded (time and verdict; "never" means
no HealthCheckProgram ran since the drain, so nothing will lift it), how far the health check is towards lifting
it, and the reason's detail:

    XID79 gpu.xid  node[003,017-019]  reboot
      NODE     STATE       DRAINED FOR  SINCE                 LAST HEALTH CHECK            DETAIL
      node003  IDLE+DRAIN  2h13m        2026-11-24T17:53:20Z  2026-11-24T20:01:00Z drain   GPU has fallen off ...

Then the notifications that did not go out (the notify spool). Times are UTC ISO 8601.

Everything here is read-only: Slurm through `scontrol show node -o`, each node's history store through
`Store.open_read_only` (a status command must never create, migrate or move a store; stores are read only for the
nodes whose details are shown) and the notify spool through read-only SQLite connections. Slurm's view is always
shown, even when a store cannot be read.
"""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import sys
import time
from typing import Any, Optional

from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.slurm.parse import slurm_time  # noqa: F401 - re-exported: status callers and tests use it here
from gpuguard.store.sqlite import Store
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


def drained_nodes(scontrol_output: str) -> list[dict[str, Any]]:
    """Nodes that are drained or down, from `scontrol show node -o`. Pure."""
    from gpuguard.slurm.reason import is_ours, parse_reason
    from gpuguard.slurm.parse import node_state_from_fields, parse_node_lines

    out = []
    for name, fields in parse_node_lines(scontrol_output).items():
        st = node_state_from_fields(fields)
        if not (st.drained or st.down):
            continue
        parsed = parse_reason(st.reason) if is_ours(st.reason) else None
        out.append({"node": name, "state": fields.get("State") or "+".join(sorted(st.states)), "reason": st.reason,
                    "ours": is_ours(st.reason), "reason_time": st.reason_time, "reason_user": st.reason_user,
                    "check_id": parsed.check_id if parsed else None, "keyword": parsed.keyword if parsed else None,
                    "action": parsed.action if parsed else None, "detail": parsed.detail if parsed else None,
                    "legacy_reason": parsed.legacy if parsed else None})
    return sorted(out, key=lambda n: n["node"])


def group_nodes(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpuguard's drains grouped by fault (keyword + check), each with its nodes as a Slurm hostlist; the biggest
    group first. A gpuguard reason that does not parse (hand-edited) is its own group, keyword '?'. Pure."""
    from gpuguard.slurm.hostlist import compress_hostlist

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


# --------------------------------------------------------------------------- read-only SQLite


def _connect_ro(path: str) -> sqlite3.Connection:
    """A read-only connection (the notify spool); raises sqlite3.Error when the file is missing or unreadable."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
    conn.execute("PRAGMA query_only=1")
    return conn


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def store_facts(path: str, node: str) -> dict[str, Any]:
    """From the node's history store: when gpuguard recorded the drain it has not lifted yet, the last health check
    (and the last run of any kind), and how many passing health checks of the drained check came since."""
    facts: dict[str, Any] = {}
    if not os.path.exists(path):  # e.g. a node-local store.path read from an admin host
        facts["store_missing"] = path
        return facts
    try:
        st = Store.open_read_only(path)
    except sqlite3.Error as e:
        facts["store_error"] = f"{path}: {e}"
        return facts
    try:
        drain = st.active_drain(node)
        if drain:
            facts["drained_at"] = drain["ts"]
            facts["drain_check"] = drain.get("check_id")
            if drain.get("check_id"):
                facts["passes_since"] = st.consecutive_passes(node, drain["check_id"], drain["ts"])
        for key, kind in (("last_healthcheck", "healthcheck"), ("last_run", None)):
            run = st.last_run(node, kind)
            if run:
                facts[key] = run
    except sqlite3.Error as e:  # status must show Slurm's view even when a store is unreadable
        facts["store_error"] = f"{path}: {type(e).__name__}: {e}"
    finally:
        st.close()
    return facts


def _paths(pattern: str) -> list[str]:
    if "{node}" not in pattern:
        return [pattern]
    return sorted(glob.glob(glob.escape(pattern).replace(glob.escape("{node}"), "*")))


def undelivered_notifications(pattern: str) -> dict[str, Any]:
    """Messages in the notify spool(s) that have not gone out: pending (being retried), held (rate-limited,
    waiting for a digest) and expired (given up after notify.spool_max_age_h). Read-only."""
    out: dict[str, Any] = {"pending": 0, "held": 0, "expired": 0, "oldest": None, "by_node": {}, "last_errors": [],
                           "errors": []}
    for path in _paths(pattern):
        try:
            conn = _connect_ro(path)
        except sqlite3.Error:
            continue  # no spool file: nothing was ever spooled there
        try:
            if "notify_spool" not in _tables(conn):
                continue
            rows = conn.execute(
                "SELECT COALESCE(node, '?'), status, COUNT(*), MIN(created) FROM notify_spool "
                "WHERE status IN ('pending','held','expired') GROUP BY 1, 2").fetchall()
            for node, status, count, oldest in rows:
                out[status] += count
                per = out["by_node"].setdefault(node, {"pending": 0, "held": 0, "expired": 0})
                per[status] += count
                if status != "expired" and oldest is not None and (out["oldest"] is None or oldest < out["oldest"]):
                    out["oldest"] = oldest
            for node, title, error, attempts in conn.execute(
                    "SELECT COALESCE(node, '?'), title, last_error, attempts FROM notify_spool "
                    "WHERE status='pending' AND last_error IS NOT NULL ORDER BY id DESC LIMIT 3"):
                out["last_errors"].append({"node": node, "title": title, "error": error, "attempts": attempts})
        except sqlite3.Error as e:
            out["errors"].append(f"{path}: {type(e).__name__}: {e}")
        finally:
            conn.close()
    return out


# --------------------------------------------------------------------------- rendering


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
        for e in spool["last_errors"]:
            lines.append(f"  last error ({e['node']}, {e['attempts']} attempt(s)): {e['error']}")
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


# --------------------------------------------------------------------------- command


# --------------------------------------------------------------------------- gpuguard's own health


def own_health(runtime_dir: str) -> dict[str, Any]:
    """From the nodes' verdict journals readable here (gpuguard.pipeline.journal): drains still pending (Slurm did
    not take them: jobs are refused meanwhile) and broken configurations, by node. Read-only."""
    out: dict[str, Any] = {"pending": [], "config": []}
    for path in sorted(glob.glob(os.path.join(glob.escape(runtime_dir), "*.journal.json"))):
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            continue
        node = str(doc.get("node") or os.path.basename(path).split(".")[0])
        for p in doc.get("pending") or []:
            if isinstance(p, dict):
                out["pending"].append({"node": node, **p})
        conf = doc.get("config") or {}
        if conf.get("issues"):
            out["config"].append({"node": node, **conf})
    return out


def render_own_health(local_cfg: Any, health: dict[str, Any], now: float) -> list[str]:
    """The lines an admin must see first: gpuguard itself is not working as configured."""
    from gpuguard.slurm.hostlist import compress_hostlist

    lines: list[str] = []
    if local_cfg.issues:
        from gpuguard.config.lastgood import describe

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
    return lines


def _wanted(args: Any) -> Optional[set[str]]:
    """--node HOSTLIST -> those node names; None when not given."""
    text = getattr(args, "node", None)
    if not text:
        return None
    from gpuguard.slurm.hostlist import HostlistError, expand_hostlist

    try:
        return set(expand_hostlist(text))
    except HostlistError as e:
        raise ValueError(f"--node: not a Slurm hostlist ({e}): {text!r}") from None


def cmd_status(args: Any) -> int:
    from gpuguard.config.lastgood import load_guarded
    from gpuguard.pipeline.journal import runtime_dir
    from gpuguard.slurm.client import CliSlurmClient, SlurmError

    cfg = load_guarded(args.config)  # a broken config is what status must report, not a reason to fail
    health = own_health(runtime_dir(cfg))
    if not args.json:
        for line in render_own_health(cfg, health, time.time()):
            print(line)
    wanted = _wanted(args)
    s = cfg.sections["slurm"]
    client = CliSlurmClient(s["scontrol"], cfg.sections["deadlines"]["scontrol_s"], s["conf"])
    try:
        text = client.run(["show", "node", "-o"])
    except SlurmError as e:
        print(f"gpuguard status: cannot ask Slurm: {e}", file=sys.stderr)
        return 2
    now = time.time()
    store_pattern = cfg.sections["store"]["path"]
    nodes = [n for n in drained_nodes(text) if (args.all or n["ours"]) and (wanted is None or n["node"] in wanted)]
    ours = sum(1 for n in nodes if n["ours"])
    details = True if (getattr(args, "details", False) or wanted is not None) else None
    read_stores = args.json or details or ours <= DETAIL_AUTO  # the summary alone needs only Slurm's view
    for n in nodes:
        path = store_pattern.replace("{node}", n["node"])
        facts = store_facts(path, n["node"]) if n["ours"] and read_stores else {}
        recorded = facts.pop("drained_at", None)
        n.update(facts)
        # Slurm's ReasonTime is when the reason was set (a later prolog finding the node already drained does not
        # move it); gpuguard's own record when Slurm shows none
        n["drained_since"] = slurm_time(n.get("reason_time")) or recorded
    spool = undelivered_notifications(cfg.sections["notify"].get("state_path") or store_pattern)
    if args.json:
        doc = to_json(nodes, spool, now)
        doc["gpuguard"] = {"config_issues": [str(i) for i in cfg.issues], "config_mode": cfg.mode, **health}
        print(json.dumps(doc, indent=2, default=str))
        return 0
    print(render_status(nodes, spool, now, args.all, details))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="nodes drained by gpuguard, grouped by fault: hostlists, drained for, last "
                                      "health check, undelivered notifications")
    p.add_argument("--config", help="config file")
    p.add_argument("--all", action="store_true", help="also list nodes drained or down by someone else")
    p.add_argument("--details", action="store_true", help="every drained node, not only the summary (shown "
                   "without asking for up to 20 nodes)")
    p.add_argument("--node", help="only these nodes, with their details: a Slurm hostlist, e.g. gpu-[0100-0163]")
    p.add_argument("--json", action="store_true")


def run(args: Any) -> int:
    return cmd_status(args)
