"""A store that cannot be written never turns hardware evidence into a pass, and only real corruption is moved
aside (issue 9). Full disks and read-only filesystems are real (a tiny tmpfs, a read-only bind mount), locks
are a second real SQLite connection."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from gpuguard.model import Finding, Severity
from gpuguard.runner import execute
from gpuguard.store import GuardedStore, Store, StoreUnavailable, is_corruption

from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg


def _record(st: Store, n: int = 1) -> None:
    for _ in range(n):
        st.record_run(started=1.0, duration_ms=1.0, node="n1", kind="healthcheck", job_id=None, profile="p",
                      verdict="pass", action="none", reason=None, exit_code=0, error=None, boot_id="b",
                      findings=[Finding("gpu.ecc", Severity.OK, "x" * 200)])


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str = "320k") -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)):
        pytest.skip("needs root and mount(8) for a real full filesystem")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    if os.geteuid() != 0 or not _mount("--bind", str(path), str(path)):
        pytest.skip("needs root and mount(8) for a real read-only filesystem")
    try:
        if not _mount("-o", "remount,ro,bind", str(path)):
            pytest.skip("read-only remount not permitted here")
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(directory: Path) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:  # ENOSPC: the filesystem is full
        pass
    finally:
        os.close(fd)


def test_full_disk_is_not_corruption_and_nothing_is_moved(tmp_path):
    with tiny_tmpfs(tmp_path / "fs") as fs:
        path = fs / "state.db"
        with Store(str(path)) as st:
            _record(st, 3)
            st.set_cursor("kernel_log:n1", {"kind": "kmsg", "seq": 41})
        _fill(fs)
        try:
            with Store(str(path)) as st:
                with pytest.raises(sqlite3.OperationalError, match="full"):
                    _record(st, 400)
        except StoreUnavailable:
            pass  # also fine: could not even open it; what matters is below
        assert not [p for p in fs.iterdir() if ".corrupt-" in p.name]
        os.unlink(fs / "filler")
        with Store(str(path)) as st:  # everything written before the disk filled up is still there
            assert st.get_cursor("kernel_log:n1") == {"kind": "kmsg", "seq": 41}
            assert len(st.runs(node="n1", limit=1000)) >= 3
            assert st.recreated_from is None


def test_read_only_filesystem_is_not_corruption(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    with Store(str(d / "state.db")) as st:
        _record(st)
        st.set_cursor("kernel_log:n1", {"kind": "kmsg", "seq": 7})
    with read_only(d):
        try:
            with Store(str(d / "state.db")) as st:
                with pytest.raises(sqlite3.OperationalError):
                    _record(st)
        except StoreUnavailable:
            pass
        assert sorted(p.name for p in d.iterdir() if not p.name.endswith(("-wal", "-shm"))) == ["state.db"]
    with Store(str(d / "state.db")) as st:
        assert st.get_cursor("kernel_log:n1") == {"kind": "kmsg", "seq": 7}


def test_real_corruption_is_moved_aside_and_kept(tmp_path):
    path = tmp_path / "state.db"
    with Store(str(path)) as st:
        _record(st, 50)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw = bytearray(path.read_bytes())
    page = 4096
    assert len(raw) > 4 * page
    raw[0:16] = b"definitely-junk!"  # the SQLite header: "file is not a database"
    path.write_bytes(bytes(raw))
    st = Store(str(path))
    try:
        assert st.recreated_from and st.corruption_error
        kept = Path(st.recreated_from)
        assert kept.exists() and kept.read_bytes() == bytes(raw)  # kept byte for byte, for forensics
        assert st.runs() == []  # a fresh store
    finally:
        st.close()


def test_damaged_pages_found_by_quick_check(tmp_path):
    path = tmp_path / "state.db"
    with Store(str(path)) as st:
        _record(st, 200)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw = bytearray(path.read_bytes())
    for off in range(3 * 4096, len(raw) - 4096, 4096):
        raw[off:off + 64] = b"\xff" * 64  # trash the b-tree page headers, keep the file header
    path.write_bytes(bytes(raw))
    err = sqlite3.DatabaseError("database disk image is malformed")
    assert is_corruption(str(path), err)


def test_environment_errors_are_never_corruption(tmp_path):
    path = tmp_path / "ok.db"
    with Store(str(path)) as st:
        _record(st)
    for text in ("database or disk is full", "database is locked", "attempt to write a readonly database",
                 "disk I/O error", "unable to open database file"):
        assert not is_corruption(str(path), sqlite3.OperationalError(text)), text
    full = sqlite3.OperationalError("x")
    full.sqlite_errorcode = 13  # SQLITE_FULL
    assert not is_corruption(str(path), full)


def test_guarded_store_reports_instead_of_raising(tmp_path):
    g = GuardedStore(lambda: (_ for _ in ()).throw(StoreUnavailable("disk full")))
    assert not g.available
    assert g.get_cursor("x") is None and g.record_run(started=1) is None and g.incomplete_streaks("n", []) == {}
    g.set_cursor("x", {"a": 1})
    assert g.errors and "disk full" in g.errors[0]


# --------------------------------------------------------------------------- the runner: evidence wins


def _xid79_prolog(tmp_path, store_path: str):
    cfg = make_cfg(tmp_path, store_path=store_path)
    slurm = MemorySlurm()
    result = execute(ctx("prolog", "n1"), cfg, simulate=str(SCENARIOS / "xid79.yaml"), slurm_client=slurm)
    return result, slurm


def _assert_drained_anyway(result, slurm):
    assert result.verdict.outcome == "drain" and result.exit_code == 1
    assert slurm.calls and slurm.calls[0][0] == "drain" and "XID79" in slurm.calls[0][1]
    assert result.store_errors, "the store trouble must be reported"
    assert any("history store unusable" in n for n in result.notes)


def test_locked_store_still_drains_and_fails_the_prolog(tmp_path):
    path = tmp_path / "state.db"
    with Store(str(path)):
        pass
    holder = sqlite3.connect(path, isolation_level=None, timeout=0.1)
    holder.execute("BEGIN EXCLUSIVE")  # another process holds the write lock for longer than our timeout
    try:
        result, slurm = _xid79_prolog(tmp_path, str(path))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    _assert_drained_anyway(result, slurm)
    with Store(str(path)) as st:
        assert st.get_cursor("kernel_log:n1") is None  # the cursor did not move: the next run judges again


def test_full_disk_store_still_drains(tmp_path):
    with tiny_tmpfs(tmp_path / "fs") as fs:
        path = fs / "state.db"
        with Store(str(path)):
            pass
        _fill(fs)
        result, slurm = _xid79_prolog(tmp_path, str(path))
        _assert_drained_anyway(result, slurm)
        assert path.exists() and not [p for p in fs.iterdir() if ".corrupt-" in p.name]


def test_read_only_store_still_drains(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    with read_only(d):
        result, slurm = _xid79_prolog(tmp_path, str(d / "state.db"))
    _assert_drained_anyway(result, slurm)


def test_recreated_store_restarts_the_cursor_at_the_end_of_the_log(tmp_path):
    """An Xid judged before the store got corrupt must not drain the node again: the cursor restarts at the end
    of the log, explicitly (a warning names what was skipped)."""
    path = tmp_path / "state.db"
    path.write_bytes(b"garbage, not a database" * 200)
    cfg = make_cfg(tmp_path, store_path=str(path))
    slurm = MemorySlurm()
    result = execute(ctx("healthcheck", "n1"), cfg, simulate=str(SCENARIOS / "xid79.yaml"), slurm_client=slurm)
    gxid = [f for f in result.findings if f.check_id == "gpu.xid"]
    assert any(f.severity is Severity.WARN and "restarted at the end of the log" in f.message and "Xid 79" in f.message
               for f in gxid), gxid
    assert not any(c[0] == "drain" and "XID79" in (c[1] or "") for c in slurm.calls)
    assert any("corrupt" in n for n in result.notes)
    # the cursor now sits at the end: the next run sees nothing new
    again = execute(ctx("healthcheck", "n1"), cfg, simulate=str(SCENARIOS / "xid79.yaml"), slurm_client=slurm)
    assert not [f for f in again.findings if f.check_id == "gpu.xid" and f.severity is not Severity.OK]


def test_the_verdict_reaches_the_hook_watchdog_before_anything_can_hang(tmp_path):
    """A prolog that hangs after judging (a drain call stuck, a hung filesystem under the store or the metrics)
    is ended by the hook's watchdog: it must exit with the verdict, not the fail-open default of 0."""
    import threading
    import time

    class StuckSlurm(MemorySlurm):
        def drain(self, name, reason):
            time.sleep(60)

    seen: list[int] = []
    got = threading.Event()

    def on_verdict(code: int) -> None:
        seen.append(code)
        got.set()

    cfg = make_cfg(tmp_path)
    t = threading.Thread(target=execute, args=(ctx("prolog", "n1"), cfg),
                         kwargs={"simulate": str(SCENARIOS / "xid79.yaml"), "slurm_client": StuckSlurm(),
                                 "on_verdict": on_verdict}, daemon=True)
    t.start()
    assert got.wait(20) and seen == [1]
    assert t.is_alive()  # still stuck in the drain: the watchdog would now exit 1
