"""The pre-flight's floor and its own history (pure): the bus bandwidth an N-node run's largest size must reach,
and the sample a passed pre-flight adds to the NCCL history.

The floor for N nodes: `--floor`, else `nccl.preflight_busbw_by_nodes` (the entry for the largest node count <= N),
else `nccl.preflight_busbw_gbps` (the sweep's `threshold_resolver`, the same order), else the baseline proposal
(`gpuguard baseline propose`) for (profile, N, the pre-flight's largest size), else the one for the largest node
count below N that has one, else the smallest above (gpuguard.nccl.baseline.floor_proposal: the pairs of the blame
get the job size's floor), else none (only a hang or failure is judged). Only proposals of samples measured with the
pre-flight's own collective count (nccl-tests, torch's nccl or gloo: their bus bandwidths are not comparable).
The size must match: the pre-flight's 4 MiB is far below the sweep's sizes, whose bandwidth would be a floor no
healthy pre-flight reaches.

A pre-flight that passed adds its all-node run's bus bandwidth as one sample (source `preflight`, with its backend) per
(profile, node count, size): the nodes' own history, from which the next pre-flights' proposal comes. A run judged slow, too
slow to judge or hung never does (the pre-flight did not pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from gpuguard.nccl.baseline import Proposal, floor_proposal
from gpuguard.nccl.isolate import SweepOutcome
from gpuguard.nccl.sweep import threshold_resolver
from gpuguard.nccl.torch_probe import sizes
from gpuguard.preflight.protocol import SIZE_FACTOR
from gpuguard.slurm.hostlist import compress_hostlist

SOURCE = "preflight"
Sample = tuple[str, int, int, float, str, str, Optional[str], str]  # as gpuguard.nccl.history.record_samples takes


@dataclass(frozen=True)
class Floor:
    resolve: Callable[[int], Optional[float]]  # node count -> GB/s (None: only a hang or failure is judged)
    describe: Callable[[int], str]  # node count -> where it came from, for the job line


def preflight_floor(fixed: Optional[float], by_nodes: Mapping[Any, Any], proposals: list[Proposal], profile: str,
                    size_bytes: int, backend: str, given: str = "config") -> Floor:
    """The floor per node count for a pre-flight measuring with `backend`; `given` names where `fixed`/`by_nodes`
    came from ("config", "--floor"). Raises gpuguard.nccl.sweep.SweepError on a malformed `by_nodes`."""
    configured = threshold_resolver(fixed, by_nodes)

    def proposal(n: int) -> Optional[Proposal]:
        return floor_proposal(proposals, profile, n, size_bytes, larger=True, backend=backend)

    def from_baseline(n: int) -> Optional[float]:
        p = proposal(n)
        return p.threshold_gbps if p else None

    def describe(n: int) -> str:
        t = configured(n)
        if t is not None:
            return f"floor {t:.3g} GB/s ({given})"
        p = proposal(n)
        if p is None or p.threshold_gbps is None:
            return "no floor (only a hang or failure judged)"
        of = f" of {p.n_nodes}-node runs" if p.n_nodes != n else ""
        return f"floor {p.threshold_gbps:.3g} GB/s (baseline {p.samples} {backend} samples{of})"

    return Floor(threshold_resolver(fixed, by_nodes, from_baseline), describe)


def largest_size(min_bytes: int, max_bytes: int) -> int:
    """The largest message the workers' collective sends (the sizes grow by SIZE_FACTOR from `min_bytes`)."""
    found = sizes(min_bytes, max_bytes, SIZE_FACTOR)
    return found[-1] if found else max(4, min_bytes)


def pass_sample(outcome: SweepOutcome, nodes: list[str], profile: str, job_id: Optional[str], backend: str
                ) -> Optional[Sample]:
    """The sample a pre-flight measuring with `backend` adds to the history: its all-node run's largest size, only
    when the pre-flight passed on that run (never one judged slow, too slow to judge, or hung)."""
    if outcome.conclusion != "pass" or not outcome.measurements:
        return None
    m = outcome.measurements[0]
    if (m.verdict != "ok" or m.error or not m.busbw_gbps or m.size_bytes is None
            or sorted(m.nodes) != sorted(nodes)):
        return None
    return (profile, len(nodes), int(m.size_bytes), float(m.busbw_gbps), compress_hostlist(nodes), SOURCE, job_id,
            backend)
