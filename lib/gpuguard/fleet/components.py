"""Drains per shared component per week (`gpuguard fleet report`): the per-node weekly drain counts of the report,
summed over the leaf switch (Slurm's topology) and the site file's racks/PDUs each node is under. The component is
joined at report time, from the topology as it is now, not recorded with each drain: a node recabled to another
switch takes its past drains with it (docs/fleet.md). Pure."""

from __future__ import annotations

from typing import Any

NODE_WEEKLY = """
SELECT week, node, COALESCE(check_id, '-') AS check_id, COUNT(*) AS drains
FROM ev WHERE op = 'drain' AND outcome = 'done' AND t >= :since AND t < :until
GROUP BY week, node, COALESCE(check_id, '-') ORDER BY week, node
"""


def per_component(rows: list[dict[str, Any]], components: list[Any]) -> list[dict[str, Any]]:
    """[{week, kind, component, drains, nodes, checks}] from NODE_WEEKLY's rows; nodes under no component are left
    out. Ordered by week, then most drains."""
    acc: dict[tuple[str, str, str], dict[str, Any]] = {}
    for c in components:
        members = set(c.nodes)
        for r in rows:
            if r["node"] not in members:
                continue
            a = acc.setdefault((r["week"], c.kind, c.name), {"drains": 0, "nodes": set(), "checks": {}})
            a["drains"] += int(r["drains"])
            a["nodes"].add(r["node"])
            a["checks"][r["check_id"]] = a["checks"].get(r["check_id"], 0) + int(r["drains"])
    out = [{"week": w, "kind": k, "component": n, "drains": a["drains"], "nodes": len(a["nodes"]),
            "checks": [f"{c}:{d}" for c, d in sorted(a["checks"].items(), key=lambda x: (-x[1], x[0]))]}
           for (w, k, n), a in acc.items()]
    return sorted(out, key=lambda x: (x["week"], -x["drains"], x["kind"], x["component"]))


def component_lines(per: list[dict[str, Any]]) -> list[str]:
    lines = ["", "drains per switch (and site component) per week (as the topology is now):"]
    if not per:
        return lines + ["  none"]
    lines.append(f"  {'week':<11} {'component':<22} {'drains':>6} {'nodes':>6}  checks")
    for p in per:
        lines.append(f"  {p['week']:<11} {p['kind'] + ' ' + p['component']:<22} {p['drains']:>6} {p['nodes']:>6}  "
                     f"{' '.join(p['checks'])}")
    return lines
