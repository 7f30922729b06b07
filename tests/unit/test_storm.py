"""gpuguard.pipeline.storm: a check failing on every node at once pages a human instead of draining a fleet."""

from __future__ import annotations

import time
from datetime import datetime

from gpuguard.pipeline.storm import StormSettings, storm_hold
from gpuguard.slurm.reason import format_reason
from gpuguard.slurm.parse import NodeRow, parse_sinfo_census

S = StormSettings(share=0.1, window_s=3600, min_nodes=2)
NOW = time.time()


def stamp(ago: float) -> str:
    return datetime.fromtimestamp(NOW - ago).strftime("%Y-%m-%dT%H:%M:%S")


def rows(n: int, drained: dict[str, tuple[str, float]], partition: str = "gpu") -> list[NodeRow]:
    out = []
    for i in range(1, n + 1):
        name = f"n{i:03d}"
        if name in drained:
            check, ago = drained[name]
            out.append(NodeRow(name, partition, "drained",
                               format_reason(check, "EFA", "28 EFA devices, 32 expected", "healthcheck"), stamp(ago)))
        else:
            out.append(NodeRow(name, partition, "idle", None, None))
    return out


def test_parses_sinfo_with_pipes_in_a_foreign_reason():
    text = ("n001|gpu*|drained|2026-11-25T10:00:00|gpuguard: EFA fabric.efa: 28 EFA devices [healthcheck]\n"
            "n001|debug|drained|2026-11-25T10:00:00|gpuguard: EFA fabric.efa: 28 EFA devices [healthcheck]\n"
            "n002|gpu*|idle|Unknown|none\n"
            "n003|gpu*|drained*|2026-11-25T09:00:00|admin: cable|swap | ticket 7\n")
    r = parse_sinfo_census(text)
    assert [(x.node, x.partition, x.drained) for x in r] == [("n001", "gpu", True), ("n001", "debug", True),
                                                             ("n002", "gpu", False), ("n003", "gpu", True)]
    assert r[2].reason is None and r[2].reason_time is None
    assert r[3].reason == "admin: cable|swap | ticket 7"


def test_the_first_drains_go_through_then_the_limit_holds():
    census = rows(64, {"n001": ("fabric.efa", 60), "n002": ("fabric.efa", 50)})
    assert storm_hold(census, "n003", "fabric.efa", NOW, S) is None  # 2 of 64 < ceil(6.4) = 7
    census = rows(64, {f"n{i:03d}": ("fabric.efa", 60) for i in range(1, 8)})
    why = storm_hold(census, "n010", "fabric.efa", NOW, S)
    assert why and "7 of 64 nodes of partition gpu" in why and "limit 7" in why


def test_other_checks_old_drains_and_flapping_do_not_count():
    census = rows(10, {"n001": ("gpu.temperature", 60), "n002": ("fabric.efa", 7200)})
    assert storm_hold(census, "n003", "fabric.efa", NOW, S) is None
    assert storm_hold(census, "n003", "gpu.temperature", NOW, S) is None  # 1 < min_nodes 2


def test_a_small_partition_still_takes_min_nodes_drains():
    census = rows(3, {"n001": ("fabric.efa", 10)})
    assert storm_hold(census, "n002", "fabric.efa", NOW, S) is None
    census = rows(3, {"n001": ("fabric.efa", 10), "n002": ("fabric.efa", 5)})
    assert storm_hold(census, "n003", "fabric.efa", NOW, S)


def test_after_a_simultaneous_round_only_the_first_limit_keep_their_drain():
    """Every node drained in the same second and each saw none of the others before: afterwards each computes
    the same order (reason time, then name) and the ones after the limit lift their own drain."""
    census = rows(20, {f"n{i:03d}": ("fabric.efa", 1) for i in range(1, 21)})
    kept = [r.node for r in census if storm_hold(census, r.node, "fabric.efa", NOW, S, drained_self=True) is None]
    assert kept == ["n001", "n002"]  # limit = max(2, ceil(0.1 * 20))


def test_a_node_in_two_partitions_is_held_by_the_stricter():
    census = rows(64, {}) + rows(4, {"n001": ("fabric.efa", 5), "n002": ("fabric.efa", 5)}, partition="small")
    assert storm_hold(census, "n003", "fabric.efa", NOW, S)
    assert storm_hold(census, "n010", "fabric.efa", NOW, S) is None  # only in the big one
