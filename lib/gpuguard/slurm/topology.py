"""Slurm's network topology: which leaf switch each node hangs from (topology.conf, `TopologyPlugin=topology/tree`,
as `scontrol show topology` prints it). The parser is pure; `read_topology` is one bounded scontrol call, kept for
CACHE_S so a run that asks twice (the storm guard's decision, then its page) runs scontrol once.

Without a topology (no topology.conf, `topology/none`, scontrol missing or failing) every reader gets `{}` and
everything works as it does without one: no switch is ever blamed, no report groups by switch.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

from gpuguard.slurm.client import CliSlurmClient, SlurmError
from gpuguard.slurm.hostlist import HostlistError, expand_hostlist

CACHE_S = 60.0  # a run's topology: long enough for one hook or command, short enough for a daemon to see a change
_cache: dict[tuple[str, Optional[str]], tuple[float, dict[str, list[str]]]] = {}


def parse_topology(text: str) -> dict[str, list[str]]:
    """{leaf switch: its nodes} from `scontrol show topology` (one `SwitchName=leaf7 Level=0 LinkSpeed=1
    Nodes=node[1-4]` per switch, tests/fixtures/slurm). Only leaves: a switch above others (`Level=1`, or child
    `Switches=`) also lists every node below it (`SwitchName=spine Level=1 ... Nodes=node[1-6]
    Switches=leaf7,leaf8`), and a spine is not what a node hangs from. Malformed lines are skipped."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        name, nodes = fields.get("SwitchName"), fields.get("Nodes")
        if not name or not nodes or nodes == "(null)" or not is_leaf(fields):
            continue
        try:
            out[name] = expand_hostlist(nodes)
        except HostlistError:
            continue
    return out


def is_leaf(fields: dict[str, str]) -> bool:
    level, children = fields.get("Level"), fields.get("Switches")
    if level is not None and level.strip() not in ("0", ""):
        return False
    return children in (None, "", "(null)")


def switch_of(topology: dict[str, list[str]], node: str) -> Optional[str]:
    """The leaf switch `node` hangs from (the first, should topology.conf list it twice), or None."""
    return next((s for s, members in topology.items() if node in members), None)


def switches_of(topology: dict[str, list[str]], nodes: Iterable[str]) -> dict[str, str]:
    """node -> its leaf switch, for the nodes that have one."""
    where = {n: s for s, members in reversed(list(topology.items())) for n in members}
    return {n: where[n] for n in nodes if n in where}


def read_topology(scontrol: str = "scontrol", timeout_s: float = 5.0, slurm_conf: Optional[str] = None,
                  now: Optional[float] = None) -> dict[str, list[str]]:
    """`scontrol show topology`, bounded by `timeout_s`; {} when Slurm has none or it cannot be read (never
    raises). Kept CACHE_S per (scontrol, slurm.conf)."""
    t = time.monotonic() if now is None else now
    key = (scontrol, slurm_conf)
    hit = _cache.get(key)
    if hit is not None and 0 <= t - hit[0] < CACHE_S:
        return hit[1]
    try:
        topology = parse_topology(CliSlurmClient(scontrol, timeout_s, slurm_conf).run(["show", "topology"]))
    except SlurmError:
        topology = {}
    _cache[key] = (t, topology)
    return topology


def topology_from_config(slurm_cfg: object, timeout_s: float) -> dict[str, list[str]]:
    """The topology for a `slurm:` config section (its scontrol and slurm.conf)."""
    return read_topology(str(getattr(slurm_cfg, "scontrol", "scontrol") or "scontrol"), timeout_s,
                         getattr(slurm_cfg, "conf", None))
