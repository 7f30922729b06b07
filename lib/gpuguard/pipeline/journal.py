"""The node's verdict journal: what gpuguard must not lose when its history store is damaged, full or read-only.

One small JSON file per node in `store.runtime_dir` (default /run/gpuguard: a tmpfs, so a full or read-only
/var never takes it down, and it is per boot like the kernel's own log). It holds

- the kernel-log positions of the hooks and of the watch daemon: a run moves its position only in the same write
  that makes its verdict durable (applied, or recorded here as pending), so an Xid is never skipped and, once
  acted on, never acted on again, even after an admin resumed the node;
- pending drains: verdicts Slurm has not taken yet (slurmctld down or hung). Every later run and the watch daemon
  retry them first; the prolog refuses jobs while one is pending;
- the node's conditions (gpuguard.pipeline.conditions): the faults that stand until what clears them is seen.
  Evidence is consumed only into a condition, in the same write that moves the position past it. Conditions also
  survive a reboot (a fault that needs the hardware replaced does): every change is copied, durably, to
  `conditions/<node>.json` beside the node's history store (the state directory), which is read when the journal itself is gone (a new boot emptied /run);
- gpuguard's own health as last seen on the node: the configuration's state (broken keys, last good one).

Written atomically (temp file, fsync, rename) under the node lock. The history store keeps a copy of the positions
for kernel logs that outlive a boot (a `file:` source) and for `gpuguard status` from another host.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from gpuguard.model import PendingDrain
from gpuguard.pipeline.conditions import Condition
from gpuguard.util.fs import atomic_write
from gpuguard.util.nodedirs import runtime_dir_from_env
from gpuguard.util.record import Record, field, record

VERSION = 1


def runtime_dir(cfg: Any) -> str:
    """store.runtime_dir, else $GPUGUARD_RUNTIME_DIR (gpuguard.env), else /run/gpuguard."""
    return cfg.store.runtime_dir or runtime_dir_from_env()


def conditions_copy_path(cfg: Any, node: str) -> str:
    """The durable copy of a node's conditions (outlives a reboot, unlike the runtime directory): beside the node's
    history store, so it follows `store.path` (and, through its default, $GPUGUARD_STATE_DIR)."""
    return os.path.join(os.path.dirname(os.path.abspath(cfg.store.path_for(node))), "conditions", f"{node}.json")


def journal_for(cfg: Any, node: str) -> "Journal":
    """The node's main journal, with its conditions' durable copy (every reader and writer of conditions)."""
    return Journal.load(runtime_dir(cfg), node, copy_path=conditions_copy_path(cfg, node))


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
    conditions: list[Condition] = field(default_factory=list)
    error: Optional[str] = None  # why it could not be read or written (the run goes on, loudly)
    damaged_copy: Optional[str] = None  # where an unreadable journal was moved
    main: bool = True  # the node's journal (conditions, pending drains), not a single-writer part
    copy_path: Optional[str] = None  # the conditions' durable copy (the main journal only)
    saved_conditions: Any = None  # what the durable copy holds, as JSON-able data (written only on a change)

    @classmethod
    def load(cls, runtime_dir: str, node: str, part: str = "journal", copy_path: Optional[str] = None) -> "Journal":
        """`copy_path`: the conditions' durable copy (journal_for()); None for a part (`watch`), which holds no
        conditions. The main journal is loaded through journal_for()."""
        j = cls(path=journal_path(runtime_dir, node, part), node=node, main=part == "journal")
        if j.main:
            j.copy_path = copy_path
        doc = j._read()
        if doc is None:
            if j.copy_path is not None:  # no journal (a new boot, or it was lost): the durable copy of the conditions
                j.conditions = j._read_copy()
            return j
        j.positions = {k: v for k, v in (doc.get("positions") or {}).items() if isinstance(v, dict)}
        j.pending = [PendingDrain.from_dict(p) for p in doc.get("pending") or [] if isinstance(p, dict)
                     and {"id", "op", "reason"} <= set(p)]
        j.config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
        if "conditions" in doc or j.copy_path is None:
            j.conditions = _conditions(doc.get("conditions"))
            # the copy holds what the journal holds, unless writing it failed (then the next save tries again)
            j.saved_conditions = [c.to_dict() for c in j.conditions] if doc.get("copy_ok", True) else None
        else:  # a journal written before conditions existed
            j.conditions = j._read_copy()
        return j

    def _read(self) -> Optional[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read(1 << 20) or b"{}")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.error = f"verdict journal {self.path} unreadable: {e}"
            self._move_aside()
            return None
        if not isinstance(doc, dict):
            self.error = f"verdict journal {self.path} is not a JSON object"
            self._move_aside()
            return None
        return doc

    def _read_copy(self) -> list[Condition]:
        assert self.copy_path is not None
        try:
            with open(self.copy_path, "rb") as f:
                doc = json.loads(f.read(1 << 20) or b"{}")
        except FileNotFoundError:
            self.saved_conditions = []
            return []
        except (OSError, ValueError) as e:
            self.error = f"conditions copy {self.copy_path} unreadable: {e}"
            return []
        conds = _conditions(doc.get("conditions") if isinstance(doc, dict) else None)
        self.saved_conditions = [c.to_dict() for c in conds]
        return conds

    def _move_aside(self) -> None:
        aside = f"{self.path}.damaged-{int(time.time())}"
        try:
            os.replace(self.path, aside)
            self.damaged_copy = aside
        except OSError:
            pass

    def save(self) -> Optional[str]:
        """Write it; the error text when it could not be written (the caller keeps the store's copy and is loud)."""
        conditions = [c.to_dict() for c in self.conditions]
        doc = {"version": VERSION, "node": self.node, "written": time.time(), "positions": self.positions,
               "pending": [p.to_dict() for p in self.pending], "config": self.config}
        if self.main:
            doc["conditions"] = conditions
        changed = self.copy_path is not None and conditions != self.saved_conditions
        if changed:
            self._save_copy(conditions)  # first: the journal then says whether the copy holds them
            doc["copy_ok"] = self.saved_conditions == conditions
        try:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            # fsync only with a pending drain or a new condition in it: a position alone is worth nothing after a
            # power cut (the kernel log starts again with the next boot), and the prolog runs before every job
            atomic_write(self.path, json.dumps(doc, sort_keys=True), mode=0o600,
                         durable=bool(self.pending) or changed)
        except OSError as e:
            self.error = f"verdict journal {self.path} could not be written: {e}"
            return self.error
        return None

    def _save_copy(self, conditions: list[dict[str, Any]]) -> None:
        """The durable copy (a full or read-only state directory is loud, never fatal: the journal holds them for
        this boot)."""
        assert self.copy_path is not None
        try:
            os.makedirs(os.path.dirname(self.copy_path), mode=0o700, exist_ok=True)
            atomic_write(self.copy_path, json.dumps({"version": VERSION, "node": self.node,
                                                     "conditions": conditions}, sort_keys=True),
                         mode=0o600, durable=True)
            self.saved_conditions = conditions
        except OSError as e:
            self.error = f"conditions copy {self.copy_path} could not be written (they stand for this boot): {e}"

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


def _conditions(raw: Any) -> list[Condition]:
    out = [Condition.from_dict(c) for c in raw] if isinstance(raw, list) else []
    return [c for c in out if c is not None]
