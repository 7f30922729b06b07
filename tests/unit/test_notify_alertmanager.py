"""gpuguard's alerts in a REAL Alertmanager (Debian's prometheus-alertmanager, started in a temp dir on a free port
with observability/alertmanager.yml's grouping, inhibition and routes), whose receivers post to a real local
webhook server: 40 nodes draining for the same check are one notification and their undrains resolve it; a node
silenced with `amtool` stays quiet; an Alertmanager that is down or hangs delays no hook and loses no alert; an
HA pair gets every alert. The exact payload (labels, annotations, startsAt/endsAt, keep-alive) is checked on a
plain HTTP server standing in for the API. Time is passed explicitly wherever gpuguard's clock matters."""

from __future__ import annotations

import threading
from dataclasses import replace
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
import yaml

from alertmanager_server import AMTOOL, BINARY, EXAMPLE, Alertmanager, HungServer, free_port, routed_config
from notify_servers import WebhookServer

from gpuguard.siteconfig import parse_config
from gpuguard.model import Handoff
from gpuguard.notify import Event, emit, flush

needs_am = pytest.mark.skipif(not BINARY or not AMTOOL, reason="prometheus-alertmanager / amtool missing: make deps")
XID79 = "gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [prolog reboot]"


@pytest.fixture
def am(tmp_path, hook):
    # group_wait 5 s: the whole burst of a test arrives before the first notification, even on a loaded machine
    a = Alertmanager(tmp_path / "am", routed_config(f"http://127.0.0.1:{hook.port}", group_wait="5s"))
    yield a
    a.stop()


@pytest.fixture
def am_wide(tmp_path, hook):
    """group_interval 3 s instead of 1: a burst of 40 undrains reaches it within one interval on a loaded machine."""
    a = Alertmanager(tmp_path / "am", routed_config(f"http://127.0.0.1:{hook.port}", group_wait="5s",
                                                    group_interval="3s"))
    yield a
    a.stop()


def make_cfg(tmp_path, ams, **notify):
    data = {"store": {"path": str(tmp_path / "state" / "{node}.db")}, "logging": {"syslog": False},
            "notify": {"alertmanager_urls": list(ams), "cluster": "c1", "timeout_s": 2,
                       "runbook_url": "https://docs.example/runbooks.md", **notify}}
    return parse_config(yaml.safe_dump(data), source="test")


def drain(node, **kw):
    base = dict(kind="drain", node=node, severity="critical", check_id="gpu.xid", reason=XID79,
                message="GPU has fallen off the bus on 0000:86:00", action="reboot", partition="gpu")
    return Event(**{**base, **kw})


def undrain(node):
    return Event(kind="undrain", node=node, severity="info", message="undrained: gpu.xid passes again")


def notifications(hook, path, pred=lambda b: True, n=1, timeout=20.0):
    end = time.monotonic() + timeout
    while True:
        got = [r["body"] for r in hook.requests if r["path"] == path and pred(r["body"])]
        if len(got) >= n or time.monotonic() > end:
            return got
        time.sleep(0.05)


def resolved_nodes(hook, path):
    """The nodes whose alert some notification on `path` reported resolved."""
    return {a["labels"]["node"] for r in hook.requests if r["path"] == path for a in r["body"]["alerts"]
            if a["status"] == "resolved"}


def ts(text):
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# --------------------------------------------------------------------------- the example configuration


@needs_am
def test_the_example_configuration_passes_amtool_check_config():
    import subprocess

    p = subprocess.run([AMTOOL, "check-config", str(EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout and "3 inhibit rules" in p.stdout


# --------------------------------------------------------------------------- grouping across the fleet


@needs_am
def test_forty_nodes_drained_for_the_same_check_are_one_notification_and_their_undrains_resolve_it(
        tmp_path, hook, am_wide):
    from gpuguard.store.sqlite import Store

    am = am_wide
    cfg = make_cfg(tmp_path, [am.url])
    nodes = [f"gpu-r12-{i:03d}" for i in range(1, 41)]
    for n in nodes:  # every node has its history store already
        Store(str(tmp_path / "state" / f"{n}.db")).close()
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:  # 40 nodes' prologs, each with its own state, at about the same time
        results = list(pool.map(lambda n: emit(cfg, drain(n), budget_s=5), nodes))
    burst = time.monotonic() - start
    assert results == ["sent"] * 40
    page = notifications(hook, "/page", lambda b: b["status"] == "firing")
    assert len(page) == 1, (burst, [len(p["alerts"]) for p in page])
    assert page[0]["groupLabels"] == {"alertname": "GpuguardDrain", "cluster": "c1", "check": "gpu.xid",
                                      "keyword": "XID79"}
    assert sorted(a["labels"]["node"] for a in page[0]["alerts"]) == nodes
    one = page[0]["alerts"][0]
    assert one["labels"]["severity"] == "critical" and one["labels"]["partition"] == "gpu"
    assert one["annotations"]["reason"] == XID79
    assert one["annotations"]["runbook_url"] == "https://docs.example/runbooks.md#gpu.xid"
    # the health checks undrain them (an undrain names no check: the alert's own labels are used)
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda n: emit(cfg, undrain(n), budget_s=5), nodes)) == ["sent"] * 40
    # every node's alert is resolved: in one notification when the 40 undrains reach Alertmanager within its
    # group_interval, in two when a loaded machine spreads them wider (seen with 1 s); never one per node
    end = time.monotonic() + 20
    while resolved_nodes(hook, "/page") != set(nodes) and time.monotonic() < end:
        time.sleep(0.05)
    assert resolved_nodes(hook, "/page") == set(nodes)
    resolved = [b for b in notifications(hook, "/page", timeout=0) if b["status"] == "resolved"]
    assert resolved and {a["status"] for a in resolved[-1]["alerts"]} == {"resolved"}
    assert am.alerts(active="true") == []
    assert len(notifications(hook, "/page", timeout=0)) <= 3  # no page per node


@needs_am
def test_a_drained_node_silences_its_own_lower_alerts(tmp_path, hook, am):
    cfg = make_cfg(tmp_path, [am.url])
    slow = dict(kind="straggler", severity="warning", check_id="monitor.gpu_clock", job_id="77", gpu=3,
                message="GPU 3 SM clock 1200 MHz is 61% of the job's median")
    assert emit(cfg, drain("node7")) == "sent"
    assert emit(cfg, Event(node="node7", **slow)) == "sent"
    assert emit(cfg, Event(node="node8", **slow)) == "sent"
    alerts = {(a["labels"]["alertname"], a["labels"]["node"]): a for a in am.wait_alerts(3)}
    assert alerts[("GpuguardStragglerDetected", "node7")]["status"]["inhibitedBy"]
    assert not alerts[("GpuguardStragglerDetected", "node8")]["status"]["inhibitedBy"]
    ticket = notifications(hook, "/ticket")
    assert [a["labels"]["node"] for t in ticket for a in t["alerts"]] == ["node8"]


@needs_am
def test_a_node_silenced_with_amtool_stays_quiet(tmp_path, hook, am):
    """What an admin does before maintenance: `amtool silence add node=node7 ...`."""
    silence = am.amtool("silence", "add", "node=node7", "--duration=2h", "--comment=maintenance: GPU swap",
                        "--author=admin").strip()
    assert silence
    cfg = make_cfg(tmp_path, [am.url])
    assert emit(cfg, drain("node7")) == "sent" and emit(cfg, drain("node8")) == "sent"
    page = notifications(hook, "/page")
    time.sleep(1.5)  # group_interval (1 s) passes again: anything else due would have come by now
    got = [a["labels"]["node"] for p in notifications(hook, "/page", timeout=0) for a in p["alerts"]]
    assert page and got == ["node8"]
    node7 = am.alerts(filter='node="node7"')
    assert node7 and node7[0]["status"]["state"] == "suppressed" and node7[0]["status"]["silencedBy"] == [silence]


# --------------------------------------------------------------------------- an Alertmanager in trouble


@needs_am
def test_an_alertmanager_down_delays_no_hook_and_gets_the_alert_when_it_is_back(tmp_path, hook):
    """An HA pair: one is down when the drain happens. The other has the alert at once; the hook is not held
    up; the spool delivers to the first once it is back (the next flush, e.g. the next health check)."""
    port = free_port()
    up = Alertmanager(tmp_path / "am-up", routed_config(f"http://127.0.0.1:{hook.port}"))
    back = None
    try:
        cfg = make_cfg(tmp_path, [f"http://127.0.0.1:{port}", up.url])
        t0 = time.time()
        start = time.monotonic()
        assert emit(cfg, drain("node7"), budget_s=2, now=t0) == "spooled"  # one target still owes it
        assert time.monotonic() - start < 1.5
        assert [a["labels"]["node"] for a in up.alerts()] == ["node7"]
        back = Alertmanager(tmp_path / "am-back", routed_config(f"http://127.0.0.1:{hook.port}"), port=port)
        assert back.alerts() == []
        cfg.node = replace(cfg.node, name="node7")  # the node whose state holds the spool flushes it
        assert flush(cfg, now=t0 + 60) == 1  # after the 30 s back-off
        got = back.alerts()
        assert [a["labels"]["node"] for a in got] == ["node7"] and got[0]["labels"]["keyword"] == "XID79"
        assert flush(cfg, now=t0 + 120) == 0  # delivered once
    finally:
        up.stop()
        if back:
            back.stop()


@needs_am
def test_a_hung_alertmanager_delays_no_hook_and_loses_no_alert(tmp_path, hook):
    """An Alertmanager that accepts connections and never answers: a whole simulated prolog (drain, notify) ends
    within its notification budget, the drain is applied, and the alert arrives once a working Alertmanager is
    at that address."""
    from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg as sim_cfg

    from simnode import run_sim

    def prolog(cfg, node):
        slurm = MemorySlurm()
        start = time.monotonic()
        result = run_sim(ctx("prolog", node), cfg, simulate=str(SCENARIOS / "ecc-dbe.yaml"), slurm_client=slurm)
        assert result.drain and result.drain["outcome"] == "done" and slurm.reason.startswith("gpuguard: ")
        return time.monotonic() - start

    baseline = prolog(sim_cfg(tmp_path / "base"), "n2")  # the same drain, nothing to notify
    hung = HungServer()
    cfg = sim_cfg(tmp_path, notify={"alertmanager_urls": [f"http://127.0.0.1:{hung.port}"], "timeout_s": 30})
    took = prolog(cfg, "n1")
    assert took < baseline + 2.0 + 1.0, (took, baseline)  # at most the run's notification budget (2 s), not 30 s
    hung.close()
    am = Alertmanager(tmp_path / "am", routed_config(f"http://127.0.0.1:{hook.port}"), port=hung.port)
    try:
        cfg.node = replace(cfg.node, name="n1")
        assert flush(cfg, budget_s=10, now=time.time() + 3600) == 1
        alert = am.alerts()[0]
        assert alert["labels"]["alertname"] == "GpuguardDrain" and alert["labels"]["node"] == "n1"
        assert alert["labels"]["gpu_uuid"].startswith("GPU-") and alert["labels"]["gpu_serial"]
        page = notifications(hook, "/page")
        assert page and page[0]["alerts"][0]["labels"]["node"] == "n1"
    finally:
        am.stop()


# --------------------------------------------------------------------------- keep-alive against a real one


@needs_am
def test_a_firing_alert_lives_while_gpuguard_reposts_it_and_ends_when_it_stops(tmp_path, hook, am):
    """Alertmanager resolves an alert whose endsAt has passed. Posted as if the last post were two TTLs ago, the
    alert is already over in Alertmanager; the next flush re-posts it and it fires again, with its start kept."""
    cfg = make_cfg(tmp_path, [am.url], alertmanager_ttl_s=600)
    cfg.node = replace(cfg.node, name="node7")
    now = time.time()
    assert emit(cfg, drain("node7", ts=now - 1200), now=now - 1200) == "sent"
    assert am.alerts(active="true") == []  # its endsAt (now - 600) has passed: resolved
    assert flush(cfg, now=now) == 0  # no spooled message, but the keep-alive post
    alive = am.wait_alerts(1, active="true")
    assert [a["labels"]["node"] for a in alive] == ["node7"]
    assert abs(ts(alive[0]["startsAt"]) - (now - 1200)) < 1 and abs(ts(alive[0]["endsAt"]) - (now + 600)) < 1


# --------------------------------------------------------------------------- the payload, exactly


def posts(api):
    return [r["body"] for r in api.requests if r["path"] == "/api/v2/alerts"]


def test_the_payload_labels_annotations_and_times(tmp_path):
    """A plain HTTP server stands in for the API: what each post carries."""
    api = WebhookServer()
    try:
        cfg = make_cfg(tmp_path, [f"http://127.0.0.1:{api.port}"], alertmanager_resend_s=60, alertmanager_ttl_s=900)
        cfg.node = replace(cfg.node, name="node7")
        t0 = 1_800_000_000.0
        gpus = [{"index": 5, "uuid": "GPU-5ca1ab1e", "serial": "1652000000005", "pci_bus_id": "0000:a8:00.0"}]
        assert emit(cfg, drain("node7", gpus=gpus, ts=t0, evidence={"xid": 79})) == "sent"
        [fired] = posts(api)[0]
        assert fired["labels"] == {"alertname": "GpuguardDrain", "node": "node7", "cluster": "c1", "partition": "gpu",
                                   "severity": "critical", "check": "gpu.xid", "keyword": "XID79", "gpu": "5",
                                   "gpu_uuid": "GPU-5ca1ab1e", "gpu_serial": "1652000000005",
                                   "gpu_pci": "0000:a8:00.0"}
        assert fired["annotations"]["summary"] == "gpuguard: DRAINED node7 gpu.xid"
        assert fired["annotations"]["dedup_key"] == "gpuguard/node7/drain"
        assert fired["annotations"]["evidence"] == "xid=79" and "uuid=GPU-5ca1ab1e" in fired["annotations"]["gpus"]
        assert (fired["startsAt"], fired["endsAt"]) == ("2027-01-15T08:00:00.000Z", "2027-01-15T08:15:00.000Z")
        # a flush before resend_s posts nothing; after it, the same alert with a later end
        assert flush(cfg, now=t0 + 30) == 0 and len(posts(api)) == 1
        flush(cfg, now=t0 + 90)
        [kept] = posts(api)[1]
        assert kept["labels"] == fired["labels"] and kept["startsAt"] == fired["startsAt"]
        assert kept["endsAt"] == "2027-01-15T08:16:30.000Z"
        # FLAPPING: the same alert (labels), saying more
        assert emit(cfg, Event(kind="flapping", node="node7", severity="critical", message="pinned", ts=t0 + 100)) \
            == "sent"
        [flap] = posts(api)[2]
        assert flap["labels"] == fired["labels"] and "FLAPPING" in flap["annotations"]["summary"]
        # the undrain knows no check or keyword: the alert's own labels end it, at the time it happened
        assert emit(cfg, undrain("node7"), now=t0 + 3600) == "sent"
        [ended] = posts(api)[3]
        assert ended["labels"] == fired["labels"] and ended["startsAt"] == fired["startsAt"]
        assert ended["endsAt"] == "2027-01-15T09:00:00.000Z"
        assert "passes again" in ended["annotations"]["resolution"]
        flush(cfg, now=t0 + 7200)
        assert len(posts(api)) == 4  # nothing firing: nothing to keep alive
    finally:
        api.close()


def test_a_job_hang_is_one_alert_whichever_node_reports_or_resolves_it(tmp_path):
    api = WebhookServer()
    try:
        cfg = make_cfg(tmp_path, [f"http://127.0.0.1:{api.port}"])
        hang = dict(kind="hang", severity="critical", check_id="monitor.progress", job_id="5150", scope="job",
                    message="no progress for 15 min")
        assert emit(cfg, Event(node="node1", **hang), state_path=str(tmp_path / "n1.db")) == "sent"
        # node1's monitor died; node2 adopted the episode and resolves it from its own state
        assert emit(cfg, Event(node="node2", state="resolved", **hang), state_path=str(tmp_path / "n2.db")) == "sent"
        (fired,), (ended,) = posts(api)
        assert fired["labels"] == ended["labels"] == {"alertname": "GpuguardHangDetected", "cluster": "c1",
                                                      "severity": "critical", "check": "monitor.progress",
                                                      "job_id": "5150"}
        assert ts(ended["endsAt"]) <= time.time() + 1
    finally:
        api.close()


def test_a_new_drain_for_another_check_ends_the_old_alert(tmp_path):
    """An admin resumed the node by hand without gpuguard noticing; it drains again, for ECC this time."""
    api = WebhookServer()
    try:
        cfg = make_cfg(tmp_path, [f"http://127.0.0.1:{api.port}"])
        t0 = 1_800_000_000.0
        emit(cfg, drain("node7", ts=t0))
        ecc = "gpuguard: ECC gpu.ecc: 3 uncorrectable ECC errors on GPU 2 [healthcheck]"
        emit(cfg, drain("node7", ts=t0 + 600, check_id="gpu.ecc", reason=ecc))
        new, old = posts(api)[1]
        assert (new["labels"]["keyword"], old["labels"]["keyword"]) == ("ECC", "XID79")
        assert old["endsAt"] == "2027-01-15T08:10:00.000Z" and new["startsAt"] == "2027-01-15T08:10:00.000Z"
    finally:
        api.close()


def test_basic_auth_from_the_url_and_no_password_in_errors(tmp_path):
    import http.server

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://gpuguard:pa%2Fss@127.0.0.1:{httpd.server_address[1]}/am/"
        cfg = make_cfg(tmp_path, [url])
        cfg.node = replace(cfg.node, name="node7")
        assert emit(cfg, drain("node7")) == "sent"  # a 401 is permanent: reported, not retried forever
        assert seen == ["Basic Z3B1Z3VhcmQ6cGEvc3M="]  # gpuguard:pa/ss
        import sqlite3

        error = sqlite3.connect(tmp_path / "state" / "node7.db").execute(
            "SELECT last_error FROM notify_spool").fetchone()[0]
        assert "HTTP 401" in error and "pa/ss" not in error and "pa%2Fss" not in error
    finally:
        httpd.shutdown()


@needs_am
def test_the_watch_daemons_drain_reaches_alertmanager_in_seconds(tmp_path, hook, am):
    """`gpuguard watch` sees Xid 79 in the kernel log, drains through (a stand-in) scontrol and posts the alert:
    no scrape, no rule evaluation in between. (The watch daemon notifies when `notify.urls` is set too.)"""
    from test_watch import FakeSlurm, Running, append, xid_line

    slurm = FakeSlurm(tmp_path)
    log = tmp_path / "kern.log"
    log.write_text("")
    extra = yaml.safe_dump({"notify": {"urls": [hook.url("/apprise")], "alertmanager_urls": [am.url],
                                       "cluster": "c1"}})
    start = time.monotonic()
    with Running(tmp_path, slurm, f"file:{log}", extra=extra):
        append(log, xid_line(79, "86"))
        alerts = am.wait_alerts(1)
    assert time.monotonic() - start < 10
    assert slurm.reason() and "XID79" in slurm.reason()
    labels = alerts[0]["labels"]
    assert (labels["alertname"], labels["node"], labels["keyword"], labels["cluster"]) == \
        ("GpuguardDrain", "n1", "XID79", "c1")
    assert "[watch reboot]" in alerts[0]["annotations"]["reason"]


def test_an_alert_nothing_resolves_ends_by_itself_after_the_episode_window(tmp_path):
    """A failed prolog, a crash, a requeue: no event ever says they are over. Their alert ends dedup_window_s
    after the last time it happened (as their episode does) and is not kept alive."""
    api = WebhookServer()
    try:
        cfg = make_cfg(tmp_path, [f"http://127.0.0.1:{api.port}"], dedup_window_s=3600)
        cfg.node = replace(cfg.node, name="node7")
        t0 = 1_800_000_000.0
        crash = dict(kind="internal_error", node="node7", severity="critical", message="gpuguard prolog crashed")
        assert emit(cfg, Event(**crash), now=t0) == "sent"
        [first] = posts(api)[0]
        assert first["labels"]["alertname"] == "GpuguardInternalError"
        assert (first["startsAt"], first["endsAt"]) == ("2027-01-15T08:00:00.000Z", "2027-01-15T09:00:00.000Z")
        flush(cfg, now=t0 + 600)
        assert len(posts(api)) == 1  # not kept alive
        assert emit(cfg, Event(**crash), now=t0 + 1200) == "sent"  # again, later: the same alert lasts longer
        [again] = posts(api)[1]
        assert (again["startsAt"], again["endsAt"]) == ("2027-01-15T08:00:00.000Z", "2027-01-15T09:20:00.000Z")
    finally:
        api.close()


def test_alertmanager_gets_every_alert_while_the_apprise_rate_limit_holds_messages_back(tmp_path):
    api, hook = WebhookServer(), WebhookServer()
    try:
        cfg = make_cfg(tmp_path, [f"http://127.0.0.1:{api.port}"], urls=[hook.url("/chat")], rate_limit=2,
                       state_path=str(tmp_path / "one.db"))
        t0 = 1_800_000_000.0
        assert [emit(cfg, drain(f"node{i}"), now=t0 + i) for i in range(1, 6)] == ["sent"] * 5
        assert sorted(p[0]["labels"]["node"] for p in posts(api)) == [f"node{i}" for i in range(1, 6)]
        assert len(hook.wait_for(2)) == 2  # two chat messages, the other three held for one digest
        assert flush(cfg, now=t0 + 700) == 1
        assert "3 events on 3 node(s): node[3-5]" in hook.wait_for(3)[2]["body"]["title"]
    finally:
        api.close()
        hook.close()


def test_a_spooled_alert_is_posted_once_not_again_as_its_own_keep_alive(tmp_path):
    """A hook spools its drain's alert; the hand-off's flush posts it with the message, and does not post it a
    second time as a keep-alive of an alert that was never posted (issue 27: the alert arrived 2-4 times)."""
    api = WebhookServer()
    try:
        cfg = make_cfg(tmp_path, [f"http://127.0.0.1:{api.port}"])
        cfg.node = replace(cfg.node, name="node7")
        now = time.time()
        assert emit(cfg, drain("node7"), now=now, defer=Handoff()) == "spooled"
        assert posts(api) == []
        with ThreadPoolExecutor(3) as pool:  # the hand-offs of two hooks and the health check's, side by side
            assert sorted(pool.map(lambda _: flush(cfg, now=now + 1), range(3))) == [0, 0, 1]
        time.sleep(0.5)
        assert len(posts(api)) == 1 and [a["labels"]["node"] for a in posts(api)[0]] == ["node7"]
        assert flush(cfg, now=now + 2) == 0 and len(posts(api)) == 1  # posted: not due for a keep-alive yet
    finally:
        api.close()


@needs_am
def test_a_health_check_drain_for_an_xid_carries_the_gpu_the_kernel_line_names(tmp_path, hook, am):
    """Issue 29 item 4: the Xid line names PCI 0000:86:00 (GPU 3, still seen by NVML); the drain event itself
    carries GPU 3 (it was gpu=None: only its `gpus` list named it), in the spooled record and in Alertmanager's
    labels; the drain stays one incident per node, so the undrain (no GPU) still resolves it."""
    import json
    import sqlite3

    from simnode import MemorySlurm, ctx, make_cfg as sim_cfg, run_sim

    scenario = tmp_path / "xid48.yaml"
    scenario.write_text(yaml.safe_dump({"instance_type": "p5.48xlarge", "kernel_log": [
        "NVRM: Xid (PCI:0000:86:00): 48, pid=1234, name=python, An uncorrectable double bit error"]}))
    cfg = sim_cfg(tmp_path, notify={"alertmanager_urls": [am.url], "urls": [hook.url("/page")], "timeout_s": 5})
    result = run_sim(ctx("healthcheck", "n1"), cfg, simulate=str(scenario), slurm_client=MemorySlurm())
    assert result.drain and result.drain["outcome"] == "done" and "XID48" in result.drain["reason"]
    alert = am.wait_alerts(1, active="true")[0]
    assert alert["labels"]["gpu"] == "3" and alert["labels"]["gpu_pci"] == "0000:86:00.0", alert["labels"]
    assert alert["annotations"]["dedup_key"] == "gpuguard/n1/drain"
    with sqlite3.connect(str(tmp_path / "state" / "n1.db")) as db:
        spooled = [json.loads(e) for (e,) in db.execute("SELECT event FROM notify_spool WHERE kind='drain'")]
    assert spooled and all(e["gpu"] == 3 for e in spooled), spooled
    assert spooled[0]["gpus"][0]["pci_bus_id"] == "0000:86:00.0"
    page = [b for b in notifications(hook, "/page", lambda b: "DRAINED n1" in b.get("title", ""))]
    assert page and "GPU 3 uuid=GPU-" in page[0]["message"]
    cfg.node = replace(cfg.node, name="n1")
    assert emit(cfg, undrain("n1")) == "sent"
    end = time.monotonic() + 20
    while am.alerts(active="true") and time.monotonic() < end:
        time.sleep(0.2)
    assert am.alerts(active="true") == []  # the same incident: resolved by the node's undrain
