"""Starting and stopping the dev cluster's daemons (munged, slurmctld, every slurmd) in sessions of their own,
faults of the controller on demand (stopped, hung, back), and waiting for what they should do."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from devtools.devenv import DevClusterError, which
from devtools.devlayout import ClusterPaths, NodePlacement
from devtools.devnetns import NodeNetworks
from devtools.devprocs import kill_quietly, killpg_quietly, terminate_group


@dataclass
class SlurmDaemons:
    """The daemons of one dev cluster: started from the files under `paths`, where `placement` says, with `environ()`
    (their environment); `ping()` says whether slurmctld answers (a client command). Owns their processes."""

    paths: ClusterPaths
    placement: NodePlacement
    environ: Callable[[], dict[str, str]]
    ping: Callable[[], bool]
    boot_timeout: float = 30.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def node_names(self) -> tuple[str, ...]:
        return self.paths.node_names

    def start_all(self) -> None:
        """munged, slurmctld (answering `scontrol ping`), then every slurmd."""
        self._start_munged()
        self._start_slurmctld()
        for node in self.node_names:
            self._start_slurmd(node)

    def stop_all(self) -> None:
        """Every daemon's process group, slurmd first, munged last."""
        for name in reversed(list(self.procs)):
            terminate_group(self.procs[name])
        self.procs.clear()

    # ---------------------------------------------------------------- daemons

    def _spawn(self, name: str, argv: list[str], log_stem: Path, node: str = "") -> subprocess.Popen[bytes]:
        """Start a daemon in the foreground of its own session (so its whole process group can be killed); a
        node's daemon runs as on that node."""
        with open(log_stem.with_suffix(".stderr"), "ab") as stderr:
            proc = subprocess.Popen(
                self.placement.node_command(node, argv) if node else self.placement.command(argv),
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                env=self.environ(),
                cwd=str(self.paths.base),
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def _start_munged(self) -> None:
        munge = self.paths.munge_dir
        self._spawn(
            "munged",
            [
                which("munged") or "munged",
                "--foreground",
                "--force",  # a reused workdir may hold the stale socket of a killed run; munged would refuse it
                f"--socket={self.paths.munge_socket}",
                f"--key-file={munge}/munge.key",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munged.seed",
            ],
            munge / "munged.log",
        )
        self.wait_for(lambda: self.paths.munge_socket.exists(), "munged socket", timeout=10)

    def _start_slurmctld(self) -> None:
        self._spawn(
            "slurmctld",
            [which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(self.paths.conf_path)],
            self.paths.ctld_dir / "slurmctld.log",
        )
        self.wait_for(
            self.ping,
            "slurmctld to answer `scontrol ping`",
            timeout=self.boot_timeout,
        )

    # ---------------------------------------------------------------- controller faults (gpuguard's own surroundings)

    def stop_controller(self) -> None:
        """slurmctld goes away (a restart or a failover in progress): clients get 'Unable to contact'."""
        proc = self.procs.pop("slurmctld", None)
        if proc is not None:
            terminate_group(proc)

    def start_controller(self) -> None:
        """slurmctld back, recovering its saved state (drains included), answering `scontrol ping`."""
        if "slurmctld" not in self.procs:
            self._start_slurmctld()

    def pause_controller(self) -> None:
        """slurmctld hangs (SIGSTOP): it accepts connections but never answers, so clients wait to their timeout."""
        killpg_quietly(self.procs["slurmctld"].pid, signal.SIGSTOP)

    def resume_controller(self) -> None:
        killpg_quietly(self.procs["slurmctld"].pid, signal.SIGCONT)
        self.wait_for(self.ping,
                       "slurmctld to answer again after SIGCONT", timeout=self.boot_timeout)

    def _start_slurmd(self, node: str) -> None:
        self._spawn(
            node,
            [which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.paths.conf_path)],
            self.paths.node_dir(node) / "slurmd.log",
            node=node,
        )

    # ---------------------------------------------------------------- node faults

    def kill_slurmd(self, node: str) -> None:
        """slurmd dies (SIGKILL); its job steps (slurmstepd, tasks) go on, as after a slurmd crash."""
        proc = self.procs.pop(node, None)
        if proc is not None:
            killpg_quietly(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def power_off(self, node: str) -> None:
        """The node loses power: slurmd and everything running on it die at once, nothing is told. Needs
        per-node namespaces (`devtools.devnetns.NodeNetworks`), where "on it" is well defined."""
        view = self.placement.view
        if not isinstance(view, NodeNetworks):
            raise DevClusterError("power_off needs a cluster with per-node namespaces (NodeNetworks)")
        index = self.placement.index(node)
        view.cut_link(index)  # first: a node without power sends nothing more (no FIN, no RST to its peers)
        self.kill_slurmd(node)
        for _ in range(20):  # a task may fork while we kill: until nothing is left
            pids = view.node_pids(index)
            if not pids:
                return
            for pid in pids:
                kill_quietly(pid, signal.SIGKILL)
            time.sleep(0.05)
        raise DevClusterError(f"processes on {node} survived its power-off: {view.node_pids(index)}")

    def power_on(self, node: str) -> None:
        """The node after `power_off` boots again: its link is back and its slurmd registers."""
        view = self.placement.view
        if not isinstance(view, NodeNetworks):
            raise DevClusterError("power_on needs a cluster with per-node namespaces (NodeNetworks)")
        view.restore_link(self.placement.index(node))
        self.start_slurmd(node)

    def start_slurmd(self, node: str) -> None:
        """slurmd back on `node` (after kill_slurmd or power_off): it registers again."""
        if node not in self.procs:
            self._start_slurmd(node)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise DevClusterError(f"{name} exited with {proc.returncode}\n{self.paths.log_tails()}")

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        """Poll `ready()` with a short, growing interval until true; fail fast if a daemon died. The interval
        reaches 0.25 s, and 1 s once the wait has lasted 5 s (a training job's minute): each poll is an RPC that
        costs slurmctld, munged and the client about 10 ms of CPU."""
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.02
        while not ready_within(ready):
            self.check_alive()
            now = time.monotonic()
            if now > deadline:
                raise DevClusterError(f"timed out after {timeout}s waiting for {what}\n{self.paths.log_tails()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25 if now - start < 5 else 1.0)


def ready_within(ready: Callable[[], bool]) -> bool:
    # A client command that hangs (slurmctld busy or still starting) counts as "not yet", not as an error.
    try:
        return ready()
    except subprocess.TimeoutExpired:
        return False
