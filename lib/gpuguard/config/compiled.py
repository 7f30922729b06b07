"""Compiled copies of YAML files the hooks read on every run (the last good configuration, profiles, a simulated
node's scenario), so that a hook reads JSON instead of importing and running a YAML parser before every job.

A copy is keyed by the SHA-256 of the source file's bytes: the hooks still read the (small) source every time and
use the copy only when it was compiled from exactly those bytes, so an edit is never missed, whatever the file
system's timestamp granularity. A copy decides what root hooks do, so it is trusted only when it is a regular file
owned by this user that nobody else can write, read without following a symlink.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Optional

from gpuguard.util.digest import sha256_hex
from gpuguard.util.fs import atomic_write

MAX_BYTES = 4 << 20


def source_digest(data: bytes) -> str:
    return sha256_hex(data)


def copy_path(directory: str, kind: str, source: str) -> str:
    """Where the compiled copy of `source` lives in `directory`: one file per source path."""
    key = sha256_hex(os.path.abspath(source).encode())[:16]
    return os.path.join(directory, f"{kind}-{key}.json")


def read_trusted_json(path: str) -> Optional[Any]:
    """The JSON document at `path`, or None when it is missing, unreadable, not JSON, or could have been written
    by someone else (not a regular file, not owned by us, writable by group or others)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return json.loads(f.read(MAX_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def read_copy(path: str, digest: str) -> Optional[Any]:
    """The compiled value stored at `path` if it was compiled from a source whose bytes hash to `digest`."""
    doc = read_trusted_json(path)
    if not isinstance(doc, dict) or doc.get("digest") != digest or "value" not in doc:
        return None
    return doc["value"]


def write_copy(path: str, digest: str, value: Any, source: str) -> None:
    """Best effort (0600, atomic): without a copy the next run parses the source again."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        atomic_write(path, json.dumps({"source": os.path.abspath(source), "digest": digest, "value": value},
                                      sort_keys=True), mode=0o600)
    except (OSError, TypeError, ValueError):
        pass
