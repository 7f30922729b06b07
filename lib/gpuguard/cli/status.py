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
nodes whose details are shown) and the notify spool through read-only SQLite connections (its summary is
gpuguard.notify.backlog's: the spool's SQL stays in notify). Slurm's view is always shown, even when a store cannot
be read. What is printed is rendered by gpuguard.cli.status_render.
"""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import sys
import time
from typing import Any, Iterator, Optional

from gpuguard.cli.status_held import add_switches, attribute_to_components, held_lines, held_nodes
from gpuguard.slurm.components import load_components
from gpuguard.cli.status_render import DETAIL_AUTO, render_own_health, render_status, to_json
from gpuguard.config.lastgood import unreadable_by_this_user
from gpuguard.notify.backlog import undelivered_notifications
from gpuguard.siteconfig import load_guarded
from gpuguard.pipeline.journal import conditions_copy_path, runtime_dir
from gpuguard.slurm.client import CliSlurmClient, SlurmError
from gpuguard.slurm.hostlist import HostlistError, expand_hostlist
from gpuguard.slurm.parse import node_state_from_fields, parse_node_lines, slurm_time
from gpuguard.slurm.reason import is_ours, parse_reason
from gpuguard.slurm.topology import topology_from_config
from gpuguard.store.sqlite import Store
from gpuguard.util.cliargs import add_config_option


def drained_nodes(scontrol_output: str) -> list[dict[str, Any]]:
    """Nodes that are drained or down, from `scontrol show node -o`. Pure."""
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


# --------------------------------------------------------------------------- the node's store


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


# --------------------------------------------------------------------------- gpuguard's own health


def _json_docs(directory: str, suffix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), f"*{suffix}"))):
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            yield str(doc.get("node") or os.path.basename(path)[:-len(suffix)]), doc


def own_health(runtime_dir: str, conditions_dir: Optional[str] = None) -> dict[str, Any]:
    """From the nodes' verdict journals readable here (gpuguard.pipeline.journal): drains still pending (Slurm did
    not take them: jobs are refused meanwhile), standing conditions (jobs are refused until they clear; a node
    without a journal, e.g. after a reboot, from the conditions' durable copy in `conditions_dir`) and broken
    configurations, by node. Read-only."""
    out: dict[str, Any] = {"pending": [], "config": [], "conditions": []}
    journaled = set()
    for node, doc in _json_docs(runtime_dir, ".journal.json"):
        journaled.add(node)
        out["pending"] += [{"node": node, **p} for p in doc.get("pending") or [] if isinstance(p, dict)]
        out["conditions"] += _standing(node, doc)
        conf = doc.get("config") or {}
        if conf.get("issues"):
            out["config"].append({"node": node, **conf})
    for node, doc in _json_docs(conditions_dir, ".json") if conditions_dir else ():
        if node not in journaled:
            out["conditions"] += _standing(node, doc)
    return out


def _standing(node: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"node": node, **c} for c in doc.get("conditions") or [] if isinstance(c, dict) and
            c.get("cleared_by") is None and c.get("keyword")]


def _wanted(args: Any) -> Optional[set[str]]:
    """--node HOSTLIST -> those node names; None when not given."""
    text = getattr(args, "node", None)
    if not text:
        return None
    try:
        return set(expand_hostlist(text))
    except HostlistError as e:
        raise ValueError(f"--node: not a Slurm hostlist ({e}): {text!r}") from None


def cmd_status(args: Any) -> int:
    cfg = load_guarded(args.config)  # a broken config is what status must report, not a reason to fail
    denied = unreadable_by_this_user(cfg)
    if denied:  # not a broken config: this user may not read it
        print(f"gpuguard status: {denied}: run it as root (sudo gpuguard status)", file=sys.stderr)
        return 2
    health = own_health(runtime_dir(cfg), os.path.dirname(conditions_copy_path(cfg, "_")))
    if not args.json:
        for line in render_own_health(cfg, health, time.time()):
            print(line)
    wanted = _wanted(args)
    s = cfg.slurm
    client = CliSlurmClient(s.scontrol, cfg.deadlines.scontrol_s, s.conf)
    try:
        text = client.run(["show", "node", "-o"])
    except SlurmError as e:
        print(f"gpuguard status: cannot ask Slurm: {e}", file=sys.stderr)
        return 2
    now = time.time()
    store_pattern = cfg.store.path
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
    topology = topology_from_config(s, cfg.deadlines.scontrol_s)
    add_switches(nodes, topology)
    held = held_nodes(text)
    if any(h["component"] for h in held) and any(not h["component"] for h in held):
        attribute_to_components(held, load_components(s, cfg.deadlines.scontrol_s, topology)[0])
    held = [h for h in held if wanted is None or h["node"] in wanted]
    spool = undelivered_notifications(cfg.notify.state_path or store_pattern)
    if args.json:
        doc = to_json(nodes, spool, now)
        doc["held"] = held
        doc["gpuguard"] = {"config_issues": [str(i) for i in cfg.issues], "config_mode": cfg.mode, **health}
        print(json.dumps(doc, indent=2, default=str))
        return 0
    print("\n".join([render_status(nodes, spool, now, args.all, details), *held_lines(held)]))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="nodes drained by gpuguard, grouped by fault: hostlists, drained for, last "
                                      "health check, undelivered notifications")
    add_config_option(p)
    p.add_argument("--all", action="store_true", help="also list nodes drained or down by someone else")
    p.add_argument("--details", action="store_true", help="every drained node, not only the summary (shown "
                   "without asking for up to 20 nodes)")
    p.add_argument("--node", help="only these nodes, with their details: a Slurm hostlist, e.g. gpu-[0100-0163]")
    p.add_argument("--json", action="store_true")


def run(args: Any) -> int:
    return cmd_status(args)
