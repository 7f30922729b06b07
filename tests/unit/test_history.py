"""`gpuguard history` over real SQLite stores (per-node files; requeues from the job-side store named by
templates.store_path, never from the hooks' store) and the pure parts of `gpuguard status`."""

from __future__ import annotations

import csv
import io
import json
import re
import time

import pytest
import yaml
from clirun import gpuguard

from gpuguard.cli.history import parse_since
from gpuguard.cli.status import drained_nodes
from gpuguard.model import Action, Finding, Severity
from gpuguard.store.sqlite import Store


def gg(cfg_path, *args):
    return gpuguard(*args, "--config", str(cfg_path))


@pytest.fixture
def fleet(tmp_path):
    """Two per-node stores: node1 healthy, node2 drained for Xid 79 two hours ago; a requeue in the ledger."""
    state = tmp_path / "state"
    now = time.time()
    with Store(str(state / "node1.db")) as st:
        st.record_run(started=now - 600, duration_ms=120.0, node="node1", kind="prolog", job_id="41", profile="p5",
                      verdict="pass", action="none", reason=None, exit_code=0, error=None, boot_id="b", findings=[])
        st.record_run(started=now - 3 * 86400, duration_ms=110.0, node="node1", kind="healthcheck", job_id=None,
                      profile="p5", verdict="pass", action="none", reason=None, exit_code=0, error=None,
                      boot_id="b", findings=[])
    reason = "gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [prolog reboot]"
    with Store(str(state / "node2.db")) as st:
        rid = st.record_run(started=now - 7200, duration_ms=140.0, node="node2", kind="prolog", job_id="40",
                            profile="p5", verdict="drain", action="reboot", reason=reason, exit_code=1, error=None,
                            boot_id="b", findings=[Finding("gpu.xid", Severity.FAIL, "Xid 79 on 0000:86:00", "XID79",
                                                           "reboot", Action.REBOOT, {"xid": 79}),
                                                   Finding("gpu.count", Severity.OK, "8 GPUs")])
        st.record_drain(node="node2", op="drain", outcome="done", reason=reason, check_id="gpu.xid",
                        action="reboot", run_id=rid, ts=now - 7199)
        # an old-style attempt in the hooks' own store: no longer read (the template writes the job-side store)
        _attempts(st.conn, now - 7000, "39", "node2")
    # the torchrun template's job-side store (templates.store_path, "{node}" = the batch host)
    jobs = tmp_path / "jobs"
    with Store(str(jobs / "node2.db")) as st:
        _attempts(st.conn, now - 7100, "40", "node[2-3]", excluded="node2")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"path": str(state / "{node}.db")},
                                   "templates": {"store_path": str(jobs / "{node}.db")}}))
    return cfg


def _attempts(conn, ts, job, nodes, excluded=None):
    conn.execute("CREATE TABLE IF NOT EXISTS attempts (id INTEGER PRIMARY KEY, ts REAL NOT NULL, job_id TEXT "
                 "NOT NULL, attempt INTEGER NOT NULL, nodes TEXT, exit_code INTEGER, signal INTEGER, "
                 "reason TEXT, action TEXT, excluded TEXT)")
    conn.execute("INSERT INTO attempts(ts,job_id,attempt,nodes,exit_code,signal,reason,action,excluded) "
                 "VALUES (?,?,?,?,?,?,?,?,?)", (ts, job, 1, nodes, 1, 0, "node_fail", "requeued", excluded))


def test_history_reads_every_node_store_with_findings_and_requeues(fleet):
    p = gg(fleet, "history", "--json")
    assert p.returncode == 0, p.stderr
    h = json.loads(p.stdout)
    assert len(h["stores"]) == 2
    assert [r["node"] for r in h["runs"]] == ["node1", "node2"]  # newest first; the 3-day-old run is out of 24h
    drain_run = h["runs"][1]
    assert drain_run["verdict"] == "drain" and [f["check_id"] for f in drain_run["findings"]] == ["gpu.xid"]
    assert drain_run["findings"][0]["evidence"] == {"xid": 79}
    assert h["drains"][0]["outcome"] == "done" and "XID79" in h["drains"][0]["reason"]
    assert [(q["job_id"], q["excluded"]) for q in h["requeues"]] == [("40", "node2")]  # not job 39 (hooks' store)
    assert h["counts"] == {"drains": 1, "findings": 1, "runs": 2, "requeues": 1}
    assert h["findings"][0]["check_id"] == "gpu.xid" and h["findings"][0]["node"] == "node2"
    utc = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
    assert re.fullmatch(utc, h["runs"][0]["started"]) and re.fullmatch(utc, h["drains"][0]["ts"])
    assert re.fullmatch(utc, h["findings"][0]["time"]) and re.fullmatch(utc, h["requeues"][0]["ts"])
    assert re.fullmatch(utc, h["since"])


def test_history_without_templates_store_path_has_no_requeues(fleet, tmp_path):
    cfg = yaml.safe_load(fleet.read_text())
    del cfg["templates"]
    fleet.write_text(yaml.safe_dump(cfg))
    h = json.loads(gg(fleet, "history", "--json").stdout)
    assert h["requeues"] == [] and h["counts"]["requeues"] == 0 and len(h["drains"]) == 1


def test_history_node_filter_since_and_text(fleet):
    p = gg(fleet, "history", "--node", "node1", "--since", "7d")
    assert p.returncode == 0
    assert "runs (2):" in p.stdout and "healthcheck" in p.stdout and "node2" not in p.stdout
    assert "requeues (0):" in p.stdout  # job 40 ran on node[2-3]: not node1's
    p = gg(fleet, "history", "--node", "node2", "--since", "1h")
    assert "runs (0):" in p.stdout and "drains (0):" in p.stdout


def test_history_csv_is_one_timeline(fleet):
    p = gg(fleet, "history", "--csv")
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert [r["type"] for r in rows] == ["run", "requeue", "drain", "run"]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["time"]) for r in rows)
    req = rows[1]
    assert req["job_id"] == "40" and req["outcome"] == "requeued" and "excluded=node2" in req["detail"]
    assert rows[2]["check"] == "gpu.xid" and rows[3]["outcome"] == "drain"


def test_history_bad_since_and_missing_store(fleet, tmp_path):
    p = gg(fleet, "history", "--since", "yesterday")
    assert p.returncode == 2 and "--since" in p.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text(yaml.safe_dump({"store": {"path": str(tmp_path / "none" / "{node}.db")}}))
    p = gg(empty, "history", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["runs"] == []


def test_parse_since():
    now = 1_000_000.0
    assert parse_since("30m", now) == now - 1800
    assert parse_since("24h", now) == now - 86400
    assert parse_since("2d", now) == now - 2 * 86400
    assert parse_since("2026-03-02T10:00") == 1772445600.0  # no offset: UTC, like every time gpuguard prints
    assert parse_since("2026-03-02T10:00:00Z") == parse_since("2026-03-02T11:00:00+01:00") == 1772445600.0
    with pytest.raises(ValueError):
        parse_since("-5h", now)


def test_drained_nodes_from_scontrol_output():
    text = (
        "NodeName=node1 Arch=x86_64 CoresPerSocket=1 State=IDLE+DRAIN ThreadsPerCore=1 Reason=gpuguard: XID79 "
        "gpu.xid: GPU has fallen off the bus on 0000:86:00 [prolog reboot] [root@2026-03-02T10:00:01] Comment=x\n"
        "NodeName=node2 Arch=x86_64 State=IDLE ThreadsPerCore=1\n"
        "NodeName=node3 Arch=x86_64 State=DOWN+DRAIN ThreadsPerCore=1 Reason=admin: PSU [ticket 4411] "
        "[alice@2026-03-01T09:00:00]\n")
    nodes = drained_nodes(text)
    assert [n["node"] for n in nodes] == ["node1", "node3"]
    ours, theirs = nodes
    assert ours["ours"] and (ours["check_id"], ours["keyword"], ours["action"]) == ("gpu.xid", "XID79", "reboot")
    assert ours["reason_time"] == "2026-03-02T10:00:01"
    assert not theirs["ours"] and theirs["reason_user"] == "alice"
