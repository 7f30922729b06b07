"""The drain-storm guard: gpuguard never drains a fleet because of something that is the same on every node.

A configuration or launch choice applied to every node at once (a profile expecting 32 EFA interfaces on nodes
launched with 4, a threshold too tight for this driver) makes every health check fail at the same moment. When
gpuguard has already drained a configured share of a partition for the same check within a window, further drains
for that check become a page to a human. Unambiguous per-node hardware evidence (fatal Xid, GPU gone, uncorrectable
ECC, row-remap failure, recovery action needing a reset) is never held back.

The guard reads slurmctld's own view (one `sinfo` call, only when about to drain), so it holds across every node
without any shared file. Nodes of one health-check round drain at the same instant and each sees none of the
others yet: after draining, a node waits a moment for the rest of its round to land, reads the census again and,
if it is not among the first `limit` drains of the window (ordered by Slurm's reason time, then name: every node
computes the same order over the same set), it lifts its own drain and pages instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from gpuguard.config.core import PolicyConfig
from gpuguard.slurm.reason import parse_reason
from gpuguard.slurm.parse import NodeRow, slurm_time


@dataclass(frozen=True)
class StormSettings:
    share: float  # policy.storm_share: of a partition's nodes
    window_s: float  # policy.storm_window_s
    min_nodes: int  # policy.storm_min_nodes: never held below this many drains per partition and check

    def limit(self, partition_size: int) -> int:
        return max(self.min_nodes, math.ceil(self.share * partition_size))


def _same_check_drains(rows: Sequence[NodeRow], partition: str, check_id: str, now: float,
                       window_s: float) -> list[tuple[float, str]]:
    out = []
    for r in rows:
        if r.partition != partition or not r.drained or not r.reason:
            continue
        parsed = parse_reason(r.reason)
        when = slurm_time(r.reason_time)
        if parsed and parsed.check_id == check_id and parsed.keyword != "FLAPPING" and when is not None \
                and now - when <= window_s:
            out.append((when, r.node))
    return sorted(out)


def storm_hold(rows: Sequence[NodeRow], node: str, check_id: str, now: float, s: StormSettings,
               drained_self: bool = False) -> Optional[str]:
    """Why `node` must not (stay) drained for `check_id`, or None. Before draining (`drained_self` False): the
    other nodes already drained for it fill the limit. After (`drained_self` True): `node` is not among the first
    `limit` drains of the window."""
    for partition in sorted({r.partition for r in rows if r.node == node}):
        size = len({r.node for r in rows if r.partition == partition})
        limit = s.limit(size)
        drains = _same_check_drains(rows, partition, check_id, now, s.window_s)
        others = [d for d in drains if d[1] != node]
        if not drained_self and len(others) >= limit:
            return (f"{len(others)} of {size} nodes of partition {partition} already drained for {check_id} within "
                    f"{s.window_s / 60:g} min (limit {limit})")
        if drained_self:
            order = [d[1] for d in drains]
            if node in order and order.index(node) >= limit:
                return (f"{len(drains)} of {size} nodes of partition {partition} drained for {check_id} at once "
                        f"(limit {limit}); this node came after the first {limit}")
    return None


def settings_from(policy: PolicyConfig) -> StormSettings:
    return StormSettings(share=float(policy.storm_share), window_s=float(policy.storm_window_s),
                         min_nodes=int(policy.storm_min_nodes))


def census_hold(slurm: Any, node: str, verdict: Any, cfg: Any, drained_self: bool,
                now: Optional[float] = None) -> Optional[str]:
    """Ask slurmctld for its census (one sinfo call) and apply `storm_hold` to the verdict's check. No census
    (slurmctld unreachable, a Slurm client without one): no hold, the drain goes its normal way."""
    from gpuguard.slurm.client import SlurmError

    if slurm.unreachable or verdict.primary is None:
        return None
    census = getattr(slurm.client(), "census", None)
    if census is None:
        return None
    try:
        rows = census()
    except SlurmError:
        return None
    return storm_hold(rows, node, verdict.primary.check_id, now if now is not None else time.time(),
                      settings_from(cfg.policy), drained_self)
