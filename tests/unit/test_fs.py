"""atomic_write: readers see the old file or the new one; nothing is left behind on failure."""

import os

import pytest

from gpuguard.util.fs import atomic_write


def test_replaces_with_mode_and_leaves_no_temp(tmp_path):
    p = tmp_path / "sub" / "gpuguard_prolog.prom"
    atomic_write(p, "a 1\n")
    atomic_write(p, b"a 2\n", mode=0o640)
    assert p.read_text() == "a 2\n" and (os.stat(p).st_mode & 0o777) == 0o640
    assert [x.name for x in p.parent.iterdir()] == ["gpuguard_prolog.prom"]


def test_failure_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "f.json"
    atomic_write(p, "{}")
    with pytest.raises(TypeError):
        atomic_write(p, 42)  # type: ignore[arg-type]
    assert p.read_text() == "{}" and [x.name for x in tmp_path.iterdir()] == ["f.json"]


# ------------------------------------------------------------------ issue 29 item 6: root never writes through a user

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from gpuguard.util.trust import Untrusted  # noqa: E402

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                             reason="needs root and setpriv to act as the real user nobody")


def as_nobody(*argv: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv], check=True,
                   capture_output=True, timeout=30)


@pytest.fixture
def user_area():
    """A world-readable area outside pytest's private temp dir, with a directory that belongs to nobody."""
    base = Path(tempfile.mkdtemp(prefix="gg-trust-"))
    base.chmod(0o755)
    home = base / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    try:
        yield base, home
    finally:
        shutil.rmtree(base, ignore_errors=True)


@as_root
def test_root_does_not_write_through_a_users_symlink(user_area):
    base, home = user_area
    target = base / "target"  # where the user wants root's file to land (root's own directory)
    target.mkdir()
    as_nobody("ln", "-s", str(target), str(home / "prom"))  # the user's link: metrics.textfile_dir below it
    with pytest.raises(Untrusted, match="owned by uid 65534"):
        atomic_write(home / "prom" / "gpuguard_node.prom", "x 1\n")
    sticky = base / "tmp"  # the same link in a directory like /tmp, which root may pass through
    sticky.mkdir()
    sticky.chmod(0o1777)
    as_nobody("ln", "-s", str(target), str(sticky / "prom"))
    with pytest.raises(Untrusted, match="symlink owned by uid 65534"):
        atomic_write(sticky / "prom" / "gpuguard_node.prom", "x 1\n")
    assert list(target.iterdir()) == []


@as_root
def test_root_does_not_write_in_a_directory_a_user_may_write(user_area):
    base, home = user_area
    with pytest.raises(Untrusted, match="owned by uid 65534"):
        atomic_write(home / "metrics" / "gpuguard_node.prom", "x 1\n")
    assert not (home / "metrics").exists()
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # group/world-writable without the sticky bit
    with pytest.raises(Untrusted, match="writable by others"):
        atomic_write(shared / "f", "x")


@as_root
def test_root_replaces_a_users_planted_symlink_in_a_sticky_directory_without_following_it(user_area):
    base, _ = user_area
    sticky = base / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    victim = base / "victim"
    victim.write_text("root's data\n")
    as_nobody("ln", "-s", str(victim), str(sticky / "out.json"))
    atomic_write(sticky / "out.json", "{}")
    assert victim.read_text() == "root's data\n"
    assert not (sticky / "out.json").is_symlink() and (sticky / "out.json").read_text() == "{}"
    assert os.stat(sticky / "out.json").st_uid == 0
    with pytest.raises(Untrusted, match="writable by others"):
        atomic_write(sticky / "gpuguard_node.prom", "x 1\n", sticky_ok=False)  # a directory whose every file counts


@as_root
def test_a_user_writes_as_before(user_area):
    _, home = user_area
    code = ("import sys; from gpuguard.util.fs import atomic_write; atomic_write(sys.argv[1], 'ok')")
    as_nobody(sys.executable, "-c", code, str(home / "sub" / "f"))
    assert (home / "sub" / "f").read_text() == "ok"


@as_root
def test_a_refused_log_file_is_said_once_on_stderr(user_area, capsys):
    from gpuguard.util.log import HookLog

    base, home = user_area
    target = base / "root-file.log"
    as_nobody("ln", "-s", str(base), str(home / "logs"))
    log = HookLog(use_syslog=False, path=str(home / "logs" / "root-file.log"), stderr=False)
    log.error("first")
    log.error("second")
    err = capsys.readouterr().err
    assert err.count("logging.file refused") == 1 and "owned by uid 65534" in err, err
    assert not target.exists()


@as_root
def test_config_check_warns_about_paths_root_will_refuse_and_the_cluster_label(user_area):
    import yaml

    base, home = user_area
    as_nobody("ln", "-s", str(base), str(home / "link"))
    sticky = base / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    cfg = {"logging": {"file": str(home / "link" / "gpuguard.log")},
           "metrics": {"textfile_dir": str(sticky)},  # 1777: a user's evil.prom would be served with root's
           "store": {"path": str(base / "state" / "{node}.db")},
           "notify": {"cluster": "clusterB"}}
    path = base / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = subprocess.run([sys.executable, "-m", "gpuguard", "config", "--check", str(path)], capture_output=True,
                       text=True, timeout=60)
    out = p.stdout
    assert p.returncode == 0 and out.rstrip().endswith("valid"), out + p.stderr
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert any("logging.file" in w and "owned by uid 65534" in w for w in warnings), out
    assert any("metrics.textfile_dir" in w and "writable by others" in w for w in warnings), out
    assert not any("store.path" in w for w in warnings), out  # missing, in root's directory: root creates it
    assert any("external_labels" in w and "clusterB" in w for w in warnings), out
