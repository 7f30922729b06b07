"""Where notification state lives (SQLite: episodes, the rate limiter, the spool, the alerts posted to
Alertmanager) and how root opens it without trusting anything a user could have put there.

Root hooks keep their state in the history store (`notify.state_path`, default `store.path`). Before using it,
root walks the path from `/` one component at a time with O_NOFOLLOW (a symlink anywhere is refused; missing
directories are created 0755): every directory must be owned by root (or this process's user) and not writable by
others. A sticky world-writable directory such as /tmp may be on the way, never the state's own directory:
SQLite creates its journal and WAL next to the database by name, and a user who can create entries there could
plant them. The file itself (and its -journal, -wal, -shm) must be a regular file with a trusted owner that others
cannot write, or missing (SQLite then creates it). Once that holds, no other user can change what the path leads
to, so SQLite may open it by name. When it does not hold, root does not use the state (and delivers directly:
better a duplicate page than a silenced one).

The file is only ever looked at (lstat), never opened outside SQLite: closing any descriptor of a file drops every
POSIX lock the process holds on it, SQLite's included, and another process may then delete the -wal/-shm under a
live connection (the store corrupts).

The monitor (the job's user) keeps its own small state in the job directory (`user_state_path`).
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from gpuguard.util.log import HookLog, escape_text
from gpuguard.util.trust import Untrusted, check_owner_mode, open_trusted_dir, trusted_uids

if TYPE_CHECKING:
    from gpuguard.config.schema import Config

SCHEMA = """
CREATE TABLE IF NOT EXISTS notify_keys (key TEXT PRIMARY KEY, last_sent REAL, suppressed INTEGER NOT NULL DEFAULT 0,
    first_suppressed REAL);
CREATE TABLE IF NOT EXISTS notify_sent (ts REAL NOT NULL);
CREATE TABLE IF NOT EXISTS notify_spool (
    id INTEGER PRIMARY KEY, created REAL NOT NULL, kind TEXT, node TEXT, check_id TEXT, severity TEXT,
    title TEXT NOT NULL, body TEXT NOT NULL,
    targets TEXT NOT NULL,          -- JSON list of target ids (URL hashes) still to deliver to
    status TEXT NOT NULL,           -- pending | held | digested | sent | expired
    attempts INTEGER NOT NULL DEFAULT 0, next_try REAL NOT NULL DEFAULT 0, last_error TEXT,
    event TEXT                      -- the Event as JSON (digests are built from these)
);
CREATE INDEX IF NOT EXISTS notify_spool_status ON notify_spool(status, next_try);
CREATE TABLE IF NOT EXISTS notify_am_alerts (
    key TEXT PRIMARY KEY,           -- the dedupe key of the incident
    labels TEXT NOT NULL, annotations TEXT NOT NULL,   -- JSON, as last posted
    starts_at REAL NOT NULL, ends_at REAL,             -- ends_at NULL: firing
    last_posted REAL,               -- the last time every Alertmanager took it (keep-alive)
    superseded TEXT                 -- JSON {labels, annotations, starts_at, ends_at}: an alert this one replaced
);
"""
# Columns added since the first release (ALTER TABLE on an existing state file)
ADDED_COLUMNS = {
    "notify_keys": (("opened", "REAL"), ("last_seen", "REAL"), ("is_open", "INTEGER"),
                    ("announced", "INTEGER NOT NULL DEFAULT 0")),
    "notify_spool": (("dedup_key", "TEXT"), ("state", "TEXT"),
                     ("claimed_by", "TEXT"), ("claimed_at", "REAL")),  # gpuguard.notify.claim
}


def log_warning(msg: str) -> None:
    """Notification trouble must be visible somewhere even when it cannot be notified (syslog, escaped)."""
    try:
        import syslog  # only when notification trouble is logged

        syslog.syslog(syslog.LOG_WARNING, escape_text(f"gpuguard notify: {msg}"))
    except Exception:  # noqa: BLE001
        pass


@dataclass(frozen=True)
class DeliveryLog:
    """Where failed delivery attempts are logged: syslog always (log_warning), and `logging.file` at warning level
    when the config names one (`level` its logging.level). One line per message and receiver per attempt; the
    receiver is named by its id and redacted URL, never its secrets (the caller scrubs the error)."""
    file: Optional[str] = None
    level: str = "info"

    def failed(self, title: str, attempt: int, error: str, retried: bool) -> None:
        what = "retried later" if retried else "not retried (permanent)"
        msg = f"delivery failed (attempt {attempt}, {what}) of '{title}' to {error}"
        log_warning(msg)
        if self.file:
            HookLog(use_syslog=False, path=self.file, level=self.level, stderr=False).warning(f"notify: {msg}")


def local_node(cfg: "Config", fallback: Optional[str] = None) -> str:
    return (cfg.node.name or os.environ.get("SLURMD_NODENAME") or fallback
            or socket.gethostname().split(".")[0])


def state_path(cfg: "Config", node: str) -> str:
    return str(cfg.notify.state_path or cfg.store.path).replace("{node}", node)


def user_state_path(cfg: "Config", job_dir: str, job_id: Optional[str], node: str) -> str:
    """Where the monitor (the job's user) keeps its own notification state: `notify.user_state_path` or
    `<job dir>/gpuguard/notify/<node>.db`. Never the hooks' state (root's history store)."""
    template = cfg.notify.user_state_path or \
        os.path.join("{job_dir}", "gpuguard", "notify", "{node}.db")
    safe_node = re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "_"
    return (template.replace("{job_dir}", job_dir).replace("{job_id}", str(job_id or "nojob"))
            .replace("{node}", safe_node).replace("{uid}", str(os.geteuid())))


# --------------------------------------------------------------------------- trust (root)


# the walk itself: gpuguard.util.trust (every root writer uses it)


def _entry_problem(dir_fd: int, name: str, what: str, uids: set[int]) -> Optional[str]:
    """Why the entry `name` of a trusted directory must not be used (None: missing, or a regular file a trusted
    uid owns that others cannot write). Looked at with lstat only, never opened."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{what}: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode):
        return f"{what} is a symlink (not followed)"
    if not stat.S_ISREG(st.st_mode):
        return f"{what} is not a regular file"
    try:
        check_owner_mode(st, what, uids, allow_sticky=False)
    except Untrusted as e:
        return str(e)
    return None


# SQLite's own files beside the database (rollback journal, WAL, shared memory): checked like the database
SQLITE_SUFFIXES = ("", "-journal", "-wal", "-shm")


def ensure_trusted_state(path: str, uids: Optional[set[int]] = None) -> Optional[str]:
    """Why root must not keep its state at `path` (None: it may). See the module docstring.

    The database file is never opened here, only looked at (lstat through the trusted directory's descriptor):
    closing any descriptor of a file drops every POSIX lock this process holds on it, SQLite's included, and
    another process could then delete the -wal/-shm under a live connection (issue 27). A missing file is fine:
    SQLite creates it in the trusted directory, where nobody else can put anything in its way."""
    uids = trusted_uids() if uids is None else uids
    directory, name = os.path.split(os.path.abspath(path))
    try:
        dfd = open_trusted_dir(directory, uids)
    except OSError as e:
        return f"state directory {directory}: {e}"
    try:
        for suffix in SQLITE_SUFFIXES:
            why = _entry_problem(dfd, name + suffix, f"state file {path}{suffix}", uids)
            if why:
                return why
        return None
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- opening


def migrate(conn: Any) -> None:
    conn.executescript(SCHEMA)
    for table, cols in ADDED_COLUMNS.items():
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        for name, decl in cols:
            if name not in have:
                try:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
                except Exception as e:  # noqa: BLE001 - another process added it between our look and ours
                    if "duplicate column" not in str(e):
                        raise


def connect_hooks(path: str, timeout_s: float) -> Any:
    """The hooks' state: the history store (WAL, busy timeout, a corrupt file is moved aside). The caller has
    checked the path with ensure_trusted_state."""
    from gpuguard.store.sqlite import Store  # only with receivers configured: nothing configured imports no SQLite

    store = Store(path, timeout_s=timeout_s)
    migrate(store.conn)
    return store.conn


def connect_user(path: str, timeout_s: float) -> Any:
    """The monitor's own state: a small SQLite file of its own (rollback journal, not WAL: it may sit on the job
    directory's network filesystem, where WAL does not work), created private (0700 directory, 0600 file)."""
    import sqlite3  # only with receivers configured: nothing configured imports no SQLite

    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    for attempt in (1, 2):
        # SQLite creates the file (never opened outside SQLite: closing a descriptor of it would drop the locks
        # of this process's other connections, a delivery thread's say); private once it exists
        conn = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
        try:
            _make_private(path)
            conn.execute("PRAGMA busy_timeout=%d" % int(timeout_s * 1000))
            migrate(conn)
            return conn
        except sqlite3.DatabaseError as e:
            conn.close()
            if attempt == 2 or "malformed" not in str(e) and "not a database" not in str(e):
                raise
            os.replace(path, f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
            log_warning(f"notification state {path} was corrupt ({e}); moved aside, starting a new one")
    raise AssertionError("unreachable")


def _make_private(path: str) -> None:
    """The monitor's state readable by its user only (chmod by name: nothing is opened). Best effort."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o600)
    except OSError:
        pass
