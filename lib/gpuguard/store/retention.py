"""When the health check prunes its store (`store.retention_days`): not at every run. A run every few minutes on
every node adds a few rows; pruning them is one bounded batch (gpuguard.fleet.ship.prune_store), worth doing
once an hour, and at once again while the last batch still removed something (a backlog: a store that grew
before retention was set, or a lowered `retention_days`). The time of the last batch and what it removed live in
the store's `cursors` table, so the decision costs the health check one read and no import of the shipping code."""

from __future__ import annotations

from typing import Any, Optional

RETENTION_CURSOR = "retention:last"
PRUNE_EVERY_S = 3600.0


def batch_record(now: float, removed: dict[str, int]) -> dict[str, Any]:
    """What a batch leaves in RETENTION_CURSOR: when it ran and how many rows it removed (per table)."""
    return {"ts": now, "removed": sum(removed.values())}


def prune_due(last: Optional[dict[str, Any]], now: float, every_s: float = PRUNE_EVERY_S) -> bool:
    """`last`: the cursor the last batch left (batch_record), None when none ran yet (or the store could not be
    read: then pruning is tried, and fails or not on its own)."""
    if not last:
        return True
    try:
        ts, removed = float(last.get("ts") or 0), int(last.get("removed") or 0)
    except (TypeError, ValueError):
        return True
    return removed > 0 or not 0 <= now - ts < every_s
