"""Issue 27 item 7: `make install` over a running install. It rewrote gpuguard.env, dropping a site's
GPUGUARD_STATE_DIR / GPUGUARD_RUNTIME_DIR lines (the hooks silently switched journal, last-good copy and agent socket),
and pip replaced the package in place: 1 of 77 prologs during an install died with ModuleNotFoundError, which Slurm
answers with a "Prolog error" drain. Here prologs run back to back as slurmd runs them (the installed script, a bare
environment), some through a node agent started from the install, while `make install` runs over the install twice."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from devtools.devsite import DevSite, start_agent, stop_agent

ROOT = Path(__file__).resolve().parents[2]
PAUSE_S = 0.2  # between prologs: a few a second, leaving the CPU to the installs (2 cores)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def make_install(prefix: Path, confdir: Path) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["make", "-C", str(ROOT), "install", f"PREFIX={prefix}", f"CONFDIR={confdir}"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "MAKEFLAGS": ""})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


class PrologLoop:
    """The installed prolog, run back to back the way slurmd runs it; every run that did not pass is kept."""

    def __init__(self, script: Path, env: dict[str, str]) -> None:
        self.script, self.env = script, env
        self.runs = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while not self.stop.is_set():
            job = str(1000 + self.runs)
            p = subprocess.run([str(self.script)], env={**self.env, "SLURM_JOB_ID": job}, capture_output=True,
                               text=True, timeout=120, cwd="/")
            self.runs += 1
            if p.returncode != 0 or "verdict=pass" not in p.stderr or "Traceback" in p.stderr:
                self.failures.append(f"job {job}: exit {p.returncode}: {p.stderr[-1500:]}")
            self.stop.wait(PAUSE_S)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(150)


@pytest.mark.slow(60)  # three installs (a fresh venv, then two seeded from the one in use)
def test_make_install_over_a_running_install_fails_no_prolog_and_keeps_the_sites_env(tmp_path: Path):
    prefix, confdir = tmp_path / "usr", tmp_path / "etc"
    site = DevSite(nodes=1, workdir=tmp_path / "site", agent=False)  # the simulated node and its config
    confdir.mkdir()
    shutil.copy(site.config_path, confdir / "config.yaml")  # the site's config: `make install` never overwrites it
    make_install(prefix, confdir)
    libexec, root = prefix / "libexec" / "gpuguard", prefix / "lib" / "gpuguard"
    env_file = libexec / "gpuguard.env"
    state, run = tmp_path / "state", tmp_path / "run"
    site_lines = [f"GPUGUARD_STATE_DIR={state}", f"GPUGUARD_RUNTIME_DIR={run}", "# the site's own note",
                  "GPUGUARD_SITE_MARK=1"]
    env_file.write_text(env_file.read_text() + "\n".join(site_lines) + "\n")
    first = (root / "current").resolve()

    python = str(root / "current" / "venv" / "bin" / "python")  # what the watch unit runs: through `current`
    agent_log = (tmp_path / "agent.log").open("wb")
    agent = start_agent(python, state, stderr=agent_log)
    hook_env = {**site.hook_env("node1", "prolog"), "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "SLURM_JOB_USER": "root",
                "SLURM_JOB_UID": "0"}
    loop = PrologLoop(libexec / "gpuguard-prolog", hook_env)
    try:
        until = time.monotonic() + 60
        while loop.runs < 2 and time.monotonic() < until:  # prologs pass on the running install
            time.sleep(0.1)
        before = loop.runs
        make_install(prefix, confdir)
        second = (root / "current").resolve()
        make_install(prefix, confdir)
        third = (root / "current").resolve()
        time.sleep(2.0)  # a few prologs on the last version
    finally:
        loop.finish()
        stop_agent(agent)
        agent_log.close()

    assert loop.failures == [], f"{len(loop.failures)} of {loop.runs} prologs failed: {loop.failures[:3]}"
    assert before >= 2 and loop.runs >= before + 10, (before, loop.runs)
    text = env_file.read_text()
    assert all(line in text.splitlines() for line in site_lines), text  # the site's lines survive, as they were
    assert f"GPUGUARD_PYTHON={python}" in text and text.count("GPUGUARD_PYTHON=") == 1
    assert len({first, second, third}) == 3
    # the one before is kept for rollback, older ones go
    assert sorted(p.name for p in (root / "versions").iterdir()) == sorted([second.name, third.name])
    assert (root / "previous").resolve() == second
    # the agent took each new version up by itself
    log = (tmp_path / "agent.log").read_text(errors="replace")
    assert log.count("re-executing") >= 2, log
    assert "gpuguard now resolves to" in log, log
    assert site.log_lines("via=agent"), "no prolog ran through the agent"
