"""`make install` puts the config in place privately (issue 9): notification URLs in it carry tokens."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from gpuguard.cli.install import install_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "config.yaml"


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_new_config_is_not_world_readable_whatever_the_umask(tmp_path):
    old = os.umask(0o000)
    try:
        msg = install_config(EXAMPLE, tmp_path / "etc" / "gpuguard" / "config.yaml")
    finally:
        os.umask(old)
    dest = tmp_path / "etc" / "gpuguard" / "config.yaml"
    assert _mode(dest) == 0o640 and dest.read_bytes() == EXAMPLE.read_bytes() and "installed" in msg


def test_existing_config_is_kept_and_tightened(tmp_path):
    dest = tmp_path / "config.yaml"
    dest.write_text("notify: {urls: ['slack://T000/B000/XXXX']}\n")
    dest.chmod(0o644)
    msg = install_config(EXAMPLE, dest)
    assert "slack://" in dest.read_text() and _mode(dest) == 0o640 and "removed its permissions" in msg


def test_the_make_install_line_runs(tmp_path):
    """The Makefile calls exactly this (as `make install` would, with CONFDIR=...)."""
    line = next(l for l in (ROOT / "Makefile").read_text().splitlines() if "--install-config" in l)
    assert "--config $(CONFDIR)/config.yaml" in line
    out = subprocess.run([sys.executable, "-m", "gpuguard.cli.install", "--install-config", str(EXAMPLE), "--config",
                          str(tmp_path / "gg" / "config.yaml")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "lib")}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _mode(tmp_path / "gg" / "config.yaml") == 0o640


def test_gpuguard_config_never_prints_secrets(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text('notify: {urls: ["slack://TokenA/TokenB/TokenC/#gpu", "mailtos://u:secretpw@mail.example.com"]}\n'
                   'store: {url: "postgresql://gg:hunter2@db.example.com/gg"}\n')
    out = subprocess.run([sys.executable, "-m", "gpuguard", "config", "--config", str(cfg)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "lib")}, timeout=60)
    assert out.returncode == 0, out.stderr
    for secret in ("TokenA", "TokenB", "secretpw", "hunter2"):
        assert secret not in out.stdout + out.stderr
    assert '"slack://***"' in out.stdout and "postgresql://gg:***@db.example.com/gg" in out.stdout
