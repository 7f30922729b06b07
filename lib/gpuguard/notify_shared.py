"""The fleet-wide group directory (`notify.shared_dir`) as root hooks use it: a trust boundary.

Nodes drop one marker file per (kind, check, time window) in `<shared_dir>/groups/<kind>+<check>+<window>/`;
past `group_threshold` members a node stays quiet and one digest goes out when the window closes, sent by the
node whose O_EXCL claim file (`digest.claim`) is created first. A directory other users can write to could be
used to silence a drain (fake members push a group over its threshold, a fake claim makes nobody send the
digest), so:

- the path is walked from / one component at a time (openat with O_NOFOLLOW: a symlink anywhere is refused);
  every directory must be owned by root or `notify.trusted_user` and not writable by others (a sticky /tmp-like
  directory may be on the way, not at the end); then everything is done relative to directory fds;
- a member or claim file counts only when it is a regular file with a trusted owner, not writable by others,
  small (MAX_MEMBER_BYTES) and, for members, strictly parsed (parse_member);
- an untrusted claim is removed (unlinkat never follows) or the next claim name is used.

When the directory cannot be used safely, the caller pages individually: better N pages than a silenced one.
Pure functions (parse_member) and fd-based I/O; nothing here imports gpuguard.notify.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import socket
import stat
import time
from typing import Any, Optional

SEVERITIES = ("info", "warning", "critical")
STATES = ("firing", "resolved")
RESOLVING_KINDS = {"undrain"}  # kinds that are, by themselves, the resolution of an episode


def log_warning(msg: str) -> None:
    """Notification trouble must be visible somewhere even when it cannot be notified."""
    try:
        import syslog

        syslog.syslog(syslog.LOG_WARNING, f"gpuguard notify: {msg}")
    except Exception:  # noqa: BLE001
        pass


_log = log_warning




class Untrusted(OSError):
    """A path or file root hooks must not use: a symlink, or writable / owned by someone else."""


def trusted_uids(ncfg: dict[str, Any]) -> set[int]:
    """root, this process's own uid and `notify.trusted_user` (a name or a number)."""
    uids = {0, os.geteuid()}
    user = ncfg.get("trusted_user")
    if user:
        if str(user).isdigit():
            uids.add(int(user))
        else:
            try:
                import pwd

                uids.add(pwd.getpwnam(str(user)).pw_uid)
            except KeyError:
                _log(f"notify.trusted_user {user!r} is not a user on this node; only root is trusted")
    return uids


def _check_dir(st: os.stat_result, what: str, uids: set[int], allow_sticky: bool) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{what}: not a directory")
    if st.st_uid not in uids:
        raise Untrusted(f"{what}: owned by uid {st.st_uid}, not by root or notify.trusted_user")
    if st.st_mode & 0o022 and not (allow_sticky and st.st_mode & stat.S_ISVTX):
        raise Untrusted(f"{what}: writable by others (mode {stat.S_IMODE(st.st_mode):04o})")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_trusted_dir(path: str, uids: set[int], create: bool = False) -> int:
    """An fd on `path`, walked from / one component at a time with O_NOFOLLOW (a symlink anywhere is refused).
    Every directory on the way must be owned by a trusted uid and not writable by others (a sticky directory
    such as /tmp may be on the way, not at the end). `create`: make the last component (0755) if it is missing.
    Raises Untrusted / OSError."""
    if not os.path.isabs(path):
        raise Untrusted(f"{path}: not an absolute path")
    parts = [p for p in os.path.normpath(path).split("/") if p]
    fd = os.open("/", _DIR_FLAGS)
    try:
        _check_dir(os.fstat(fd), "/", uids, allow_sticky=bool(parts))
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            nfd = _open_child_dir(fd, name, uids, "/" + "/".join(parts[:i + 1]), create=create and last,
                                  allow_sticky=not last)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_child_dir(parent_fd: int, name: str, uids: set[int], what: str, create: bool,
                    allow_sticky: bool = False) -> int:
    """`name` below an open trusted directory, never through a symlink, checked like its parents."""
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Untrusted(f"{what}: a symlink or not a directory (not followed)") from e
        raise
    try:
        _check_dir(os.fstat(fd), what, uids, allow_sticky=allow_sticky)
    except BaseException:
        os.close(fd)
        raise
    return fd


MAX_MEMBER_BYTES = 16384
MAX_GROUP_ENTRIES = 20000
_MEMBER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}\.json$")


def _lstat_member(dir_fd: int, name: str, uids: set[int]) -> Optional[os.stat_result]:
    """The member file's stat when it may count: a regular file, trusted owner, not writable by others, bounded."""
    if not _MEMBER_NAME.match(name):
        return None
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in uids or st.st_mode & 0o022 or \
            st.st_size > MAX_MEMBER_BYTES:
        return None
    return st


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def group_kind(kind: str, resolved: bool) -> str:
    """Alerts and their resolutions are grouped apart: `straggler` vs `straggler.resolved` (`undrain` is one)."""
    return f"{kind}.resolved" if resolved and kind not in RESOLVING_KINDS else kind


def parse_member(raw: bytes, name: str, kind: str, check: str) -> Optional[dict[str, Any]]:
    """A group member file, parsed strictly: one JSON object (no NaN, no duplicate keys), for this group's kind
    (`group_kind`) and check, naming the node its file is named after, with sane field types. None when anything
    is off. Pure."""
    if len(raw) > MAX_MEMBER_BYTES:
        return None

    def no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            raise ValueError("duplicate key")
        return d

    def no_constants(c: str) -> Any:
        raise ValueError(f"{c} is not JSON")

    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=no_dupes, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    node = data.get("node")
    if not isinstance(node, str) or not node or _safe(node) + ".json" != name:
        return None
    state = data.get("state", "firing")
    if state not in STATES or not isinstance(data.get("kind"), str) or \
            group_kind(data["kind"], state == "resolved") != kind:
        return None
    if _safe(str(data.get("check_id") or "-")) != check:
        return None
    if not isinstance(data.get("message"), str) or data.get("severity") not in SEVERITIES or \
            not _finite(data.get("ts")):
        return None
    for opt in ("reason", "action", "job_id"):
        if data.get(opt) is not None and not isinstance(data[opt], str):
            return None
    return data


def _read_member(dir_fd: int, name: str, uids: set[int], kind: str, check: str) -> Optional[dict[str, Any]]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)  # the file we opened, not the name (no swap between a check and the read)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in uids or st.st_mode & 0o022 or \
                st.st_size > MAX_MEMBER_BYTES:
            return None
        raw = os.read(fd, MAX_MEMBER_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_member(raw, name, kind, check)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "_"


def group_name(kind: str, check: str, bucket: int) -> str:
    """`<kind>+<check>+<window number>` (kind and check with [A-Za-z0-9_.-] only, so "+" separates)."""
    return f"{_safe(kind)}+{_safe(check)}+{bucket}"


def _split_group(name: str) -> Optional[tuple[str, str, int]]:
    parts = name.split("+")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


def gate_group(shared_dir: str, uids: set[int], record: dict[str, Any], now: float, window_s: float,
               threshold: int) -> bool:
    """True when this node's event (`record`: node, kind, check_id, state, ... as parse_member reads it back)
    joins a fleet-wide group already past its threshold (stay quiet). Raises Untrusted / OSError when the
    directory cannot be used safely (the caller then pages individually)."""
    kind = _safe(group_kind(str(record["kind"]), record.get("state") == "resolved"))
    check = _safe(str(record.get("check_id") or "-"))
    name = group_name(kind, check, int(now // window_s))
    root_fd = open_trusted_dir(shared_dir, uids, create=True)
    try:
        groups_fd = _open_child_dir(root_fd, "groups", uids, f"{shared_dir}/groups", create=True)
    finally:
        os.close(root_fd)
    try:
        gfd = _open_child_dir(groups_fd, name, uids, f"{shared_dir}/groups/{name}", create=True)
    finally:
        os.close(groups_fd)
    try:
        marker = _safe(str(record["node"])) + ".json"
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=gfd)
            try:
                os.write(fd, json.dumps(record, default=str).encode()[:MAX_MEMBER_BYTES])
            finally:
                os.close(fd)
        except FileExistsError:
            pass  # this node is already counted in this window (or an untrusted file squats the name: see below)
        mine = _lstat_member(gfd, marker, uids)
        if mine is None:
            _log(f"{shared_dir}/groups/{name}/{marker} is not this node's marker (owner/type); paging individually")
            return False
        # the first `threshold` valid members (by arrival: mtime, then name) page individually
        earlier: list[tuple[int, str]] = []
        for n in os.listdir(gfd)[:MAX_GROUP_ENTRIES]:
            if n == marker:
                continue
            st = _lstat_member(gfd, n, uids)
            if st is not None and (st.st_mtime_ns, n) < (mine.st_mtime_ns, marker):
                earlier.append((st.st_mtime_ns, n))
        valid = 0
        for _, n in sorted(earlier):
            if _read_member(gfd, n, uids, kind, check) is not None:
                valid += 1
                if valid >= threshold:
                    return True
        return False
    finally:
        os.close(gfd)


def state_trust_problem(path: str, uids: set[int]) -> Optional[str]:
    """Why root must not keep its notification state in `path` (None: fine). Someone who can write it could
    fake an open episode, fill the rate limiter or delete the spool."""
    for p, what in ((os.path.dirname(path) or ".", "directory"), (path, "file")):
        try:
            st = os.stat(p)  # where a link leads is what counts
        except FileNotFoundError:
            continue  # created by the store (as root, 0755)
        except OSError as e:
            return f"state {what} {p} unusable: {e.strerror or e}"
        if st.st_uid not in uids:
            return f"state {what} {p} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not (what == "directory" and st.st_mode & stat.S_ISVTX):
            return f"state {what} {p} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None



def _claim_digest(gfd: int, uids: set[int], group: str) -> bool:
    """O_EXCL claim of a group's digest. A claim file only counts when a trusted uid owns it: anything else
    squatting the name (planted while the directory was writable) is removed, or the next name is used."""
    for name in ("digest.claim", "digest.claim.1", "digest.claim.2"):
        for _ in (1, 2):
            try:
                fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=gfd)
            except FileExistsError:
                try:
                    st = os.stat(name, dir_fd=gfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone meanwhile: try again
                if stat.S_ISREG(st.st_mode) and st.st_uid in uids and not st.st_mode & 0o022:
                    return False  # another node sends (or sent) it
                _log(f"groups/{group}/{name}: not a trusted claim (uid {st.st_uid}, mode {st.st_mode:o}); ignored")
                try:
                    os.unlink(name, dir_fd=gfd)  # unlinkat: removes the entry itself, never follows it
                except OSError:
                    break  # a directory, or cannot: use the next name
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{socket.gethostname()} {time.time():.3f}\n")
            return True
    return False



def _remove_group(groups_fd: int, gfd: int, name: str) -> None:
    """unlinkat every entry of an old (trusted) group directory, then the directory; never follows a link."""
    for n in os.listdir(gfd)[:MAX_GROUP_ENTRIES]:
        try:
            os.unlink(n, dir_fd=gfd)
        except OSError:
            pass
    try:
        os.rmdir(name, dir_fd=groups_fd)
    except OSError:
        pass


def closed_groups(shared_dir: str, uids: set[int], now: float, window_s: float, threshold: int,
                  keep_s: float) -> list[tuple[str, float, list[dict[str, Any]]]]:
    """Every group whose window has closed with more than `threshold` valid members and whose digest this node
    has just claimed: (name, window end, members). Groups older than `keep_s` are removed. Raises OSError /
    Untrusted when the directory cannot be used safely."""
    root_fd = open_trusted_dir(shared_dir, uids)
    try:
        try:
            groups_fd = _open_child_dir(root_fd, "groups", uids, f"{shared_dir}/groups", create=False)
        except FileNotFoundError:
            return []
    finally:
        os.close(root_fd)
    out = []
    try:
        for name in sorted(os.listdir(groups_fd))[:MAX_GROUP_ENTRIES]:
            parsed = _split_group(name)
            if parsed is None:
                continue
            kind, check, bucket = parsed
            end = (bucket + 1) * window_s
            if end > now:
                continue  # still open
            try:
                gfd = _open_child_dir(groups_fd, name, uids, f"{shared_dir}/groups/{name}", create=False)
            except OSError as e:
                _log(f"{shared_dir}/groups/{name} ignored ({e})")
                continue
            try:
                if now - end > keep_s:
                    _remove_group(groups_fd, gfd, name)
                    continue
                members = [m for m in (_read_member(gfd, n, uids, kind, check)
                                       for n in os.listdir(gfd)[:MAX_GROUP_ENTRIES] if _MEMBER_NAME.match(n))
                           if m is not None]
                if len(members) > threshold and _claim_digest(gfd, uids, name):
                    out.append((name, end, members))
            finally:
                os.close(gfd)
    finally:
        os.close(groups_fd)
    return out
