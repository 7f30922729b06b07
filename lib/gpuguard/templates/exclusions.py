"""The job's ExcNodeList across requeues (pure): which nodes gpuguard excludes, which it drops once they are
healthy again, and when exclusions would leave the job unable to start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from gpuguard.templates.attempts import NodeInfo


@dataclass(frozen=True)
class Excluded:
    """A node gpuguard added to the job's ExcNodeList after a failure (from the ledger)."""
    boot_time: Optional[str] = None  # its BootTime then
    flagged: bool = True             # Slurm showed it DOWN/DRAIN/...; False: only srun's log said it failed


@dataclass(frozen=True)
class ExclusionPlan:
    exclude: tuple[str, ...]       # the job's ExcNodeList from now on
    dropped: tuple[str, ...]       # nodes gpuguard excluded earlier that are healthy again
    kept: tuple[str, ...]          # nodes gpuguard excluded earlier that are still bad


def plan_exclusions(current: Sequence[str], static: Sequence[str], ours: Mapping[str, Excluded],
                    nodes: Mapping[str, NodeInfo], new_bad: Sequence[str]) -> ExclusionPlan:
    """Re-evaluate the job's ExcNodeList at a requeue. `current`: what Slurm has now; `static`: the job's own
    exclude (kept forever); `ours`: nodes gpuguard excluded after earlier failures; `nodes`: their state now;
    `new_bad`: nodes this attempt found bad. A node gpuguard excluded is dropped once Slurm no longer shows it
    DOWN/DRAIN/FAIL/... (an admin or gpuguard's health check put it back), and, when it was excluded on srun's
    word alone, once it booted again. Nodes someone else put in the list are kept. Pure."""
    keep: set[str] = set(static) | set(new_bad)
    dropped: list[str] = []
    kept: list[str] = []
    for n in current:
        if n in keep:
            continue
        if n not in ours:
            keep.add(n)  # an admin's, or from before gpuguard: not ours to drop
            continue
        info = nodes.get(n)
        if info is None or info.bad or (not ours[n].flagged and (info.boot_time is None
                                                                 or info.boot_time == ours[n].boot_time)):
            keep.add(n)
            kept.append(n)
        else:
            dropped.append(n)
    return ExclusionPlan(tuple(sorted(keep)), tuple(sorted(dropped)), tuple(sorted(kept)))


def fit_exclusions(plan: ExclusionPlan, needed: int, partition: Sequence[str], static: Sequence[str],
                   oldest_first: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the ExcNodeList to set, gpuguard's exclusions dropped to make room). A job whose exclusions leave its
    partition fewer nodes than it needs pends forever (BadConstraints), even once the excluded nodes are healthy
    again, and nothing re-evaluates a pending job. So gpuguard's own exclusions (never the job's `exclude` or an
    admin's) are dropped, oldest first, until the job fits: a node still drained or down is not used by Slurm
    anyway, and the job starts on it once it is back. If dropping all of them does not help, nothing is dropped
    (`unschedulable` then warns). Pure."""
    if not partition or needed <= 0:
        return plan.exclude, ()
    exclude = list(plan.exclude)
    dropped: list[str] = []

    def usable() -> int:
        return sum(1 for n in partition if n not in exclude)

    for n in oldest_first:
        if usable() >= needed:
            break
        if n in exclude and n not in static and n in partition:
            exclude.remove(n)
            dropped.append(n)
    if usable() < needed or not dropped:
        return plan.exclude, ()
    return tuple(sorted(exclude)), tuple(dropped)


def nodes_needed(num_nodes: str, this_attempt: int) -> int:
    """How many nodes the job needs to start again, from scontrol's `NumNodes` and the number of nodes this attempt
    ran on. While a job that Slurm requeued after a node failure is still completing, `NumNodes` counts only the
    nodes left completing (1 of 2 on Slurm 22.05: a check against it let an exclusion through that left the job
    pending forever), so a fixed size is at least this attempt's; a range ("2-4") needs its lower bound. Pure."""
    low, sep, _high = (num_nodes or "").partition("-")
    try:
        count = int(low)
    except ValueError:
        count = 0
    return count if sep else max(count, this_attempt)


def unschedulable(needed: int, partition_nodes: Sequence[str], excluded: Sequence[str]) -> Optional[str]:
    """A warning when the partition has fewer nodes than the job needs once ExcNodeList is applied. Pure."""
    if not partition_nodes or needed <= 0:
        return None
    usable = [n for n in partition_nodes if n not in set(excluded)]
    if len(usable) >= needed:
        return None
    return (f"the job needs {needed} node(s) but only {len(usable)} of the partition's {len(partition_nodes)} are "
            f"not excluded (ExcNodeList={','.join(excluded) or '(none)'}): it will pend (Reason=BadConstraints or "
            "Resources) until excluded nodes are dropped (`scontrol update JobId=<id> ExcNodeList=...`) or the "
            "partition grows")
