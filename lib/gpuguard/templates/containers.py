"""Which of a job's directories a container sees at the same path (pyxis `--container-mounts`). Pure.

A directory the training writes inside the container and gpuguard reads outside it (the checkpoints: job-attempt
looks for the newest one on the host to resume from) must be mounted at the same path, or inside the container
it is an empty directory of the image and every attempt restarts from step 0 (issue 16). The torchrun template
always mounts the job directory (ledger, error files, NCCL logs) and the node-local scratch root at their own
paths; anything else needs a `container_mounts` entry.
"""

from __future__ import annotations

import posixpath
from typing import Optional, Sequence


def parse_mount(spec: str) -> tuple[str, str]:
    """(source, destination) of a pyxis mount `SRC[:DST[:FLAGS]]` (no DST: the same path)."""
    parts = spec.split(":")
    return parts[0], (parts[1] if len(parts) > 1 and parts[1] else parts[0])


def _under(path: str, root: str) -> bool:
    root = posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def coverage_problem(what: str, path: Optional[str], mounts: Sequence[str], auto: Sequence[str]) -> Optional[str]:
    """Why `path` (a directory the job uses on both sides) is not the same directory inside the container, or
    None when a mount covers it at the same path. `auto`: roots the template mounts by itself."""
    if not path:
        return None
    if not posixpath.isabs(path):
        return (f"{what} {path!r} is relative: inside the container it is resolved against the container's working "
                "directory, not the submit directory; give an absolute path and mount it (container_mounts)")
    norm = posixpath.normpath(path)
    if any(_under(norm, root) for root in auto if root and posixpath.isabs(root)):
        return None
    best: Optional[tuple[str, str]] = None
    for spec in mounts:
        src, dst = parse_mount(spec)
        if _under(norm, dst) and (best is None or len(dst) > len(best[1])):
            best = (src, dst)
    if best is None:
        return (f"{what} {path} is not covered by any container mount: inside the container it would be an empty "
                f"directory of the image and every attempt would restart from step 0; add it to container_mounts "
                f"(e.g. {posixpath.dirname(norm) or norm}:{posixpath.dirname(norm) or norm})")
    src, dst = best
    if posixpath.normpath(src) != posixpath.normpath(dst):
        return (f"{what} {path} is mounted from another host path ({src}:{dst}): gpuguard looks for the checkpoint to "
                f"resume from outside the container, at {path}; mount it at the same path ({dst}:{dst})")
    return None
