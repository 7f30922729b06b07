"""A real multi-node Slurm cluster on this one host, for the demo and the integration tests.

`DevCluster` boots, in a private directory, its own munge daemon (own key and socket; a system munge is never
touched), one `slurmctld` and N `slurmd` (one per fake node, all on this host, each on its own free TCP port) with
fake GPUs (character devices with NVIDIA's major number 195), lets tests drive it with the ordinary client commands,
and kills everything it started on the way out.

    with DevCluster(nodes=3, prolog="/usr/libexec/gpuguard/prolog") as cluster:
        job = cluster.sbatch("#!/bin/sh\\nsrun hostname\\n", "-N2", "--gres=gpu:8")
        assert cluster.wait_job(job)["JobState"] == "COMPLETED"

The cluster is made of plain collaborators, each given what it needs and nothing else: `ClusterPaths` (its files),
`NodePlacement` (where its processes run: devhost, devnetns), `SlurmConfFiles` (slurm.conf, gres.conf, the munge
key), `SlurmDaemons` (munged, slurmctld, the slurmds, their faults) and `SlurmCommands` (sbatch, scontrol, waiting
on what they report). `DevCluster` builds them, runs the lifecycle and keeps the one face callers use.

What Slurm does, measured with this class (the prolog's environment, `scontrol -o` formats, requeue timings):
devtools/SLURM_FACTS.md.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from devtools.devcommands import SlurmCommands
from devtools.devconf import SlurmConfFiles
from devtools.devdaemons import SlurmDaemons
from devtools.devenv import (CLIENTS, DAEMONS, TERMINAL_JOB_STATES, UNUSABLE, DevClusterError, clean_environ,
                             free_tcp_ports, missing_requirements)
from devtools.devhost import DebianHostView
from devtools.devlayout import ClusterPaths, NodePlacement
from devtools.devnetns import NodeNetworks
from devtools.devprocs import MARKER_VAR, cluster_processes, kill_quietly

# The cluster's public face (tests, the demo and the benchmark import these from here).
__all__ = ["CLIENTS", "DAEMONS", "MARKER_VAR", "TERMINAL_JOB_STATES", "DevCluster", "DevClusterError",
           "free_tcp_ports", "missing_requirements"]

# A Unix socket path must fit in sockaddr_un.sun_path (108 bytes); slurmstepd puts sockets in SlurmdSpoolDir.
_MAX_BASE_LEN = 60


# --------------------------------------------------------------------------------------------- the cluster


class DevCluster:
    """munged + slurmctld + `nodes` slurmd on this host, in a private directory. Use as a context manager."""

    def __init__(
        self,
        nodes: int = 3,
        gpus_per_node: int = 8,
        prolog: Optional[str] = None,
        epilog: Optional[str] = None,
        health_check: Optional[str] = None,
        health_check_interval: int = 0,
        prolog_flags: Optional[str] = "Alloc",
        extra_conf: Optional[Mapping[str, str]] = None,
        workdir: Optional[Path] = None,
        env: Optional[Mapping[str, str]] = None,
        cred_expire: int = 5,
        boot_timeout: float = 30.0,
        command_timeout: float = 20.0,
        keep_workdir: bool = False,
        host_view: Optional[DebianHostView | NodeNetworks] = None,
        topology: Optional[Mapping[str, str]] = None,
    ) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        if cred_expire < 5:
            raise ValueError("Slurm 22.05 rejects cred_expire < 5 (and silently uses 120)")
        self.node_names = [f"node{index}" for index in range(1, nodes + 1)]
        self.gpus_per_node = gpus_per_node
        self.daemon_env_extra = dict(env or {})
        self.cluster_id = uuid.uuid4().hex[:12]
        # None: the daemons run on this host as it is. A DebianHostView or a NodeNetworks: see NodePlacement.
        self.host_view = host_view
        self._own_workdir = workdir is None
        self._keep_workdir = keep_workdir
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gpuguard-devcluster-"))
        # a short alias (a symlink made by start()) when the workdir path is too long for sockets
        self._alias: Optional[Path] = None
        if len(str(self.workdir)) > _MAX_BASE_LEN:
            self._alias = Path(tempfile.gettempdir()) / f"ggdc-{self.cluster_id}"
        self._started = False
        names = tuple(self.node_names)
        self.paths = ClusterPaths(self._alias or self.workdir, names)
        self.placement = NodePlacement(names, host_view)
        self.conf = SlurmConfFiles(
            self.paths, self.placement, gpus_per_node=gpus_per_node, cred_expire=cred_expire, prolog=prolog,
            epilog=epilog, prolog_flags=prolog_flags, health_check=health_check,
            health_check_interval=health_check_interval, extra_conf=dict(extra_conf or {}),
            topology=dict(topology or {}))  # leaf switch -> hostlist: a topology.conf and TopologyPlugin=topology/tree
        self.daemons = SlurmDaemons(self.paths, self.placement, environ=self._daemon_env, ping=self._ping,
                                    boot_timeout=boot_timeout)
        self.client = SlurmCommands(self.placement, environ=lambda: self.env, jobs_dir=self.paths.jobs_dir,
                                    wait_for=self.daemons.wait_for, command_timeout=command_timeout)
        self.boot_timeout = boot_timeout

    # ---------------------------------------------------------------- paths (ClusterPaths)

    @property
    def base(self) -> Path:
        """The workdir, or its short alias when the workdir path is too long for sockets."""
        return self.paths.base

    @property
    def conf_path(self) -> Path:
        return self.paths.conf_path

    @property
    def munge_socket(self) -> Path:
        return self.paths.munge_socket

    @property
    def jobs_dir(self) -> Path:
        return self.paths.jobs_dir

    def node_dir(self, node: str) -> Path:
        return self.paths.node_dir(node)

    def gpu_device(self, node: str, index: int) -> Path:
        return self.paths.gpu_device(node, index)

    def logs(self) -> dict[str, Path]:
        """Log file of every daemon: {"munged": ..., "slurmctld": ..., "node1": ..., ...}."""
        return self.paths.logs()

    def log_tails(self, lines: int = 30) -> str:
        """The last `lines` lines of every daemon log and its captured stdout/stderr, for failure messages."""
        return self.paths.log_tails(lines)

    def dump_logs(self, lines: int = 30) -> None:
        """Print the log tails to stderr (pytest shows it for a failed test)."""
        print(self.log_tails(lines), file=sys.stderr)

    # ---------------------------------------------------------------- the configuration (SlurmConfFiles)

    @property
    def ctld_port(self) -> int:
        return self.conf.ctld_port

    @property
    def node_ports(self) -> dict[str, int]:
        return self.conf.node_ports

    def render_slurm_conf(self) -> str:
        return self.conf.render_slurm_conf()

    def render_gres_conf(self) -> str:
        return self.conf.render_gres_conf()

    # ---------------------------------------------------------------- where things run (NodePlacement)

    @property
    def hostname(self) -> str:
        return self.placement.hostname

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands (scontrol, sbatch, ...) talking to this cluster."""
        env = clean_environ()
        env["SLURM_CONF"] = str(self.conf_path)
        env[MARKER_VAR] = self.cluster_id
        return env

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as it must run to see this cluster (inside the host view's namespaces, if any)."""
        return self.placement.command(argv)

    def node_command(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` as it runs on `node` (as slurmd and its hooks and jobs do there)."""
        return self.placement.node_command(node, argv)

    def node_hostname(self, node: str) -> str:
        """The node's NodeHostname: the host name its processes see."""
        return self.placement.node_hostname(node)

    @property
    def controller_addr(self) -> str:
        return self.placement.controller_addr

    def node_addr(self, node: str) -> str:
        """The node's NodeAddr in slurm.conf."""
        return self.placement.node_addr(node)

    def _daemon_env(self) -> dict[str, str]:
        env = self.env
        env.update(self.daemon_env_extra)
        return env

    def _ping(self) -> bool:
        return self.client.run(["scontrol", "ping"], timeout=5).returncode == 0

    # ---------------------------------------------------------------- client commands (SlurmCommands)

    def run(self, cmd: Sequence[str], timeout: Optional[float] = None, check: bool = False,
            input: Optional[str] = None) -> subprocess.CompletedProcess[str]:
        """Run a client command against this cluster (its SLURM_CONF, our munge socket via slurm.conf)."""
        return self.client.run(cmd, timeout=timeout, check=check, input=input)

    def sbatch(self, script_text: str, *args: str) -> str:
        """Submit `script_text` as a batch script (options in `args`, before the script); returns the job id.
        Output goes to `jobs/slurm-<id>.out` unless `args` says otherwise."""
        return self.client.sbatch(script_text, *args)

    def job_output(self, job_id: str) -> str:
        return self.client.job_output(job_id)

    def job_info(self, job_id: str) -> dict[str, str]:
        return self.client.job_info(job_id)

    def wait_job(self, job_id: str, states: Iterable[str] = TERMINAL_JOB_STATES,
                 timeout: float = 30.0) -> dict[str, str]:
        """Poll until the job's JobState is one of `states`; returns its fields. Raises with logs on timeout."""
        return self.client.wait_job(job_id, states, timeout)

    def node_info(self, name: str) -> dict[str, str]:
        return self.client.node_info(name)

    def nodes_info(self) -> dict[str, dict[str, str]]:
        return self.client.nodes_info()

    def node_flags(self, name: str) -> set[str]:
        return self.client.node_flags(name)

    def wait_nodes(self, predicate: Callable[[set[str]], bool], nodes: Optional[Iterable[str]] = None,
                   timeout: float = 30.0) -> None:
        """Wait until `predicate(state flags)` holds for every node (default: all nodes)."""
        self.client.wait_nodes(predicate, nodes, timeout)

    def drain(self, node: str, reason: str) -> None:
        self.client.drain(node, reason)

    def resume(self, node: str, wait: bool = True, timeout: float = 15.0) -> None:
        """Undrain `node`; with `wait`, return only once it is usable again."""
        self.client.resume(node, wait, timeout)

    # ---------------------------------------------------------------- faults (SlurmDaemons)

    def stop_controller(self) -> None:
        """slurmctld goes away (a restart or a failover in progress): clients get 'Unable to contact'."""
        self.daemons.stop_controller()

    def start_controller(self) -> None:
        """slurmctld back, recovering its saved state (drains included), answering `scontrol ping`."""
        self.daemons.start_controller()

    def pause_controller(self) -> None:
        """slurmctld hangs (SIGSTOP): it accepts connections but never answers, so clients wait to their timeout."""
        self.daemons.pause_controller()

    def resume_controller(self) -> None:
        self.daemons.resume_controller()

    def kill_slurmd(self, node: str) -> None:
        """slurmd dies (SIGKILL); its job steps (slurmstepd, tasks) go on, as after a slurmd crash."""
        self.daemons.kill_slurmd(node)

    def start_slurmd(self, node: str) -> None:
        """slurmd back on `node` (after kill_slurmd or power_off): it registers again."""
        self.daemons.start_slurmd(node)

    def power_off(self, node: str) -> None:
        """The node loses power: slurmd and everything running on it die at once (needs NodeNetworks)."""
        self.daemons.power_off(node)

    def power_on(self, node: str) -> None:
        """The node after `power_off` boots again: its link is back and its slurmd registers."""
        self.daemons.power_on(node)

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "DevCluster":
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Keep a temp dir after a failure so its logs can be read.
        self.stop(keep_workdir=self._keep_workdir or exc_type is not None)

    def start(self) -> "DevCluster":
        if self._started:
            raise DevClusterError("cluster already started")
        self._started = True
        try:
            self._prepare_dirs()
            if self.host_view is not None:  # first: slurm.conf names the addresses it chose
                self.host_view.start(self.paths.etc, len(self.node_names), self.env, names=self.node_names)
            self.conf.write()
            self.daemons.start_all()
            # registered and answering; a node the HealthCheckProgram drained at start counts as booted
            self.wait_nodes(lambda flags: "IDLE" in flags and not flags & (UNUSABLE - {"DRAIN"}),
                            timeout=self.boot_timeout)
        except BaseException:
            self.stop(keep_workdir=True)
            raise
        return self

    def stop(self, keep_workdir: Optional[bool] = None) -> None:
        """Kill every daemon and everything they spawned; safe to call twice and after a failed start."""
        try:
            self.daemons.stop_all()
            self._kill_stragglers()
        finally:
            if self.host_view is not None:
                self.host_view.stop()
            if self._alias is not None and self._alias.is_symlink():
                self._alias.unlink()
            keep = self._keep_workdir if keep_workdir is None else keep_workdir
            if self._own_workdir and not keep:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def stray_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of live processes that belong to this cluster: those carrying our marker variable
        (daemons, slurmstepd, prologs, jobs) and their descendants (a job run with --export=NONE loses the
        marker). Empty after `stop()`."""
        return cluster_processes(self.cluster_id)

    def _kill_stragglers(self, timeout: float = 5.0) -> None:
        """slurmstepd calls setsid() and is reparented to init, so killing the daemons' process groups misses it
        and the jobs under it: freeze everything that is ours (so nothing forks or escapes meanwhile), then kill."""
        deadline = time.monotonic() + timeout
        while True:
            strays = self.stray_processes()
            if not strays:
                return
            if time.monotonic() > deadline:
                raise DevClusterError(f"processes survived teardown: {strays}")
            frozen: set[int] = set()
            while True:
                new = {pid for pid, _ in self.stray_processes()} - frozen
                if not new:
                    break
                for pid in new:
                    kill_quietly(pid, signal.SIGSTOP)
                frozen |= new
            for pid in frozen:
                kill_quietly(pid, signal.SIGKILL)
            time.sleep(0.05)

    # ---------------------------------------------------------------- setup

    def _prepare_dirs(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory others can write to; others must reach the socket (jobs as users).
        self.workdir.chmod(0o755)
        if self._alias is not None and not self._alias.is_symlink():
            self._alias.symlink_to(self.workdir)
        self.paths.prepare(self.gpus_per_node)
