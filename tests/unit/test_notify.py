"""Notifications through apprise, delivered to REAL local servers (HTTP webhook, Slack-style webhook, SMTP):
content, de-duplication, rate limiting, the spool and retries, the time budget, and zero cost when not
configured. Time is passed explicitly (`now=`): no test waits for a window to pass. (Fleet-wide grouping is
Alertmanager's: test_notify_alertmanager.py.)"""

from __future__ import annotations

import json
from dataclasses import replace
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml

from notify_servers import SmtpServer

from gpuguard.siteconfig import parse_config
from gpuguard.model import Handoff
from gpuguard.notify import Event, compress_hostlist, emit, flush, render

pytest.importorskip("apprise", reason="apprise not installed (pip install apprise)")


def make_cfg(tmp_path, **notify):
    data = {"store": {"path": str(tmp_path / "state" / "{node}.db")}, "notify": notify}
    return parse_config(yaml.safe_dump(data), source="test")


def xid_drain(node="node7", **kw):
    base = dict(kind="drain", node=node, severity="critical", check_id="gpu.xid", action="reboot the node",
                message="GPU has fallen off the bus on 0000:86:00",
                reason="gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [prolog reboot]",
                job_id="4242", evidence={"xid": 79, "pci": "0000:86:00", "gpu": 3})
    base.update(kw)
    return Event(**base)


def spool_rows(tmp_path, node):
    conn = sqlite3.connect(tmp_path / "state" / f"{node}.db")
    try:
        return conn.execute("SELECT status, attempts, title FROM notify_spool ORDER BY id").fetchall()
    finally:
        conn.close()


# --------------------------------------------------------------------------- delivery and content


def test_webhook_email_and_slack_style_receive_node_check_evidence_action(tmp_path, hook, smtp):
    cfg = make_cfg(tmp_path, urls=[hook.url("/gpuguard"), hook.slack_style_url(), smtp.url()])
    assert emit(cfg, xid_drain(), budget_s=10) == "sent"

    posts = hook.wait_for(2)
    generic = next(r for r in posts if r["path"] == "/gpuguard")
    assert generic["type"] == "application/json" and generic["body"]["type"] == "failure"  # critical
    assert "node7" in generic["body"]["title"] and "gpu.xid" in generic["body"]["title"]
    text = generic["body"]["message"]
    assert "node:     node7" in text and "check:    gpu.xid" in text
    assert 'xid=79' in text and 'pci="0000:86:00"' in text  # the evidence
    assert "action:   reboot the node" in text and "job:      4242" in text
    assert "XID79" in text  # the drain reason as admins see it in Slurm

    slack = next(r for r in posts if r["path"].startswith("/hooks/"))
    assert "node7" in slack["body"]["text"] and "gpu.xid" in slack["body"]["text"]

    mail = smtp.wait_for(1)[0]
    headers, body = SmtpServer.text(mail)
    assert mail["to"] == ["<oncall@example.com>"] and "node7" in headers["Subject"]
    assert "evidence: xid=79" in body and "action:   reboot the node" in body
    assert [s for s, *_ in spool_rows(tmp_path, "node7")] == ["sent"]


def test_default_action_when_the_caller_gives_none():
    _, body = render(Event(kind="straggler", node="n1", message="GPU 3 SM clock 1200 MHz vs 1980 MHz"))
    assert "action:   check the GPU's clocks" in body


# --------------------------------------------------------------------------- zero cost when off


def test_not_configured_costs_nothing(tmp_path):
    code = (
        "import sys, yaml\n"
        "from gpuguard.siteconfig import parse_config\n"
        "from gpuguard.notify import Event, emit, flush\n"
        f"cfg = parse_config(yaml.safe_dump({{'store': {{'path': {str(tmp_path / 's.db')!r}}}}}))\n"
        "print(emit(cfg, Event(kind='drain', node='n1', message='x')), flush(cfg))\n"
        "print('apprise' in sys.modules, 'sqlite3' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    assert out == ["disabled", "0", "False", "False"]
    assert not (tmp_path / "s.db").exists()


def test_kind_and_severity_filters(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()], kinds=["drain"], min_severity="warning")
    assert emit(cfg, Event(kind="undrain", node="n1", message="ok", severity="warning")) == "disabled"
    assert emit(cfg, Event(kind="drain", node="n1", message="x", severity="info")) == "disabled"
    assert hook.requests == []


# --------------------------------------------------------------------------- de-duplication and rate limits


def test_repeats_are_suppressed_then_counted(tmp_path, hook):
    """An episode nothing repeated or resolved for dedup_window_s is over (the fallback for alerts that never
    resolve): the next one is sent and says how many repeats the last one folded."""
    cfg = make_cfg(tmp_path, urls=[hook.url()], dedup_window_s=600)
    failure = dict(kind="prolog_failure")
    t0 = 1_800_000_000.0
    assert emit(cfg, xid_drain(**failure), now=t0) == "sent"
    assert [emit(cfg, xid_drain(**failure), now=t0 + i) for i in range(1, 5)] == ["suppressed"] * 4
    # another check on the same node is another key
    assert emit(cfg, xid_drain(check_id="gpu.ecc", **failure), now=t0 + 5) == "sent"
    assert emit(cfg, xid_drain(**failure), now=t0 + 4 + 599) == "suppressed"  # inside the window of the last one
    assert emit(cfg, xid_drain(**failure), now=t0 + 4 + 599 + 601) == "sent"  # 601 s of nothing: a new episode
    last = hook.wait_for(3)[-1]["body"]["message"]
    assert "also happened 5 more time(s)" in last


def test_rate_limit_holds_the_rest_for_one_digest(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()], rate_limit=3, rate_window_s=600, state_path=str(tmp_path / "one.db"))
    t0 = 1_800_000_000.0
    results = [emit(cfg, xid_drain(node=f"node{i:03d}"), now=t0 + i) for i in range(1, 11)]
    assert results == ["sent"] * 3 + ["suppressed"] * 7
    assert len(hook.wait_for(3)) == 3
    assert flush(cfg, now=t0 + 300) == 0  # the window is still full: nothing more goes out yet
    assert flush(cfg, now=t0 + 604) == 1  # the first message is 600 s old: room for the digest
    digest = hook.wait_for(4)[3]["body"]
    assert "7 events on 7 node(s): node[004-010]" in digest["title"]
    assert "drain gpu.xid x7" in digest["message"] and "reboot the node" in digest["message"]
    assert flush(cfg, now=t0 + 1300) == 0  # sent once


# --------------------------------------------------------------------------- spool, retries, budget


def test_undeliverable_is_spooled_and_flushed_later(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()])
    hook.status = 500
    assert emit(cfg, xid_drain(), budget_s=5) == "spooled"
    assert spool_rows(tmp_path, "node7")[0][:2] == ("pending", 1)
    hook.status = 200
    cfg.node = replace(cfg.node, name="node7")  # flush runs on the node whose store holds the spool
    conn = sqlite3.connect(tmp_path / "state" / "node7.db")
    conn.execute("UPDATE notify_spool SET next_try=0")  # skip the back-off
    conn.commit()
    conn.close()
    assert flush(cfg) == 1
    assert "node7" in hook.wait_for(1)[0]["body"]["title"]
    assert spool_rows(tmp_path, "node7")[0][0] == "sent"


def test_backoff_keeps_failed_messages_for_later(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()])
    cfg.node = replace(cfg.node, name="node7")
    hook.status = 503
    emit(cfg, xid_drain())
    assert flush(cfg) == 0  # not due yet: the back-off is 30 s after the first failure
    assert spool_rows(tmp_path, "node7")[0][:2] == ("pending", 1)


def test_emit_never_exceeds_its_budget(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url()])
    hook.delay_s = 3.0
    t0 = time.monotonic()
    assert emit(cfg, xid_drain(), budget_s=0.5) == "spooled"
    assert time.monotonic() - t0 < 0.9


def test_bad_url_and_unwritable_state_never_raise(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=["not a url at all", "json://127.0.0.1:1/closed-port"])
    assert emit(cfg, xid_drain(), budget_s=3) == "spooled"
    blocked = tmp_path / "file"
    blocked.write_text("")
    cfg2 = make_cfg(tmp_path, urls=["json://127.0.0.1:1/x"], state_path=str(blocked / "sub" / "s.db"))
    assert emit(cfg2, xid_drain(), budget_s=1) == "failed"  # no state to spool into, and nobody listening
    assert flush(cfg2) == 0
    # a state that cannot be used never silences a drain: it goes out directly (no de-duplication, no spool)
    cfg3 = make_cfg(tmp_path, urls=[hook.url("/direct")], state_path=str(blocked / "sub" / "s.db"))
    assert emit(cfg3, xid_drain(), budget_s=5) == "sent"
    assert "XID79" in hook.wait_for(1)[0]["body"]["message"]


def test_config_rejects_bad_values(tmp_path):
    from gpuguard.config.schema import ConfigError

    for bad in ({"urls": "json://x"}, {"rate_limit": 0}, {"min_severity": "loud"}, {"statepath": "/x"},
                {"send_resolved": "yes"}, {"user_state_path": ""}, {"alertmanager_urls": ["am:9093"]},
                {"alertmanager_urls": ["ftp://am:9093"]}, {"alertmanager_urls": ["http://am:port"]},
                {"alertmanager_urls": ["http://am:9093/?x=1"]}, {"alertmanager_resend_s": 0}):
        with pytest.raises(ConfigError, match="notify"):
            make_cfg(tmp_path, **bad)
    # the fleet-wide shared directory is gone: its keys say where grouping went
    for gone in ("shared_dir", "group_threshold", "group_window_s", "trusted_user"):
        with pytest.raises(ConfigError, match=f"notify.{gone}: removed"):
            make_cfg(tmp_path, **{gone: 3})
    # an error quotes no token: apprise URLs are not echoed, an Alertmanager URL has its password masked
    with pytest.raises(ConfigError) as e:
        make_cfg(tmp_path, urls="slack://T0KEN/B0KEN/S3CRET")
    assert "S3CRET" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_cfg(tmp_path, alertmanager_urls=["http://gg:pa/ss?S3CRET@am:port"])
    assert "S3CRET" not in str(e.value) and "***" in str(e.value)
    ok = make_cfg(tmp_path, alertmanager_urls=["http://am1:9093", "https://u:p@am2.example/alertmanager/"])
    assert len(ok.notify.alertmanager_urls) == 2


# --------------------------------------------------------------------------- pure helpers


def test_compress_hostlist():
    assert compress_hostlist(["node001", "node002", "node003", "node005"]) == "node[001-003,005]"
    assert compress_hostlist(["n1"]) == "n1"
    assert compress_hostlist(["b", "a", "gpu-a10", "gpu-a9"]) == "a,b,gpu-a[9-10]"
    assert compress_hostlist(["x01", "x1"]) == "x[1,01]"  # as `scontrol show hostlistsorted x01,x1` prints it
    assert compress_hostlist([f"node{i:03d}" for i in range(95, 102)]) == "node[095-101]"


def test_event_contract_defaults():
    e = Event(kind="hang", node="n1", message="m")
    assert (e.severity, e.check_id, e.action, e.reason, e.job_id, e.evidence) == ("warning", None, None, None, None, {})
    assert abs(e.ts - time.time()) < 5
    assert json.dumps(render(e))


_CHILD = """
import json, sys
from gpuguard.notify.apprise_target import preload, send_apprise
if sys.argv[2] == "preload":
    assert preload()
before = set(sys.modules)
ok, err = send_apprise(sys.argv[1], "DRAINED node7", "gpu.xid", "critical", "gpuguard/node7/drain", "firing", 2)
print(json.dumps([ok, err, sorted(m for m in sys.modules if m.startswith("apprise") and m not in before)]))
"""


@pytest.mark.parametrize("mode", ["preload", "cold"])
def test_after_preload_a_page_costs_only_its_request(hook, mode):
    """The node agent preloads apprise before it forks a child per hook: a child's drain page then loads nothing
    (cold, it imports apprise and its ~270 plugin modules, ~0.5 s of CPU, which on a busy node pushed the page past
    the hook's notification budget into the spool)."""
    p = subprocess.run([sys.executable, "-c", _CHILD, hook.url("/pages"), mode], capture_output=True, text=True,
                       timeout=60)
    ok, err, loaded = json.loads(p.stdout)
    assert (ok, err) == (True, None) and hook.wait_for(1)[0]["body"]["title"] == "DRAINED node7"
    if mode == "preload":
        assert loaded == []
    else:
        assert len(loaded) > 100


def test_the_node_agent_preloads_apprise_before_it_forks():
    code = ("import sys; from gpuguard.agent.server import warm; warm(); "
            "print(sum(m.startswith('apprise.plugins.') for m in sys.modules))")
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and int(p.stdout) > 100, p.stdout + p.stderr


# --------------------------------------------------------------------------- each message leaves once (issue 27)


def _spool_db(tmp_path, node="node7"):
    return sqlite3.connect(tmp_path / "state" / f"{node}.db")


def test_a_hook_only_spools_and_one_flush_sends_it_once_however_many_run_at_once(tmp_path, hook):
    """A hook spools (its process ends right after it: a thread cut off mid-request would be sent again by the
    next flush). Four flushes at once (hand-offs of two hooks, the health check's, the watch daemon's) against a
    receiver that takes a second to answer: the page arrives once."""
    cfg = make_cfg(tmp_path, urls=[hook.url("/pages")])
    cfg.node = replace(cfg.node, name="node7")
    handoff = Handoff()
    assert emit(cfg, xid_drain(), defer=handoff) == "spooled" and handoff.wanted  # the run says: hand it off
    time.sleep(0.3)
    assert hook.requests == []  # nothing left the hook's process
    hook.delay_s = 1.0
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        sent = list(pool.map(lambda _: flush(cfg, budget_s=5), range(4)))
    time.sleep(1.5)  # anything sent twice would have arrived by now
    assert sorted(sent) == [0, 0, 0, 1] and len(hook.requests) == 1, (sent, hook.requests)
    assert spool_rows(tmp_path, "node7")[0][:2] == ("sent", 1)
    assert flush(cfg) == 0 and len(hook.requests) == 1


def test_a_worker_lost_mid_message_is_taken_over_for_the_targets_it_had_not_reached(tmp_path, hook):
    """A delivery process killed between two receivers: its claim dies with it. The next flush sends to the
    receiver it had not reached, and not again to the one it had."""
    cfg = make_cfg(tmp_path, urls=[hook.url("/first"), hook.url("/second")])
    cfg.node = replace(cfg.node, name="node7")
    assert emit(cfg, xid_drain(), defer=Handoff()) == "spooled"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    from gpuguard.notify.claim import process_identity
    from gpuguard.notify.delivery import url_id

    boot = process_identity().split(":")[0]
    with _spool_db(tmp_path) as db:  # what that process had done: claimed the row, reached /first
        db.execute("UPDATE notify_spool SET claimed_by=?, claimed_at=?, targets=?",
                   (f"{boot}:{gone.stdout.strip()}:12345/cafe", time.time(), json.dumps([url_id(hook.url("/second"))])))
    assert flush(cfg) == 1
    assert [r["path"] for r in hook.wait_for(1)] == ["/second"]
    assert spool_rows(tmp_path, "node7")[0][0] == "sent"


def test_a_live_workers_claim_is_respected_until_its_lease_ends(tmp_path, hook):
    cfg = make_cfg(tmp_path, urls=[hook.url("/pages")])
    cfg.node = replace(cfg.node, name="node7")
    t0 = time.time()
    assert emit(cfg, xid_drain(), defer=Handoff(), now=t0) == "spooled"
    from gpuguard.notify.claim import LEASE_S, new_token

    with _spool_db(tmp_path) as db:  # this process (alive) is sending it
        db.execute("UPDATE notify_spool SET claimed_by=?, claimed_at=?", (new_token(), t0))
    assert flush(cfg, now=t0 + 10) == 0 and hook.requests == []
    assert flush(cfg, now=t0 + LEASE_S + 1) == 1  # stuck past every timeout: taken over
    assert len(hook.wait_for(1)) == 1
