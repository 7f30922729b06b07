"""Runs on one node are serialised: prolog, epilog, health check and the watch daemon share the kernel-log
position, the verdict journal and the drain bookkeeping."""

from __future__ import annotations

import fcntl
import os
import time
from typing import Optional


class NodeLock:
    """flock on a file beside the store: released by the kernel if the holder dies (slurmd kills a hung health
    check). `__enter__` says whether the lock was taken within `wait_s`; a run without it goes on read-only."""

    def __init__(self, path: str, wait_s: float, fallback: Optional[str] = None) -> None:
        self.paths = [path] + ([fallback] if fallback else [])  # the fallback: when the first cannot be created
        self.wait_s = wait_s
        self.fd: Optional[int] = None

    def _open(self) -> Optional[int]:
        for path in self.paths:
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except OSError:
                continue
        return None

    def __enter__(self) -> bool:
        self.fd = self._open()
        if self.fd is None:
            return False
        until = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() >= until:
                    return False
                time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def lock_path(runtime_dir: str, node: str) -> str:
    return os.path.join(runtime_dir, f"{node}.lock")
