"""Issue 9, trust boundaries: `notify.shared_dir` and whatever the user-run monitor writes are never followed
or trusted by root hooks. The attacker steps run as a non-root uid (`setpriv --reuid`), the hooks as root, and
every test ends with the drain notification arriving at a real local HTTP server.

What a user tries: pre-creating group marker files so that the next drain looks like "one more node of a group
already past its threshold" (stay quiet), planting the digest's claim file so that nobody sends the digest,
swapping a directory for a symlink to their own. What the monitor needs: its own notification state, not root's."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from test_notify_servers import WebhookServer

from gpuguard.config import parse_config
from gpuguard.notify import (Event, Untrusted, emit, flush, open_trusted_dir, parse_member, trusted_uids,
                             user_state_path)

pytest.importorskip("apprise", reason="apprise not installed (pip install apprise)")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root (the hooks) and setpriv (the attacker, as another uid)")

ATTACKER = 54321  # no such user needed: setpriv switches to the bare uid/gid
WINDOW = 3600.0  # group windows are fixed buckets: an hour keeps the whole test inside one


def as_attacker(code: str) -> None:
    """Run `code` (stdlib only) as the unprivileged attacker."""
    p = subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "--",
                        sys.executable, "-I", "-c", textwrap.dedent(code)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


@pytest.fixture
def hook():
    s = WebhookServer()
    yield s
    s.close()


@pytest.fixture
def world():
    """A directory tree the attacker can reach (pytest's tmp dirs are root-only)."""
    base = Path(tempfile.mkdtemp(prefix="gg-trust-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def root_cfg(tmp_path, shared, hook, **notify):
    """The hooks' config: root's own store (0700 under pytest's tmp), the shared directory, threshold 3."""
    data = {"store": {"path": str(tmp_path / "state" / "{node}.db")},
            "notify": {"urls": [hook.url("/pages")], "shared_dir": str(shared), "group_threshold": 3,
                       "group_window_s": WINDOW, **notify}}
    return parse_config(yaml.safe_dump(data), source="test")


def drain(node="node7"):
    return Event(kind="drain", node=node, severity="critical", check_id="gpu.xid", action="reboot",
                 message="GPU has fallen off the bus on 0000:86:00",
                 reason="gpuguard: gpu.xid XID79: GPU has fallen off the bus on 0000:86:00 [prolog reboot]")


def plant_markers(groups: str, n: int = 5, window: float = WINDOW) -> str:
    """Attacker code: fake, older markers for the current window of drain/gpu.xid, in the group directory name
    of this version and of the previous one, and a claim on each group's digest."""
    return f"""
        import json, os, time
        bucket = int(time.time() // {window})
        for name in ("drain+gpu.xid+%d" % bucket, "drain__gpu.xid__%d" % bucket):
            gdir = os.path.join({groups!r}, name)
            os.makedirs(gdir, exist_ok=True)
            os.chmod(gdir, 0o755)
            for i in range({n}):
                path = os.path.join(gdir, "fake%d.json" % i)
                with open(path, "w") as f:
                    json.dump({{"node": "fake%d" % i, "kind": "drain", "check_id": "gpu.xid", "severity": "critical",
                               "message": "x", "ts": time.time() - 60}}, f)
                os.utime(path, (time.time() - 60, time.time() - 60))  # "arrived" before any real node
            open(os.path.join(gdir, "digest.claim"), "w").write("attacker\\n")
        """


def pages(hook, n):
    return [r["body"] for r in hook.wait_for(n)]


# --------------------------------------------------------------------------- the attacks


def test_markers_planted_in_a_world_writable_shared_dir_do_not_silence_a_drain(tmp_path, world, hook):
    shared = world / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # a scratch-like directory: every user can create entries in it
    as_attacker(plant_markers(str(shared / "groups")))
    assert (shared / "groups").stat().st_uid == ATTACKER
    cfg = root_cfg(tmp_path, shared, hook)
    assert emit(cfg, drain("node7"), budget_s=5) == "sent"
    page = pages(hook, 1)[0]
    assert "DRAINED node7 gpu.xid" in page["title"] and "XID79" in page["message"]
    # root wrote nothing into a directory others can write
    assert not list(shared.glob("groups/*/node7.json"))


def test_an_attacker_owned_subtree_left_after_the_admin_fixed_the_mode_is_ignored(tmp_path, world, hook):
    shared = world / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    as_attacker(plant_markers(str(shared / "groups")))
    shared.chmod(0o755)  # the admin fixes the top directory; the attacker's groups/ stays
    cfg = root_cfg(tmp_path, shared, hook)
    assert [emit(cfg, drain(f"node{i}"), budget_s=5) for i in range(1, 5)] == ["sent"] * 4
    assert sorted(p["title"].split()[2] for p in pages(hook, 4)) == ["node1", "node2", "node3", "node4"]


def test_attacker_owned_markers_and_claim_in_a_trusted_group_dir_count_for_nothing(tmp_path, world, hook):
    """The admin fixed every directory (root-owned, 0755); the attacker's files inside stay theirs. They push
    nobody over the threshold and claim no digest: the real group (5 nodes, threshold 3) still gets its digest."""
    shared = world / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    window = 8.0
    time.sleep(window - time.time() % window + 0.05)  # the top of a window: all of this happens inside it
    as_attacker(plant_markers(str(shared / "groups"), window=window))
    for d in [shared, *[p for p in shared.rglob("*") if p.is_dir()]]:
        os.chown(d, 0, 0)
        d.chmod(0o755)
    gdir = shared / "groups" / f"drain+gpu.xid+{int(time.time() // window)}"
    assert (gdir / "fake0.json").stat().st_uid == ATTACKER and (gdir / "digest.claim").stat().st_uid == ATTACKER
    cfg = root_cfg(tmp_path, shared, hook, group_window_s=window)
    results = [emit(cfg, drain(f"gpu-r12-{i:03d}"), budget_s=5) for i in range(1, 6)]
    assert results == ["sent", "sent", "sent", "suppressed", "suppressed"]  # only real nodes count
    assert len(pages(hook, 3)) == 3
    time.sleep(window - time.time() % window + 0.05)  # the window closes
    flusher = root_cfg(tmp_path, shared, hook, group_window_s=window, state_path=str(tmp_path / "flusher.db"))
    assert flush(flusher) == 1  # the planted claim is no claim
    digest = pages(hook, 4)[3]
    assert "5 events on 5 node(s): gpu-r12-[001-005]" in digest["title"] and "fake" not in digest["message"]
    assert (gdir / "digest.claim").stat().st_uid == 0  # root's claim replaced the attacker's
    assert flush(flusher) == 0  # sent once


def test_a_symlink_swapped_in_is_never_followed(tmp_path, world, hook):
    shared = world / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    evil = shared / "evil"
    as_attacker(f"""
        import os
        os.makedirs({str(evil)!r}, exist_ok=True)
        os.symlink({str(evil)!r}, {str(shared / "groups")!r})
        """)
    as_attacker(plant_markers(str(evil)))
    shared.chmod(0o755)
    cfg = root_cfg(tmp_path, shared, hook)
    assert emit(cfg, drain("node7"), budget_s=5) == "sent"
    assert "node7" in pages(hook, 1)[0]["title"]
    assert not list(evil.rglob("node7.json"))  # nothing written through the link
    # the shared directory itself given as a link (even root's own) is refused too
    real = world / "real"
    real.mkdir()
    (world / "link").symlink_to(real)
    with pytest.raises(Untrusted, match="symlink"):
        open_trusted_dir(str(world / "link"), {0})


def test_the_state_file_made_user_writable_is_not_trusted(tmp_path, hook):
    """Someone who can write root's notification state could fake an open episode or fill the rate limiter:
    root then delivers directly (no de-duplication) rather than trust it."""
    cfg = parse_config(yaml.safe_dump({"store": {"path": str(tmp_path / "state" / "n.db")},
                                       "notify": {"urls": [hook.url()], "rate_limit": 1}}), source="test")
    assert emit(cfg, drain("n1")) == "sent"
    db = tmp_path / "state" / "n.db"
    os.chown(db, ATTACKER, ATTACKER)  # e.g. docs that told admins to make the store user-writable
    assert emit(cfg, drain("n2"), budget_s=5) == "sent"  # over the rate limit of 1, yet not held: direct
    assert [p["title"].split()[2] for p in pages(hook, 2)] == ["n1", "n2"]


# --------------------------------------------------------------------------- the monitor has its own state


def test_the_monitor_as_a_user_pages_through_its_own_state(tmp_path, world, hook):
    """`gpuguard monitor` as the job's user (uid 54321): a stalled training log is a hang; the page reaches the
    webhook through the monitor's own state in the job directory. Root's store (0700) and shared_dir (root,
    0755) are configured but never needed."""
    probe = subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "--",
                            sys.executable, "-c", "import gpuguard.notify, apprise"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"this Python cannot run as another uid: {probe.stderr.decode()[-200:]}")
    shared = world / "shared"
    shared.mkdir(mode=0o755)
    job_dir = world / "job"
    job_dir.mkdir()
    os.chown(job_dir, ATTACKER, ATTACKER)
    (job_dir / "train.log").write_text("starting\n")
    os.chown(job_dir / "train.log", ATTACKER, ATTACKER)
    store = tmp_path / "rootstate"
    store.mkdir(mode=0o700)
    config = world / "config.yaml"
    config.write_text(yaml.safe_dump({
        "store": {"path": str(store / "{node}.db")},
        "logging": {"syslog": False},
        "notify": {"urls": [hook.url("/pages")], "shared_dir": str(shared)},
        "monitor": {"train_log": str(job_dir / "train.log"), "startup_minutes": 1e-6, "py_spy": None,
                    "cpu_percent_max": None, "memory_percent_max": None, "disk_percent_max": None}}))
    config.chmod(0o644)
    p = subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "--",
                        sys.executable, "-m", "gpuguard", "monitor", "--config", str(config), "--job-dir",
                        str(job_dir), "--node", "nodeU", "--job-id", "99", "--once"],
                       capture_output=True, text=True, timeout=120, cwd=str(world))
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["fired"] in (["monitor.progress:sent"], ["monitor.progress:spooled"]), p.stderr
    if report["fired"] == ["monitor.progress:spooled"]:  # a slow machine: delivery outlived the 2 s budget
        again = subprocess.run(p.args, capture_output=True, text=True, timeout=120, cwd=str(world))
        assert again.returncode == 0 and json.loads(again.stdout)["fired"] == [], again.stderr  # same episode
    page = pages(hook, 1)[0]
    assert "job hang nodeU monitor.progress" in page["title"] and page["dedup_key"] == "gpuguard/job99/hang"
    state = job_dir / "gpuguard" / "notify" / "nodeU.db"
    assert state.stat().st_uid == ATTACKER and stat.S_IMODE(state.stat().st_mode) == 0o600
    assert list(store.iterdir()) == [] and list(shared.iterdir()) == []  # root's state and shared_dir untouched


def test_user_state_path_template(tmp_path):
    cfg = parse_config(yaml.safe_dump({"notify": {"user_state_path": "/scratch/{uid}/{job_id}-{node}.db"}}))
    assert user_state_path(cfg, "/fsx/job", "42", "gpu/1") == f"/scratch/{os.geteuid()}/42-gpu_1.db"
    default = parse_config("{}")
    assert user_state_path(default, "/fsx/job", "42", "n1") == "/fsx/job/gpuguard/notify/n1.db"


# --------------------------------------------------------------------------- member files, strictly


def test_member_files_are_parsed_strictly():
    good = {"node": "n1", "kind": "drain", "check_id": "gpu.xid", "severity": "critical", "message": "m", "ts": 1.0}
    raw = json.dumps(good).encode()
    assert parse_member(raw, "n1.json", "drain", "gpu.xid") == good
    assert parse_member(raw, "n2.json", "drain", "gpu.xid") is None  # names another node than its file
    assert parse_member(raw, "n1.json", "drain", "gpu.ecc") is None  # another group's
    assert parse_member(raw, "n1.json", "drain.resolved", "gpu.xid") is None
    for bad in (b"[1]", b"{", b'{"node": "n1", "node": "n1"}', raw[:-1] + b', "ts": NaN}',
                json.dumps({**good, "ts": "soon"}).encode(), json.dumps({**good, "severity": "loud"}).encode(),
                json.dumps({**good, "reason": 7}).encode(), b"\xff\xfe", b"[" * 100000,
                json.dumps({**good, "message": "x" * 20000}).encode()):
        assert parse_member(bad, "n1.json", "drain", "gpu.xid") is None, bad[:40]
    resolved = json.dumps({**good, "kind": "straggler", "state": "resolved"}).encode()
    assert parse_member(resolved, "n1.json", "straggler.resolved", "gpu.xid")


def test_trusted_user_extends_the_owners_root_accepts(world):
    d = world / "squashed"
    d.mkdir(mode=0o755)
    os.chown(d, 65534, 65534)  # NFS root_squash: root's files appear as nobody
    with pytest.raises(Untrusted, match="owned by uid 65534"):
        open_trusted_dir(str(d), trusted_uids({}))
    os.close(open_trusted_dir(str(d), trusted_uids({"trusted_user": "65534"})))
    d.chmod(0o775)
    with pytest.raises(Untrusted, match="writable by others"):
        open_trusted_dir(str(d), trusted_uids({"trusted_user": "65534"}))
