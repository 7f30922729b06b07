"""`ensure_trusted_state` (where root keeps its notification state: the node's history store) refuses what a user
could have put in the way, and never opens the database outside SQLite: closing any descriptor of a file drops
every POSIX lock the process holds on it, SQLite's included (issue 27: another process then deleted the -wal/-shm
under a live connection and the store corrupted). The locks are checked from a second process, as SQLite's are
per process."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuguard.notify.state import ensure_trusted_state
from gpuguard.store.sqlite import Store

OTHER_UID = 54321
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give a file to another uid)")


def other_process(code: str) -> str:
    p = subprocess.run([sys.executable, "-I", "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    return d / "node1.db"


def test_a_missing_file_is_fine_and_is_not_created(state):
    assert ensure_trusted_state(str(state)) is None
    assert not state.exists()  # SQLite creates it, in a directory nobody else can write


def test_a_regular_root_file_is_fine(state):
    Store(str(state)).close()
    assert ensure_trusted_state(str(state)) is None


def test_a_symlink_is_refused_and_not_followed(state, tmp_path):
    target = tmp_path / "elsewhere.db"
    state.symlink_to(target)
    assert "symlink" in (ensure_trusted_state(str(state)) or "")
    assert not target.exists()


def test_a_symlink_in_place_of_the_wal_is_refused(state, tmp_path):
    Store(str(state)).close()
    Path(f"{state}-wal").symlink_to(tmp_path / "elsewhere")
    assert "-wal is a symlink" in (ensure_trusted_state(str(state)) or "")


def test_a_fifo_is_refused_without_blocking(state):
    os.mkfifo(state)
    assert "not a regular file" in (ensure_trusted_state(str(state)) or "")


@as_root
def test_a_file_another_user_owns_is_refused(state):
    Store(str(state)).close()
    os.chown(state, OTHER_UID, OTHER_UID)
    assert f"owned by uid {OTHER_UID}" in (ensure_trusted_state(str(state)) or "")


def test_a_file_others_can_write_is_refused(state):
    Store(str(state)).close()
    state.chmod(0o666)
    assert "writable by others" in (ensure_trusted_state(str(state)) or "")


def test_a_directory_others_can_write_is_refused(state):
    state.parent.chmod(0o777)
    assert "writable by others" in (ensure_trusted_state(str(state)) or "")


def test_checking_keeps_the_write_lock_a_connection_of_this_process_holds(state):
    """A rollback-journal database: RESERVED is a POSIX lock on the file itself. Opening and closing the file
    beside the connection would drop it, and a second process could then write at the same time."""
    conn = sqlite3.connect(state, isolation_level=None)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO t VALUES (1)")
    assert ensure_trusted_state(str(state)) is None
    seen = other_process(f"""
        import sqlite3
        c = sqlite3.connect({str(state)!r}, timeout=0, isolation_level=None)
        try:
            c.execute("BEGIN IMMEDIATE")
            print("not locked")
        except sqlite3.OperationalError as e:
            print(e)
        """)
    assert seen == "database is locked"
    conn.execute("COMMIT")
    conn.close()


def test_checking_keeps_the_wal_of_a_live_store_from_being_deleted(state):
    """The history store (WAL): while a connection of this process is open, another process that closes its own
    connection must not think it was the last one (it would checkpoint and delete the -wal and -shm under the
    live connection: the corruption seen on nodes)."""
    with Store(str(state)) as st:
        st.set_cursor("c", {"v": 1})
        assert Path(f"{state}-wal").exists()
        assert ensure_trusted_state(str(state)) is None
        other_process(f"""
            import sqlite3
            c = sqlite3.connect({str(state)!r})
            c.execute("SELECT COUNT(*) FROM cursors").fetchall()
            c.close()
            """)
        assert Path(f"{state}-wal").exists() and Path(f"{state}-shm").exists()
        st.set_cursor("c", {"v": 2})
        assert st.get_cursor("c") == {"v": 2}
    conn = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    conn.close()
