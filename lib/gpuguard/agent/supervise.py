"""`gpuguard watch --agent`: the watch daemon keeps the node agent (gpuguard.agent.server) running beside it.

The agent is a child process rather than a thread of the daemon: it forks one child per hook, which is only safe in
a single-threaded process, and the daemon has threads. A supervising thread starts it with the bare environment
slurmd gives hooks (the agent's children take each hook's own environment anyway), starts it again when it ends (at
once when it could not re-execute itself after its code changed on disk; after RESTART_BACKOFF_S otherwise) and stops
it with the daemon; `--exit-with-parent` ends it if the daemon dies. An agent that refuses to run where it is (a
sandboxed unit: gpuguard.agent.confinement) is not started again: the hooks then run in their own processes, as
they do without an agent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from gpuguard.agent import EXIT_BUSY, EXIT_CODE_CHANGED, EXIT_CONFINED, EXIT_UNSAFE
from gpuguard.util.nodedirs import ENV_STATE_DIR, state_dir

RESTART_BACKOFF_S = 5.0
STOP_WAIT_S = 2.0
HOOK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what the hook scripts set
GIVE_UP = {EXIT_CONFINED: "hooks would not run here as slurmd runs them (a sandboxed unit: use "
                          "gpuguard-watch-agent.service)",
           EXIT_UNSAFE: "its state directory is writable by others", EXIT_BUSY: "another agent serves this node"}


class AgentProcess:
    def __init__(self, log: Any, directory: Optional[str] = None, python: Optional[str] = None) -> None:
        self.log = log
        self.directory = directory or state_dir(os.environ)
        self.python = python or sys.executable
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.starts = 0
        self.given_up: Optional[str] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def command(self) -> list[str]:
        return [self.python, "-I", "-m", "gpuguard.agent.server", "--state-dir", self.directory, "--exit-with-parent"]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="gpuguard-agent", daemon=True)
        self._thread.start()

    def _spawn(self) -> Optional[subprocess.Popen[bytes]]:
        env = {"PATH": os.environ.get("PATH") or HOOK_PATH, ENV_STATE_DIR: self.directory}
        with self._lock:
            if self._stop.is_set():
                return None
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, env=env, cwd="/", close_fds=True)
            self.starts += 1
            return self.proc

    def _supervise(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                proc = self._spawn()
            except OSError as e:
                self.log.error(f"agent: cannot start {self.command()[0]}: {e}")
                proc = None
            if proc is None:
                if self._stop.wait(RESTART_BACKOFF_S):
                    return
                continue
            self.log.info(f"agent: started (pid {proc.pid}) for the hooks of {self.directory}")
            rc = proc.wait()
            if self._stop.is_set():
                return
            if rc in GIVE_UP:
                self.given_up = GIVE_UP[rc]
                self.log.warning(f"agent: not running: {self.given_up}; the hooks run in their own processes")
                return
            self.log.warning(f"agent: exited with {rc}; starting it again")
            if rc != EXIT_CODE_CHANGED and self._stop.wait(max(0.0, RESTART_BACKOFF_S - (time.monotonic() - started))):
                return

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
