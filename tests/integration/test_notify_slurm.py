"""Alerts on a real local Slurm cluster (issue 11), delivered to a real local webhook server:

- a hung 3-node job (`gpuguard monitor` on every node, as the torchrun template starts it) pages once, and is
  resolved once, with the same dedupe key, when the job ends (slurmd's SIGTERM to the monitors);
- a prolog drain names the faulty GPU by UUID and serial; when an admin resumes the node by hand, the health
  check resolves the drain's alert;
- the same through a real Alertmanager (Debian's prometheus-alertmanager, observability/alertmanager.yml): the
  installed prolog's drain is an alert with the node, check, keyword and GPU labels within seconds, and pages
  through Alertmanager's receiver; the health check after the admin's resume ends it."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from alertmanager_server import BINARY, Alertmanager, routed_config
from notify_servers import WebhookServer

from devtools.devcluster import missing_requirements
from devtools.devsite import DevSite

pytest.importorskip("apprise", reason="apprise not installed (pip install apprise)")


@pytest.fixture(scope="module")
def hook():
    """One webhook server for the module's one cluster (the conftest's is per test)."""
    s = WebhookServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory, hook):
    if missing_requirements():
        pytest.skip("cannot boot a local Slurm cluster")
    s = DevSite(workdir=tmp_path_factory.mktemp("notify-site"), nodes=3)
    s.start()
    yield s
    s.cluster.stop()


def pages(hook, what: str, n: int, timeout: float = 20.0) -> list[dict]:
    """The apprise pages whose title holds `what` (Alertmanager's notifications to the same server have none)."""
    def got() -> list[dict]:
        return [r["body"] for r in hook.requests if what in str(r["body"].get("title", ""))]

    end = time.monotonic() + timeout
    while time.monotonic() < end and len(got()) < n:
        time.sleep(0.1)
    return got()


def test_a_hung_three_node_job_pages_once_and_resolves_once(site, hook, tmp_path):
    site.write_config({"notify": {"urls": [hook.url("/pages")]},
                       "monitor": {"startup_minutes": 0.03, "py_spy": None, "train_log": "auto",
                                   "cpu_percent_max": None, "memory_percent_max": None, "disk_percent_max": None}})
    job_dir = tmp_path / "jobdir"
    job_dir.mkdir()
    (job_dir / "train.log").write_text("loading the dataset\n")  # no iteration ever: the job is stuck
    # The job ends with the sidecar still running: slurmd sends its tasks SIGTERM (then SIGKILL after KillWait).
    # (`kill $!` on the background srun would not do: srun answers SIGTERM by killing the step with SIGKILL.)
    script = (f"#!/bin/sh\nexport GPUGUARD_CONFIG={site.config_path}\n"
              f"srun --overlap --ntasks-per-node=1 {site.python} -m gpuguard monitor --job-dir {job_dir} "
              f"--interval 0.3 &\nsleep 6\nexit 0\n")
    job = site.cluster.sbatch(script, "-N3")
    info = site.cluster.wait_job(job, timeout=90)
    assert info["JobState"] == "COMPLETED", site.cluster.job_output(job)
    got = pages(hook, "job hang", 2)
    assert [b["status"] for b in got] == ["firing", "resolved"], site.cluster.job_output(job)
    assert {b["dedup_key"] for b in got} == {f"gpuguard/job{job}/hang"}
    assert "no longer monitored: the job ended" in got[1]["message"]
    events = [json.loads(line) for line in (job_dir / "gpuguard" / "events.jsonl").read_text().splitlines()]
    seen = [e for e in events if e["kind"] == "hang" and e.get("state") != "resolved"]
    assert sorted(e["node"] for e in seen) == ["node1", "node2", "node3"]  # every node saw it...
    assert sum(e["reported"] for e in seen) == 1  # ...one paged
    time.sleep(1.0)
    assert len(pages(hook, "job hang", 3, timeout=0.5)) == 2  # and nothing more came


def test_a_prolog_drain_names_the_gpu_and_an_admin_resume_resolves_it(site, hook):
    site.write_config({"notify": {"urls": [hook.url("/pages")]}})
    site.set_scenario("node2", "ecc-dbe")
    job = site.cluster.sbatch("#!/bin/sh\ntrue\n", "-N1", "-w", "node2", "--gres=gpu:8")
    try:
        drained = pages(hook, "DRAINED node2", 1, timeout=60)
    finally:
        site.cluster.run(["scancel", job])
    assert drained, site.log_lines()
    page = drained[0]
    assert page["dedup_key"] == "gpuguard/node2/drain" and page["status"] == "firing"
    assert "gpu:      GPU 5 uuid=GPU-" in page["message"] and " serial=" in page["message"]
    # the admin reset the GPU (its volatile ECC counters read 0 again: reset evidence, the conditions clear) and
    # resumed the node by hand (no need to wait until it is schedulable)
    site.set_scenario("node2", "healthy-p5")
    site.cluster.resume("node2", wait=False)
    hc = site.run_hook("healthcheck", "node2")
    assert hc.returncode == 0, hc.stderr
    resolved = pages(hook, "RESOLVED undrained node2", 1)
    assert resolved and resolved[0]["dedup_key"] == "gpuguard/node2/drain" and resolved[0]["type"] == "success"


@pytest.mark.skipif(not BINARY, reason="prometheus-alertmanager missing: make deps")
def test_a_prolog_drain_reaches_alertmanager_and_the_health_check_ends_it(site, hook, tmp_path):
    am = Alertmanager(tmp_path / "am", routed_config(f"http://127.0.0.1:{hook.port}/am"))
    try:
        site.write_config({"notify": {"alertmanager_urls": [am.url], "cluster": "dev"}})
        site.set_scenario("node3", "ecc-dbe")
        job = site.cluster.sbatch("#!/bin/sh\ntrue\n", "-N1", "-w", "node3", "--gres=gpu:8")
        try:
            alerts = am.wait_alerts(1, timeout=60, filter='node="node3"')
        finally:
            site.cluster.run(["scancel", job])
        assert alerts, site.log_lines()
        labels = alerts[0]["labels"]
        assert (labels["alertname"], labels["cluster"], labels["severity"]) == ("GpuguardDrain", "dev", "critical")
        assert labels["check"] == "gpu.xid" and labels["keyword"].startswith("XID")
        assert labels["gpu_uuid"].startswith("GPU-") and labels["gpu_serial"]
        reason = site.cluster.run(["scontrol", "show", "node", "node3"]).stdout
        assert alerts[0]["annotations"]["reason"] in reason  # the drain reason, as Slurm shows it
        page = pages_at(hook, "/am/page", lambda b: b["status"] == "firing")
        assert page and page[0]["alerts"][0]["labels"]["node"] == "node3"
        site.set_scenario("node3", "healthy-p5")  # the GPU reset: its ECC counters read 0 again (reset evidence)
        site.cluster.resume("node3", wait=False)  # the admin, by hand
        hc = site.run_hook("healthcheck", "node3")
        assert hc.returncode == 0, hc.stderr
        end = time.monotonic() + 15
        while am.alerts(active="true", filter='node="node3"') and time.monotonic() < end:
            time.sleep(0.1)
        assert am.alerts(active="true", filter='node="node3"') == []
        assert pages_at(hook, "/am/page", lambda b: b["status"] == "resolved")
    finally:
        am.stop()


def test_a_drain_page_the_prolog_could_not_finish_is_delivered_after_it_exits_exactly_once(site):
    """A receiver slower than the hook's 2 s notification budget (or a node too busy to import apprise in that
    time): the prolog exits on time, and its page leaves from a process of its own within seconds, instead of
    waiting in the spool for the next health check (none runs here). Exactly once, to the webhook and to
    Alertmanager's API (issue 27: the page arrived twice, the alert two to four times: the hand-off re-sent what
    the hook's thread had sent)."""
    slow = WebhookServer()
    slow.delay_s = 4.0  # every answer: longer than the hook's whole notification budget
    slow.hold()  # and none at all while the prolog runs, however long a loaded machine takes to run it
    try:
        site.write_config({"notify": {"urls": [slow.url("/slow")],
                                      "alertmanager_urls": [f"http://127.0.0.1:{slow.port}/am"]}})
        site.set_scenario("node1", "ecc-dbe")
        p = site.run_hook("prolog", "node1", SLURM_JOB_ID="4711", SLURM_JOB_GPUS="0,1,2,3,4,5,6,7")
        assert p.returncode == 1 and "drain=done" in p.stderr, p.stderr
        assert slow.requests == []  # it exited with no answer from the receiver: it did not wait for one
        slow.release()
        end = time.monotonic() + 30
        while time.monotonic() < end and spool_of(site, "node1") != [("drain", "sent")]:
            time.sleep(0.2)
        time.sleep(slow.delay_s + 1.0)  # a second copy of anything would have arrived by now
        spool = spool_of(site, "node1")
        assert spool == [("drain", "sent")], (spool, site.log_lines("node1"))
        assert [r["body"]["title"] for r in slow.requests if r["path"] == "/slow"] == [
            "gpuguard: DRAINED node1 gpu.xid"], slow.requests
        alerts = [a for r in slow.requests if r["path"] == "/am/api/v2/alerts" for a in r["body"]]
        assert [(a["labels"]["alertname"], a["labels"]["node"]) for a in alerts] == [("GpuguardDrain", "node1")]
    finally:
        slow.close()
        site.set_scenario("node1", "healthy-p5")
        site.cluster.resume("node1", wait=False)


def test_a_drain_the_health_check_could_not_apply_pages_once_while_pending(site, hook):
    """slurmctld stopped: the health check's drain waits in the journal, and a human hears it now, once, however
    many health checks run while it is pending; when slurmctld is back the drain is applied and says so."""
    site.write_config({"notify": {"urls": [hook.url("/pending")]}, "deadlines": {"scontrol_s": 2.0}})
    site.set_scenario("node2", "healthy-p5")
    assert site.run_hook("healthcheck", "node2").returncode == 0
    before = len(hook.requests)
    site.set_scenario("node2", "xid79")
    site.cluster.stop_controller()
    try:
        for _ in range(2):
            assert site.run_hook("healthcheck", "node2").returncode == 0
        got = pages(hook, "DRAIN PENDING node2", 1)
        time.sleep(2.0)
        new = [r["body"].get("title") for r in hook.requests[before:] if r["path"] == "/pending"]
        assert new == ["gpuguard: DRAIN PENDING node2 gpu.xid"], (new, site.log_lines("node2"))
        assert "jobs are refused until it is applied" in got[0]["message"]
    finally:
        site.cluster.start_controller()
    assert site.run_hook("healthcheck", "node2").returncode == 0
    assert "DRAIN" in site.cluster.node_info("node2")["State"]
    assert pages(hook, "DRAINED node2", 1)
    site.set_scenario("node2", "healthy-p5")


def spool_of(site, node: str) -> list[tuple[str, str]]:
    with sqlite3.connect(site.workdir / "state" / f"{node}.db") as db:
        return db.execute("SELECT kind, status FROM notify_spool WHERE node=?", (node,)).fetchall()


def pages_at(hook, path: str, pred, timeout: float = 30.0) -> list[dict]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = [r["body"] for r in hook.requests if r["path"] == path and pred(r["body"])]
        if got:
            return got
        time.sleep(0.1)
    return []
