"""Central history against a real PostgreSQL server (Debian's postgresql, booted once for this module in a temp dir
on a free port; a fresh database per test): schema creation, the outbox (the database down, the hooks go on
recording, everything shipped once it is back, exactly once), a hung database costing the health check only its
budget, `fleet history` / `fleet report` giving the same answers from PostgreSQL as from the SQLite stores, and a
drain on a real Slurm cluster reaching the central history."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from gpuguard.fleet.devpg import DevPostgres, missing_requirements
from gpuguard.model import Action, Finding, Severity
from gpuguard.simulate.build import build_fake_nvml
from gpuguard.store import Store

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "examples" / "scenarios"


@pytest.fixture(scope="module")
def pg():
    missing = missing_requirements()
    if missing:
        pytest.skip("cannot boot PostgreSQL: " + "; ".join(missing))
    server = DevPostgres().start()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def db(pg, request):
    """A fresh database owned by the gpuguard role; its URL carries the password."""
    import psycopg
    from psycopg import sql

    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:50].lower()
    with psycopg.connect(pg.admin_url, autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        c.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(pg.user)))
    return f"postgresql://{pg.user}:{pg.password}@127.0.0.1:{pg.port}/{name}"


def q(url, sql, *args):
    import psycopg

    with psycopg.connect(url) as c:
        return c.execute(sql, args).fetchall()


def write_cfg(tmp_path, url, **extra):
    data = {"store": {"path": str(tmp_path / "state" / "{node}.db"), "url": url},
            "simulation": {"scenario_dir": str(tmp_path / "scenarios"), "workdir": str(tmp_path / "sim"),
                           "fake_nvml": str(build_fake_nvml())},
            "logging": {"syslog": False, "file": str(tmp_path / "gpuguard.log")},
            "slurm": {"scontrol": "/bin/false"}}  # no cluster here: a drain is attempted and recorded as failed
    for k, v in extra.items():
        data.setdefault(k, {}).update(v)
    (tmp_path / "scenarios").mkdir(exist_ok=True)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def gg(cfg, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "gpuguard", *args, "--config", str(cfg)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def healthcheck(cfg, node):
    """What slurmd runs (HealthCheckProgram gets only SLURMD_NODENAME); returns (exit code, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gpuguard", "healthcheck", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60, env={"SLURMD_NODENAME": node, "PATH": "/usr/bin:/bin"})
    return p.returncode, time.monotonic() - t0


def local_counts(path):
    with sqlite3.connect(path) as c:
        return (c.execute("SELECT COUNT(*) FROM runs").fetchone()[0],
                c.execute("SELECT COUNT(*) FROM drains").fetchone()[0],
                c.execute("SELECT COUNT(*) FROM findings WHERE severity NOT IN ('ok','skip')").fetchone()[0])


def pg_counts(url, node):
    return tuple(q(url, f"SELECT COUNT(*) FROM gpuguard.{t} WHERE node=%s", node)[0][0]
                 for t in ("runs", "drains", "findings"))


def test_init_db_creates_and_migrates_the_schema_idempotently(db, tmp_path):
    cfg = write_cfg(tmp_path, db)
    p = gg(cfg, "fleet", "init-db")
    assert p.returncode == 0 and "migrated from version 0 to 1" in p.stdout, p.stderr
    p = gg(cfg, "fleet", "init-db")
    assert p.returncode == 0 and "gpuguard schema at version 1" in p.stdout
    assert ":***@" in p.stdout and db.split(":")[2].split("@")[0] not in p.stdout + p.stderr  # the password
    tables = {r[0] for r in q(db, "SELECT tablename FROM pg_tables WHERE schemaname='gpuguard'")}
    assert tables == {"origins", "runs", "findings", "drains", "schema_version"}


def test_database_down_hooks_keep_recording_and_everything_ships_once_when_back(pg, db, tmp_path):
    cfg = write_cfg(tmp_path, db)
    (tmp_path / "scenarios" / "default.yaml").write_bytes((SCENARIOS / "healthy-p5.yaml").read_bytes())
    (tmp_path / "scenarios" / "n2.yaml").write_bytes((SCENARIOS / "xid79.yaml").read_bytes())
    assert gg(cfg, "fleet", "init-db").returncode == 0
    pg.stop()
    try:
        for node in ("n1", "n2", "n1"):
            rc, took = healthcheck(cfg, node)
            assert rc == 0 and took < 10, (node, took)
        p = gg(cfg, "fleet", "ship")
        assert p.returncode == 1 and "postgresql://gpuguard:***@127.0.0.1" in p.stdout
    finally:
        pg.start()
    log = (tmp_path / "gpuguard.log").read_text()
    assert "central history not updated" in log and pg.password not in log + p.stdout + p.stderr
    n1, n2 = (str(tmp_path / "state" / f"{n}.db") for n in ("n1", "n2"))
    assert local_counts(n1)[0] == 2 and local_counts(n2)[1] == 1 and local_counts(n2)[2] >= 1  # recorded locally

    p = gg(cfg, "fleet", "ship", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(r["complete"] for r in json.loads(p.stdout))
    assert pg_counts(db, "n1") == local_counts(n1) and pg_counts(db, "n2") == local_counts(n2)
    drain = q(db, "SELECT node, op, outcome, check_id, keyword FROM gpuguard.drains")
    assert drain == [("n2", "drain", "failed", "gpu.xid", "XID79")]

    again = json.loads(gg(cfg, "fleet", "ship", "--json").stdout)
    assert [r["sent"] for r in again] == [{"drains": 0, "runs": 0, "findings": 0}] * 2
    # a shipper that died after its commit but before moving the watermark sends everything again: stored once
    with Store(n2) as st:
        st.set_cursor("fleet:shipped:runs", {"id": 0, "db": f"127.0.0.1:{pg.port}/{db.rsplit('/', 1)[1]}"})
        st.set_cursor("fleet:shipped:drains", {"id": 0, "db": f"127.0.0.1:{pg.port}/{db.rsplit('/', 1)[1]}"})
    resent = json.loads(gg(cfg, "fleet", "ship", "--node", "n2", "--json").stdout)[0]
    assert resent["sent"]["runs"] == local_counts(n2)[0] and pg_counts(db, "n2") == local_counts(n2)

    # with the database up, the health check ships its own run after its verdict
    rc, _ = healthcheck(cfg, "n1")
    assert rc == 0 and pg_counts(db, "n1") == local_counts(n1) == (3, 0, 0)


def test_a_hung_database_costs_the_health_check_only_its_budget(tmp_path):
    """A server that accepts the TCP connection and never answers (a wedged database, a black-holed proxy)."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    try:
        url = f"postgresql://gg:pw@127.0.0.1:{hung.getsockname()[1]}/fleet"
        cfg = write_cfg(tmp_path, url, store={"ship_budget_s": 1.0})
        (tmp_path / "scenarios" / "default.yaml").write_bytes((SCENARIOS / "healthy-p5.yaml").read_bytes())
        healthcheck(cfg, "n1")  # warm up (first run materialises the simulated node)
        rc, took = healthcheck(cfg, "n1")
        assert rc == 0 and took < 4.0, took
        assert "shipping did not finish within 1.0s" in (tmp_path / "gpuguard.log").read_text()
        assert local_counts(str(tmp_path / "state" / "n1.db"))[0] == 2
    finally:
        hung.close()


def test_the_watch_daemon_ships_a_drain_within_seconds(db, tmp_path):
    """The watch daemon acts on a fatal Xid (here Slurm refuses the drain: recorded as failed, retried) and its
    idle loop ships the records soon after, without the health check or the timer."""
    import threading

    from gpuguard.config import load_config
    from gpuguard.log import HookLog
    from gpuguard.watch import WatchDaemon

    log = tmp_path / "kern.log"
    log.write_text("")
    cfg = write_cfg(tmp_path, db, watch={"source": f"file:{log}", "retry_initial_s": 5.0},
                    simulation={"scenario_dir": None})  # a real node's kernel log: this file
    assert gg(cfg, "fleet", "init-db").returncode == 0
    daemon = WatchDaemon(load_config(str(cfg)), node="n1",
                         log=HookLog(use_syslog=False, path=str(tmp_path / "gpuguard.log"), stderr=False))
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        assert daemon.ready.wait(10)
        with open(log, "a") as f:
            f.write("Nov 20 10:11:12 gpu-node-1 kernel: [ 5234.567890] NVRM: Xid (PCI:0000:86:00): 79, "
                    "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15 and not q(db, "SELECT 1 FROM gpuguard.drains"):
            time.sleep(0.1)
        took = time.monotonic() - t0
    finally:
        daemon.request_stop()
        thread.join(15)
    assert q(db, "SELECT node, op, outcome, keyword FROM gpuguard.drains") == [("n1", "drain", "failed", "XID79")]
    assert q(db, "SELECT kind, verdict FROM gpuguard.runs") == [("watch", "drain")]
    assert took < 8, took


# --------------------------------------------------------------------------- history and reports: PG == SQLite

T0 = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
T0 = T0 - timedelta(days=T0.weekday() + 21)  # a Monday three weeks ago
DAY = 86400.0
XID = "gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [healthcheck reboot]"
ECC_OLD = "gpuguard: gpu.ecc ECC: 2 volatile uncorrectable ECC errors on GPU 5 [prolog reset]"  # old grammar
FLAP = "gpuguard: FLAPPING gpu.xid: drained again after 2 undrains in 24h: x [healthcheck replace]"


def t(days, node_offset=0):
    return T0.timestamp() + days * DAY + node_offset


def fleet_stores(state):
    """node1: Xid 79 drain day 1 (undrained day 1.5), ECC drain day 8 still on. node2: Xid drains on days 2, 3, 4
    (undrained after 6 h twice), pinned FLAPPING on day 4.5. node3: healthy. A health check a day everywhere."""
    plan = {
        "node1": [(1, "gpu.xid", "XID79", XID, 3, 1.5), (8, "gpu.ecc", "ECC", ECC_OLD, 5, None)],
        "node2": [(2, "gpu.xid", "XID79", XID, 3, 2.25), (3, "gpu.xid", "XID79", XID, 6, 3.25),
                  (4, "gpu.xid", "XID79", XID, 3, None)],
        "node3": [],
    }
    for i, (node, drains) in enumerate(plan.items()):
        with Store(str(state / f"{node}.db")) as st:
            for day in range(21):
                st.record_run(started=t(day, i), duration_ms=100.0, node=node, kind="healthcheck", job_id=None,
                              profile="p5", verdict="pass", action="none", reason=None, exit_code=0, error=None,
                              boot_id="b", findings=[Finding("gpu.count", Severity.OK, "8 GPUs")])
            for day, check, kw, reason, gpu, undrain in drains:
                rid = st.record_run(started=t(day + 0.1, i), duration_ms=120.0, node=node, kind="prolog", job_id="9",
                                    profile="p5", verdict="drain", action="reboot", reason=reason, exit_code=1,
                                    error=None, boot_id="b",
                                    findings=[Finding(check, Severity.FAIL, f"{kw} on GPU {gpu}", kw, "x",
                                                      Action.REBOOT, {"gpu": gpu, "n": [1, 2]}, gpu=gpu),
                                              Finding("gpu.temperature", Severity.WARN, "warm", "THERMAL", gpu=1)])
                st.record_drain(node=node, op="drain", outcome="done", reason=reason, check_id=check, action="reboot",
                                run_id=rid, ts=t(day + 0.1, i))
                if undrain:
                    st.record_drain(node=node, op="undrain", outcome="done", reason=reason, check_id=check,
                                    action="reboot", run_id=None, ts=t(undrain + 0.1, i))
            if node == "node2":
                st.record_drain(node=node, op="drain", outcome="flapping", reason=FLAP, check_id="gpu.xid",
                                action="replace", run_id=None, ts=t(4.6, i))


@pytest.fixture
def shipped(db, tmp_path):
    cfg = write_cfg(tmp_path, db)
    fleet_stores(tmp_path / "state")
    p = gg(cfg, "fleet", "ship")
    assert p.returncode == 0, p.stdout + p.stderr
    return cfg


def _strip(h):
    for kind in ("runs", "drains", "findings", "requeues"):
        for r in h[kind]:
            r.pop("origin", None)
    h.pop("stores")
    return h


@pytest.mark.parametrize("filters", [
    (), ("--node", "node[1-2]"), ("--keyword", "XID"), ("--keyword", "ecc"), ("--check", "gpu.xid", "--gpu", "3"),
    ("--verdict", "drain"), ("--limit", "4"), ("--gpu", "1"), ("--node", "node3"),
])
def test_fleet_history_from_postgresql_equals_the_local_stores(shipped, filters):
    window = ("--since", datetime.fromtimestamp(t(0), timezone.utc).isoformat(),
              "--until", datetime.fromtimestamp(t(14), timezone.utc).isoformat())
    central = gg(shipped, "fleet", "history", "--json", *window, *filters)
    local = gg(shipped, "fleet", "history", "--local", "--json", *window, *filters)
    assert central.returncode == 0 and local.returncode == 0, central.stderr + local.stderr
    c, l_ = json.loads(central.stdout), json.loads(local.stdout)
    assert c["stores"][0].startswith("postgresql://gpuguard:***@")
    assert _strip(c) == _strip(l_)
    assert c["counts"]["runs"] > 0 or filters == ("--gpu", "1") or "node3" in filters
    text = gg(shipped, "fleet", "history", *window, *filters)
    assert text.returncode == 0 and "drains (" in text.stdout


def test_fleet_report_numbers_from_postgresql_and_sqlite(shipped):
    window = ("--since", datetime.fromtimestamp(t(0), timezone.utc).isoformat(),
              "--until", datetime.fromtimestamp(t(14), timezone.utc).isoformat())
    central = json.loads(gg(shipped, "fleet", "report", "--json", *window).stdout)
    local = json.loads(gg(shipped, "fleet", "report", "--json", "--local", *window).stdout)
    assert central["source"].startswith("PostgreSQL postgresql://gpuguard:***@")
    central.pop("source"), local.pop("source")
    assert central == local
    monday = T0.strftime("%Y-%m-%d")
    next_monday = (T0 + timedelta(days=7)).strftime("%Y-%m-%d")
    assert central["drains_per_check_per_week"] == [
        {"week": monday, "check": "gpu.xid", "drains": 4, "nodes": 2},
        {"week": next_monday, "check": "gpu.ecc", "drains": 1, "nodes": 1}]
    nodes = {n["node"]: n for n in central["nodes"]}
    n1, n2, n3 = nodes["node1"], nodes["node2"], nodes["node3"]
    # node1: drained 0.5 d (Xid) + from day 8.1 to the end of the window (5.9 d); observed 14 d
    assert n1["failures"] == 2 and n1["drained_now"] and n1["drained_s"] == pytest.approx(6.4 * DAY, abs=1)
    assert n1["mtbf_s"] == pytest.approx((14 - 6.4) / 2 * DAY, abs=1)
    # node2: 0.25 + 0.25 + 9.9 days drained; three failures; pinned FLAPPING
    assert (n2["failures"], n2["undrains"], n2["flapping_pins"], n2["flapping"]) == (3, 2, 1, True)
    assert n2["drained_s"] == pytest.approx(10.4 * DAY, abs=3)
    assert n2["mtbf_s"] == pytest.approx((14 - 10.4) * DAY / 3, abs=3)
    assert n3["failures"] == 0 and n3["mtbf_s"] is None and n3["drained_s"] == 0 and not n3["flapping"]
    assert [n["node"] for n in central["flapping"]] == ["node2"]
    keyword = json.loads(gg(shipped, "fleet", "report", "--json", "--keyword", "ECC", *window).stdout)
    assert [w["check"] for w in keyword["drains_per_check_per_week"]] == ["gpu.ecc"]
    text = gg(shipped, "fleet", "report", *window)
    assert text.returncode == 0 and "node2" in text.stdout and "flapping nodes" in text.stdout


def test_missing_schema_and_unreachable_database_are_one_line_errors(db, tmp_path):
    cfg = write_cfg(tmp_path, db)
    p = gg(cfg, "fleet", "report")
    assert p.returncode == 1 and "gpuguard fleet init-db" in p.stderr and "Traceback" not in p.stderr
    closed = f"postgresql://gg:topsecret@127.0.0.1:{_closed_port()}/fleet"
    cfg = write_cfg(tmp_path, closed)
    p = gg(cfg, "fleet", "history")
    assert p.returncode == 1 and "postgresql://gg:***@127.0.0.1" in p.stderr and "topsecret" not in p.stderr
    assert "Traceback" not in p.stderr


def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --------------------------------------------------------------------------- a real cluster


def test_a_drain_on_a_real_cluster_reaches_the_central_history(site_factory, db):
    site = site_factory(nodes=2, config={"store": {"url": db}})
    site.set_scenario("node2", "xid79")
    p = site.run_hook("healthcheck", "node2")
    assert p.returncode == 0, p.stderr
    assert "DRAIN" in site.cluster.node_flags("node2")  # Slurm drained it (the health check drains itself)
    h = json.loads(site.gpuguard("fleet", "history", "--json", "--node", "node2").stdout)
    assert h["stores"][0].startswith("postgresql://")
    assert [(d["op"], d["outcome"]) for d in h["drains"]] == [("drain", "done")]
    assert h["drains"][0]["reason"].startswith("gpuguard: XID79 gpu.xid")
    assert any(f["keyword"] == "XID79" for f in h["findings"])
    rep = json.loads(site.gpuguard("fleet", "report", "--json").stdout)
    assert {n["node"]: n["failures"] for n in rep["nodes"]}.get("node2") == 1
