"""A store found damaged and replaced is loud (issue 27, gpuguard.store.replaced): a syslog line at error level naming
the file and the damaged copy, a note in the new store, and `gpuguard_history_store_ok` 0 in the node's metrics
until a later good run. (The hooks' log line and page: tests/integration/test_own_faults.py.)"""

from __future__ import annotations

import syslog
from pathlib import Path

from test_metrics import MemorySlurm, make_cfg, read_metrics, run, value

from gpuguard.store import replaced
from gpuguard.store.sqlite import Store


def damage(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"this is not an SQLite database\n" * 100)


def test_a_replaced_store_is_logged_at_error_level_and_noted_in_the_new_one(tmp_path, monkeypatch):
    said: list[tuple[int, str]] = []
    monkeypatch.setattr(syslog, "syslog", lambda pri, msg: said.append((pri, msg)))
    db = tmp_path / "node1.db"
    damage(db)
    with Store(str(db)) as st:
        aside = st.recreated_from
        assert aside and Path(aside).read_bytes().startswith(b"this is not")
        note = replaced.untold(st)
    assert note and note["aside"] == aside and "not a database" in note["error"]
    assert str(db) in replaced.replaced_here()
    assert [pri for pri, _ in said] == [syslog.LOG_ERR]
    assert f"history store {db} was damaged" in said[0][1] and f"the damaged copy is {aside}" in said[0][1]
    with Store(str(db)) as st:  # a sound store: nothing more is said, the note stays until it is told
        assert replaced.untold(st) == note
        replaced.mark_told(st, note)
        assert replaced.untold(st) is None
    assert len(said) == 1


def test_the_metric_reads_0_from_the_first_file_after_it_until_a_later_good_run():
    n = replaced.note("/x.corrupt", "malformed", 100.0)
    ok, n1 = replaced.metric_ok(n, 90.0, True)  # the run during which it was replaced
    assert not ok and n1 is not None
    assert replaced.metric_ok(n1, 90.0, True) == (False, None)  # the same run again: still 0
    assert replaced.metric_ok(n1, 200.0, False)[0] is False  # a later run whose store failed: not a good run
    ok, n2 = replaced.metric_ok(n1, 200.0, True)
    assert ok and n2 is not None
    assert replaced.metric_ok(n2, 300.0, True) == (True, None)
    assert replaced.metric_ok(None, 300.0, True) == (True, None)


def test_the_node_metrics_show_the_replacement_then_recover(tmp_path):
    cfg = make_cfg(tmp_path, str(tmp_path / "prom"))
    slurm = MemorySlurm()
    prom = tmp_path / "prom" / "gpuguard_node.prom"
    run(cfg, "healthcheck", "healthy-p5", slurm)
    assert value(read_metrics(prom), "gpuguard_history_store_ok") == 1
    db = tmp_path / "state" / "node2.db"
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    damage(db)
    run(cfg, "healthcheck", "healthy-p5", slurm)
    assert value(read_metrics(prom), "gpuguard_history_store_ok") == 0
    assert list(db.parent.glob("node2.db.corrupt-*"))
    run(cfg, "healthcheck", "healthy-p5", slurm)
    assert value(read_metrics(prom), "gpuguard_history_store_ok") == 1
