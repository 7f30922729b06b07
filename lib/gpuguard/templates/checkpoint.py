"""Find the latest *complete* checkpoint to resume from. Pure functions over a directory tree (no clock).

Kinds:
- glob: entries of `directory` matching `pattern`; the one with the highest step number in its name wins
  (natural order: step-10 after step-9), ties by modification time. Names marking work in progress (.tmp,
  .partial, .incomplete, a leading dot) are skipped; with `marker`, a directory counts only once that file
  exists inside it (e.g. `.metadata`, which torch.distributed.checkpoint writes last).
- megatron: `latest_checkpointed_iteration.txt` holds an iteration number (or "release"); it is valid only if
  its `iter_%07d` (or `release`) directory exists. Megatron's `--load` takes the checkpoint *root* and reads the
  tracker itself, so the root is what is returned.
- latest: a `latest` symlink to the checkpoint, or a `latest` file holding its tag (DeepSpeed's convention).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

KINDS = ("glob", "megatron", "latest")
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
_IN_PROGRESS = re.compile(r"(^\.|\.(tmp|partial|incomplete|inprogress)$|^tmp)", re.I)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: Optional[int]
    why: str


def _step_of(name: str) -> Optional[int]:
    nums = re.findall(r"\d+", name)
    return int(nums[-1]) if nums else None


def _complete(path: Path, marker: Optional[str]) -> bool:
    if _IN_PROGRESS.search(path.name) or _CONTROL.search(str(path)):
        return False
    try:
        if marker:
            return path.is_dir() and (path / marker).exists()
        if path.is_dir():
            return any(path.iterdir())
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def find_glob(directory: Path, pattern: str, marker: Optional[str] = None) -> Optional[Checkpoint]:
    best: Optional[tuple[tuple[int, float], Path]] = None
    for cand in directory.glob(pattern):
        if not _complete(cand, marker):
            continue
        step = _step_of(cand.name)
        try:
            mtime = cand.stat().st_mtime
        except OSError:
            continue
        key = (step if step is not None else -1, mtime)
        if best is None or key > best[0]:
            best = (key, cand)
    if best is None:
        return None
    step = best[0][0] if best[0][0] >= 0 else None
    return Checkpoint(best[1], step, f"newest complete match of {pattern!r}" + (f" (step {step})" if step is not None
                                                                                else ""))


def find_megatron(directory: Path, marker: Optional[str] = None) -> Optional[Checkpoint]:
    tracker = directory / MEGATRON_TRACKER
    try:
        text = tracker.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "release":
        sub, step = directory / "release", None
    elif text.isdigit():
        step = int(text)
        sub = directory / f"iter_{step:07d}"
    else:
        return None  # a tracker being rewritten, or garbage: no resume rather than a wrong one
    if not sub.is_dir() or (marker and not (sub / marker).exists()):
        return None
    return Checkpoint(directory, step, f"{MEGATRON_TRACKER} -> {sub.name}")


def find_latest_link(directory: Path, marker: Optional[str] = None) -> Optional[Checkpoint]:
    link = directory / "latest"
    try:
        if link.is_symlink():
            target = Path(os.path.realpath(link))
        elif link.is_file():
            tag = link.read_text(encoding="utf-8").strip()
            if not tag or "/" in tag or _CONTROL.search(tag) or tag in (".", ".."):
                return None
            target = directory / tag
        else:
            return None
    except (OSError, UnicodeDecodeError):
        return None
    if not target.exists() or not _complete(target, marker):
        return None
    return Checkpoint(target, _step_of(target.name), f"'latest' -> {target.name}")


def find_checkpoint(directory: str, kind: str = "glob", pattern: str = "*",
                    marker: Optional[str] = None) -> Optional[Checkpoint]:
    """The checkpoint to resume from, or None (no checkpoint yet, or none complete)."""
    if kind not in KINDS:
        raise ValueError(f"checkpoint kind must be one of {', '.join(KINDS)}, got {kind!r}")
    root = Path(directory)
    if not root.is_dir():
        return None
    if kind == "megatron":
        return find_megatron(root, marker)
    if kind == "latest":
        return find_latest_link(root, marker)
    return find_glob(root, pattern, marker)
