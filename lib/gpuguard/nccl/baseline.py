"""Baselines: bus bandwidth measured across the fleet per (profile, node count, message size), and thresholds
proposed from that distribution instead of copied from a blog post.

The proposal is robust to the slow nodes it is meant to catch: centre = median, spread = 1.4826 * MAD (the
normal-consistent median absolute deviation), threshold = median - max(k * spread, margin% of the median). The
margin keeps a very uniform fleet (tiny MAD) from getting a threshold that ordinary run-to-run noise crosses.
Fewer than `min_samples` samples: no proposal ("measure more"), never a guess.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional

from gpuguard.nccl.result import NcclResult


@dataclass(frozen=True)
class Proposal:
    profile: str
    n_nodes: int
    size_bytes: int
    samples: int
    median: Optional[float]
    mad: Optional[float]
    p05: Optional[float]
    minimum: Optional[float]
    maximum: Optional[float]
    threshold_gbps: Optional[float]  # None: not enough samples
    note: str = ""
    sources: str = ""  # where the samples came from: "measure 6, preflight 5"
    backend: str = ""  # the collective they were measured with (nccl-tests | nccl | gloo; "": unknown, older samples)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], pct: float) -> float:
    """Linear-interpolated percentile of a non-empty list."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * pct / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def propose_threshold(values: list[float], k: float = 3.0, margin_pct: float = 5.0,
                      min_samples: int = 5) -> tuple[Optional[float], dict[str, Optional[float]]]:
    """(threshold, stats). Pure."""
    if not values:
        return None, {"median": None, "mad": None, "p05": None, "min": None, "max": None}
    med = statistics.median(values)
    mad = statistics.median([abs(v - med) for v in values])
    stats = {"median": med, "mad": mad, "p05": percentile(values, 5), "min": min(values), "max": max(values)}
    if len(values) < min_samples:
        return None, stats
    spread = 1.4826 * mad
    threshold = med - max(k * spread, med * margin_pct / 100.0)
    return max(0.0, threshold), stats


def propose(rows: Iterable[dict[str, Any]], k: float = 3.0, margin_pct: float = 5.0,
            min_samples: int = 5) -> list[Proposal]:
    """One proposal per (profile, n_nodes, size_bytes, backend) found in sample rows (as `history.samples` returns):
    samples of different collectives never share a distribution."""
    groups: dict[tuple[str, int, int, str], list[float]] = {}
    sources: dict[tuple[str, int, int, str], dict[str, int]] = {}
    for r in rows:
        key = (r["profile"], int(r["n_nodes"]), int(r["size_bytes"]), str(r.get("backend") or ""))
        groups.setdefault(key, []).append(float(r["busbw_gbps"]))
        src = sources.setdefault(key, {})
        src[str(r.get("source") or "?")] = src.get(str(r.get("source") or "?"), 0) + 1
    out = []
    for (profile, n, size, backend), values in sorted(groups.items()):
        thr, st = propose_threshold(values, k, margin_pct, min_samples)
        note = "" if thr is not None else f"only {len(values)} samples (need {min_samples})"
        src = ", ".join(f"{name} {c}" for name, c in sorted(sources[(profile, n, size, backend)].items()))
        out.append(Proposal(profile, n, size, len(values), _r(st["median"]), _r(st["mad"]), _r(st["p05"]),
                            _r(st["min"]), _r(st["max"]), _r(thr), note, src, backend))
    return out


def _r(v: Optional[float]) -> Optional[float]:
    """Five significant digits: 462.74 GB/s as before, and a CPU pre-flight's 0.0048 GB/s not rounded to 0 (nor
    0.0475 up to its median 0.05)."""
    return None if v is None else float(f"{v:.5g}")


NCCL_TESTS = "nccl-tests"  # the backend of every sample read from an nccl-tests table


def samples_from_result(result: NcclResult, profile: str, n_nodes: int, nodes: str, source: str,
                        job_id: Optional[str] = None, min_bytes: int = 1 << 20
                        ) -> list[tuple[str, int, int, float, str, str, Optional[str], str]]:
    """Rows for history.record_samples: one per message size >= min_bytes with an out-of-place busbw."""
    return [(profile, n_nodes, r.size_bytes, float(r.busbw), nodes, source, job_id, NCCL_TESTS)
            for r in result.rows if r.size_bytes >= min_bytes and r.busbw is not None and r.busbw > 0]


def best_for(proposals: list[Proposal], profile: str, n_nodes: int, size_bytes: Optional[int] = None,
             backend: Optional[str] = None) -> Optional[Proposal]:
    """The proposal for this profile and node count at `size_bytes` (default: the largest size measured), of
    `backend`'s samples only when given."""
    cands = [p for p in proposals if p.profile == profile and p.n_nodes == n_nodes and p.threshold_gbps is not None
             and (backend is None or p.backend == backend)]
    if size_bytes is not None:
        cands = [p for p in cands if p.size_bytes == size_bytes]
    return max(cands, key=lambda p: p.size_bytes) if cands else None


def floor_proposal(proposals: list[Proposal], profile: str, n_nodes: int, size_bytes: int,
                   any_size: bool = False, larger: bool = False, backend: Optional[str] = None
                   ) -> Optional[Proposal]:
    """The proposal that gives an `n_nodes`-node run its floor: the one for `n_nodes` at `size_bytes`, else (as a
    `*_busbw_by_nodes` table) the one for the largest node count below it that has one; `any_size`: a node count
    without that size gives its largest measured size instead (the sweep; the pre-flight's small sizes must match);
    `larger`: with none below, the smallest count above (the pre-flight's pairs: its history holds job sizes, and a
    smaller group reaches at least a larger one's bus bandwidth). `backend`: only proposals of samples measured with
    that collective (a floor of gloo samples is no floor for nccl-tests, nor the other way round)."""
    proposals = [p for p in proposals if backend is None or p.backend == backend]
    counts = {p.n_nodes for p in proposals if p.profile == profile}
    order = sorted((c for c in counts if c <= n_nodes), reverse=True) + \
        (sorted(c for c in counts if c > n_nodes) if larger else [])
    for count in order:
        p = best_for(proposals, profile, count, size_bytes) or (best_for(proposals, profile, count) if any_size
                                                                 else None)
        if p is not None:
            return p
    return None


def config_snippet(proposals: list[Proposal]) -> str:
    """YAML for the `nccl:` config section: the proposed threshold per node count at its largest size."""
    by_n: dict[int, Proposal] = {}
    for p in proposals:
        if p.threshold_gbps is None or p.n_nodes < 2 or p.backend != NCCL_TESTS:  # the sweep runs nccl-tests
            continue
        if p.n_nodes not in by_n or p.size_bytes > by_n[p.n_nodes].size_bytes:
            by_n[p.n_nodes] = p
    if not by_n:
        return "# no proposal yet: measure more (gpuguard baseline measure / nccl sweep record samples)\n"
    lines = ["nccl:", "  sweep_busbw_by_nodes:"]
    for n, p in sorted(by_n.items()):
        lines.append(f"    {n}: {p.threshold_gbps}   # median {p.median} GB/s over {p.samples} runs at "
                     f"{p.size_bytes} B ({p.profile})")
    return "\n".join(lines) + "\n"
