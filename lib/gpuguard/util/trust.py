"""Paths root may write through without trusting anything a user could have put there: the one walk every root
writer uses (the history store's notification state, the log file, the metrics textfiles, atomic_write).

The path is walked from `/` one component at a time with O_NOFOLLOW: every directory must be owned by root (or
this process's user) and not writable by others. A symlink on the way is followed only when a trusted uid owns it
(in a directory already found trustworthy nobody else can replace it: /var/run -> /run). A sticky world-writable
directory such as /tmp may be on the way; at the end only where the caller allows it (a file root creates there
with O_CREAT|O_EXCL|O_NOFOLLOW and then renames into place is root's, and the sticky bit keeps users from removing
or replacing it). Missing directories are created 0755 unless the caller only asks (`gpuguard config --check`).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Optional


class Untrusted(OSError):
    """A path root must not use: a symlink, or writable / owned by someone else."""


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 16


def trusted_uids() -> set[int]:
    return {0, os.geteuid()}


def check_owner_mode(st: os.stat_result, what: str, uids: set[int], allow_sticky: bool) -> None:
    """Raises Untrusted unless `st` is owned by a trusted uid and not writable by others (a sticky directory
    passes when `allow_sticky`)."""
    if st.st_uid not in uids:
        raise Untrusted(f"{what} is owned by uid {st.st_uid}, not by root")
    if st.st_mode & 0o022 and not (allow_sticky and st.st_mode & stat.S_ISVTX):
        raise Untrusted(f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})")


def _child_dir(parent_fd: int, name: str, what: str, uids: set[int], allow_sticky: bool, create: bool) -> int:
    """`name` below an open trusted directory (created 0755 when missing and `create`), never through a symlink."""
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Untrusted(f"{what} is a symlink or not a directory (not followed)") from e
        raise
    try:
        check_owner_mode(os.fstat(fd), what, uids, allow_sticky)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _trusted_link(parent_fd: int, name: str, what: str, uids: set[int]) -> Optional[str]:
    """The target of `name` when it is a symlink a trusted uid made; None when it is no symlink. Raises Untrusted
    for a link someone else owns."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISLNK(st.st_mode):
        return None
    if st.st_uid not in uids:
        raise Untrusted(f"{what} is a symlink owned by uid {st.st_uid} (not followed)")
    return os.readlink(name, dir_fd=parent_fd)


def open_trusted_dir(path: str, uids: Optional[set[int]] = None, sticky_end: bool = False,
                     create: bool = True) -> int:
    """An fd on directory `path`, walked from / one component at a time, creating what is missing (0755) when
    `create`. Every directory must be owned by a trusted uid and not writable by others (a sticky one may be on
    the way, at the end only with `sticky_end`); a symlink on the way is followed only when a trusted uid owns it.
    Raises Untrusted / OSError (FileNotFoundError for a missing one when not `create`)."""
    uids = trusted_uids() if uids is None else uids
    if not os.path.isabs(path):
        raise Untrusted(f"{path}: not an absolute path")
    parts = [p for p in os.path.normpath(path).split("/") if p]
    links = 0
    fd = os.open("/", DIR_FLAGS)
    try:
        check_owner_mode(os.fstat(fd), "/", uids, allow_sticky=bool(parts) or sticky_end)
        i = 0
        while i < len(parts):
            here = "/" + "/".join(parts[:i + 1])
            target = _trusted_link(fd, parts[i], here, uids)
            if target is not None:  # resolve it lexically (everything before it is resolved) and walk again
                links += 1
                if links > MAX_LINKS:
                    raise Untrusted(f"{path}: too many symlinks")
                resolved = os.path.normpath(os.path.join("/" + "/".join(parts[:i]), target))
                parts = [p for p in resolved.split("/") if p] + parts[i + 1:]
                os.close(fd)
                fd = os.open("/", DIR_FLAGS)
                i = 0
                continue
            nfd = _child_dir(fd, parts[i], here, uids, i < len(parts) - 1 or sticky_end, create)
            os.close(fd)
            fd = nfd
            i += 1
        return fd
    except BaseException:
        os.close(fd)
        raise


def untrusted_reason(path: str, sticky_end: bool = False) -> Optional[str]:
    """Why root must not write in directory `path` (None: it may, or it does not exist yet and root will create
    it 0755). Creates nothing: for `gpuguard config --check`."""
    try:
        os.close(open_trusted_dir(path, sticky_end=sticky_end, create=False))
    except FileNotFoundError:
        parent = os.path.dirname(os.path.normpath(path))
        return None if parent == path else untrusted_reason(parent, sticky_end=True)
    except OSError as e:
        return str(e)
    return None
