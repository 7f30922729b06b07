"""Isolating the node(s) that make a multi-node all_reduce slow (pure apart from the `measure` it is given): see
gpuguard.nccl.sweep for the method. `measure(groups, stage)` runs one measurement per group, concurrently."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from gpuguard.nccl.result import NcclResult
from gpuguard.slurm.hostlist import compress_hostlist
from gpuguard.slurm.reason import format_reason

Group = tuple[str, ...]
Progress = Callable[[str], None]


@dataclass
class Measurement:
    nodes: Group
    stage: str  # all | pair | bisect | cross | confirm | baseline
    threshold_gbps: Optional[float] = None
    busbw_gbps: Optional[float] = None  # bus bandwidth of the largest message
    size_bytes: Optional[int] = None
    job_id: Optional[str] = None
    job_state: Optional[str] = None
    error: Optional[str] = None
    output_path: Optional[str] = None
    duration_s: float = 0.0
    wrong: int = 0  # wrong / out-of-bounds values the collective returned
    result: Optional[NcclResult] = field(default=None, repr=False)

    @property
    def verdict(self) -> str:
        if self.busbw_gbps is None:
            return "error"
        if self.wrong:
            return "wrong"
        if self.threshold_gbps is not None and self.busbw_gbps < self.threshold_gbps:
            return "slow"
        return "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "stage": self.stage, "threshold_gbps": self.threshold_gbps,
                "busbw_gbps": self.busbw_gbps, "size_bytes": self.size_bytes, "job_id": self.job_id,
                "job_state": self.job_state, "verdict": self.verdict, "error": self.error, "wrong": self.wrong,
                "output": self.output_path, "duration_s": round(self.duration_s, 2),
                "peak_busbw_gbps": self.result.peak_busbw_gbps if self.result else None,
                "avg_busbw_gbps": self.result.avg_busbw_gbps if self.result else None}


Measure = Callable[[list[Group], str], list[Measurement]]


@dataclass
class NodeVerdict:
    node: str
    status: str  # ok | slow | unknown
    busbw_gbps: Optional[float] = None
    threshold_gbps: Optional[float] = None
    evidence: str = ""
    job_id: Optional[str] = None
    partner: Optional[str] = None
    wrong: int = 0
    drain: Optional[dict[str, Any]] = None


@dataclass
class SweepOutcome:
    nodes: list[str]
    measurements: list[Measurement] = field(default_factory=list)
    verdicts: dict[str, NodeVerdict] = field(default_factory=dict)
    conclusion: str = "pass"  # pass | isolated | fabric | inconclusive | error
    message: str = ""

    @property
    def slow(self) -> list[str]:
        return [n for n in self.nodes if self.verdicts.get(n) and self.verdicts[n].status == "slow"]

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "conclusion": self.conclusion, "message": self.message,
                "slow": self.slow, "measurements": [m.to_dict() for m in self.measurements],
                "verdicts": {n: {"status": v.status, "busbw_gbps": v.busbw_gbps, "threshold_gbps": v.threshold_gbps,
                                 "evidence": v.evidence, "job_id": v.job_id, "partner": v.partner,
                                 "drain": v.drain} for n, v in self.verdicts.items()}}


def _pairs(nodes: Sequence[str]) -> tuple[list[Group], list[str]]:
    """Disjoint pairs in order, and the odd one out."""
    pairs = [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
    rest = [nodes[-1]] if len(nodes) % 2 else []
    return pairs, rest


def _halves(group: Sequence[str]) -> list[list[str]]:
    mid = len(group) // 2
    return [list(group[:mid]), list(group[mid:])]


def isolate(nodes: Sequence[str], measure: Measure, method: str = "pairwise",
            max_drain_fraction: float = 0.5, progress: Optional[Progress] = None) -> SweepOutcome:
    """Run the sweep's measurements through `measure` and decide every node's verdict. Pure apart from
    `measure`."""
    say = progress or (lambda _m: None)
    nodes = list(dict.fromkeys(nodes))
    out = SweepOutcome(nodes=nodes)
    if not nodes:
        out.conclusion, out.message = "error", "no nodes to sweep"
        return out

    def run(groups: list[Group], stage: str) -> list[Measurement]:
        ms = measure(groups, stage)
        out.measurements.extend(ms)
        return ms

    first = run([tuple(nodes)], "all")[0]
    if first.verdict == "ok":
        for n in nodes:
            out.verdicts[n] = NodeVerdict(n, "ok", first.busbw_gbps, first.threshold_gbps,
                                          f"{len(nodes)}-node run", first.job_id)
        out.conclusion = "pass"
        out.message = f"all {len(nodes)} nodes: {first.busbw_gbps:.1f} GB/s (threshold {first.threshold_gbps:g})"
        return out
    if len(nodes) == 1:
        _convict(out, nodes[0], first, None)
        return _finish(out, max_drain_fraction)
    say(f"all-node run {first.verdict.upper()}: isolating ({method})")

    good, suspects = _bisect(nodes, run) if method == "bisect" else _pairwise(nodes, run)
    suspects = [s for s in dict.fromkeys(suspects) if s not in good]
    suspects = _cross_pair(out, run, good, suspects)
    _clear(out, good)
    if not good:
        for n in suspects:
            out.verdicts[n] = NodeVerdict(n, "unknown", evidence="no run at full speed: nothing to compare against")
        out.conclusion = "fabric"
        out.message = ("every run was slow or failed: a fabric-wide or configuration problem, not one node; "
                       "nothing drained")
        return out
    _confirm(out, run, good, suspects)
    return _finish(out, max_drain_fraction)


def _bisect(nodes: list[str], run: Measure) -> tuple[list[str], list[str]]:
    """(good, suspects): halves run concurrently; the slow halves are halved again, down to pairs."""
    good: list[str] = []
    suspects: list[str] = []
    queue = [list(nodes)]
    while queue:
        halves = [h for g in queue for h in _halves(g)]
        queue = []
        testable = [tuple(h) for h in halves if len(h) >= 2]
        results = dict(zip(testable, run(testable, "bisect"))) if testable else {}
        for h in halves:
            if len(h) < 2:
                suspects.extend(h)
                continue
            m = results[tuple(h)]
            if m.verdict == "ok":
                good.extend(h)
            elif len(h) > 2:
                queue.append(h)
            else:
                suspects.extend(h)
    return good, suspects


def _pairwise(nodes: list[str], run: Measure) -> tuple[list[str], list[str]]:
    """(good, suspects): disjoint pairs run concurrently; a pair at full speed clears both nodes."""
    good: list[str] = []
    suspects: list[str] = []
    pairs, rest = _pairs(nodes)
    for pair, m in zip(pairs, run(pairs, "pair")):
        (good if m.verdict == "ok" else suspects).extend(pair)
    suspects.extend(rest)
    return good, suspects


def _cross_pair(out: SweepOutcome, run: Measure, good: list[str], suspects: list[str]) -> list[str]:
    """Nothing known good yet: pair suspects that have not run together, a few rounds, until one pair is fast
    (added to `good`). Returns the suspects left."""
    tried = {frozenset(m.nodes) for m in out.measurements if len(m.nodes) == 2}
    for _round in range(3):
        if good or len(suspects) < 2:
            break
        cross: list[Group] = []
        used: set[str] = set()
        for a in suspects:
            for b in suspects:
                if a != b and a not in used and b not in used and frozenset((a, b)) not in tried:
                    cross.append((a, b))
                    used |= {a, b}
                    tried.add(frozenset((a, b)))
        if not cross:
            break
        for pair, m in zip(cross, run(cross, "cross")):
            if m.verdict == "ok":
                good.extend(pair)
        suspects = [s for s in suspects if s not in good]
    return suspects


def _clear(out: SweepOutcome, good: list[str]) -> None:
    """Each good node's verdict, from its fastest run."""
    for n in good:
        best = max((m for m in out.measurements if n in m.nodes and m.verdict == "ok"),
                   key=lambda m: m.busbw_gbps or 0.0)
        partner = next((p for p in best.nodes if p != n), None) if len(best.nodes) == 2 else None
        out.verdicts[n] = NodeVerdict(n, "ok", best.busbw_gbps, best.threshold_gbps,
                                      f"{len(best.nodes)}-node run ({best.stage})", best.job_id, partner)


def _confirm(out: SweepOutcome, run: Measure, good: list[str], suspects: list[str]) -> None:
    """Every suspect in a 2-node run with a node known good: convicted only where it was the only unknown."""
    remaining = list(suspects)
    while remaining:
        batch = remaining[: len(good)]
        remaining = remaining[len(good):]
        groups = [(s, g) for s, g in zip(batch, good)]
        for (s, g), m in zip(groups, run(groups, "confirm")):
            if m.verdict == "ok":
                out.verdicts[s] = NodeVerdict(s, "ok", m.busbw_gbps, m.threshold_gbps, f"2-node run with {g}",
                                              m.job_id, g)
            elif m.verdict in ("slow", "wrong"):
                _convict(out, s, m, g)
            else:
                out.verdicts[s] = NodeVerdict(s, "unknown", None, m.threshold_gbps,
                                              f"2-node run with {g} failed: {m.error or m.job_state}", m.job_id, g)


def _convict(out: SweepOutcome, node: str, m: Measurement, partner: Optional[str]) -> None:
    what = f"2-node run with {partner}" if partner else f"{len(m.nodes)}-node run"
    out.verdicts[node] = NodeVerdict(node, "slow", m.busbw_gbps, m.threshold_gbps, what, m.job_id, partner,
                                     wrong=m.wrong)


def _finish(out: SweepOutcome, max_drain_fraction: float) -> SweepOutcome:
    slow = out.slow
    unknown = [n for n, v in out.verdicts.items() if v.status == "unknown"]
    if slow and len(slow) > max_drain_fraction * len(out.nodes) and len(out.nodes) > 1:
        out.conclusion = "fabric"
        out.message = (f"{len(slow)} of {len(out.nodes)} nodes look slow (more than {max_drain_fraction:.0%}): "
                       "a fabric or configuration problem is likelier than bad nodes; nothing drained")
        for n in slow:
            out.verdicts[n].status = "unknown"
            out.verdicts[n].evidence += " (not drained: too many slow nodes)"
        return out
    if slow:
        out.conclusion = "isolated"
        out.message = f"slow: {compress_hostlist(slow)}" + (f"; undecided: {compress_hostlist(unknown)}" if unknown else "")
    elif unknown:
        out.conclusion = "inconclusive"
        out.message = f"runs failed for {compress_hostlist(unknown)}; no slow node proven"
    else:
        out.conclusion = "inconclusive"
        out.message = ("the all-node run was slow but every smaller run was at full speed: a scale-dependent "
                       "problem (switch, topology), not one node; nothing drained")
    return out


def drain_reason(v: NodeVerdict) -> str:
    """`gpuguard: nccl.sweep NCCL: all_reduce busbw 160.2 GB/s < 300 GB/s, 2-node run with node1, job 15 [sweep]`"""
    if v.wrong:
        what = f"all_reduce returned {v.wrong} wrong values"
    else:
        what = f"all_reduce busbw {v.busbw_gbps:.1f} GB/s < {v.threshold_gbps:g} GB/s"
    detail = f"{what}, {v.evidence}" + (f", job {v.job_id}" if v.job_id else "")
    return format_reason("nccl.sweep", "NCCL", detail, "sweep")
