"""gpuguard run by a real unprivileged user (issue 29 item 11): the hooks must run as root and say so, loudly, with
a non-zero exit; `gpuguard status` names the permission that failed instead of calling the config broken."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from gpuguard.simulate.build import build_fake_nvml

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "scenarios" / "healthy-p5.yaml"
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to run as the real user nobody")


@pytest.fixture
def site() -> Iterator[Path]:
    """A root-owned site as `make install` leaves it (config 0644 or 0600, state 0755), outside pytest's private
    (0700) temp dir so that nobody can reach it."""
    d = Path(tempfile.mkdtemp(prefix="gg-nonroot-"))
    try:
        d.chmod(0o755)
        for sub in ("state", "run"):
            (d / sub).mkdir(mode=0o755)
        cfg = {"store": {"path": f"{d}/state/{{node}}.db", "runtime_dir": f"{d}/run"},
               "simulation": {"workdir": f"{d}/sim", "fake_nvml": str(build_fake_nvml()), "scenario": str(SCENARIO)},
               "logging": {"syslog": False}, "node": {"name": "n1"}}
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        (d / "config.yaml").chmod(0o644)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_nobody(args: list[str], site: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": "n1", "GPUGUARD_STATE_DIR": str(site / "state"),
           "GPUGUARD_RUNTIME_DIR": str(site / "run")}
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           sys.executable, "-I", *args], env=env, cwd="/", capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("kind", ["healthcheck", "prolog"])
def test_a_hook_run_by_a_user_says_it_must_run_as_root_and_fails(site, kind):
    p = as_nobody(["-m", "gpuguard.cli.hooks", kind, "--config", str(site / "config.yaml")], site)
    assert p.returncode != 0, (p.returncode, p.stdout, p.stderr)
    assert "must run as root" in p.stderr and "uid 65534" in p.stderr, p.stderr
    assert "CONFIG BROKEN" not in p.stdout + p.stderr


def test_status_run_by_a_user_names_the_permission_that_failed(site):
    (site / "config.yaml").chmod(0o600)  # the config may hold notification secrets: root's only
    p = as_nobody(["-m", "gpuguard", "status", "--config", str(site / "config.yaml")], site)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "CONFIG BROKEN" not in out, out
    assert "permission denied" in out.lower() and str(site / "config.yaml") in out and "root" in out, out
