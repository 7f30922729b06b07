"""Writing files that other processes read concurrently (a prolog and a health check, node_exporter, every
node of a job): write a hidden temp file in the same directory, then rename it over the target, so a reader
sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from typing import Union


def atomic_write(path: Union[str, os.PathLike[str]], data: Union[bytes, str], mode: int = 0o644,
                 durable: bool = False) -> str:
    """Replace `path` with `data` atomically (creating its directory). Raises OSError; no temp file is left.
    `durable`: the data reaches the disk before the rename (a verdict must survive a power cut)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # a dot-file: tools that glob the directory (node_exporter's *.prom) never pick up the temp file
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600; readers are often other users (node_exporter, slurmd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
