"""The shared job directory (the same path on every node): each node's latest report, claims for job-wide
events, stack dumps. Layout under `<job dir>/gpuguard/`:

    monitor/<node>.json     this node's latest sample summary (rewritten atomically every interval)
    claims/<name>           O_EXCL markers: exactly one node acts on a job-wide hang (alert, requeue)
    stacks/<node>-<time>.txt py-spy dumps
    events.jsonl            one line per alert any node raised (what happened during the job, in order)
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from gpuguard.util.fs import atomic_write


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:200] or "_"


class JobDir:
    def __init__(self, root: str) -> None:
        self.root = os.path.join(root, "gpuguard")
        for sub in ("monitor", "claims", "stacks"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def write_report(self, node: str, report: dict[str, Any]) -> None:
        atomic_write(os.path.join(self.path("monitor"), f"{_safe(node)}.json"),
                     json.dumps(report, separators=(",", ":"), default=str))

    def read_reports(self, stale_s: float, now: float) -> dict[str, dict[str, Any]]:
        """Every node's report younger than `stale_s` (a node whose monitor died stops counting)."""
        out = {}
        d = self.path("monitor")
        for name in os.listdir(d):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                with open(os.path.join(d, name)) as f:
                    r = json.load(f)
            except (OSError, ValueError):
                continue  # being replaced, or garbage: skip this round
            if isinstance(r, dict) and isinstance(r.get("ts"), (int, float)) and now - r["ts"] <= stale_s:
                out[str(r.get("node", name[:-5]))] = r
        return out

    def claim(self, name: str, owner: str) -> bool:
        """True for exactly one caller per name, on any node (O_CREAT|O_EXCL is atomic on NFSv3+ and Lustre)."""
        try:
            fd = os.open(self.path("claims", _safe(name)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{owner} {time.time():.3f}\n")
        return True

    def record_event(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
        # one write() in append mode: lines from several nodes do not interleave (on a local fs; good enough
        # on shared ones for a log humans read)
        with open(self.path("events.jsonl"), "a") as f:
            f.write(line)

    def stacks_path(self, node: str, now: float) -> str:
        return self.path("stacks", f"{_safe(node)}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.txt")
