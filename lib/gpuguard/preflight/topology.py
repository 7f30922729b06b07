"""When a switch, not a node, is to blame in a pre-flight (the topology itself is read by gpuguard.slurm.topology,
re-exported here). Pure: deciding only; without a topology every blame falls on nodes, as before."""

from __future__ import annotations

from typing import Iterable, Optional

from gpuguard.nccl.isolate import Measurement, SweepOutcome
from gpuguard.slurm.topology import parse_topology

__all__ = ["parse_topology", "job_switches", "crossing", "blamed_switch"]


def job_switches(topology: dict[str, list[str]], nodes: Iterable[str]) -> dict[str, list[str]]:
    """The job's nodes under each leaf switch (switches without any of them left out)."""
    mine = set(nodes)
    return {s: [n for n in members if n in mine] for s, members in topology.items() if mine.intersection(members)}


def _pairs(ms: Iterable[Measurement], verdicts: tuple[str, ...]) -> set[frozenset[str]]:
    return {frozenset(m.nodes) for m in ms if len(m.nodes) == 2 and m.verdict in verdicts}


def crossing(pair: frozenset[str], members: list[str]) -> bool:
    return len(pair.intersection(members)) == 1


def blamed_switch(outcome: SweepOutcome, switches: dict[str, list[str]]) -> Optional[str]:
    """The switch to blame, or None:
    - the slow 2-node runs are exactly the measured ones that cross one switch (and only one switch fits), or
    - most (more than half, at least 2) of a switch's nodes in this job were found slow together."""
    if len(switches) < 2:
        return _most_slow(outcome, switches)
    slow = _pairs(outcome.measurements, ("slow", "wrong", "error"))
    measured = _pairs(outcome.measurements, ("ok", "slow", "wrong", "error"))
    if slow:
        fits = [s for s, members in switches.items()
                if slow == {p for p in measured if crossing(p, members)}]
        if len(fits) == 1:
            return fits[0]
    return _most_slow(outcome, switches)


def _most_slow(outcome: SweepOutcome, switches: dict[str, list[str]]) -> Optional[str]:
    flagged = {n for n, v in outcome.verdicts.items() if v.status in ("slow", "unknown")}
    if len(switches) < 2 and len(flagged) < len(outcome.nodes):
        return None  # one switch for the whole job: nothing to tell a switch from the fabric
    hits = [s for s, members in switches.items()
            if len(members) >= 2 and sum(n in flagged for n in members) * 2 > len(members)]
    outside = [n for n in flagged if not any(n in switches[s] for s in hits)]
    return hits[0] if len(hits) == 1 and not outside else None
