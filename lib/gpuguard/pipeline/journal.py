"""The node's verdict journal: what gpuguard must not lose when its history store is damaged, full or read-only.

One small JSON file per node in `store.runtime_dir` (default /run/gpuguard: a tmpfs, so a full or read-only
/var never takes it down, and it is per boot like the kernel's own log). It holds

- the kernel-log positions of the hooks and of the watch daemon: a run moves its position only in the same write
  that makes its verdict durable (applied, or recorded here as pending), so an Xid is never skipped and, once
  acted on, never acted on again, even after an admin resumed the node;
- pending drains: verdicts Slurm has not taken yet (slurmctld down or hung). Every later run and the watch daemon
  retry them first; the prolog refuses jobs while one is pending;
- gpuguard's own health as last seen on the node: the configuration's state (broken keys, last good one).

Written atomically (temp file, fsync, rename) under the node lock. The history store keeps a copy of the positions
for kernel logs that outlive a boot (a `file:` source) and for `gpuguard status` from another host.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from gpuguard.util.fs import atomic_write
from gpuguard.util.nodedirs import runtime_dir_from_env
from gpuguard.model import PendingDrain
from gpuguard.util.record import Record, field, record

VERSION = 1


def runtime_dir(cfg: Any) -> str:
    """store.runtime_dir, else $GPUGUARD_RUNTIME_DIR (gpuguard.env), else /run/gpuguard."""
    return cfg.store.runtime_dir or runtime_dir_from_env()


def journal_path(runtime_dir: str, node: str, part: str = "journal") -> str:
    """The node's journal, or one of its single-writer parts (`watch`: the watch daemon's own kernel-log
    position, written every second without taking the node lock)."""
    return os.path.join(runtime_dir, f"{node}.{part}.json")


@record
class Journal(Record):
    path: str
    node: str
    positions: dict[str, Any] = field(default_factory=dict)  # consumer -> kernel-log cursor
    pending: list[PendingDrain] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # {"issues": [...], "since": ts, "source": ...}
    error: Optional[str] = None  # why it could not be read or written (the run goes on, loudly)
    damaged_copy: Optional[str] = None  # where an unreadable journal was moved

    @classmethod
    def load(cls, runtime_dir: str, node: str, part: str = "journal") -> "Journal":
        j = cls(path=journal_path(runtime_dir, node, part), node=node)
        try:
            with open(j.path, "rb") as f:
                doc = json.loads(f.read(1 << 20) or b"{}")
        except FileNotFoundError:
            return j
        except (OSError, ValueError) as e:
            j.error = f"verdict journal {j.path} unreadable: {e}"
            j._move_aside()
            return j
        if not isinstance(doc, dict):
            j.error = f"verdict journal {j.path} is not a JSON object"
            j._move_aside()
            return j
        j.positions = {k: v for k, v in (doc.get("positions") or {}).items() if isinstance(v, dict)}
        j.pending = [PendingDrain.from_dict(p) for p in doc.get("pending") or [] if isinstance(p, dict)
                     and {"id", "op", "reason"} <= set(p)]
        j.config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
        return j

    def _move_aside(self) -> None:
        aside = f"{self.path}.damaged-{int(time.time())}"
        try:
            os.replace(self.path, aside)
            self.damaged_copy = aside
        except OSError:
            pass

    def save(self) -> Optional[str]:
        """Write it; the error text when it could not be written (the caller keeps the store's copy and is loud)."""
        doc = {"version": VERSION, "node": self.node, "written": time.time(), "positions": self.positions,
               "pending": [p.to_dict() for p in self.pending], "config": self.config}
        try:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            # fsync only with a pending drain in it: a position alone is worth nothing after a power cut (the
            # kernel log starts again with the next boot), and the prolog runs before every job
            atomic_write(self.path, json.dumps(doc, sort_keys=True), mode=0o600, durable=bool(self.pending))
        except OSError as e:
            self.error = f"verdict journal {self.path} could not be written: {e}"
            return self.error
        return None

    # ------------------------------------------------------------------ pending drains
    def add_pending(self, p: PendingDrain) -> PendingDrain:
        """Add `p` unless the same drain is already pending (another run decided it too); returns the entry."""
        for q in self.pending:
            if q.reason == p.reason and q.op == p.op:
                return q
        self.pending.append(p)
        return p

    def resolve(self, pending_id: str) -> None:
        self.pending = [p for p in self.pending if p.id != pending_id]
