"""Trust boundaries of root's notification state and log file: whatever a user could have put in their way is never
followed or trusted. The attacker steps run as a non-root uid (`setpriv --reuid`), the hooks as root, and every
test that pages ends with the drain notification arriving at a real local HTTP server.

What a user tries: a symlink where root keeps its notification state (or its log file), in a sticky /tmp-like
directory, pointing at a file root would then create or write; making root's state writable to themselves. What
the monitor needs: its own notification state, not root's."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from gpuguard.siteconfig import parse_config
from gpuguard.util.log import HookLog
from gpuguard.notify import Event, Untrusted, emit, flush, open_trusted_dir, user_state_path

pytest.importorskip("apprise", reason="apprise not installed (pip install apprise)")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root (the hooks) and setpriv (the attacker, as another uid)")

ATTACKER = 54321  # no such user needed: setpriv switches to the bare uid/gid


def as_attacker(code: str) -> None:
    """Run `code` (stdlib only) as the unprivileged attacker."""
    p = subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "--",
                        sys.executable, "-I", "-c", textwrap.dedent(code)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


@pytest.fixture
def world():
    """A directory tree the attacker can reach (pytest's tmp dirs are root-only)."""
    base = Path(tempfile.mkdtemp(prefix="gg-trust-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def scratch(world):
    """A sticky, world-writable directory like /tmp (every user can create entries in it)."""
    d = world / "scratch"
    d.mkdir()
    d.chmod(0o1777)
    return d


def root_cfg(tmp_path, hook, **notify):
    data = {"store": {"path": str(tmp_path / "state" / "{node}.db")}, "logging": {"syslog": False},
            "notify": {"urls": [hook.url("/pages")], **notify}}
    return parse_config(yaml.safe_dump(data), source="test")


def drain(node="node7"):
    return Event(kind="drain", node=node, severity="critical", check_id="gpu.xid", action="reboot",
                 message="GPU has fallen off the bus on 0000:86:00",
                 reason="gpuguard: XID79 gpu.xid: GPU has fallen off the bus on 0000:86:00 [prolog reboot]")


def pages(hook, n):
    return [r["body"] for r in hook.wait_for(n)]


# --------------------------------------------------------------------------- root's state


def test_root_never_follows_a_symlink_planted_where_it_keeps_its_state(tmp_path, scratch, hook):
    """notify.state_path in a sticky /tmp-like directory: the user plants `state.db` as a link to a file root
    would create (a cron job, say) and to root's own history store. Root follows neither (without relying on the
    kernel's protected_symlinks); the drain still pages, directly."""
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    created = private / "cron.d-evil"  # does not exist: root must not create it
    as_attacker(f"import os; os.symlink({str(created)!r}, {str(scratch / 'state.db')!r})")
    cfg = root_cfg(tmp_path, hook, state_path=str(scratch / "state.db"))
    assert emit(cfg, drain("n1"), budget_s=5) == "sent"
    assert not created.exists()
    assert "DRAINED n1" in pages(hook, 1)[0]["title"]

    other = private / "other.db"  # root's own database elsewhere: root must not write its tables into it
    sqlite3.connect(other).execute("CREATE TABLE mine (x)").connection.close()
    as_attacker(f"import os; os.symlink({str(other)!r}, {str(scratch / 'other.db')!r})")
    cfg = root_cfg(tmp_path, hook, state_path=str(scratch / "other.db"))
    assert emit(cfg, drain("n2"), budget_s=5) == "sent"
    tables = {r[0] for r in sqlite3.connect(other).execute("SELECT name FROM sqlite_master")}
    assert tables == {"mine"}
    assert flush(cfg) == 0  # nothing flushed through it either


def test_a_sticky_world_writable_state_directory_is_not_used(tmp_path, scratch, hook):
    """Even without a link: SQLite creates its journal and WAL next to the state by name, and a user who can
    create entries there could plant them. Root keeps no state there (and creates nothing there)."""
    cfg = root_cfg(tmp_path, hook, state_path=str(scratch / "state.db"), rate_limit=1)
    assert [emit(cfg, drain(f"n{i}"), budget_s=5) for i in (1, 2)] == ["sent", "sent"]  # no rate limit: direct
    assert list(scratch.iterdir()) == []
    assert [p["title"].split()[2] for p in pages(hook, 2)] == ["n1", "n2"]


def test_a_root_owned_directory_below_a_sticky_one_is_fine(tmp_path, scratch, hook):
    """/tmp/gpuguard (root, 0755) is safe although /tmp is not: nobody else can rename or replace it."""
    cfg = root_cfg(tmp_path, hook, state_path=str(scratch / "gpuguard" / "state.db"), rate_limit=1)
    assert emit(cfg, drain("n1")) == "sent" and emit(cfg, drain("n2")) == "suppressed"  # the limiter works
    st = (scratch / "gpuguard" / "state.db").stat()
    assert st.st_uid == 0 and not st.st_mode & 0o022


def test_a_directory_the_attacker_made_first_or_a_link_they_own_is_refused(tmp_path, scratch, hook):
    as_attacker(f"import os; os.mkdir({str(scratch / 'gpuguard')!r}, 0o755)")  # before root's first run
    cfg = root_cfg(tmp_path, hook, state_path=str(scratch / "gpuguard" / "state.db"), rate_limit=1)
    assert [emit(cfg, drain(f"n{i}"), budget_s=5) for i in (1, 2)] == ["sent", "sent"]  # direct: not trusted
    assert list((scratch / "gpuguard").iterdir()) == []
    mine = tmp_path / "mine"
    mine.mkdir()
    as_attacker(f"import os; os.symlink({str(mine)!r}, {str(scratch / 'link')!r})")
    with pytest.raises(Untrusted, match="symlink owned by uid 54321"):
        os.close(open_trusted_dir(str(scratch / "link")))
    # a link root made (e.g. /var/run -> /run) is followed: nobody else can replace it
    (tmp_path / "rootlink").symlink_to(mine)
    os.close(open_trusted_dir(str(tmp_path / "rootlink")))


def test_the_state_file_made_user_writable_is_not_trusted(tmp_path, hook):
    """Someone who can write root's notification state could fake an open episode or fill the rate limiter:
    root then delivers directly (no de-duplication) rather than trust it."""
    cfg = root_cfg(tmp_path, hook, state_path=str(tmp_path / "state" / "n.db"), rate_limit=1)
    assert emit(cfg, drain("n1")) == "sent"
    db = tmp_path / "state" / "n.db"
    os.chown(db, ATTACKER, ATTACKER)  # e.g. docs that told admins to make the store user-writable
    assert emit(cfg, drain("n2"), budget_s=5) == "sent"  # over the rate limit of 1, yet not held: direct
    os.chown(db, 0, 0)
    db.chmod(0o666)
    assert emit(cfg, drain("n3"), budget_s=5) == "sent"
    assert [p["title"].split()[2] for p in pages(hook, 3)] == ["n1", "n2", "n3"]


# --------------------------------------------------------------------------- root's log file


def test_the_hook_log_is_never_written_through_a_link_or_into_a_users_file(tmp_path, scratch):
    victim = tmp_path / "shadow"
    victim.write_text("root:x:0:0\n")
    as_attacker(f"import os; os.symlink({str(victim)!r}, {str(scratch / 'gpuguard.log')!r})")
    HookLog(use_syslog=False, path=str(scratch / "gpuguard.log"), stderr=False).error("prolog drained node7")
    assert victim.read_text() == "root:x:0:0\n"
    as_attacker(f"open({str(scratch / 'theirs.log')!r}, 'w').write('')")  # a file the user owns
    HookLog(use_syslog=False, path=str(scratch / "theirs.log"), stderr=False).error("prolog drained node7")
    assert (scratch / "theirs.log").read_text() == ""
    HookLog(use_syslog=False, path=str(tmp_path / "gpuguard.log"), stderr=False).error("prolog drained node7")
    assert "prolog drained node7" in (tmp_path / "gpuguard.log").read_text()  # a normal file is written


# --------------------------------------------------------------------------- the monitor has its own state


def test_the_monitor_as_a_user_pages_through_its_own_state(tmp_path, world, hook):
    """`gpuguard monitor` as the job's user (uid 54321): a stalled training log is a hang; the page reaches the
    webhook through the monitor's own state in the job directory. Root's store (0700) is configured but never
    needed."""
    probe = subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "--",
                            sys.executable, "-c", "import gpuguard.notify, apprise"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"this Python cannot run as another uid: {probe.stderr.decode()[-200:]}")
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
        "notify": {"urls": [hook.url("/pages")]},
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
    # a slow machine: delivery outlived the 2 s budget (a loaded one: apprise's import alone can); each later pass
    # flushes the spool, until the page is there
    until = time.monotonic() + 180
    while not (report["fired"] == ["monitor.progress:sent"] or hook.requests) and time.monotonic() < until:
        again = subprocess.run(p.args, capture_output=True, text=True, timeout=120, cwd=str(world))
        assert again.returncode == 0 and json.loads(again.stdout)["fired"] == [], again.stderr  # same episode
    page = pages(hook, 1)[0]
    assert "job hang nodeU monitor.progress" in page["title"] and page["dedup_key"] == "gpuguard/job99/hang"
    state = job_dir / "gpuguard" / "notify" / "nodeU.db"
    assert state.stat().st_uid == ATTACKER and stat.S_IMODE(state.stat().st_mode) == 0o600
    assert list(store.iterdir()) == []  # root's state untouched


def test_user_state_path_template(tmp_path):
    cfg = parse_config(yaml.safe_dump({"notify": {"user_state_path": "/scratch/{uid}/{job_id}-{node}.db"}}))
    assert user_state_path(cfg, "/fsx/job", "42", "gpu/1") == f"/scratch/{os.geteuid()}/42-gpu_1.db"
    default = parse_config("{}")
    assert user_state_path(default, "/fsx/job", "42", "n1") == "/fsx/job/gpuguard/notify/n1.db"
