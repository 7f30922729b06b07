"""Following the training log for progress, with the same parser as `gpuguard trainlog`. Survives the log
appearing late, being truncated or rotated; reads at most `max_bytes` per poll so a huge log cannot stall the
monitor."""

from __future__ import annotations

import os
import statistics
from typing import Optional

from gpuguard.trainlog import IterRecord, parse_line


class LogFollower:
    def __init__(self, path: str, max_bytes: int = 4 << 20, tail_bytes: int = 256 << 10) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.tail_bytes = tail_bytes  # on first sight, only the end of an existing log matters
        self.offset: Optional[int] = None
        self.inode: Optional[int] = None
        self.partial = ""
        self.last: Optional[IterRecord] = None
        self.iter_times: list[float] = []

    def poll(self) -> list[IterRecord]:
        """New iteration records since the last poll (in order)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        if self.inode != st.st_ino or (self.offset is not None and st.st_size < self.offset):
            # first sight, rotation (new file) or truncation: start over
            fresh = self.inode is None
            self.inode, self.partial = st.st_ino, ""
            self.offset = max(0, st.st_size - self.tail_bytes) if fresh else 0
        assert self.offset is not None
        if st.st_size <= self.offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(self.max_bytes)
        except OSError:
            return []
        self.offset += len(data)
        text = self.partial + data.decode("utf-8", "replace")
        lines = text.split("\n")
        self.partial = lines.pop()  # an unfinished last line waits for the next poll
        out = []
        for line in lines:
            rec = parse_line(line)
            if rec is not None:
                out.append(rec)
                if rec.iter_time_s is not None:
                    self.iter_times = (self.iter_times + [rec.iter_time_s])[-20:]
        if out:
            self.last = out[-1]
        return out

    def step_time_s(self) -> Optional[float]:
        return statistics.median(self.iter_times) if self.iter_times else None
