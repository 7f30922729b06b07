"""Real filesystem faults for the store and hook tests: a tiny tmpfs that fills up, a read-only bind mount. Both
need root and mount(8), and skip the test without them."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str = "320k") -> Iterator[Path]:
    """A new directory `path` on a tmpfs of `size` (made full by writing to it)."""
    path.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)):
        pytest.skip("needs root and mount(8) for a real full filesystem")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path` on a real read-only filesystem (a read-only bind mount over itself)."""
    if os.geteuid() != 0 or not _mount("--bind", str(path), str(path)):
        pytest.skip("needs root and mount(8) for a real read-only filesystem")
    try:
        if not _mount("-o", "remount,ro,bind", str(path)):
            pytest.skip("read-only remount not permitted here")
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
