"""Slurm hostlists: `node[1-3,5],gpu-a[01-02]` <-> ['node1', 'node2', 'node3', 'node5', 'gpu-a01', ...].

The one place gpuguard expands and compresses hostlists (the NCCL sweep, notification digests, `gpuguard status`,
the simulated nccl-tests binary). The work is done by python-hostlist (NSC's implementation of Slurm's notation,
`import hostlist`), so no Slurm round trip is needed; this module only adds what gpuguard wants on top: one error
type, whitespace around items ignored, and host names restricted to what Slurm node names look like (a hostlist
may come from a job's environment, which is hostile input for a root hook).

Compression matches `scontrol show hostlistsorted` (sorted, zero padding kept: `node[003,017-019]`); duplicates
are dropped.
"""

from __future__ import annotations

import re
from typing import Iterable

import hostlist

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class HostlistError(ValueError):
    pass


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist expression (duplicates dropped, order kept). Raises HostlistError."""
    try:
        names = hostlist.expand_hostlist(text.strip())
    except hostlist.BadHostlist as e:
        raise HostlistError(f"bad hostlist {text!r}: {e}") from None
    out: list[str] = []
    seen: set[str] = set()
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if not _NAME.match(name):
            raise HostlistError(f"bad host name {name!r} in {text!r}")
        if name not in seen:
            seen.add(name)
            out.append(name)
    return out


def compress_hostlist(names: Iterable[str]) -> str:
    """['node001', 'node002', 'node005', 'gpu-a'] -> 'gpu-a,node[001-002,005]' (sorted, duplicates dropped).
    Raises HostlistError for a name that cannot be part of a hostlist (holds ',', '[' or ']')."""
    try:
        return str(hostlist.collect_hostlist([str(n) for n in names]))
    except hostlist.BadHostlist as e:
        raise HostlistError(f"cannot compress host names: {e}") from None
