"""`gpuguard status`'s view of the drain-storm guard and of the topology: the nodes held back (not drained) with
what holds them, read from the marks in their Slurm Comments (`gpuguard-storm:held:<check>[@switch=leaf7]:<time>`,
gpuguard.pipeline.storm), and the leaf switch of each drained node (gpuguard.slurm.topology). Pure apart from
nothing: the caller gives `scontrol show node -o` and the topology."""

from __future__ import annotations

from typing import Any

from gpuguard.pipeline.storm import parse_mark
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.slurm.parse import parse_node_lines
from gpuguard.slurm.topology import switches_of


def held_nodes(scontrol_output: str) -> list[dict[str, Any]]:
    """The nodes the storm guard holds: node, check, component ("switch=leaf7"; "" for a partition storm), since."""
    out = []
    for name, fields in parse_node_lines(scontrol_output).items():
        m = parse_mark(fields.get("Comment"))
        if m is not None and m.state == "held":
            out.append({"node": name, "check": m.check_id, "component": m.component, "since": m.ts})
    return out


def add_switches(nodes: list[dict[str, Any]], topology: dict[str, list[str]]) -> None:
    """Each node's leaf switch (`switch`), when Slurm has a topology; nothing added without one."""
    where = switches_of(topology, [n["node"] for n in nodes])
    for n in nodes:
        if n["node"] in where:
            n["switch"] = where[n["node"]]


def held_lines(held: list[dict[str, Any]]) -> list[str]:
    if not held:
        return []
    groups: dict[tuple[str, str], list[str]] = {}
    for h in held:
        groups.setdefault((h["component"], h["check"]), []).append(h["node"])
    lines = ["", f"held by the drain-storm guard (failing, not drained): {len(held)} node(s)"]
    for (component, check), names in sorted(groups.items()):
        what = (f"one {component.split('=', 1)[0]} fault: {component.replace('=', ' ', 1)}" if component
                else "drain storm (one cause on many nodes)")
        lines.append(f"  {check:<16} {len(names):>5}  {compress_hostlist(names):<40}  {what}")
    return lines
