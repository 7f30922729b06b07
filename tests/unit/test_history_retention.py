"""Store retention (`store.retention_days`, pruned by the health check in bounded batches) and the schema migration
that adds the history indexes. Real SQLite files; a real health check run (the pipeline on a simulated node)."""

from __future__ import annotations

import sqlite3
import time

import pytest
from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg, run_sim

from gpuguard.model import Finding, Severity
from gpuguard.store.retention import RETENTION_CURSOR, prune_due
from gpuguard.store.schema import SCHEMA_VERSION
from gpuguard.store.sqlite import Store

DAY = 86400.0
NOW = time.time()


def run(st, node, age_days, verdict="pass", boot="b1"):
    return st.record_run(started=NOW - age_days * DAY, duration_ms=100.0, node=node, kind="healthcheck", job_id=None,
                         profile="p5", verdict=verdict, action="none", reason=None, exit_code=0, error=None,
                         boot_id=boot, findings=[Finding("gpu.count", Severity.OK, "8 GPUs"),
                                                 Finding("gpu.ecc", Severity.WARN, "1 corrected", "ECC")])


def build(path):
    """n1: a health check a day for 200 days; drained 150 days ago and undrained the next day; drained again
    100 days ago (boot b0) and still drained."""
    with Store(path) as st:
        for age in range(200, 0, -1):
            run(st, "n1", age, boot="b0" if age >= 100 else "b1")
        old = run(st, "n1", 150.5, verdict="drain", boot="b0")
        st.record_drain(node="n1", op="drain", outcome="done", reason="gpuguard: ECC gpu.ecc: x [healthcheck reset]",
                        check_id="gpu.ecc", action="reset", run_id=old, ts=NOW - 150.5 * DAY)
        st.record_drain(node="n1", op="undrain", outcome="done", reason=None, check_id="gpu.ecc", action="reset",
                        run_id=None, ts=NOW - 149 * DAY)
        active = run(st, "n1", 100.5, verdict="drain", boot="b0")
        st.record_drain(node="n1", op="drain", outcome="done", reason="gpuguard: XID79 gpu.xid: x [healthcheck reboot]",
                        check_id="gpu.xid", action="reboot", run_id=active, ts=NOW - 100.5 * DAY)
    return old, active


def counts(path):
    with sqlite3.connect(path) as c:
        return tuple(c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("runs", "findings", "drains"))


def test_prune_in_bounded_batches_keeps_what_undrain_and_escalation_need(tmp_path):
    path = str(tmp_path / "s.db")
    old_drain_run, active_run = build(path)
    assert counts(path) == (202, 404, 3)
    with Store(path) as st:
        first = st.prune_history(NOW - 90 * DAY, batch=25)
        assert first == {"runs": 25, "drains": 2}  # one batch at most; the first undrain cycle goes
        while sum(st.prune_history(NOW - 90 * DAY, batch=25).values()):
            pass
        runs = {r["id"]: r for r in st.runs(node="n1", limit=1000)}
        assert min(r["started"] for r in runs.values() if r["id"] != active_run) >= NOW - 90 * DAY
        assert active_run in runs and old_drain_run not in runs  # the still-active drain's run stays (its boot id)
        active = st.active_drain("n1")
        assert active is not None and active["check_id"] == "gpu.xid" and active["boot_id"] == "b0"
        assert [d["op"] for d in st.drains("n1")] == ["drain"]
    runs_left, findings_left, drains_left = counts(path)
    assert runs_left == 90 + 1 and findings_left == 2 * runs_left and drains_left == 1


def test_prune_never_touches_unshipped_rows_nor_the_newest_row(tmp_path):
    path = str(tmp_path / "s.db")
    build(path)
    with Store(path) as st:
        assert st.prune_history(NOW - 90 * DAY, batch=1000, shipped={"runs": 5, "drains": 0}) == \
            {"runs": 5, "drains": 0}
        assert counts(path)[0] == 197
        # everything is old: the newest run and drain are kept anyway (row ids must never go back)
        st.prune_history(NOW + DAY, batch=10_000)
        ids = [r["id"] for r in st.runs(limit=10)]
        assert max(ids) == 202 and len(st.drains()) == 1


def healthy_health_check(cfg) -> None:
    """A health check of n1 (a healthy simulated p5) with `cfg`, through the whole pipeline."""
    res = run_sim(ctx("healthcheck"), cfg, simulate=str(SCENARIOS / "healthy-p5.yaml"), slurm_client=MemorySlurm())
    assert res.verdict.outcome in ("pass", "warn") and not res.store_errors


@pytest.fixture
def one_day_kept(tmp_path):
    """retention_days 1 under a 30-day reboot window, over n1's store from `build`: (config, store path)."""
    cfg = make_cfg(tmp_path, store={"retention_days": 1}, reboot={"window_days": 30})
    path = str(tmp_path / "state" / "n1.db")
    build(path)
    return cfg, path


def test_health_check_prunes_after_its_verdict_never_below_the_reboot_window(one_day_kept):
    cfg, path = one_day_kept

    def healthcheck():
        healthy_health_check(cfg)
        with Store(path) as st:
            return sorted(round((NOW - r["started"]) / DAY, 1) for r in st.runs(node="n1", limit=1000))

    # everything older than 30 days goes (not 1: escalation reads reboot.window_days), but the run of a drain
    # record that this same batch removes only goes in the next batch
    ages = healthcheck()
    assert ages[1:-2] == [float(a) for a in range(1, 30)] and ages[-2:] == [100.5, 150.5] and ages[0] <= 0
    ages = healthcheck()
    assert ages[-1] == 100.5 and len(ages) == 29 + 2 + 1


def test_pruning_waits_an_hour_once_a_batch_found_nothing_and_goes_on_at_once_while_one_did(one_day_kept):
    """Every health check pruning cost every node a batch query (and loading the shipping code) every few minutes:
    now a batch runs once an hour, and at the next run again as long as the last one still removed rows."""
    cfg, path = one_day_kept

    def healthcheck():
        healthy_health_check(cfg)
        with Store(path) as st:
            return st.get_cursor(RETENTION_CURSOR)

    assert healthcheck()["removed"] > 0  # the backlog, in batches
    while healthcheck()["removed"]:
        pass
    done = healthcheck()
    assert done["removed"] == 0 and time.time() - done["ts"] < 60
    with Store(path) as st:
        run(st, "n1", 45)  # a run that has just passed the window
    assert healthcheck() == done  # within the hour: no batch
    assert counts(path)[0] == 29 + 2 + 1 + 3 + 1  # ... and the old run is still there
    with Store(path) as st:
        st.set_cursor(RETENTION_CURSOR, {**done, "ts": done["ts"] - 3601})
    assert healthcheck()["removed"] == 1  # an hour later it goes
    assert counts(path)[0] == 29 + 2 + 1 + 4


def test_the_pruning_schedule():
    assert prune_due(None, NOW)
    assert prune_due({"ts": NOW - 10, "removed": 3}, NOW)  # a backlog: again at once
    assert not prune_due({"ts": NOW - 10, "removed": 0}, NOW)
    assert prune_due({"ts": NOW - 3600, "removed": 0}, NOW)
    assert prune_due({"ts": NOW + 7200, "removed": 0}, NOW)  # the clock went back: not stuck for two hours
    assert prune_due({"ts": "garbage"}, NOW)


def test_no_retention_no_pruning(tmp_path):
    cfg = make_cfg(tmp_path, store={"retention_days": None})
    path = str(tmp_path / "state" / "n1.db")
    build(path)
    healthy_health_check(cfg)
    assert counts(path)[0] == 203


def test_migration_to_v3_adds_the_history_indexes_and_keeps_the_data(tmp_path):
    path = str(tmp_path / "old.db")
    with Store(path) as st:
        run(st, "n1", 1)
    with sqlite3.connect(path) as c:  # what a version-2 store looked like
        for ix in ("runs_time", "drains_time", "findings_problems"):
            c.execute(f"DROP INDEX {ix}")
        c.execute("PRAGMA user_version=2")
    with Store(path) as st:
        assert len(st.runs()) == 1
        names = {r[0] for r in st.conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert {"runs_time", "drains_time", "findings_problems"} <= names
        assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 3
        plan = " ".join(r[3] for r in st.conn.execute(
            "EXPLAIN QUERY PLAN SELECT f.run_id FROM findings f WHERE f.severity NOT IN ('ok','skip')"))
        assert "findings_problems" in plan
