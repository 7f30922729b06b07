"""Writing files that other processes read concurrently (a prolog and a health check, node_exporter, every
node of a job): write a hidden temp file in the same directory, then rename it over the target, so a reader
sees the old file or the new one, never half of one.

Run as root, the write never goes through anything a user controls (gpuguard.util.trust): the directory is walked
from / without following a symlink a user owns, every directory on the way must be root's and not writable by
others (a sticky one such as /tmp may be on the way; at the end only with `sticky_ok`, the default), missing ones
are created 0755, and the temp file is created in that directory's file descriptor with O_CREAT|O_EXCL|O_NOFOLLOW
and renamed there: a symlink planted at the target is replaced, never followed. A path that fails this raises
Untrusted (an OSError) and nothing is written. Unprivileged callers (the job monitor, tests, devtools) write as
before: what they can write, a user could have written anyway."""

from __future__ import annotations

import os
from typing import Union

from gpuguard.util.trust import open_trusted_dir


def _encoded(data: Union[bytes, str]) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else data


def atomic_write(path: Union[str, os.PathLike[str]], data: Union[bytes, str], mode: int = 0o644,
                 durable: bool = False, sticky_ok: bool = True) -> str:
    """Replace `path` with `data` atomically (creating its directory). Raises OSError (Untrusted as root, see the
    module docstring); no temp file is left. `durable`: the data reaches the disk before the rename (a verdict
    must survive a power cut). `sticky_ok` False: as root, the directory itself may not be world-writable even
    with the sticky bit (a directory whose every file counts, such as node_exporter's textfile directory)."""
    path = os.fspath(path)
    if os.geteuid() == 0:
        return _root_write(path, _encoded(data), mode, durable, sticky_ok)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # a dot-file: tools that glob the directory (node_exporter's *.prom) never pick up the temp file
    import tempfile  # not root (tests, a user's own files): root's hooks write through _root_write

    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_encoded(data))
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


def _root_write(path: str, data: bytes, mode: int, durable: bool, sticky_ok: bool) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    dfd = open_trusted_dir(directory, sticky_end=sticky_ok)
    tmp = f".{name}.{os.urandom(6).hex()}.tmp"  # secrets.token_hex(6), without importing secrets (random, hashlib)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
                os.fchmod(f.fileno(), mode)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
    return path
