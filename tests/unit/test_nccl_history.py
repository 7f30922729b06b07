"""NCCL results in the node's store (gpuguard.nccl.history) live under the store's own schema and version
(gpuguard.store.schema, issue 30): a fresh store has the tables, an older one gets them by its migration, and an
older one that `gpuguard nccl` had already given them keeps its rows."""

from __future__ import annotations

import sqlite3

from gpuguard.nccl import history
from gpuguard.store.schema import SCHEMA_VERSION
from gpuguard.store.sqlite import Store

NCCL = ("nccl_runs", "nccl_runs_sweep", "nccl_samples", "nccl_samples_key", "nccl_sweeps")


def _nccl_objects(conn: sqlite3.Connection) -> tuple[str, ...]:
    return tuple(sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'nccl%'")))


def _as_version_3(path: str, keep_nccl: bool) -> None:
    """What a version-3 store looked like: the store's tables without the NCCL ones, or with the ones
    `gpuguard nccl` created outside the version."""
    with sqlite3.connect(path) as c:
        if not keep_nccl:
            for table in ("nccl_sweeps", "nccl_runs", "nccl_samples"):
                c.execute(f"DROP TABLE {table}")
        if keep_nccl:  # as `gpuguard nccl` created them: no backend column (version 5)
            c.execute("ALTER TABLE nccl_samples DROP COLUMN backend")
        c.execute("PRAGMA user_version=3")


def test_a_fresh_store_has_the_nccl_tables_at_the_current_version(tmp_path):
    with Store(str(tmp_path / "s.db")) as st:
        assert _nccl_objects(st.conn) == NCCL
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5


def test_a_version_3_store_gets_them_by_its_migration(tmp_path):
    path = str(tmp_path / "s.db")
    Store(path).close()
    _as_version_3(path, keep_nccl=False)
    with sqlite3.connect(path) as c:
        assert _nccl_objects(c) == ()
    with history.open_history(path) as st:
        assert _nccl_objects(st.conn) == NCCL
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert history.record_samples(st, [("p5", 2, 1 << 30, 180.5, "n[1-2]", "measure", "42", "nccl-tests")]) == 1
        assert [s["busbw_gbps"] for s in history.samples(st, profile="p5")] == [180.5]


def test_samples_recorded_before_the_migration_are_kept(tmp_path):
    path = str(tmp_path / "s.db")
    with history.open_history(path) as st:
        history.record_samples(st, [("p5", 4, 1 << 30, 170.0, "n[1-4]", "sweep", None, "nccl-tests")])
        sweep = history.start_sweep(st, partition="gpu", nodes="n[1-4]", method="pairs", profile="p5",
                                    threshold_gbps=150.0)
    _as_version_3(path, keep_nccl=True)
    with Store(path) as st:  # any store user upgrades it: a hook, the health check
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert [(s["n_nodes"], s["busbw_gbps"]) for s in history.samples(st)] == [(4, 170.0)]
        assert [s["id"] for s in history.sweeps(st)] == [sweep]


def _as_version_4(path: str) -> None:
    """What a version-4 store looked like: samples without the collective they were measured with."""
    with sqlite3.connect(path) as c:
        c.execute("ALTER TABLE nccl_samples DROP COLUMN backend")
        c.execute("PRAGMA user_version=4")


def test_a_version_4_store_gets_each_samples_backend_by_its_migration(tmp_path):
    """Version 5 (issue 28): every sample says which collective measured it. The sweep's, `baseline measure`'s and
    recorded files' samples were always nccl-tests; a pre-flight's from before is unknown and stays so (it gives no
    floor to any backend rather than a wrong one)."""
    path = str(tmp_path / "s.db")
    Store(path).close()
    _as_version_4(path)
    with sqlite3.connect(path) as c:
        assert "backend" not in [r[1] for r in c.execute("PRAGMA table_info(nccl_samples)")]
        c.executemany("INSERT INTO nccl_samples(ts,profile,n_nodes,size_bytes,busbw_gbps,nodes,source,job_id) "
                      "VALUES (1,'p5',4,?,?,'n[1-4]',?,NULL)",
                      [(1 << 30, 170.0, "sweep"), (1 << 30, 171.0, "measure"), (1 << 30, 172.0, "file"),
                       (262144, 0.05, "preflight")])
    with history.open_history(path) as st:
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
        assert [(s["source"], s["backend"]) for s in history.samples(st)] == [
            ("sweep", "nccl-tests"), ("measure", "nccl-tests"), ("file", "nccl-tests"), ("preflight", None)]
        assert [s["busbw_gbps"] for s in history.samples(st, backend="nccl-tests")] == [170.0, 171.0, 172.0]
        history.record_samples(st, [("p5", 4, 262144, 0.06, "n[1-4]", "preflight", "9", "gloo")])
        assert [s["backend"] for s in history.samples(st, size_bytes=262144)] == [None, "gloo"]
