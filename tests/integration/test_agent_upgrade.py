"""Issue 27 item 6: the node agent noticed no upgrade when gpuguard was installed in a venv (its code stamp left out
everything under the venv), so hooks ran old code through it until its unit was restarted, and nothing said so. Here
gpuguard lives in a venv's site-packages, as `make install` puts it; a file the agent loaded is changed underneath:
the next hook runs the new code, the agent says what changed and re-executes itself with it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from devtools.devsite import DevSite, agent_listening, start_agent, stop_agent
from test_agent import Hook, prolog_env

REPO = Path(__file__).resolve().parents[2]


def venv_with_gpuguard(where: Path) -> tuple[str, Path]:
    """A venv whose site-packages holds a copy of gpuguard and of pynvml (its other dependencies come from the test
    run's own environment through a .pth file); returns its python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120,
                   capture_output=True)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    shutil.copytree(REPO / "lib" / "gpuguard", site / "gpuguard", ignore=shutil.ignore_patterns("__pycache__"))
    import pynvml

    shutil.copy(pynvml.__file__, site / "pynvml.py")
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return str(python), site


def queued_connections(sock: Path) -> int:
    """Connections waiting in the accept queue of the listening Unix socket `sock` (ss's Recv-Q of a listener)."""
    out = subprocess.run(["ss", "-xlH", "src", str(sock)], capture_output=True, text=True, timeout=10).stdout
    return sum(int(line.split()[2]) for line in out.splitlines() if len(line.split()) > 2)


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> None:
    until = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def test_a_changed_file_the_agent_loaded_from_a_venv_is_never_run_old(tmp_path: Path):
    python, site = venv_with_gpuguard(tmp_path / "venv")
    node = DevSite(nodes=1, workdir=tmp_path / "site", python=python, agent=False)
    agent_log = (tmp_path / "agent.log").open("wb")
    agent = start_agent(python, node.workdir / "state", stderr=agent_log)
    try:
        first = Hook(node, "prolog", **prolog_env("600")).wait()
        assert first.code == 0 and "via=agent" in first.err and first.client_pid not in first.ran_in(), first.err
        loaded = subprocess.run([python, "-I", "-c", "import gpuguard.cli.hooks as h; print(h.__file__)"],
                                capture_output=True, text=True, timeout=60).stdout.strip()
        assert loaded.startswith(str(site)), loaded  # the hooks really run the venv's copy

        # an upgrade changes a module the agent has loaded (what `pip install` over a running install does)
        hooks_py = site / "gpuguard" / "cli" / "hooks.py"
        text = hooks_py.read_text()
        assert "verdict={outcome} took=" in text
        # The agent also looks for changes by itself when idle (every second): had it re-executed before this hook
        # came, no agent would listen and the hook, run here, would rightly say nothing. A hook started on a loaded
        # machine takes longer than that to connect, so the agent is held still (SIGSTOP) from the change until the
        # hook's connection is queued on its socket, the event this part is about: an agent asked to run a hook
        # with old code refuses it, and the hook says so.
        sock = node.workdir / "state" / "agent.sock"
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            hooks_py.write_text(text.replace("verdict={outcome} took=", "verdict={outcome} version=new took="))
            pending = Hook(node, "prolog", **prolog_env("601"))
            # the hook waits 0.5 s for the agent's answer once connected: poll its arrival closely
            wait_for(lambda: queued_connections(sock) > 0 or pending.proc.poll() is not None, 90,
                     "the hook to connect to the agent", interval=0.02)
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        second = pending.wait()
        assert second.code == 0 and "version=new" in second.err, second.err  # never the old code
        assert "via=local(agent refused" in second.err, second.err  # the fallback says why (issue 30 item 5)

        def said(needle: str) -> bool:
            return needle in (tmp_path / "agent.log").read_text(errors="replace")

        wait_for(lambda: said(f"changed on disk since the agent started ({hooks_py})") and said("re-executing"),
                 15, "the agent's log line")
        wait_for(lambda: agent_listening(node.workdir / "state" / "agent.sock"), 30, "the agent to listen again")
        assert agent.poll() is None  # the same process, re-executed: its supervisor sees no change
        third = Hook(node, "prolog", **prolog_env("602")).wait()
        assert third.code == 0 and "via=agent" in third.err and "version=new" in third.err, third.err

        # a dependency loaded from the venv's site-packages (pynvml) counts too
        with (site / "pynvml.py").open("a") as f:
            f.write("\n# patched\n")
        wait_for(lambda: said(f"changed on disk since the agent started ({site / 'pynvml.py'})"), 15,
                 "the agent to notice pynvml.py")
        wait_for(lambda: agent_listening(node.workdir / "state" / "agent.sock"), 30, "the agent to listen again")
        fourth = Hook(node, "prolog", **prolog_env("603")).wait()
        assert fourth.code == 0 and "via=agent" in fourth.err, fourth.err
    finally:
        stop_agent(agent)
        agent_log.close()
    assert [r["job_id"] for r in node.runs("node1", "prolog")].count("601") == 1  # refused, then run once
