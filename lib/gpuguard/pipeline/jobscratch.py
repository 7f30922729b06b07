"""Remove a job's private node-local scratch directories (the torchrun template's `gpuguard-<jobid>`, where
TRITON_CACHE_DIR and torchrun's logs live) from the epilog, as root, without trusting anything the user wrote.

The job creates `<root>/gpuguard-<jobid>` with mode 0700 (or `<root>/gpuguard-<jobid>.XXXXXXXX` from mktemp when
the predictable name was taken). Everything below a root such as /tmp is user-controlled, so:
- only entries named exactly like that, that are real directories (never a symlink) owned by the job's uid;
- every path is opened relative to a directory file descriptor with O_NOFOLLOW and re-checked with fstat (same
  inode, same owner) before anything below it is touched, so a link planted or swapped in never redirects the
  removal (a symlink inside is unlinked, never followed);
- never crosses into another file system (a FUSE mount the user made inside) and leaves subdirectories owned by
  someone else in place;
- bounded in time (`deadline_s`) and depth; what is left is reported, never raised.
"""

from __future__ import annotations

import os
import re
import stat
import time
from typing import Callable, Iterable, Optional

from gpuguard.util.record import Record, field, record

MAX_DEPTH = 128
_JOB_ID = re.compile(r"^\d{1,20}$")


@record
class ScratchResult(Record):
    removed: list[str] = field(default_factory=list)   # directories removed (full paths)
    skipped: list[str] = field(default_factory=list)   # "path: why" for matching names left alone
    errors: list[str] = field(default_factory=list)
    incomplete: bool = False                           # the deadline or a limit stopped the removal

    def summary(self) -> str:
        parts = []
        if self.removed:
            parts.append(f"removed {', '.join(self.removed)}")
        if self.skipped:
            parts.append(f"left alone {'; '.join(self.skipped)}")
        if self.errors:
            parts.append(f"errors {'; '.join(self.errors[:5])}")
        if self.incomplete:
            parts.append("incomplete (time or depth limit)")
        return "; ".join(parts) or "nothing to remove"


def scratch_name_pattern(job_id: str) -> re.Pattern[str]:
    return re.compile(rf"^gpuguard-{re.escape(job_id)}(?:\.[A-Za-z0-9]{{6,32}})?$")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def remove_job_scratch(job_id: Optional[str], uid: Optional[int], roots: Iterable[str], deadline_s: float = 5.0,
                       clock: Callable[[], float] = time.monotonic) -> ScratchResult:
    """Remove `<root>/gpuguard-<job_id>[.XXXXXXXX]` directories owned by `uid` under each root. Never raises."""
    out = ScratchResult()
    if job_id is None or uid is None or not _JOB_ID.match(str(job_id)):
        out.errors.append(f"job id {job_id!r} / uid {uid!r} unusable: nothing removed")
        return out
    deadline = clock() + max(0.0, deadline_s)
    pattern = scratch_name_pattern(str(job_id))
    for root in roots:
        try:
            root_fd = os.open(root, _DIR_FLAGS)
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                out.errors.append(f"{root}: {e.strerror or e} (a scratch root must be a real directory, not a link)")
            continue
        try:
            _remove_in_root(root, root_fd, pattern, uid, deadline, clock, out)
        finally:
            os.close(root_fd)
    return out


def _remove_in_root(root: str, root_fd: int, pattern: re.Pattern[str], uid: int, deadline: float,
                    clock: Callable[[], float], out: ScratchResult) -> None:
    try:
        names = [e.name for e in os.scandir(root_fd) if pattern.match(e.name)]
    except OSError as e:
        out.errors.append(f"{root}: cannot list: {e.strerror or e}")
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        except OSError:
            continue  # gone already
        if not stat.S_ISDIR(st.st_mode):
            out.skipped.append(f"{path}: not a directory (a link or file someone planted)")
            continue
        if st.st_uid != uid:
            out.skipped.append(f"{path}: owned by uid {st.st_uid}, not the job's uid {uid}")
            continue
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        except OSError as e:
            out.skipped.append(f"{path}: {e.strerror or e}")
            continue
        try:
            fst = os.fstat(fd)
            if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or fst.st_uid != uid:
                out.skipped.append(f"{path}: changed while being checked")
                continue
            complete = _empty_dir(fd, path, fst.st_dev, uid, deadline, clock, out)
        finally:
            os.close(fd)
        if not complete:
            out.incomplete = out.incomplete or clock() > deadline
            continue
        try:
            os.rmdir(name, dir_fd=root_fd)
        except FileNotFoundError:
            pass  # removed at the same time by another epilog (a scratch root shared by the job's nodes): gone
        except OSError as e:
            out.errors.append(f"{path}: {e.strerror or e}")
            continue
        out.removed.append(path)


def _empty_dir(top_fd: int, top_path: str, dev: int, uid: int, deadline: float, clock: Callable[[], float],
               out: ScratchResult) -> bool:
    """Remove everything below the directory open at `top_fd`. Iterative (no recursion limit), every step relative
    to an open directory descriptor. Returns whether the directory is now empty."""
    return _TreeEmptier(dev, uid, deadline, clock, out).run(top_fd, top_path)


@record
class _OpenDir(Record):
    """A directory being emptied: its descriptor, its path, the names still to look at, whether all went so far."""

    fd: int
    path: str
    names: list[str]
    emptied: bool = True


class _TreeEmptier:
    """One removal below a job's scratch directory: a stack of open directories instead of recursion; what it
    leaves, and why, goes to `out`."""

    def __init__(self, dev: int, uid: int, deadline: float, clock: Callable[[], float], out: ScratchResult) -> None:
        self.dev, self.uid, self.deadline, self.clock, self.out = dev, uid, deadline, clock, out
        self.stack: list[_OpenDir] = []
        self.owned_fds: list[int] = []  # descriptors this opened (the top one belongs to the caller)

    def run(self, top_fd: int, top_path: str) -> bool:
        try:
            self.stack.append(_OpenDir(top_fd, top_path, [e.name for e in os.scandir(top_fd)]))
        except OSError as e:
            self.out.errors.append(f"{top_path}: cannot list: {e.strerror or e}")
            return False
        try:
            while self.stack:
                current = self.stack[-1]
                if self.clock() > self.deadline:
                    self.out.incomplete = True
                    return False
                if current.names:
                    self._visit(current, current.names.pop())
                    continue
                self.stack.pop()
                if not self.stack:
                    return current.emptied
                self._leave(current)
            return True
        finally:
            for extra in self.owned_fds:
                try:
                    os.close(extra)
                except OSError:
                    pass

    def _leave(self, done: _OpenDir) -> None:
        """A subdirectory is done: close it and remove it from its parent (if everything below it went)."""
        self._close(done.fd)
        parent = self.stack[-1]
        if not done.emptied:
            parent.emptied = False
            return
        try:
            os.rmdir(os.path.basename(done.path), dir_fd=parent.fd)
        except FileNotFoundError:
            pass  # another remover took it first: gone is what was wanted
        except OSError as e:
            self._error(parent, f"{done.path}: {e.strerror or e}")

    def _visit(self, parent: _OpenDir, name: str) -> None:
        child = os.path.join(parent.path, name)
        try:
            st = os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as e:
            self._error(parent, f"{child}: {e.strerror or e}")
            return
        if not stat.S_ISDIR(st.st_mode):
            try:
                os.unlink(name, dir_fd=parent.fd)  # files, and links: the link goes, its target is never touched
            except FileNotFoundError:
                pass
            except OSError as e:
                self._error(parent, f"{child}: {e.strerror or e}")
        elif self._may_enter(parent, st, child):
            self._enter(parent, name, child, st)

    def _may_enter(self, parent: _OpenDir, st: os.stat_result, child: str) -> bool:
        """Only the job user's own subdirectories on the same file system, within the depth limit."""
        if st.st_dev != self.dev:
            self.out.skipped.append(f"{child}: another file system mounted inside: not crossed")
        elif st.st_uid != self.uid:
            self.out.skipped.append(f"{child}: owned by uid {st.st_uid}, not the job's uid {self.uid}")
        elif len(self.stack) >= MAX_DEPTH:
            self.out.incomplete = True
        else:
            return True
        parent.emptied = False
        return False

    def _enter(self, parent: _OpenDir, name: str, child: str, st: os.stat_result) -> None:
        try:
            cfd = os.open(name, _DIR_FLAGS, dir_fd=parent.fd)
        except FileNotFoundError:
            return  # removed since it was looked at (another remover)
        except OSError as e:
            self._error(parent, f"{child}: {e.strerror or e}")
            return
        self.owned_fds.append(cfd)
        cst = os.fstat(cfd)
        if (cst.st_dev, cst.st_ino) != (st.st_dev, st.st_ino):
            self.out.skipped.append(f"{child}: changed while being checked")
            parent.emptied = False
            self._close(cfd)
            return
        try:
            self.stack.append(_OpenDir(cfd, child, [e.name for e in os.scandir(cfd)]))
        except OSError as e:
            self._error(parent, f"{child}: cannot list: {e.strerror or e}")
            self._close(cfd)

    def _error(self, parent: _OpenDir, message: str) -> None:
        self.out.errors.append(message)
        parent.emptied = False

    def _close(self, fd: int) -> None:
        os.close(fd)
        self.owned_fds.remove(fd)
