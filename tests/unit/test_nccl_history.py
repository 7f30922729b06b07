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
        c.execute("PRAGMA user_version=3")


def test_a_fresh_store_has_the_nccl_tables_at_the_current_version(tmp_path):
    with Store(str(tmp_path / "s.db")) as st:
        assert _nccl_objects(st.conn) == NCCL
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4


def test_a_version_3_store_gets_them_by_its_migration(tmp_path):
    path = str(tmp_path / "s.db")
    Store(path).close()
    _as_version_3(path, keep_nccl=False)
    with sqlite3.connect(path) as c:
        assert _nccl_objects(c) == ()
    with history.open_history(path) as st:
        assert _nccl_objects(st.conn) == NCCL
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert history.record_samples(st, [("p5", 2, 1 << 30, 180.5, "n[1-2]", "measure", "42")]) == 1
        assert [s["busbw_gbps"] for s in history.samples(st, profile="p5")] == [180.5]


def test_samples_recorded_before_the_migration_are_kept(tmp_path):
    path = str(tmp_path / "s.db")
    with history.open_history(path) as st:
        history.record_samples(st, [("p5", 4, 1 << 30, 170.0, "n[1-4]", "sweep", None)])
        sweep = history.start_sweep(st, partition="gpu", nodes="n[1-4]", method="pairs", profile="p5",
                                    threshold_gbps=150.0)
    _as_version_3(path, keep_nccl=True)
    with Store(path) as st:  # any store user upgrades it: a hook, the health check
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert [(s["n_nodes"], s["busbw_gbps"]) for s in history.samples(st)] == [(4, 170.0)]
        assert [s["id"] for s in history.sweeps(st)] == [sweep]
