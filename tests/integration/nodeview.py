"""What the integration tests read from a dev site's node the way an admin would: run its health check, its drain
reason (parsed by gpuguard's own grammar), whether it is drained, the findings of a run."""

from __future__ import annotations

import time
from typing import Any

from devtools.devsite import DevSite
from gpuguard.slurm.reason import parse_reason


def hc(site: DevSite, node: str = "node1") -> dict[str, Any]:
    """Run the node's installed health check as slurmd would; its run as the node's store recorded it."""
    before = len(site.runs(node, "healthcheck"))
    p = site.run_hook("healthcheck", node)
    assert p.returncode in (0, 1), p.stderr
    return newest_run(site, node, "healthcheck", count=before + 1)


def newest_run(site: DevSite, node: str, kind: str, count: int, timeout: float = 60) -> dict[str, Any]:
    """The node's newest run of `kind` once it has `count` of them: a hook run by the node agent answers slurmd
    with its verdict and records the run after (a loaded machine shows the gap)."""
    until = time.monotonic() + timeout
    while len(runs := site.runs(node, kind)) < count and time.monotonic() < until:
        time.sleep(0.05)
    assert len(runs) >= count, (count, runs)
    return runs[0]


def reason(site: DevSite, node: str = "node1") -> Any:
    """The node's drain reason as `scontrol show node` gives it, parsed (None when it has none)."""
    r = site.cluster.node_info(node).get("Reason")
    return parse_reason(r) if r else None


def drained(site: DevSite, node: str = "node1") -> bool:
    return "DRAIN" in site.cluster.node_flags(node)


def findings(run: dict[str, Any], check_id: str) -> list[dict[str, Any]]:
    return [f for f in run["findings"] if f["check_id"] == check_id]
