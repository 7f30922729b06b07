"""A real multi-node Slurm cluster on this one host, for the demo and the integration tests.

`DevCluster` boots, in a private directory, its own munge daemon (own key and socket; a system munge is never
touched), one `slurmctld` and N `slurmd` (one per fake node, all on this host, each on its own free TCP port) with
fake GPUs (character devices with NVIDIA's major number 195), lets tests drive it with the ordinary client commands,
and kills everything it started on the way out.

    with DevCluster(nodes=3, prolog="/usr/libexec/gpuguard/prolog") as cluster:
        job = cluster.sbatch("#!/bin/sh\\nsrun hostname\\n", "-N2", "--gres=gpu:8")
        assert cluster.wait_job(job)["JobState"] == "COMPLETED"

What Slurm does, measured with this class (the prolog's environment, `scontrol -o` formats, requeue timings):
devtools/SLURM_FACTS.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Mapping, Optional, Sequence

from devtools.devcommands import SlurmCommands
from devtools.devconf import SlurmConfFiles
from devtools.devdaemons import SlurmDaemons
from devtools.devenv import (CLIENTS, DAEMONS, TERMINAL_JOB_STATES, UNUSABLE, DevClusterError, clean_environ,
                             free_tcp_ports, missing_requirements)
from devtools.devhost import DebianHostView
from devtools.devnetns import NodeNetworks
from devtools.devprocs import MARKER_VAR, cluster_processes, kill_quietly, terminate_group

# The cluster's public face (tests, the demo and the benchmark import these from here).
__all__ = ["CLIENTS", "DAEMONS", "MARKER_VAR", "TERMINAL_JOB_STATES", "DevCluster", "DevClusterError",
           "free_tcp_ports", "missing_requirements"]

# A Unix socket path must fit in sockaddr_un.sun_path (108 bytes); slurmstepd puts sockets in SlurmdSpoolDir.
_MAX_BASE_LEN = 60


# --------------------------------------------------------------------------------------------- the cluster


class DevCluster(SlurmConfFiles, SlurmDaemons, SlurmCommands):
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
        self.node_names = [f"node{index}" for index in range(1, nodes + 1)]
        self.gpus_per_node = gpus_per_node
        self.prolog = prolog
        self.epilog = epilog
        self.health_check = health_check
        self.health_check_interval = health_check_interval
        self.prolog_flags = prolog_flags
        self.extra_conf = dict(extra_conf or {})
        self.topology = dict(topology or {})  # leaf switch -> hostlist: a topology.conf and TopologyPlugin=topology/tree
        self.daemon_env_extra = dict(env or {})
        if cred_expire < 5:
            raise ValueError("Slurm 22.05 rejects cred_expire < 5 (and silently uses 120)")
        self.cred_expire = cred_expire
        self.boot_timeout = boot_timeout
        self.command_timeout = command_timeout
        self.cluster_id = uuid.uuid4().hex[:12]
        # None: the daemons run on this host as it is, every node at 127.0.0.1 (the default). A DebianHostView:
        # they run in private namespaces laid out like a stock Debian node, each node at its own address. A
        # NodeNetworks: each node's slurmd in network/UTS/mount namespaces of its own, on a bridge (devnetns).
        self.host_view = host_view
        self.hostname = host_view.hostname if host_view else socket.gethostname().split(".")[0]
        self._own_workdir = workdir is None
        self._keep_workdir = keep_workdir
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gpuguard-devcluster-"))
        self.base = self.workdir  # replaced by a short alias when the workdir path is too long for sockets
        self._alias: Optional[Path] = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._started = False
        self.ctld_port = 0
        self.node_ports: dict[str, int] = {}

    # ---------------------------------------------------------------- paths

    @property
    def conf_path(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket"

    @property
    def jobs_dir(self) -> Path:
        return self.base / "jobs"

    def node_dir(self, node: str) -> Path:
        return self.base / node

    def gpu_device(self, node: str, index: int) -> Path:
        return self.node_dir(node) / "dev" / f"nvidia{index}"

    def logs(self) -> dict[str, Path]:
        """Log file of every daemon: {"munged": ..., "slurmctld": ..., "node1": ..., ...}."""
        # munged in the foreground logs to stderr, which _spawn captures.
        paths = {"munged": self.base / "munge" / "munged.stderr", "slurmctld": self.base / "ctld" / "slurmctld.log"}
        for node in self.node_names:
            paths[node] = self.node_dir(node) / "slurmd.log"
        return paths

    def log_tails(self, lines: int = 30) -> str:
        """The last `lines` lines of every daemon log and its captured stdout/stderr, for failure messages."""
        chunks = []
        for path in self.logs().values():
            for candidate in dict.fromkeys((path, path.with_suffix(".stderr"))):
                if candidate.exists():
                    tail = candidate.read_text(errors="replace").splitlines()[-lines:]
                    chunks.append(f"==> {candidate} <==\n" + "\n".join(tail))
        return "\n".join(chunks)

    def dump_logs(self, lines: int = 30) -> None:
        """Print the log tails to stderr (pytest shows it for a failed test)."""
        print(self.log_tails(lines), file=sys.stderr)

    # ---------------------------------------------------------------- environment for clients

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands (scontrol, sbatch, ...) talking to this cluster."""
        env = clean_environ()
        env["SLURM_CONF"] = str(self.conf_path)
        env[MARKER_VAR] = self.cluster_id
        return env

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as it must run to see this cluster (inside the host view's namespaces, if any)."""
        return self.host_view.wrap(argv) if self.host_view else list(argv)

    def node_command(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` as it runs on `node` (as slurmd and its hooks and jobs do there)."""
        if self.host_view is None:
            return list(argv)
        return self.host_view.wrap_node(self.node_names.index(node) + 1, argv)

    def node_hostname(self, node: str) -> str:
        """The node's NodeHostname: the host name its processes see."""
        if self.host_view is None:
            return self.hostname
        return self.host_view.node_hostname(self.node_names.index(node) + 1)

    @property
    def controller_addr(self) -> str:
        return self.host_view.controller_addr if self.host_view else "127.0.0.1"

    def node_addr(self, node: str) -> str:
        """The node's NodeAddr in slurm.conf."""
        if self.host_view is None:
            return "127.0.0.1"
        return self.host_view.node_addr(self.node_names.index(node) + 1)

    def _daemon_env(self) -> dict[str, str]:
        env = self.env
        env.update(self.daemon_env_extra)
        return env

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
                self.host_view.start(self.base / "etc", len(self.node_names), self.env, names=self.node_names)
            self._write_configs()
            self._start_munged()
            self._start_slurmctld()
            for node in self.node_names:
                self._start_slurmd(node)
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
            for name in reversed(list(self._procs)):  # slurmd first, munged last
                terminate_group(self._procs[name])
            self._procs.clear()
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
        if len(str(self.workdir)) > _MAX_BASE_LEN:
            self._alias = Path(tempfile.mkdtemp(prefix="ggdc-"))
            self._alias.rmdir()
            self._alias.symlink_to(self.workdir)
            self.base = self._alias
        for sub in ("etc", "munge", "ctld/state", "jobs"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        (self.base / "munge").chmod(0o755)
        self.jobs_dir.chmod(0o1777)  # jobs may run as other users, like /tmp
        for node in self.node_names:
            (self.node_dir(node) / "spool").mkdir(parents=True, exist_ok=True)
            (self.node_dir(node) / "dev").mkdir(exist_ok=True)
            for index in range(self.gpus_per_node):
                self._make_gpu_device(self.gpu_device(node, index), index)

    @staticmethod
    def _make_gpu_device(path: Path, index: int) -> None:
        # Major 195 is NVIDIA's; Slurm reads the device numbers for cgroup confinement (not used here), and the
        # numbering makes SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES come out as on a real node.
        if not path.exists():
            os.mknod(path, 0o666 | 0o020000, os.makedev(195, index))
