"""Which node of a hung job is stuck, from what the monitor really knows: every node's latest report in the job
directory (its GPUs' utilisation and since when they are idle, the last iteration its training log showed).
The node that pages a job's hang is whichever claimed it first; the page names these nodes instead, or says that
it cannot tell. Pure: reports in, names and the reason out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gpuguard.slurm.hostlist import compress_hostlist


@dataclass(frozen=True)
class Culprit:
    nodes: tuple[str, ...]  # the nodes that look stuck; empty: cannot tell
    why: str                # one sentence a human reads in the page
    everyone: tuple[str, ...]  # every node with a fresh report (this one included)

    @property
    def label(self) -> str:
        """What the page is about: the stuck nodes, else the job's nodes (never just the node that paged)."""
        return compress_hostlist(self.nodes or self.everyone)


def _names(nodes: list[str]) -> str:
    return compress_hostlist(nodes) if nodes else "-"


def _behind_in_the_log(reports: Mapping[str, Mapping[str, Any]]) -> Optional[Culprit]:
    """Nodes following their own training logs (per-node logs): the ones whose last iteration is behind."""
    its = {n: r.get("last_iteration") for n, r in reports.items() if isinstance(r.get("last_iteration"), int)}
    if len(its) < 2 or len(set(its.values())) < 2:
        return None
    low, high = min(its.values()), max(its.values())
    behind = sorted(n for n, it in its.items() if it == low)
    ahead = sorted(n for n, it in its.items() if it != low)
    return Culprit(tuple(behind), f"{_names(behind)} logged iteration {low} last while {_names(ahead)} reached "
                                  f"{high}", tuple(sorted(reports)))


def _idle_gpus(reports: Mapping[str, Mapping[str, Any]], now: float, margin_s: float) -> Optional[Culprit]:
    """A rank stuck outside a collective leaves its GPUs idle while the others spin in the collective waiting for
    it (their GPUs look busy); when every node is idle, the one that went idle first, by more than `margin_s`."""
    sampled = {n: r for n, r in reports.items() if r.get("gpus")}
    if len(sampled) < 2:
        return None
    idle = {n: float(r["idle_since"]) for n, r in sampled.items() if isinstance(r.get("idle_since"), (int, float))}
    busy = sorted(set(sampled) - set(idle))
    if idle and busy:
        stuck = sorted(idle)
        first = min(idle.values())
        return Culprit(tuple(stuck), f"{_names(stuck)}: every GPU idle for {(now - first) / 60:.1f} min while "
                                     f"{_names(busy)} are busy (waiting for it in a collective?)", tuple(sorted(reports)))
    if len(idle) == len(sampled):
        first = min(idle.values())
        early = sorted(n for n, t in idle.items() if t - first <= margin_s)
        later = [t for t in idle.values() if t - first > margin_s]
        if later and len(early) < len(idle):
            return Culprit(tuple(early), f"{_names(early)} went idle first, {min(later) - first:.0f} s before the "
                                         f"others", tuple(sorted(reports)))
    return None


def find_stuck(reports: Mapping[str, Mapping[str, Any]], now: float, interval_s: float) -> Culprit:
    """The stuck nodes of a hung job, from every node's fresh report (the caller's own included)."""
    everyone = tuple(sorted(reports))
    if len(reports) < 2:
        return Culprit(everyone, "the only node of the job with a fresh monitor report", everyone)
    found = _behind_in_the_log(reports) or _idle_gpus(reports, now, max(2 * interval_s, 30.0))
    if found is not None:
        return found
    return Culprit((), f"cannot tell which node is stuck: {_names(list(everyone))} show the same progress and GPU "
                       "state (one shared training log, no GPU singled out)", everyone)
