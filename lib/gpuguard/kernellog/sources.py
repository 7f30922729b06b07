"""Choosing a kernel-log source from its spec, and the two entry points everyone calls:

- `read_xid_events(spec, cursor, timeout_s=...)`: the hooks' probe; never raises.
- `make_follower(spec, cursor=..., boot_id=..., start_at=...)`: the watch daemon's follower (a source that is
  following); raises FollowError when there is nothing to follow.

Specs: `auto` | `kmsg[:PATH]` | `journal[:JOURNALCTL]` | `dmesg[:DMESG]` | `file:PATH`. `auto` = /dev/kmsg if it can
be opened, else journalctl if installed, else dmesg.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from gpuguard.kernellog.base import (DEFAULT_BOOT_ID_PATH, START_AT, FollowError, KernelLogSource, StoredCursor,
                                     kmsg_readable)
from gpuguard.model import KernelLogObservation, ProbeStatus
from gpuguard.util.toolrun import which

SPECS = "auto, kmsg[:PATH], journal[:JOURNALCTL], dmesg[:DMESG], file:PATH"


def make_source(source_spec: str, *, boot_id_path: str = DEFAULT_BOOT_ID_PATH, boot_id: Optional[str] = None,
                poll_interval_s: float = 0.25) -> KernelLogSource:
    """The source a spec names. Raises ValueError for an unknown spec. Only the module of the source a spec names is
    imported (a node reads /dev/kmsg: the prolog never imports the journal, dmesg or file readers)."""
    kind, _, arg = source_spec.partition(":")
    ids = {"boot_id": boot_id, "boot_id_path": boot_id_path}
    if kind == "auto" and not arg:
        if kmsg_readable("/dev/kmsg"):
            kind, arg = "kmsg", "/dev/kmsg"
        elif which("journalctl"):
            kind, arg = "journal", "journalctl"
        else:
            kind, arg = "dmesg", "dmesg"
    if kind == "kmsg":
        from gpuguard.kernellog.kmsg import KmsgSource

        return KmsgSource(arg or "/dev/kmsg", poll_interval_s=poll_interval_s, **ids)
    if kind == "journal":
        from gpuguard.kernellog.journal import JournalSource

        return JournalSource(arg or "journalctl", **ids)
    if kind == "dmesg":
        from gpuguard.kernellog.dmesg import DmesgSource

        return DmesgSource(arg or "dmesg", **ids)
    if kind == "file" and arg:
        from gpuguard.kernellog.file import FileSource

        return FileSource(arg, poll_interval_s=poll_interval_s)
    raise ValueError(f"unknown kernel log source {source_spec!r} ({SPECS})")


def read_xid_events(source_spec: str, cursor: Optional[StoredCursor], *, timeout_s: float,
                    boot_id_path: str = DEFAULT_BOOT_ID_PATH, boot_id: Optional[str] = None) -> KernelLogObservation:
    """Xid events from the kernel log since `cursor` (None: everything available) and the next cursor.
    Never raises: a failure gives status.complete False with status.error, and the old cursor back so the
    next run retries from the same place."""
    started = time.monotonic()
    try:
        source = make_source(source_spec, boot_id_path=boot_id_path, boot_id=boot_id)
        obs = source.read(cursor, timeout_s=timeout_s)
    except Exception as e:  # a probe reports failure as an incomplete observation, never upward
        obs = KernelLogObservation(status=ProbeStatus(complete=False, error=f"{type(e).__name__}: {e}"),
                                   source=source_spec, cursor=cursor)
    obs.status.duration_s = time.monotonic() - started
    return obs


def make_follower(spec: str, *, cursor: Optional[StoredCursor], boot_id: Optional[str], start_at: str = "auto",
                  poll_interval_s: float = 0.25, follow: bool = True) -> KernelLogSource:
    """A source following `spec` after `cursor` (see KernelLogSource.follow for `start_at`); `follow=False` reads
    what is there and finishes. Raises FollowError when it cannot be followed."""
    if start_at not in START_AT:
        raise FollowError(f"unknown start position {start_at!r} (one of {', '.join(START_AT)})")
    kind, _, arg = spec.partition(":")
    if kind == "auto" and not arg and not kmsg_readable("/dev/kmsg") and not which("journalctl"):
        raise FollowError("no kernel log to follow: /dev/kmsg is not readable and journalctl is not installed")
    if kind == "kmsg" and not os.path.exists(arg or "/dev/kmsg"):
        raise FollowError(f"{arg or '/dev/kmsg'} does not exist")
    try:
        source = make_source(spec, boot_id=boot_id, poll_interval_s=poll_interval_s)
    except ValueError as e:
        raise FollowError(str(e)) from None
    try:
        source.follow(cursor, start_at=start_at, once=not follow)
    except OSError as e:
        raise FollowError(f"cannot open {spec}: {e.strerror or e}") from None
    return source

