"""`gpuguard status`: drains grouped by fault into hostlists, drained-for, the last health check from each node's
REAL SQLite store (read-only), undelivered notifications from a REAL notify spool (a local webhook that fails),
UTC ISO 8601 times. The command end to end against a real Slurm cluster is in
tests/integration/test_monitor_slurm.py."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from clirun import gpuguard

from gpuguard.model import Action, Finding, Severity
from gpuguard.slurm.reason import format_reason
from gpuguard.cli.status import drained_nodes, store_facts
from gpuguard.notify.backlog import undelivered_notifications
from gpuguard.cli.status_render import format_duration, group_nodes, render_status, to_json
from gpuguard.slurm.parse import slurm_time
from gpuguard.util.timefmt import iso_utc
from gpuguard.store.sqlite import Store

NOW = 1795550793.0  # 2026-11-24T20:06:33Z
XID = "GPU has fallen off the bus on 0000:86:00"


def _slurm_local(ts: float) -> str:
    """How scontrol prints a time: local, no zone."""
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%dT%H:%M:%S")


def scontrol_text(drained_at: float) -> str:
    stamp = f"[root@{_slurm_local(drained_at)}]"
    lines = []
    for n in ("node003", "node017", "node018", "node019"):
        reason = format_reason("gpu.xid", "XID79", XID, "prolog", "reboot")
        lines.append(f"NodeName={n} Arch=x86_64 CoresPerSocket=1 State=IDLE+DRAIN ThreadsPerCore=1 "
                     f"Reason={reason} {stamp} Comment=x")
    # a node an older gpuguard drained (check id first): still ours, grouped under its keyword
    lines.append("NodeName=node020 Arch=x86_64 State=MIXED+DRAIN ThreadsPerCore=1 Reason=gpuguard: gpu.ecc ECC: "
                 f"GPU 2 uncorrectable volatile ECC errors 3 [healthcheck] {stamp}")
    lines.append("NodeName=node021 Arch=x86_64 State=IDLE ThreadsPerCore=1")
    lines.append("NodeName=node022 Arch=x86_64 State=DOWN+DRAIN ThreadsPerCore=1 Reason=admin: PSU [ticket 4411] "
                 f"[alice@{_slurm_local(drained_at - 86400)}]")
    return "\n".join(lines) + "\n"


def test_nodes_are_grouped_by_fault_into_hostlists():
    nodes = drained_nodes(scontrol_text(NOW - 7980))
    assert [n["node"] for n in nodes] == ["node003", "node017", "node018", "node019", "node020", "node022"]
    groups = group_nodes(nodes)
    assert [(g["keyword"], g["check_id"], g["hostlist"], g["actions"]) for g in groups] == [
        ("XID79", "gpu.xid", "node[003,017-019]", ["reboot"]),
        ("ECC", "gpu.ecc", "node020", ["drain"]),
    ]
    old = next(n for n in nodes if n["node"] == "node020")
    assert old["ours"] and old["legacy_reason"] and old["detail"].startswith("GPU 2 uncorrectable")
    foreign = next(n for n in nodes if n["node"] == "node022")
    assert not foreign["ours"] and foreign["reason_user"] == "alice"


def test_times_and_durations():
    assert iso_utc(NOW) == "2026-11-24T20:06:33Z"
    assert iso_utc(None) is None
    assert slurm_time(_slurm_local(NOW)) == NOW
    assert slurm_time("None") is None and slurm_time("garbage") is None
    assert [format_duration(s) for s in (None, -5, 45, 125, 7980, 273600)] == ["-", "0s", "45s", "2m05s", "2h13m",
                                                                           "3d4h"]


# --------------------------------------------------------------------------- the stores, read-only


def _finding(check_id, severity, keyword=None, action=Action.NONE):
    return Finding(check_id=check_id, severity=severity, message="m", keyword=keyword, action=action)


def make_store(path, node, drained_at, healthchecks):
    with Store(str(path)) as st:
        rid = st.record_run(started=drained_at, duration_ms=50, node=node, kind="prolog", job_id="7", profile=None,
                            verdict="drain", action="reboot", reason="x", exit_code=1, error=None, boot_id="b1",
                            findings=[_finding("gpu.xid", Severity.FAIL, "XID79", Action.REBOOT)])
        st.record_drain(node=node, op="drain", outcome="done", check_id="gpu.xid", action="reboot", run_id=rid,
                        reason=format_reason("gpu.xid", "XID79", XID, "prolog", "reboot"), ts=drained_at)
        for started, sev in healthchecks:
            st.record_run(started=started, duration_ms=900, node=node, kind="healthcheck", job_id=None,
                          profile=None, verdict="pass" if sev is Severity.OK else "drain", action=None, reason=None,
                          exit_code=0, error=None, boot_id="b2", findings=[_finding("gpu.xid", sev)])


EMPTY = hashlib.sha256(b"").hexdigest()


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_store_facts_last_health_check_and_passes(tmp_path):
    path = tmp_path / "node003.db"
    make_store(path, "node003", NOW - 7980, [(NOW - 600, Severity.FAIL), (NOW - 300, Severity.OK),
                                             (NOW - 60, Severity.OK)])
    before = {p.name: _digest(p) for p in tmp_path.iterdir()}
    facts = store_facts(str(path), "node003")
    assert facts["drained_at"] == NOW - 7980 and facts["drain_check"] == "gpu.xid"
    assert facts["last_healthcheck"] == {"kind": "healthcheck", "verdict": "pass", "started": NOW - 60,
                                         "reason": None}
    assert facts["passes_since"] == 2
    # read-only: the database and its write-ahead log are unchanged (SQLite may add an empty -wal/-shm pair to
    # read a WAL database, which is how WAL readers work)
    after = {p.name: _digest(p) for p in tmp_path.iterdir()}
    assert after["node003.db"] == before["node003.db"]
    assert after.get("node003.db-wal", EMPTY) == before.get("node003.db-wal", EMPTY)


def test_a_missing_or_broken_store_is_reported_not_created(tmp_path):
    missing = tmp_path / "nope" / "node9.db"
    facts = store_facts(str(missing), "node9")
    assert facts == {"store_missing": str(missing)} and not missing.parent.exists()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    facts = store_facts(str(junk), "node9")
    assert "store_error" in facts
    assert junk.read_bytes() == b"this is not a database" * 100  # never moved aside or "repaired" by status


def test_undelivered_notifications_from_a_real_spool(tmp_path):
    pytest.importorskip("apprise")
    from notify_servers import WebhookServer

    from gpuguard.siteconfig import parse_config
    from gpuguard.notify import Event, emit

    hook = WebhookServer()
    try:
        hook.status = 500
        pattern = str(tmp_path / "state" / "{node}.db")
        cfg = parse_config(yaml.safe_dump({"store": {"path": pattern}, "notify": {"urls": [hook.url()]}}),
                           source="test")
        for node in ("node003", "node017"):
            ev = Event(kind="drain", node=node, severity="critical", check_id="gpu.xid", message=XID,
                       reason=format_reason("gpu.xid", "XID79", XID, "prolog", "reboot"))
            assert emit(cfg, ev, budget_s=5) == "spooled"
    finally:
        hook.close()
    spool = undelivered_notifications(pattern)
    assert (spool["pending"], spool["held"], spool["expired"]) == (2, 0, 0)
    assert set(spool["by_node"]) == {"node003", "node017"}
    assert spool["oldest"] and spool["last_errors"] and "failed" in spool["last_errors"][0]["error"]
    assert undelivered_notifications(str(tmp_path / "empty" / "{node}.db"))["pending"] == 0


# --------------------------------------------------------------------------- rendering


def _nodes_with_facts(tmp_path):
    drained_at = NOW - 7980
    nodes = drained_nodes(scontrol_text(drained_at))
    make_store(tmp_path / "node003.db", "node003", drained_at, [(NOW - 60, Severity.FAIL)])
    for n in nodes:
        facts = store_facts(str(tmp_path / f"{n['node']}.db"), n["node"]) if n["ours"] else {}
        recorded = facts.pop("drained_at", None)
        n.update(facts)
        n["drained_since"] = slurm_time(n.get("reason_time")) or recorded
    return nodes


def test_render_for_an_admin_at_3am(tmp_path):
    nodes = _nodes_with_facts(tmp_path)
    spool = {"pending": 2, "held": 1, "expired": 0, "oldest": NOW - 3600, "by_node": {
        "node003": {"pending": 2, "held": 1, "expired": 0}}, "last_errors": [
        {"node": "node003", "title": "t", "error": "HTTP 500", "attempts": 3}], "errors": []}
    text = render_status(nodes, spool, NOW, show_foreign=True)
    lines = text.splitlines()
    assert lines[0] == ("gpuguard status at 2026-11-24T20:06:33Z: 5 node(s) drained by gpuguard, "
                        "1 drained or down by someone else")
    assert "XID79 gpu.xid  node[003,017-019]  reboot" in lines
    assert "ECC gpu.ecc  node020  drain" in lines
    n003 = next(line for line in lines if line.strip().startswith("node003"))
    assert "2h13m" in n003 and iso_utc(NOW - 7980) in n003 and "2026-11-24T20:05:33Z drain" in n003
    n017 = next(line for line in lines if line.strip().startswith("node017"))
    assert " no store " in n017  # its store is not on this host: said once, below, as a hostlist
    assert "no history store here for node[017-020]" in text
    assert any(line.strip().startswith("node020") and "older gpuguard" in line for line in lines)
    assert any(line.strip().startswith("node022") and "admin: PSU" in line and "[alice]" in line for line in lines)
    assert "notifications: 3 undelivered (2 retrying, 1 held for a digest, oldest 2026-11-24T19:06:33Z)" in text
    assert "HTTP 500" in text
    assert "node022" not in render_status(nodes, None, NOW, show_foreign=False)


def test_json_times_are_utc_iso(tmp_path):
    nodes = _nodes_with_facts(tmp_path)
    doc = json.loads(json.dumps(to_json(nodes, None, NOW)))
    assert doc["time"] == "2026-11-24T20:06:33Z"
    n003 = next(n for n in doc["nodes"] if n["node"] == "node003")
    assert n003["drained_at"] == iso_utc(NOW - 7980) and n003["drained_for_s"] == 7980
    assert n003["reason_time"] == iso_utc(NOW - 7980)
    assert n003["last_healthcheck"]["started"] == "2026-11-24T20:05:33Z"
    assert doc["groups"][0]["hostlist"] == "node[003,017-019]"
    stamps = [n003["drained_at"], n003["reason_time"], n003["last_run"]["started"]]
    assert all(s.endswith("Z") and "T" in s for s in stamps)



# --------------------------------------------------------------------------- 10,000 nodes


def fleet_scontrol_text(drained_at: float) -> str:
    """10,000 drained nodes as `scontrol show node -o` prints them: 6,000 idle with an Xid 79, 3,990 still running
    jobs with an ECC error (draining), 10 down with a GPU missing, plus 5 that an admin drained."""
    lines = []
    for i in range(1, 10006):
        name = f"gpu-{i:05d}"
        if i > 10000:
            lines.append(f"NodeName={name} State=IDLE+DRAIN Reason=admin: rack move [bob@{_slurm_local(drained_at)}]")
            continue
        check, kw, state = (("gpu.xid", "XID79", "IDLE+DRAIN") if i <= 6000 else
                            ("gpu.ecc", "ECC", "MIXED+DRAIN") if i <= 9990 else ("gpu.count", "GPUCOUNT", "DOWN+DRAIN"))
        reason = format_reason(check, kw, f"{kw} on GPU {i % 8}", "healthcheck", "reboot")
        since = drained_at - (10000 - i) * 60  # the lower the number, the longer ago
        lines.append(f"NodeName={name} Arch=x86_64 State={state} ThreadsPerCore=1 Reason={reason} "
                     f"[root@{_slurm_local(since)}]")
    return "\n".join(lines) + "\n"


def _with_slurm_times(nodes):
    for n in nodes:
        n["drained_since"] = slurm_time(n.get("reason_time"))
    return nodes


def test_ten_thousand_drained_nodes_are_a_summary_that_fits_a_screen():
    """Before: two lines per node (10,021 lines at 10,000 nodes). Now the summary: counts by state and by fault,
    hostlists clipped to a line, the oldest drains, and how to get the details."""
    nodes = _with_slurm_times(drained_nodes(fleet_scontrol_text(NOW - 3600)))
    text = render_status(nodes, None, NOW, show_foreign=True)
    lines = text.splitlines()
    assert len(lines) <= 20, text[:3000]
    assert lines[0] == ("gpuguard status at 2026-11-24T20:06:33Z: 10000 node(s) drained by gpuguard, "
                        "5 drained or down by someone else")
    assert "  state: 6000 drained (idle), 3990 draining (jobs still running), 10 down" in lines
    xid = next(line for line in lines if line.startswith("  XID79"))
    assert " 6000 " in xid and "gpu-[00001-06000]" in xid and "reboot" in xid
    gpucount = next(line for line in lines if line.startswith("  GPUCOUNT"))
    assert " 10 " in gpucount and "gpu-[09991-10000]" in gpucount
    assert all(len(line) <= 140 for line in lines)
    at = lines.index("  oldest drains:")
    assert [line.split()[1] for line in lines[at + 1:at + 6]] == [f"gpu-{i:05d}" for i in range(1, 6)]
    assert lines[at + 1].split() == ["6d23h", "gpu-00001", "XID79", "gpu.xid"]
    assert "gpuguard status --details" in text and "--node HOSTLIST" in text


def test_details_for_every_node_or_a_hostlist_on_request():
    nodes = _with_slurm_times(drained_nodes(fleet_scontrol_text(NOW - 3600)))
    detailed = render_status(nodes, None, NOW, show_foreign=False, details=True).splitlines()
    assert sum(1 for line in detailed if line.startswith("  gpu-")) == 10000
    few = [n for n in nodes if n["node"] in {"gpu-00017", "gpu-09995"}]
    text = render_status(few, None, NOW, show_foreign=False)  # a handful: details without asking
    assert "ECC" not in text and any(line.startswith("  gpu-09995") for line in text.splitlines())
    doc = to_json(nodes, None, NOW)
    assert doc["summary"]["by_state"] == {"drained": 6000, "draining": 3990, "down": 10}
    assert [f["count"] for f in doc["summary"]["by_fault"]] == [6000, 3990, 10]


def test_many_scattered_nodes_make_a_clipped_hostlist():
    nodes = _with_slurm_times(drained_nodes(fleet_scontrol_text(NOW - 3600)))
    every_third = [n for n in nodes if n["ours"] and int(n["node"][4:]) % 3 == 0]
    summary = render_status(every_third, None, NOW, show_foreign=False).splitlines()
    line = next(x for x in summary if x.startswith("  XID79"))
    assert "more)" in line and len(line) <= 140


def test_the_command_reads_only_the_stores_it_shows(tmp_path):
    """`gpuguard status` on 10,000 drained nodes prints the summary without opening 10,000 stores; `--node` shows
    those nodes' details (scontrol here is a stub printing a recorded `show node -o`)."""
    (tmp_path / "nodes.txt").write_text(fleet_scontrol_text(NOW - 3600))
    stub = tmp_path / "scontrol"
    stub.write_text(f"#!/bin/sh\ncat {tmp_path / 'nodes.txt'}\n")
    stub.chmod(0o755)
    make_store(tmp_path / "state" / "gpu-00017.db", "gpu-00017", NOW - 7980, [(NOW - 60, Severity.OK)])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"slurm": {"scontrol": str(stub)}, "logging": {"syslog": False},
                                   "store": {"path": str(tmp_path / "state" / "{node}.db")}}))

    def status(*args):
        p = gpuguard("status", "--config", str(cfg), *args)
        assert p.returncode == 0, p.stderr
        return p.stdout.splitlines()

    summary = status()
    assert len(summary) <= 20 and "no history store here" not in "\n".join(summary)
    picked = status("--node", "gpu-[00017-00018]")
    assert picked[0].endswith(": 2 node(s) drained by gpuguard")
    rows = [line for line in picked if line.startswith("  gpu-")]
    assert [r.split()[0] for r in rows] == ["gpu-00017", "gpu-00018"]
    assert "pass" in rows[0] and " no store " in rows[1]  # gpu-00017's last health check, from its store


def test_status_asks_notify_for_its_spool():
    """The spool's tables are notify's: `gpuguard status` takes the summary from gpuguard.notify.backlog and holds
    no SQL of the spool (issue 30)."""
    from gpuguard.cli import status
    from gpuguard.notify import backlog

    assert status.undelivered_notifications is backlog.undelivered_notifications
    assert "notify_spool" not in Path(status.__file__).read_text()
