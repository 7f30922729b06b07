"""A store that cannot be written never turns hardware evidence into a pass, and only real corruption is moved
aside (issue 9). Full disks and read-only filesystems are real (a tiny tmpfs, a read-only bind mount), locks
are a second real SQLite connection."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from fsfaults import read_only, tiny_tmpfs

from gpuguard.model import Finding, Severity
from gpuguard.store.corruption import StoreUnavailable, is_corruption
from gpuguard.store.guarded import GuardedStore
from gpuguard.store.sqlite import Store

from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg, run_sim


def _record(st: Store, n: int = 1) -> None:
    for _ in range(n):
        st.record_run(started=1.0, duration_ms=1.0, node="n1", kind="healthcheck", job_id=None, profile="p",
                      verdict="pass", action="none", reason=None, exit_code=0, error=None, boot_id="b",
                      findings=[Finding("gpu.ecc", Severity.OK, "x" * 200)])


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


def test_a_write_the_full_disk_refused_reports_the_full_disk(tmp_path):
    """SQLite rolls a transaction back by itself when the disk fills up under it: the run's notes and the hook's
    log name the full disk, never "record_run: cannot rollback - no transaction is active" (issue 27)."""
    with tiny_tmpfs(tmp_path / "fs") as fs:
        path = fs / "state.db"
        guarded = GuardedStore(lambda: Store(str(path)))  # opened while there was room
        _fill(fs)
        with Store(str(path)) as st:
            with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
                _record(st)
            assert not st.conn.in_transaction
        assert guarded.record_run(started=1.0, duration_ms=1.0, node="n1", kind="healthcheck", job_id=None,
                                  profile="p", verdict="pass", action="none", reason=None, exit_code=0, error=None,
                                  boot_id="b", findings=[Finding("gpu.ecc", Severity.OK, "x" * 200)]) is None
        assert guarded.errors == ["record_run: database or disk is full"]
        os.unlink(fs / "filler")
        with Store(str(path)) as st:  # the store itself is fine once there is room again
            _record(st)
            assert len(st.runs(node="n1")) == 1
        guarded.close()


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


def _checkpointed(path: Path, runs: int) -> bytearray:
    """A store with `runs` recorded, everything in the main file (no WAL): its bytes, to damage."""
    with Store(str(path)) as st:
        _record(st, runs)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return bytearray(path.read_bytes())


def test_real_corruption_is_moved_aside_and_kept(tmp_path):
    path = tmp_path / "state.db"
    raw = _checkpointed(path, 50)
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
    raw = _checkpointed(path, 200)
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
    result = run_sim(ctx("prolog", "n1"), cfg, simulate=str(SCENARIOS / "xid79.yaml"), slurm_client=slurm)
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


XID119 = ("NVRM: Xid (PCI:0000:86:00): 119, pid=2113, name=python3, Timeout after 6s of waiting for RPC response "
          "from GPU3 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801348 0x204).")
XID48 = "NVRM: Xid (PCI:0000:a8:00): 48, pid=1234, name=python3, An uncorrectable double bit error (DBE) has been detected"


def _with_kernel_lines(tmp_path, *lines):
    import yaml

    data = yaml.safe_load((SCENARIOS / "healthy-p5.yaml").read_text())
    data["kernel_log"] = list(data["kernel_log"]) + list(lines)
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_damaged_store_skips_no_evidence_and_repeats_none(tmp_path):
    """The store replaced by garbage: the verdict journal still knows how far the kernel log was judged. The Xid
    acted on before (the admin has cleared its condition since) is not acted on again; one logged since is judged."""
    path = tmp_path / "state.db"
    cfg = make_cfg(tmp_path, store_path=str(path))
    slurm = MemorySlurm()
    first = run_sim(ctx("healthcheck", "n1"), cfg, simulate=_with_kernel_lines(tmp_path, XID119), slurm_client=slurm)
    assert first.drain["outcome"] == "done" and "XID119" in slurm.reason
    # the admin reset the GPU and returned the node (`gpuguard undrain --force`: the condition clears, recorded)
    from gpuguard.pipeline.admin import record_admin_clear
    from gpuguard.util.log import HookLog

    record_admin_clear(cfg, "n1", "admin --force", HookLog(use_syslog=False))
    slurm.reason = None
    path.write_bytes(b"garbage, not a database" * 200)
    again = run_sim(ctx("prolog", "n1"), cfg, simulate=_with_kernel_lines(tmp_path, XID119), slurm_client=slurm)
    assert again.verdict.outcome == "pass" and slurm.reason is None, again.findings
    assert list(tmp_path.glob("state.db.corrupt-*")), "the damaged file is kept for forensics"
    path.write_bytes(b"garbage again" * 200)
    new = run_sim(ctx("prolog", "n1"), cfg, simulate=_with_kernel_lines(tmp_path, XID119, XID48), slurm_client=slurm)
    assert new.exit_code == 1 and "XID48" in (slurm.reason or ""), new.findings


def test_with_store_and_journal_both_lost_this_boots_log_is_judged_again(tmp_path):
    """Nothing remembers how far the log was judged: it is judged again from this boot's start (fail closed, and
    said), rather than skipping what arrived since."""
    path = tmp_path / "state.db"
    cfg = make_cfg(tmp_path, store_path=str(path))
    scen = _with_kernel_lines(tmp_path, XID119)
    slurm = MemorySlurm()
    run_sim(ctx("prolog", "n1", job_id="1"), make_cfg(tmp_path, store_path=str(path)),
            simulate=str(SCENARIOS / "healthy-p5.yaml"), slurm_client=slurm)
    path.write_bytes(b"garbage" * 200)
    for journal in (tmp_path / "run").glob("*.journal.json"):
        journal.unlink()
    result = run_sim(ctx("prolog", "n1", job_id="2"), cfg, simulate=scen, slurm_client=slurm)
    assert result.exit_code == 1 and "XID119" in (slurm.reason or "")
    assert any("judged again" in n for n in result.notes), result.notes


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
    t = threading.Thread(target=run_sim, args=(ctx("prolog", "n1"), cfg),
                         kwargs={"simulate": str(SCENARIOS / "xid79.yaml"), "slurm_client": StuckSlurm(),
                                 "on_verdict": on_verdict}, daemon=True)
    t.start()
    assert got.wait(20) and seen == [1]
    assert t.is_alive()  # still stuck in the drain: the watchdog would now exit 1
