"""GuardedStore: the pipeline's view of the node store, where a store that cannot be opened or written never
changes a verdict."""

from __future__ import annotations

import sqlite3
from typing import Any, Callable, Optional

from gpuguard.store.sqlite import Store


class GuardedStore:
    """The pipeline's view of the store: every call that fails (the store could not be opened, the disk is full,
    the filesystem is read-only, a lock was held too long) returns a neutral value and is remembered in
    `errors`, so that what the hardware showed decides the verdict and the exit code, never the store.

    Neutral values are chosen to fail closed: no cursor (the kernel log is judged again rather than skipped), no
    active drain (nothing is undrained), no history (nothing escalates or is forgiven)."""

    _DEFAULTS: dict[str, Any] = {
        "get_cursor": None, "incomplete_streaks": {}, "active_drain": None, "consecutive_passes": 0,
        "count_ops": 0, "previous_fault_boots": 0, "runs": [], "drains": [], "findings_for": [],
        "record_run": None, "persist_streak_start": None,
    }

    # After one failed write the others are skipped for the rest of the run: a locked store would make every one
    # of them wait its full busy timeout, and a run has a deadline (reads go on: WAL readers are never blocked).
    _WRITES = frozenset({"record_run", "record_drain", "set_cursor", "delete_cursor", "prune_cursors",
                         "advance_watermark", "setdefault_cursor", "prune_history"})

    def __init__(self, opener: Callable[[], "Store"]) -> None:
        self.errors: list[str] = []
        self.writes_failed = False
        self.store: Optional[Store] = None
        try:
            self.store = opener()
        except (sqlite3.Error, OSError) as e:
            self.errors.append(f"open: {e}")

    @property
    def available(self) -> bool:
        return self.store is not None

    @property
    def recreated_from(self) -> Optional[str]:
        return self.store.recreated_from if self.store is not None else None

    @property
    def corruption_error(self) -> Optional[str]:
        return self.store.corruption_error if self.store is not None else None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        default = self._DEFAULTS.get(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.store is None or (self.writes_failed and name in self._WRITES):
                return default() if callable(default) else _copy(default)
            try:
                return getattr(self.store, name)(*args, **kwargs)
            except (sqlite3.Error, OSError) as e:
                if name in self._WRITES:
                    self.writes_failed = True
                if self.store.conn.in_transaction:
                    try:
                        self.store.conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                self.errors.append(f"{name}: {e}")
                return _copy(default)

        return call

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except sqlite3.Error:
                pass


def _copy(value: Any) -> Any:
    return type(value)() if isinstance(value, (dict, list)) else value
