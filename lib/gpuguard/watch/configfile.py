"""The watch daemon follows an edit of its config file by itself, as the hooks do (each hook reads the file
anew): without it, a daemon started before `notify.urls` was set drained a node on a fatal Xid without paging
anybody, and judged Xids by the old `xid.overrides`, until someone remembered `systemctl reload`.

The file is looked at every CHECK_S seconds (one stat). An edit is acted on once it has settled: the file differs
from the one loaded and looked the same at two checks in a row, so an editor's half-written file is not taken.
SIGHUP still reloads at once."""

from __future__ import annotations

import os
from typing import Optional

CHECK_S = 5.0

Stamp = Optional[tuple[int, int, int]]  # (inode, mtime ns, size); None: no file


def stamp_of(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class ConfigFileWatch:
    def __init__(self, path: str, now: float, interval_s: Optional[float] = None) -> None:
        self.path = path
        self.interval_s = CHECK_S if interval_s is None else interval_s
        self.loaded_stamp = stamp_of(path)
        self._seen = self.loaded_stamp
        self.next_check = now + self.interval_s

    def loading(self) -> None:
        """Call just before the file is read: what is read is at least as new as what is recorded here."""
        self.loaded_stamp = self._seen = stamp_of(self.path)

    def settled_change(self, now: float) -> bool:
        """True when the file differs from the one loaded and was the same at this check and the one before."""
        if now < self.next_check:
            return False
        self.next_check = now + self.interval_s
        stamp = stamp_of(self.path)
        settled = stamp != self.loaded_stamp and stamp == self._seen
        self._seen = stamp
        return settled
