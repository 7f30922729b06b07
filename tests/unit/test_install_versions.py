"""`make install`'s pieces (issue 27 item 7): gpuguard.env keeps what a site put in it; versions are switched by one
rename of `current`, the previous one is kept for rollback, older ones go unless a process still holds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpuguard.cli.install import install_hooks, merge_env
from gpuguard.cli.versions import held_paths, link_target, main, prunable, seed, switch, version_id


def test_a_sites_lines_in_gpuguard_env_survive_an_install():
    site = ("# written by gpuguard install: settings for the slurmd hooks beside this file\n"
            "GPUGUARD_PYTHON=/usr/local/lib/gpuguard/venv/bin/python\n"
            "GPUGUARD_CONFIG=/site/gpuguard.yaml\n"
            "# two slurmd on this host: their own directories\n"
            "export GPUGUARD_STATE_DIR=/var/lib/gpuguard-n1\n"
            "GPUGUARD_RUNTIME_DIR='/run/gpuguard n1'\n")
    out = merge_env(site, {"GPUGUARD_PYTHON": "/usr/local/lib/gpuguard/current/venv/bin/python"},
                    {"GPUGUARD_CONFIG": "/etc/gpuguard/config.yaml"})
    assert out.splitlines() == ["# written by gpuguard install: settings for the slurmd hooks beside this file",
                                "GPUGUARD_PYTHON=/usr/local/lib/gpuguard/current/venv/bin/python",
                                "GPUGUARD_CONFIG=/site/gpuguard.yaml",  # the site's choice: only set where unset
                                "# two slurmd on this host: their own directories",
                                "export GPUGUARD_STATE_DIR=/var/lib/gpuguard-n1",
                                "GPUGUARD_RUNTIME_DIR='/run/gpuguard n1'"]
    given = merge_env(site, {"GPUGUARD_PYTHON": "/p", "GPUGUARD_CONFIG": "/etc/x.yaml"}, {})
    assert "GPUGUARD_CONFIG=/etc/x.yaml" in given.splitlines()  # CONFDIR= given: it is what the admin asked for
    assert merge_env("", {"GPUGUARD_PYTHON": "/p q"}, {"GPUGUARD_CONFIG": "/c"}).splitlines()[-2:] == [
        "GPUGUARD_PYTHON='/p q'", "GPUGUARD_CONFIG=/c"]
    twice = merge_env("GPUGUARD_PYTHON=/a\nX=1\nGPUGUARD_PYTHON=/b\n", {"GPUGUARD_PYTHON": "/new"}, {})
    assert twice == "GPUGUARD_PYTHON=/new\nX=1\n"


def test_install_hooks_keeps_the_env_file_and_the_hooks_read_it(tmp_path: Path):
    libexec = tmp_path / "libexec"
    install_hooks(libexec, "/old/python", "/etc/gpuguard/config.yaml")
    env = libexec / "gpuguard.env"
    env.write_text(env.read_text() + "GPUGUARD_STATE_DIR=/srv/gg-state\n")
    install_hooks(libexec, sys.executable, "/etc/gpuguard/config.yaml", config_if_unset=True)
    shown = subprocess.run(["sh", "-c", f'. "{env}"; echo "$GPUGUARD_PYTHON|$GPUGUARD_CONFIG|$GPUGUARD_STATE_DIR"'],
                           capture_output=True, text=True, timeout=30).stdout.strip()
    assert shown == f"{sys.executable}|/etc/gpuguard/config.yaml|/srv/gg-state"
    assert not [p for p in libexec.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_version_names_are_unique_and_sort_by_time():
    assert version_id("1.2.0", 0.0, set()) == "1.2.0-19700101T000000Z"
    assert version_id("1.2.0", 0.0, {"1.2.0-19700101T000000Z"}) == "1.2.0-19700101T000000Z.1"
    assert version_id("1.2.0", 59.0, set()) > version_id("1.2.0", 0.0, set())


def _version(root: Path, name: str) -> Path:
    d = root / "versions" / name
    (d / "venv" / "bin").mkdir(parents=True)
    (d / ".complete").write_text("x\n")
    return d


def test_switching_keeps_the_previous_version_and_prunes_older_ones_nobody_holds(tmp_path: Path):
    root = tmp_path / "lib" / "gpuguard"
    (root / "venv" / "bin").mkdir(parents=True)  # an install from before versioned installs
    a, b, c = (_version(root, n) for n in ("a", "b", "c"))
    assert switch(root, a) == root / "venv"
    assert link_target(root, "current") == a.resolve() and os.readlink(root / "current") == "versions/a"
    assert link_target(root, "previous") == (root / "venv").resolve()
    switch(root, b)
    switch(root, c)
    keep = {link_target(root, "current"), link_target(root, "previous")}
    assert keep == {c.resolve(), b.resolve()}
    held = {str(a / "venv" / "lib" / "python3.11" / "site-packages" / "gpuguard")}  # a watch daemon still on `a`
    remove, busy = prunable(root, keep, held)  # type: ignore[arg-type]
    assert remove == [root / "venv"] and busy == [a]
    remove, busy = prunable(root, keep, set())  # type: ignore[arg-type]
    assert sorted(remove) == sorted([a, root / "venv"]) and busy == []


def test_a_gpuguard_process_holds_its_version(tmp_path: Path):
    import gpuguard

    assert gpuguard.__path__[0] in held_paths()  # this very process (gpuguard/__init__.py)


def test_rollback_swaps_current_and_previous(tmp_path: Path):
    root = tmp_path / "gg"
    a, b = _version(root, "a"), _version(root, "b")
    switch(root, a)
    assert main(["--root", str(root), "--rollback"]) == 1  # nothing before `a`
    switch(root, b)
    assert main(["--root", str(root), "--rollback"]) == 0
    assert (link_target(root, "current"), link_target(root, "previous")) == (a.resolve(), b.resolve())


def test_a_seeded_venv_names_its_own_place(tmp_path: Path):
    old = tmp_path / "versions" / "a" / "venv"
    (old / "bin").mkdir(parents=True)
    (old / "bin" / "gpuguard").write_text(f"#!{old}/bin/python\nimport sys\n")
    (old / "bin" / "gpuguard").chmod(0o755)
    (old / "bin" / "python").symlink_to(sys.executable)
    (old / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = /usr/bin/python3 -m venv {old}\n")
    new = tmp_path / "versions" / "b" / "venv"
    seed(old, new)
    assert (new / "bin" / "gpuguard").read_text() == f"#!{new}/bin/python\nimport sys\n"
    assert os.access(new / "bin" / "gpuguard", os.X_OK)
    assert os.readlink(new / "bin" / "python") == sys.executable
    assert str(old) not in (new / "pyvenv.cfg").read_text()
    assert (old / "bin" / "gpuguard").read_text().startswith(f"#!{old}/")  # the one in use is untouched
