"""The drain-storm guard: gpuguard never drains a fleet because of something that is the same on every node.

A configuration or launch choice applied to every node at once (a profile expecting 32 EFA interfaces on nodes
launched with 4, a threshold too tight for this driver) makes every health check fail at the same moment. Only the
first `limit` nodes of a partition (`policy.storm_share` of it, at least `policy.storm_min_nodes`) drain for the same
check within `policy.storm_window_s`; the others are held (not drained, they keep running jobs) and one page per
storm tells a human. Unambiguous per-node hardware evidence (fatal Xid, GPU gone, uncorrectable ECC, row-remap
failure, recovery action needing a reset) is never held back.

The decision is taken before anything is drained, from slurmctld's own view, so it holds across every node without
a shared file and Slurm never sees a drain undone. The nodes of one health-check round fail at the same instant
and none of them has drained yet: each first marks its intent in its own node's Comment
(`gpuguard-storm:intent:<check>:<time>`, only where the Comment is empty or gpuguard's), waits a moment for the
rest of the round to mark theirs, then reads one census (`sinfo`: states, reasons, Comments). Every node ranks the
same set the same way: the nodes already drained for the check within the window first, then the intents by
time and name (a held node's mark keeps its intent's time, so a node held a moment ago ranks where its intent
did). A node within the first `limit` drains (and removes its mark); the others mark themselves
`gpuguard-storm:held:<check>:<time>` and are held. The first node held pages the storm; the nodes after it, in this
round or a later one (the marks of held nodes show the storm is known), do not. Pure: the census and the clock come in as arguments
(gpuguard.pipeline.stormguard does the I/O).

**Shared components** (gpuguard.slurm.components: the leaf switches of Slurm's topology, the racks and PDUs of a
site file) are judged first: when more than half of the nodes under one component, and at least SHARED_MIN_NODES,
fail a check that component's fault explains (drained for it within the window, or marked intent/held), it is one
fault of that component, not of its nodes. Every node of it that has not drained yet is held (whatever the
partition limit), its held mark names the component (`gpuguard-storm:held:<check>@switch=leaf7:<time>`), and one
of them pages once, naming the component: the first, by time and name, of those deciding now or held for it
already (nodes the partition rule held before the component was blamed page nothing and stop nothing). The
component's nodes take none of the partition's drains: the partition rule then judges a node elsewhere failing the
same check against the partition without them (its size, its limit, its ranking). Without components the partition
rule alone decides, as before.

The marks (in a node's Comment; ARCHITECTURE.md, "The storm guard's marks"): `gpuguard-storm:<intent|held>:<check>[@<kind>=<name>]:<time>`,
always four ':'-separated fields, which the releases before components parse too.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from gpuguard.config.core import PolicyConfig
from gpuguard.slurm.components import Component
from gpuguard.slurm.parse import NodeRow, slurm_time
from gpuguard.slurm.reason import parse_reason
from gpuguard.util.record import Frozen, record

MARK = "gpuguard-storm"
INTENT_TTL_S = 60.0  # an intent mark older than this is a hook that died between marking and deciding
# a component is blamed only when at least this many of its nodes fail together: two nodes failing at once are as
# likely two bad nodes (and holding drains of broken hardware has a cost)
SHARED_MIN_NODES = 3
COMPONENT_SEP = "@"  # in a held mark, between the check and the component at fault (a check id never holds one)


@record
class StormSettings(Frozen):
    share: float  # policy.storm_share: of a partition's nodes
    window_s: float  # policy.storm_window_s
    min_nodes: int  # policy.storm_min_nodes: never held below this many drains per partition and check

    def limit(self, partition_size: int) -> int:
        return max(self.min_nodes, math.ceil(self.share * partition_size))


def settings_from(policy: PolicyConfig) -> StormSettings:
    return StormSettings(share=float(policy.storm_share), window_s=float(policy.storm_window_s),
                         min_nodes=int(policy.storm_min_nodes))


# --------------------------------------------------------------------------- marks in a node's Comment


@record
class Mark(Frozen):
    state: str  # intent | held
    check_id: str
    ts: float
    component: str = ""  # a held node's component at fault: "switch=leaf7"; "" for a partition storm


def component_ref(component: Component) -> str:
    """How a held mark names a component: "switch=leaf7"."""
    return f"{component.kind}={component.name}"


def format_mark(state: str, check_id: str, ts: float, component: str = "") -> str:
    """`gpuguard-storm:<state>:<check>:<time>`, a component-held node's `gpuguard-storm:held:<check>@<kind>=<name>:
    <time>`: always four fields, so a gpuguard from before components (which wants exactly four) reads the latter as
    gpuguard's own held mark, for a check that is not `<check>` (it never counts it against a partition's drains,
    as the component's nodes must not count) instead of as an admin's Comment."""
    return f"{MARK}:{state}:{check_id}" + (f"{COMPONENT_SEP}{component}" if component else "") + f":{ts:.2f}"


def parse_mark(comment: Optional[str]) -> Optional[Mark]:
    """A mark (check ids never hold '@', component names never ':'), also the five-field held mark of the first
    build with components (`...:<check>:<time>:switch=leaf7`); None for anything else."""
    parts = (comment or "").strip().split(":")
    if len(parts) not in (4, 5) or parts[0] != MARK or parts[1] not in ("intent", "held"):
        return None
    check, _, component = parts[2].partition(COMPONENT_SEP)
    if len(parts) == 5:
        component = component or parts[4]
    try:
        return Mark(parts[1], check, float(parts[3]), component)
    except ValueError:
        return None


def may_mark(comment: Optional[str]) -> bool:
    """A node's Comment gpuguard may write its mark into: empty, or a mark of its own (never an admin's text, nor
    gpuguard's undrain token)."""
    text = (comment or "").strip()
    return text in ("", "(null)", "''") or parse_mark(text) is not None


# --------------------------------------------------------------------------- the decision


@record
class Decision(Frozen):
    hold: Optional[str]  # why the node must not drain; None: it drains
    page: bool = False  # this node tells the storm (the first held, and no node was held for it before)
    partition: str = ""
    size: int = 0
    limit: int = 0
    drained: tuple[str, ...] = ()  # the nodes that have (or take) the partition's drains for the check
    held: tuple[str, ...] = ()  # the nodes held back, this one included
    component: Optional[Component] = None  # the shared component at fault (its nodes are held, not drained)
    failing: int = 0  # a component's nodes failing the check


def _drains(rows: Sequence[NodeRow], partition: Optional[str], check_id: str, now: float,
            window_s: float) -> list[tuple[float, str]]:
    """(when, node) drained for the check within the window, in `partition` (None: in any, each node once)."""
    out = []
    for r in rows:
        if (partition is not None and r.partition != partition) or not r.drained or not r.reason:
            continue
        parsed = parse_reason(r.reason)
        when = slurm_time(r.reason_time)
        if parsed and parsed.check_id == check_id and parsed.keyword != "FLAPPING" and when is not None \
                and now - when <= window_s:
            out.append((when, r.node))
    return sorted(set(out))


def _marks(rows: Sequence[NodeRow], partition: Optional[str], check_id: str, state: str, now: float,
           max_age_s: float) -> list[tuple[float, str]]:
    out = []
    for r in rows:
        m = parse_mark(r.comment) if partition is None or r.partition == partition else None
        if m is not None and m.state == state and m.check_id == check_id and -max_age_s <= now - m.ts <= max_age_s:
            out.append((m.ts, r.node))
    return sorted(set(out))


def _ranked(rows: Sequence[NodeRow], partition: Optional[str], check_id: str, now: float,
            s: StormSettings) -> tuple[list[tuple[float, str]], list[str]]:
    """(the drains for the check within the window; every node failing it in one order: the drained first, then
    the intents and held nodes by time and name)."""
    drains = _drains(rows, partition, check_id, now, s.window_s)
    drained = {n for _, n in drains}
    # intents, and the nodes already held (a held mark keeps its intent's time): one order for everyone, whichever
    # of the two a node's mark was when each census was taken
    queued = sorted(_marks(rows, partition, check_id, "intent", now, INTENT_TTL_S)
                    + _marks(rows, partition, check_id, "held", now, s.window_s))
    order = [n for _, n in drains] + [n for _, n in queued if n not in drained]
    return drains, list(dict.fromkeys(order))


def _failing(rows: Sequence[NodeRow], node: str, check_id: str, now: float, s: StormSettings,
             component: Component) -> tuple[list[tuple[float, str]], list[str]]:
    """The component's nodes failing the check: (drains within the window; every one in the ranking's order, `node`
    last when it is one of them and shows no mark)."""
    members = set(component.nodes)
    drains, order = _ranked([r for r in rows if r.node in members], None, check_id, now, s)
    if node in members and node not in order:
        order.append(node)
    return drains, order


def _at_fault(component: Component, failing: int) -> bool:
    return failing >= SHARED_MIN_NODES and failing * 2 > len(component.nodes)


def _pager(rows: Sequence[NodeRow], node: str, check_id: str, now: float, s: StormSettings, component: Component,
           held: Sequence[str]) -> str:
    """The one node of the component that pages its fault: the first, by its mark's time and name, of the held nodes
    deciding now (an intent mark) or held for this component already (a held mark naming it: that one paged). Nodes
    held before the component was blamed (the partition rule's, another component's) decide nothing now and page
    nothing: they do not stand in the way. The same on every node, whichever of intent or held each census saw."""
    ref, members, out = component_ref(component), set(component.nodes), []
    for r in rows:
        m = parse_mark(r.comment) if r.node in members and r.node in held else None
        if m is None or m.check_id != check_id:
            continue
        if (m.state == "intent" and abs(now - m.ts) <= INTENT_TTL_S) or \
                (m.state == "held" and m.component == ref and abs(now - m.ts) <= s.window_s):
            out.append((m.ts, r.node))
    order = [n for _, n in sorted(set(out))]
    if node not in order:
        order.append(node)  # no mark of its own to be seen: it comes last
    return order[0]


def _shared(rows: Sequence[NodeRow], node: str, check_id: str, now: float, s: StormSettings,
            component: Component) -> Optional[Decision]:
    """The component's fault, when most of its nodes fail the check: this node is held (None: not the case)."""
    drains, order = _failing(rows, node, check_id, now, s, component)
    if not _at_fault(component, len(order)):
        return None
    drained = [n for _, n in drains]
    held = [n for n in order if n not in drained]
    members = len(component.nodes)
    why = (f"{component.label}: {len(order)} of the {members} nodes under it fail {check_id} within "
           f"{s.window_s / 60:g} min: one {component.kind} fault, not {len(order)} node faults (this node is held, "
           "not drained)")
    return Decision(why, page=_pager(rows, node, check_id, now, s, component, held) == node, size=members,
                    drained=tuple(drained), held=tuple(held), component=component, failing=len(order))


def _components_at_fault(rows: Sequence[NodeRow], node: str, check_id: str, now: float, s: StormSettings,
                         components: Sequence[Component]) -> set[str]:
    """The nodes whose failure of the check is a component's, not theirs: under a component blamed from this census,
    or held with a mark naming a component (held for it even when some of its nodes have let go since)."""
    by_node: dict[str, list[NodeRow]] = {}
    for r in rows:
        by_node.setdefault(r.node, []).append(r)
    out: set[str] = set()
    for c in components:  # each over its own nodes' rows: linear in the census, however many components
        mine = [r for n in dict.fromkeys(c.nodes) for r in by_node.get(n, ())]
        if c.explains(check_id) and _at_fault(c, len(_failing(mine, node, check_id, now, s, c)[1])):
            out.update(c.nodes)
    for r in rows:
        m = parse_mark(r.comment)
        if m is not None and m.state == "held" and m.component and m.check_id == check_id:
            out.add(r.node)
    return out


def _in_partition(rows: Sequence[NodeRow], node: str, partition: str, check_id: str, now: float,
                  s: StormSettings) -> Decision:
    size = len({r.node for r in rows if r.partition == partition})
    limit = s.limit(size)
    drains, order = _ranked(rows, partition, check_id, now, s)
    if node not in order:
        order.append(node)  # no mark of its own to be seen (its Comment is someone else's): it comes last
    pos = order.index(node)
    if pos < limit:
        return Decision(None, partition=partition, size=size, limit=limit, drained=tuple(order[:limit]))
    why = (f"{len(drains)} of {size} nodes of partition {partition} already drained for {check_id} within "
           f"{s.window_s / 60:g} min (limit {limit})" if len(drains) >= limit else
           f"{len(order)} nodes of partition {partition} ({size}) failed {check_id} at once (limit {limit}); this "
           f"node came after the first {limit}")
    # the first node held tells the storm; the nodes after it (in this round or later ones) know it was told
    return Decision(why, page=pos == limit, partition=partition, size=size, limit=limit,
                    drained=tuple(order[:limit]), held=tuple(order[limit:]))


def decide(rows: Sequence[NodeRow], node: str, check_id: str, now: float, s: StormSettings,
           components: Sequence[Component] = ()) -> Decision:
    """Whether `node` may drain for `check_id`, from one census taken after the node marked its intent (or without
    a mark, when it could not write one). A shared component of the node at fault first (its first such one), then
    the partitions without the nodes of components at fault (a switch fault takes none of a partition's drains: a
    node elsewhere failing the same check is judged against the rest): held in any of them, held (the first such
    one)."""
    for c in components:
        if node in c.nodes and c.explains(check_id):
            d = _shared(rows, node, check_id, now, s, c)
            if d is not None:
                return d
    theirs = _components_at_fault(rows, node, check_id, now, s, components) - {node} if components else set()
    rest = [r for r in rows if r.node not in theirs]
    for partition in sorted({r.partition for r in rest if r.node == node}):
        d = _in_partition(rest, node, partition, check_id, now, s)
        if d.hold is not None:
            return d
    return Decision(None)
