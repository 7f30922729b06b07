"""`gpuguard history` over real SQLite stores: limits per kind of record (a drain or an Xid finding is never hidden
behind healthy runs), the filters (node hostlist, check, keyword, verdict, GPU, since/until), clear errors for bad
input, and text output that cannot carry terminal escapes."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from clirun import gpuguard

from gpuguard.model import Action, Finding, Severity
from gpuguard.store.sqlite import Store

XID79 = "gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [healthcheck reboot]"
LEGACY_ECC = "gpuguard: gpu.ecc ECC: 2 volatile uncorrectable ECC errors on GPU 5 [prolog reset]"


def gg(cfg_path, *args):
    return gpuguard(*args, "--config", str(cfg_path))


def bulk_healthy_runs(path, node, n, start, step, ok_findings=4):
    """n passing health checks (each with ok findings, as the health check records them), inserted in one go."""
    with Store(path) as st:
        c = st.conn
        c.execute("BEGIN")
        first = (c.execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()[0]) + 1
        c.executemany("INSERT INTO runs(id,started,duration_ms,node,kind,verdict,action,exit_code,profile,boot_id) "
                      "VALUES (?,?,?,?,?,?,?,?,?,?)",
                      ((first + i, start + i * step, 120.0, node, "healthcheck", "pass", "none", 0, "p5", "b")
                       for i in range(n)))
        checks = ["gpu.nvml", "gpu.count", "gpu.ecc", "gpu.xid", "gpu.temperature", "gpu.pcie"][:ok_findings]
        c.executemany("INSERT INTO findings(run_id,check_id,severity,message,action,evidence) VALUES (?,?,?,?,?,?)",
                      ((first + i, cid, "ok", "fine", "none", "{}") for i in range(n) for cid in checks))
        c.execute("COMMIT")


def record_xid_drain(st, node, ts, gpu=3, reason=XID79, check="gpu.xid", keyword="XID79"):
    rid = st.record_run(started=ts, duration_ms=130.0, node=node, kind="healthcheck", job_id=None, profile="p5",
                        verdict="drain", action="reboot", reason=reason, exit_code=0, error=None, boot_id="b",
                        findings=[Finding(check, Severity.FAIL, f"{keyword} on GPU {gpu}", keyword, "reboot",
                                          Action.REBOOT, {"xid": 79, "gpu": gpu}, gpu=gpu),
                                  Finding("gpu.count", Severity.OK, "8 GPUs")])
    st.record_drain(node=node, op="drain", outcome="done", reason=reason, check_id=check, action="reboot",
                    run_id=rid, ts=ts + 0.5)
    return rid


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """The issue's case: one node with 10,000 healthy health checks in the last 6 days and 3 Xid 79 drains
    among them (the oldest 5 days ago)."""
    d = tmp_path_factory.mktemp("big")
    now = time.time()
    path = str(d / "node7.db")
    bulk_healthy_runs(path, "node7", 10_000, now - 6 * 86400, 6 * 86400 / 10_000)
    with Store(path) as st:
        for age_h in (120, 70, 2):
            record_xid_drain(st, "node7", now - age_h * 3600, gpu=age_h % 8)
    cfg = d / "config.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"path": path}}))
    return cfg


def test_drains_and_findings_are_never_hidden_behind_the_runs_limit(big_store):
    t0 = time.monotonic()
    p = gg(big_store, "history", "--since", "7d", "--json")
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    h = json.loads(p.stdout)
    assert len(h["drains"]) == 3 and all("XID79" in d["reason"] for d in h["drains"])
    assert len(h["findings"]) == 3 and {f["keyword"] for f in h["findings"]} == {"XID79"}
    assert len(h["runs"]) == 200 and h["counts"]["runs"] == 10_003  # runs are limited, and say so
    assert h["counts"]["drains"] == 3 and h["counts"]["findings"] == 3
    assert took < 10, f"history took {took:.1f}s"


def test_text_output_says_when_a_kind_is_truncated(big_store):
    p = gg(big_store, "history", "--since", "7d", "--limit", "5")
    assert p.returncode == 0, p.stderr
    assert "drains (3):" in p.stdout and "findings (3):" in p.stdout
    assert "runs (5 of 10003, newest first; --limit N or --limit 0 for more):" in p.stdout


@pytest.fixture
def fleet(tmp_path):
    """Three per-node stores: node1 healthy, node2 Xid 79 on GPU 3 (new grammar), node10 ECC on GPU 5 (old
    grammar reason), all within the last day; plus a node2 drain 3 days ago."""
    now = time.time()
    state = tmp_path / "state"
    with Store(str(state / "node1.db")) as st:
        st.record_run(started=now - 600, duration_ms=100.0, node="node1", kind="prolog", job_id="41", profile="p5",
                      verdict="pass", action="none", reason=None, exit_code=0, error=None, boot_id="b", findings=[])
        st.record_run(started=now - 500, duration_ms=100.0, node="node1", kind="healthcheck", job_id=None,
                      profile="p5", verdict="warn", action="none", reason=None, exit_code=0, error=None, boot_id="b",
                      findings=[Finding("gpu.temperature", Severity.WARN, "GPU 1 at 84 C", "THERMAL", gpu=1)])
    with Store(str(state / "node2.db")) as st:
        record_xid_drain(st, "node2", now - 3 * 86400, gpu=6)
        record_xid_drain(st, "node2", now - 3600, gpu=3)
    with Store(str(state / "node10.db")) as st:
        record_xid_drain(st, "node10", now - 1800, gpu=5, reason=LEGACY_ECC, check="gpu.ecc", keyword="ECC")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"path": str(state / "{node}.db")}}))
    return cfg


def hist(cfg, *args):
    p = gg(cfg, "history", "--json", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_node_hostlist_filter_reads_only_those_stores(fleet):
    h = hist(fleet, "--node", "node[2-10]")
    assert len(h["stores"]) == 2 and {r["node"] for r in h["runs"]} == {"node2", "node10"}
    assert {d["node"] for d in h["drains"]} == {"node2", "node10"}
    h = hist(fleet, "--node", "node1,node10")
    assert {r["node"] for r in h["runs"]} == {"node1", "node10"}


def test_check_keyword_verdict_gpu_filters(fleet):
    h = hist(fleet, "--check", "gpu.xid")
    assert [d["node"] for d in h["drains"]] == ["node2"] and [f["gpu"] for f in h["findings"]] == [3]
    assert [r["node"] for r in h["runs"]] == ["node2"]
    h = hist(fleet, "--keyword", "ecc")  # case-insensitive; an old-grammar reason is still matched
    assert [d["node"] for d in h["drains"]] == ["node10"] and [f["check_id"] for f in h["findings"]] == ["gpu.ecc"]
    h = hist(fleet, "--keyword", "XID", "--since", "7d")  # XID = any Xid code
    assert [d["node"] for d in h["drains"]] == ["node2", "node2"] and {f["gpu"] for f in h["findings"]} == {3, 6}
    h = hist(fleet, "--verdict", "warn")
    assert [r["node"] for r in h["runs"]] == ["node1"] and [f["keyword"] for f in h["findings"]] == ["THERMAL"]
    assert h["drains"] and h["requeues"] == []  # drains are not filtered by verdict
    h = hist(fleet, "--gpu", "5")
    assert [f["node"] for f in h["findings"]] == ["node10"] and [d["node"] for d in h["drains"]] == ["node10"]
    h = hist(fleet, "--check", "gpu.xid", "--gpu", "5")
    assert h["findings"] == [] and h["drains"] == [] and h["runs"] == []


def test_since_and_until(fleet):
    h = hist(fleet, "--since", "7d", "--until", "2d")
    assert [d["node"] for d in h["drains"]] == ["node2"] and len(h["runs"]) == 1
    assert h["filters"]["until"].endswith("Z")
    until = h["until"]
    h = hist(fleet, "--since", "7d", "--until", until)  # an ISO time as printed is accepted back
    assert len(h["drains"]) == 1


@pytest.mark.parametrize("args, message", [
    (("--node", "node[1-"), "--node: not a Slurm hostlist"),
    (("--verdict", "broken"), "--verdict: expected one of pass, warn, drain, error"),
    (("--keyword", "XID 79"), "--keyword"),
    (("--gpu", "three"), "--gpu"),
    (("--check", "GPU.XID;drop"), "--check"),
    (("--since", "1d", "--until", "2d"), "is not after --since"),
    (("--until", "tomorrow"), "--until"),
    (("--limit", "-1"), "--limit"),
])
def test_bad_filters_are_one_line_errors(fleet, args, message):
    p = gg(fleet, "history", *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_text_output_escapes_control_characters(tmp_path):
    path = str(tmp_path / "n.db")
    with Store(path) as st:
        st.record_run(started=time.time() - 60, duration_ms=1.0, node="n1", kind="prolog", job_id="7", profile="p5",
                      verdict="warn", action="none", reason=None, exit_code=0, error=None, boot_id="b",
                      findings=[Finding("gpu.processes", Severity.WARN, "process \x1b]0;pwned\x07\x1b[2J on GPU 0",
                                        "GPUPROC", gpu=0)])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"path": path}}))
    p = gg(cfg, "history")
    assert p.returncode == 0 and "process ?]0;pwned??[2J on GPU 0" in p.stdout and "\x1b" not in p.stdout
    assert "\x1b" in json.loads(gg(cfg, "history", "--json").stdout)["findings"][0]["message"]  # JSON keeps the data


def test_attempt_stores_expand_user_and_node(tmp_path):
    """templates.store_path may name a store per user and batch host (the job side writes it as the user)."""
    from gpuguard.cli.history import attempt_store_paths

    for user, node in (("alice", "node1"), ("bob", "node2")):
        d = tmp_path / user
        d.mkdir(exist_ok=True)
        (d / f"{node}.db").write_bytes(b"")
    found = attempt_store_paths(str(tmp_path / "{user}" / "{node}.db"))
    assert [p.split("/")[-2:] for p in found] == [["alice", "node1.db"], ["bob", "node2.db"]]
    assert attempt_store_paths(str(tmp_path / "none" / "{user}.db")) == []
