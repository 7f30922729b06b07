"""`gpuguard status`'s view of the drain-storm guard and of the topology: the nodes held back (not drained) with
what holds them, read from the marks in their Slurm Comments (`gpuguard-storm:held:<check>[@switch=leaf7]:<time>`,
gpuguard.pipeline.storm), and the leaf switch of each drained node (gpuguard.slurm.topology). Pure apart from
nothing: the caller gives `scontrol show node -o`, the topology and the shared components.

A node the partition rule held before its switch (or rack) was blamed keeps the partition's mark (no component: it
decides nothing again until its storm window ends), yet the storm guard counts it as that component's fault
(gpuguard.pipeline.storm: `_components_at_fault`, `_failing`). Status shows it the same way: under the component's
fault, with the other nodes held for it, saying that it was held before the blame."""

from __future__ import annotations

from typing import Any, Sequence

from gpuguard.pipeline.storm import component_ref, parse_mark
from gpuguard.slurm.components import Component
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


def attribute_to_components(held: list[dict[str, Any]], components: Sequence[Component]) -> None:
    """A node held by the partition rule (no component in its mark) under a component that other nodes are held for,
    for the same check (their marks name it), is that component's: `component` set, `before_blame` True."""
    named = {(h["check"], h["component"]) for h in held if h["component"]}
    if not named:
        return
    for h in held:
        if h["component"]:
            continue
        for c in components:
            ref = component_ref(c)
            if (h["check"], ref) in named and h["node"] in c.nodes and c.explains(h["check"]):
                h["component"], h["before_blame"] = ref, True
                break


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
    before: dict[tuple[str, str], list[str]] = {}
    for h in held:
        groups.setdefault((h["component"], h["check"]), []).append(h["node"])
        if h.get("before_blame"):
            before.setdefault((h["component"], h["check"]), []).append(h["node"])
    lines = ["", f"held by the drain-storm guard (failing, not drained): {len(held)} node(s)"]
    for (component, check), names in sorted(groups.items()):
        what = (f"one {component.split('=', 1)[0]} fault: {component.replace('=', ' ', 1)}" if component
                else "drain storm (one cause on many nodes)")
        early = before.get((component, check))
        if early:
            what += f" ({compress_hostlist(early)} held by the partition rule before it was blamed)"
        lines.append(f"  {check:<16} {len(names):>5}  {compress_hostlist(names):<40}  {what}")
    return lines
