"""One kernel-log position per node, shared by the hooks and the watch daemon.

Each keeps its own copy (the hooks in the verdict journal, written under the node lock; the watch in its
single-writer part, written every second), and neither ever moves past fatal evidence it has not consumed into a
condition. So the later of the two is where the node's kernel log has been judged up to: a hook starts there,
and so does the watch daemon (first start included), and an Xid one of them judged (and an admin perhaps cleared
since) is never judged again by the other. Two positions of different sources (the watch following another log
than the hooks) cannot be compared: each keeps its own.
"""

from __future__ import annotations

from typing import Any, Optional

from gpuguard.kernellog.cursor import DmesgCursor, FileCursor, FilePosition, KmsgCursor, decode
from gpuguard.pipeline.journal import Journal, runtime_dir


def _same_file(a: FilePosition, b: FilePosition) -> bool:
    return (a.path, a.inode, a.head, a.head_len) == (b.path, b.inode, b.head, b.head_len) or \
        (a.path == b.path and a.inode == b.inode and min(a.head_len, b.head_len) == 0)


def _ahead(a: Any, b: Any) -> Optional[bool]:
    """True when `b` is past `a`, False when not, None when they cannot be compared."""
    if type(a) is not type(b):
        return None
    if isinstance(a, KmsgCursor):
        if a.boot_id != b.boot_id or (a.position is None) != (b.position is None):
            return None
        if a.position is not None:
            return b.position.offset > a.position.offset if _same_file(a.position, b.position) else None
        return (b.seq or -1) > (a.seq or -1)
    if isinstance(a, FileCursor):
        return b.position.offset > a.position.offset if _same_file(a.position, b.position) else None
    if isinstance(a, DmesgCursor):
        if a.boot_id != b.boot_id or a.monotonic_s is None or b.monotonic_s is None:
            return None
        return (b.monotonic_s, b.same_ts) > (a.monotonic_s, a.same_ts)
    return None  # journald cursors are opaque


def later(mine: Optional[dict[str, Any]], other: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The later of two stored cursors; `mine` when they cannot be compared (or `other` is none)."""
    if not other or decode(other) is None:
        return mine
    if not mine or decode(mine) is None:
        return other
    return other if _ahead(decode(mine), decode(other)) else mine


def watch_position(cfg: Any, node: str) -> Optional[dict[str, Any]]:
    part = Journal.load(runtime_dir(cfg), node, part="watch")
    return part.positions.get("watch")


def hook_position(journal: Journal, cfg: Any, node: str) -> Optional[dict[str, Any]]:
    """Where a hook judges the kernel log from: its own position, or the watch daemon's when that is later."""
    return later(journal.positions.get("kernel_log"), watch_position(cfg, node))


def watch_start(cfg: Any, node: str, own: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Where the watch daemon starts: its own position, or the hooks' when that is later (or it has none)."""
    try:
        shared = Journal.load(runtime_dir(cfg), node).positions.get("kernel_log")
    except Exception:  # noqa: BLE001 - its own position (or watch.start_at)
        shared = None
    return later(own, shared)
