"""History store on a real SQLite file: runs, findings, drains, cursors, corruption, concurrency."""

import multiprocessing
import sqlite3

from gpuguard.model import Finding, Severity
from gpuguard.store.sqlite import Store


def _run(st, node="n1", sev=Severity.OK, cid="gpu.ecc"):
    return st.record_run(started=1.0, duration_ms=5.0, node=node, kind="prolog", job_id="7", profile="p5.48xlarge",
                         verdict="pass", action="none", reason=None, exit_code=0, error=None, boot_id="b",
                         findings=[Finding(cid, sev, "msg", evidence={"x": 1})])


def test_roundtrip(tmp_path):
    path = str(tmp_path / "state.db")
    with Store(path) as st:
        rid = _run(st)
        st.record_drain(node="n1", op="drain", outcome="done", reason="gpuguard: ECC gpu.ecc: x [prolog]",
                        check_id="gpu.ecc", action="reset", run_id=rid)
        st.set_cursor("kernel_log:n1", {"kind": "kmsg", "seq": 41})
        st.set_cursor("kernel_log:n1", {"kind": "kmsg", "seq": 42})
    with Store(path) as st:
        assert st.runs(node="n1")[0]["profile"] == "p5.48xlarge"
        assert st.findings_for(rid)[0]["evidence"] == '{"x": 1}'
        assert st.drains("n1")[0]["outcome"] == "done"
        assert st.get_cursor("kernel_log:n1") == {"kind": "kmsg", "seq": 42}
        assert st.get_cursor("other") is None


def test_incomplete_streaks(tmp_path):
    with Store(str(tmp_path / "s.db")) as st:
        _run(st, sev=Severity.INCOMPLETE, cid="fabric.efa")
        _run(st, sev=Severity.OK, cid="fabric.efa")
        _run(st, sev=Severity.INCOMPLETE, cid="fabric.efa")
        _run(st, sev=Severity.INCOMPLETE, cid="fabric.efa")
        _run(st, node="n2", sev=Severity.OK, cid="fabric.efa")
        _run(st, sev=Severity.OK, cid="gpu.xid")  # a run that did not evaluate fabric.efa (a watch event)
        assert st.incomplete_streaks("n1", ["fabric.efa", "gpu.ecc"]) == {"fabric.efa": 2}


def test_corrupt_file_is_moved_aside_and_recreated(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database" * 100)
    st = Store(str(path))
    assert st.recreated_from and (tmp_path / st.recreated_from.split("/")[-1]).exists()
    _run(st)
    assert len(st.runs()) == 1
    st.close()


def _writer(path, n):
    with Store(path) as st:
        for _ in range(n):
            _run(st, node="n%d" % multiprocessing.current_process().pid)


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "c.db")
    Store(path).close()
    procs = [multiprocessing.Process(target=_writer, args=(path, 40)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    n = sqlite3.connect(path).execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert n == 160


def test_prune_only_old_cursors_with_the_prefix(tmp_path):
    import time as _t

    with Store(str(tmp_path / "s.db")) as st:
        st.set_cursor("job:n1:1", {"seq": 1})
        st.set_cursor("job:n1:2", {"seq": 2})
        st.set_cursor("kernel_log:n1", {"seq": 3})
        st.conn.execute("UPDATE cursors SET updated=? WHERE name='job:n1:1'", (_t.time() - 30 * 86400,))
        assert st.prune_cursors("job:n1:", older_than=_t.time() - 7 * 86400) == 1
        assert st.get_cursor("job:n1:1") is None and st.get_cursor("job:n1:2") and st.get_cursor("kernel_log:n1")


def test_an_older_history_file_is_upgraded_in_place(tmp_path):
    """A node upgraded from an earlier gpuguard keeps its history (and its kernel-log cursor)."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE runs (id INTEGER PRIMARY KEY, started REAL NOT NULL, duration_ms REAL, node TEXT NOT NULL,
            kind TEXT NOT NULL, job_id TEXT, profile TEXT, verdict TEXT NOT NULL, action TEXT, reason TEXT,
            exit_code INTEGER, error TEXT, boot_id TEXT);
        CREATE TABLE findings (run_id INTEGER NOT NULL, check_id TEXT NOT NULL, severity TEXT NOT NULL, keyword TEXT,
            gpu INTEGER, action TEXT, message TEXT, remediation TEXT, evidence TEXT);
        CREATE TABLE drains (id INTEGER PRIMARY KEY, ts REAL NOT NULL, node TEXT NOT NULL, op TEXT NOT NULL,
            outcome TEXT NOT NULL, reason TEXT, check_id TEXT, action TEXT, run_id INTEGER, detail TEXT);
        CREATE TABLE cursors (name TEXT PRIMARY KEY, value TEXT NOT NULL, updated REAL NOT NULL);
        INSERT INTO runs(started, node, kind, verdict) VALUES (1.0, 'n1', 'prolog', 'pass');
        INSERT INTO cursors VALUES ('kernel_log:n1', '{"kind": "kmsg", "seq": 9}', 1.0);
        PRAGMA user_version=1;
    """)
    old.close()
    with Store(str(path)) as st:
        assert st.recreated_from is None
        assert st.get_cursor("kernel_log:n1") == {"kind": "kmsg", "seq": 9}
        _run(st)
        assert [r["restart_count"] for r in st.runs()] == [None, None] and len(st.runs()) == 2
