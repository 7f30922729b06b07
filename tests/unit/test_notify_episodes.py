"""Alerts as receivers need them (issue 11): a stable dedupe key per incident, one message per episode (repeats
counted, not re-sent), a "resolved" message with the same key when it clears, drains that no state can silence,
GPU UUID and serial in hardware alerts, UTC ISO 8601 times. Delivered to the real local webhook server; apprise
parses the PagerDuty/Opsgenie URLs for real."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import yaml

from gpuguard.siteconfig import parse_config
from gpuguard.notify import Event, dedupe_key, emit, flush, gpu_identities, render, target_url

apprise = pytest.importorskip("apprise", reason="apprise not installed (pip install apprise)")

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def make_cfg(tmp_path, **notify):
    data = {"store": {"path": str(tmp_path / "state" / "{node}.db")}, "notify": notify}
    return parse_config(yaml.safe_dump(data), source="test")


def straggler(state="firing", gpu=3, **kw):
    base = dict(kind="straggler", node="node7", severity="warning", check_id="monitor.gpu_clock", job_id="5150",
                message=f"GPU {gpu} SM clock 1200 MHz is 61% of the job's median", gpu=gpu, state=state)
    base.update(kw)
    return Event(**base)


def bodies(hook, n):
    return [r["body"] for r in hook.wait_for(n)]


# --------------------------------------------------------------------------- keys (pure)


def test_dedupe_keys_are_stable_per_incident():
    drain = Event(kind="drain", node="node7", message="x", check_id="gpu.xid")
    assert drain.key == "gpuguard/node7/drain"
    # the undrain (no check known) and a FLAPPING pin are the same incident as the drain: the node is drained
    assert Event(kind="undrain", node="node7", message="ok").key == drain.key
    assert Event(kind="flapping", node="node7", message="again", check_id="gpu.ecc").key == drain.key
    assert straggler().key == "gpuguard/node7/straggler/monitor.gpu_clock/gpu3/job5150"
    assert straggler(state="resolved").key == straggler().key
    assert straggler(gpu=4).key != straggler().key and straggler(job_id="5151").key != straggler().key
    # a job's hang is one incident whichever node reports it and whichever check saw it
    hang = dict(kind="hang", message="stalled", job_id="5150", scope="job")
    assert Event(node="node1", check_id="monitor.progress", **hang).key == \
        Event(node="node9", check_id="monitor.gpu_idle", **hang).key == "gpuguard/job5150/hang"
    assert dedupe_key(drain, "gpuguard-clusterB") == "gpuguard-clusterB/node7/drain"
    assert Event(kind="drain", node="n 1/../x", message="m").key == "gpuguard/n_1_.._x/drain"
    long = Event(kind="resource", node="n1", message="m", dedup_key="/".join(f"part{i}" for i in range(60)))
    assert len(long.key) == 255 and long.key == Event(kind="resource", node="n1", message="m",
                                                      dedup_key="/".join(f"part{i}" for i in range(60))).key


def test_target_url_gives_each_receiver_the_key_it_understands():
    key = "gpuguard/node7/drain"
    pd = apprise.Apprise.instantiate(target_url("pagerduty://ikey@apikey", key, "resolved", 3.0))
    assert (pd.dedup, pd.action, pd.socket_read_timeout, pd.socket_connect_timeout) == (key, "map", 3.0, 3.0)
    og = apprise.Apprise.instantiate(target_url("opsgenie://apikey/@user", key, "firing"))
    assert og.alias == key
    js = apprise.Apprise.instantiate(target_url("json://127.0.0.1:9/hook?+X-Token=abc", key, "resolved"))
    assert js.payload_extras == {"dedup_key": key, "status": "resolved"}
    assert js.headers == {"X-Token": "abc"}  # the admin's own parameters are kept
    # what the admin set wins
    fixed = apprise.Apprise.instantiate(target_url("pagerduty://ikey@apikey?dedup=mine&action=trigger", key, "firing"))
    assert (fixed.dedup, fixed.action) == ("mine", "trigger")
    assert target_url("slack://A/B/C/#gpu", key, "firing") == "slack://A/B/C/#gpu"


# --------------------------------------------------------------------------- episodes and resolved messages


def test_one_message_per_episode_then_resolved_with_the_same_key(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url("/alerts")], dedup_window_s=3600)
    t0 = 1_800_000_000.0
    assert emit(cfg, straggler(ts=t0)) == "sent"  # the event's own time is emit's clock unless now= says otherwise
    assert [emit(cfg, straggler(ts=t0 + 10 * i)) for i in range(1, 6)] == ["suppressed"] * 5  # counted
    assert emit(cfg, straggler(gpu=4, ts=t0 + 60)) == "sent"  # another GPU is another incident
    cleared = straggler(state="resolved", message="cleared: GPU 3 back at 1980 MHz", ts=t0 + 3625)
    assert emit(cfg, cleared) == "sent"
    firing, other, resolved = bodies(hook, 3)
    assert firing["status"] == "firing" and firing["type"] == "warning"
    assert resolved["status"] == "resolved" and resolved["type"] == "success"
    assert firing["dedup_key"] == resolved["dedup_key"] == "gpuguard/node7/straggler/monitor.gpu_clock/gpu3/job5150"
    assert other["dedup_key"].endswith("/gpu4/job5150")
    assert resolved["title"] == "gpuguard: RESOLVED straggler node7 monitor.gpu_clock"
    text = resolved["message"]
    assert "status:   resolved" in text and "dedup:    gpuguard/node7/straggler/monitor.gpu_clock/gpu3/job5150" in text
    assert "also happened 5 more time(s) since" in text  # the repeats of the episode it closes
    fired = re.search(r"fired:    (\S+) \(lasted (\S+)\)", text)
    assert fired and fired.group(1) == "2027-01-15T08:00:00Z" and fired.group(2) == "1h00m25s"
    assert "when:     2027-01-15T09:00:25Z" in text
    # after the resolution the same condition is a new episode: sent again
    assert emit(cfg, straggler(ts=t0 + 3630)) == "sent"
    assert len(hook.wait_for(4)) == 4


def test_a_drain_is_sent_even_when_the_state_thinks_its_episode_is_open(tmp_path, hook):
    """An admin's `gpuguard undrain` or `scontrol` leaves no resolution behind; the next drain of the node is a
    new transition Slurm confirmed and must page (no notify state may silence a drain)."""
    cfg = make_cfg(tmp_path, urls=[hook.url()], dedup_window_s=86400)
    drain = dict(kind="drain", node="node7", severity="critical", check_id="gpu.xid", message="Xid 79")
    assert [emit(cfg, Event(**drain)) for _ in range(3)] == ["sent"] * 3
    assert emit(cfg, Event(kind="flapping", node="node7", severity="critical", message="FLAPPING")) == "sent"
    assert emit(cfg, Event(kind="undrain", node="node7", severity="info", message="undrained")) == "sent"
    got = bodies(hook, 5)
    assert [b["status"] for b in got] == ["firing"] * 4 + ["resolved"]
    assert {b["dedup_key"] for b in got} == {"gpuguard/node7/drain"}


def test_window_is_the_fallback_for_alerts_that_never_resolve(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()], dedup_window_s=3600)
    failure = dict(kind="internal_error", node="n1", severity="critical", message="crash")
    t0 = 1_800_000_000.0
    assert emit(cfg, Event(**failure), now=t0) == "sent"
    for i in range(1, 4):  # each repeat keeps the episode alive, though together they span more than the window
        assert emit(cfg, Event(**failure), now=t0 + 3000 * i) == "suppressed"
    assert emit(cfg, Event(**failure), now=t0 + 9000 + 3600) == "sent"  # nothing for the window: that one is over
    assert "also happened 3 more time(s)" in bodies(hook, 2)[1]["message"]


def test_resolved_messages_obey_send_resolved_and_not_min_severity(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()], min_severity="warning")
    assert emit(cfg, straggler()) == "sent"
    assert emit(cfg, Event(kind="undrain", node="n1", severity="info", message="ok")) == "sent"
    assert emit(cfg, straggler(state="resolved", severity="info")) == "sent"
    off = make_cfg(tmp_path / "off", urls=[hook.url()], send_resolved=False)
    assert emit(off, straggler()) == "sent"
    assert emit(off, straggler(state="resolved")) == "disabled"
    assert [b["status"] for b in bodies(hook, 4)] == ["firing", "resolved", "resolved", "firing"]


def test_a_resolution_is_never_held_by_the_rate_limit_when_its_alert_went_out(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()], rate_limit=2, rate_window_s=60)
    assert emit(cfg, straggler(gpu=0)) == "sent"
    assert emit(cfg, straggler(gpu=1)) == "sent"
    assert emit(cfg, straggler(gpu=2)) == "suppressed"  # held for the digest
    assert emit(cfg, straggler(gpu=0, state="resolved")) == "sent"  # closes an incident a receiver has open
    assert emit(cfg, straggler(gpu=2, state="resolved")) == "suppressed"  # its alert is in the digest: so is it
    got = bodies(hook, 3)
    assert [(b["status"], b["dedup_key"][-12:]) for b in got] == [
        ("firing", "gpu0/job5150"), ("firing", "gpu1/job5150"), ("resolved", "gpu0/job5150")]


def test_state_from_before_episodes_is_migrated(tmp_path, hook):
    import sqlite3

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE notify_keys (key TEXT PRIMARY KEY, last_sent REAL, suppressed INTEGER NOT NULL DEFAULT 0,
            first_suppressed REAL);
        CREATE TABLE notify_sent (ts REAL NOT NULL);
        CREATE TABLE notify_spool (id INTEGER PRIMARY KEY, created REAL NOT NULL, kind TEXT, node TEXT,
            check_id TEXT, severity TEXT, title TEXT NOT NULL, body TEXT NOT NULL, targets TEXT NOT NULL,
            status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, next_try REAL NOT NULL DEFAULT 0,
            last_error TEXT, event TEXT);
        INSERT INTO notify_spool(created, kind, node, severity, title, body, targets, status)
            VALUES (0, 'drain', 'n1', 'critical', 'old title', 'old body', '[]', 'sent');""")
    conn.commit()
    conn.close()
    cfg = make_cfg(tmp_path, urls=[hook.url()], state_path=str(path))
    assert emit(cfg, straggler()) == "sent" and emit(cfg, straggler()) == "suppressed"
    assert bodies(hook, 1)[0]["dedup_key"].startswith("gpuguard/node7/")


def test_spooled_resolution_is_retried_with_its_key_and_status(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()])
    cfg.node = replace(cfg.node, name="node7")
    assert emit(cfg, straggler()) == "sent"
    hook.status = 503
    assert emit(cfg, straggler(state="resolved"), budget_s=3) == "spooled"
    hook.status = 200
    import sqlite3

    conn = sqlite3.connect(tmp_path / "state" / "node7.db")
    conn.execute("UPDATE notify_spool SET next_try=0")
    conn.commit()
    conn.close()
    assert flush(cfg) == 1
    retried = bodies(hook, 2)[1]
    assert (retried["status"], retried["type"], retried["dedup_key"]) == \
        ("resolved", "success", "gpuguard/node7/straggler/monitor.gpu_clock/gpu3/job5150")


# --------------------------------------------------------------------------- GPU identity in hardware alerts


def test_gpu_identities_come_from_the_nvml_observation():
    nvml = SimpleNamespace(gpus=[SimpleNamespace(index=3, uuid="GPU-3b1d", serial="1652000000003",
                                                 pci_bus_id="0000:86:00.0"),
                                 SimpleNamespace(index=5, uuid=None, serial=None, pci_bus_id=None)])
    ids = gpu_identities(nvml, [3, None, 7, 3, 5])
    assert ids == [{"index": 3, "uuid": "GPU-3b1d", "serial": "1652000000003", "pci_bus_id": "0000:86:00.0"},
                   {"index": 7}, {"index": 5}]
    _, body = render(Event(kind="drain", node="n1", message="m", gpus=ids))
    assert "gpu:      GPU 3 uuid=GPU-3b1d serial=1652000000003 pci=0000:86:00.0" in body
    assert "gpu:      GPU 7 (not visible to NVML: no UUID/serial)" in body
    assert gpu_identities(None, [1]) == [{"index": 1}]


def test_a_hardware_drain_names_the_gpu_by_uuid_and_serial(tmp_path, hook):
    """A whole prolog run on a simulated node (real nvidia-ml-py over the fake libnvidia-ml.so.1): the drain's
    message carries GPU 5's UUID and serial as NVML reports them. When an admin resumes the node by hand, the
    next health check sees gpuguard's drain is over and resolves its alert (same key)."""
    from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg as sim_cfg

    from simnode import run_sim

    cfg = sim_cfg(tmp_path, notify={"urls": [hook.url("/pages")]})
    slurm = MemorySlurm()
    result = run_sim(ctx("prolog", "n1"), cfg, simulate=str(SCENARIOS / "ecc-dbe.yaml"), slurm_client=slurm)
    assert result.drain and result.drain["outcome"] == "done"
    gpu5 = next(g for g in result.observations.nvml.gpus if g.index == 5)
    assert gpu5.uuid and gpu5.serial
    page = bodies(hook, 1)[0]
    assert page["status"] == "firing" and page["dedup_key"] == "gpuguard/n1/drain"
    assert f"gpu:      GPU 5 uuid={gpu5.uuid} serial={gpu5.serial} pci={gpu5.pci_bus_id}" in page["message"]
    # the node was rebooted (a reboot clears the reset-class Xid 48) and an admin resumed it by hand
    rebooted = tmp_path / "rebooted.yaml"
    rebooted.write_text(yaml.safe_dump({**yaml.safe_load((SCENARIOS / "healthy-p5.yaml").read_text()),
                                        "boot_id": "6f1e2d3c-0000-4000-8000-00000000c0de"}))
    slurm.reason = None  # `scontrol update nodename=n1 state=resume`
    result = run_sim(ctx("healthcheck", "n1"), cfg, simulate=str(rebooted), slurm_client=slurm)
    assert result.undrain and result.undrain["outcome"] == "gone"
    resolved = bodies(hook, 2)[1]
    assert (resolved["status"], resolved["type"], resolved["dedup_key"]) == ("resolved", "success", page["dedup_key"])
    assert "ended outside gpuguard" in resolved["message"]


def test_the_health_checks_undrain_resolves_the_drain(tmp_path, hook):
    from simnode import SCENARIOS, MemorySlurm, ctx, make_cfg as sim_cfg

    from simnode import run_sim

    full = sim_cfg(tmp_path, notify={"urls": [hook.url()]},
                   checks={"sys.disk": {"paths": [{"path": "/", "min_free_gib": 10**7, "root_owned": True}]}})
    slurm = MemorySlurm()
    result = run_sim(ctx("prolog", "n1"), full, simulate=str(SCENARIOS / "healthy-p5.yaml"), slurm_client=slurm)
    assert result.drain and result.drain["outcome"] == "done", result.verdict
    freed = sim_cfg(tmp_path, notify={"urls": [hook.url()]}, undrain={"passes": 2})
    outcomes = [run_sim(ctx("healthcheck", "n1"), freed, simulate=str(SCENARIOS / "healthy-p5.yaml"),
                        slurm_client=slurm).undrain["outcome"] for _ in range(2)]
    assert outcomes == ["wait", "done"]
    drain, undrain = bodies(hook, 2)
    assert (drain["status"], undrain["status"], undrain["type"]) == ("firing", "resolved", "success")
    assert drain["dedup_key"] == undrain["dedup_key"] == "gpuguard/n1/drain"
    assert "RESOLVED undrained n1" in undrain["title"] and "fired:    " in undrain["message"]
    assert "gpu:" not in drain["message"]  # not about a GPU
