"""`make install` then `make uninstall` into a temporary PREFIX / CONFDIR / STATEDIR: install puts in place what the
hooks and a central history (store.url) need, uninstall removes it and keeps the config and the history unless
PURGE=1 (issue 16)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def _make(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MAKEFLAGS": ""})


@pytest.mark.slow(50)  # a venv and pip install
def test_uninstall_removes_the_install_and_keeps_config_and_history_unless_purged(tmp_path):
    prefix, confdir, statedir = tmp_path / "usr", tmp_path / "etc" / "gpuguard", tmp_path / "var" / "gpuguard"
    where = [f"PREFIX={prefix}", f"CONFDIR={confdir}", f"STATEDIR={statedir}"]
    installed = _make("install", *where[:2])
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    placed = [prefix / "bin" / "gpuguard", prefix / "lib" / "gpuguard" / "current" / "venv",
              prefix / "libexec" / "gpuguard" / "gpuguard-prolog", prefix / "libexec" / "gpuguard" / "gpuguard.env",
              prefix / "share" / "gpuguard" / "sbatch_templates" / "torchrun.sbatch.j2", confdir / "config.yaml"]
    assert all(p.exists() for p in placed), [str(p) for p in placed if not p.exists()]
    # issue 29: the example Alertmanager configuration and the rules' tests are installed beside the rules, and
    # the installed tests pass against the installed rules (runbook links and all)
    obs = prefix / "share" / "gpuguard" / "observability"
    shared = [obs / n for n in ("gpuguard.rules.yml", "gpuguard.rules.test.yml", "alertmanager.yml")]
    assert all(p.is_file() for p in shared), [str(p) for p in shared if not p.is_file()]
    assert "@RUNBOOK_URL@" not in (obs / "gpuguard.rules.test.yml").read_text()
    if shutil.which("promtool"):
        rules = subprocess.run(["promtool", "test", "rules", "gpuguard.rules.test.yml"], cwd=obs, capture_output=True,
                               text=True, timeout=120)
        assert rules.returncode == 0 and "SUCCESS" in rules.stdout, rules.stdout[-2000:] + rules.stderr[-2000:]
    if shutil.which("amtool"):
        am = subprocess.run(["amtool", "check-config", str(obs / "alertmanager.yml")], capture_output=True, text=True,
                            timeout=60)
        assert am.returncode == 0, am.stdout + am.stderr
    # the venv once had no psycopg: `gpuguard fleet init-db` and every ship to store.url failed with "psycopg (3) is
    # not installed". Now it has one with its libpq (the binary or the C build, not the pure-Python fallback).
    venv_python = prefix / "lib" / "gpuguard" / "current" / "venv" / "bin" / "python"
    pq = subprocess.run([str(venv_python), "-c", "import psycopg; print(psycopg.pq.__impl__)"], capture_output=True,
                        text=True, timeout=60)
    assert pq.returncode == 0 and pq.stdout.strip() in ("binary", "c"), pq.stderr
    statedir.mkdir(parents=True)
    (statedir / "state.db").write_bytes(b"history")
    mine = prefix / "bin" / "other-tool"  # not gpuguard's: never touched
    mine.write_text("#!/bin/sh\n")

    out = _make("uninstall", *where)
    assert out.returncode == 0, out.stderr
    assert not any(p.exists() for p in placed[:5]), [str(p) for p in placed[:5] if p.exists()]
    assert (confdir / "config.yaml").exists() and (statedir / "state.db").read_bytes() == b"history"
    assert "kept the config" in out.stdout and mine.exists()

    purged = _make("uninstall", *where, "PURGE=1")
    assert purged.returncode == 0, purged.stderr
    assert not confdir.exists() and not statedir.exists() and mine.exists()


def test_uninstall_refuses_a_root_prefix():
    out = _make("uninstall", "PREFIX=/")
    assert out.returncode != 0 and "refusing" in out.stderr
