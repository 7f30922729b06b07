"""Where a dev cluster's files lie (`ClusterPaths`) and where its processes run (`NodePlacement`): the two plain
collaborators every other part of `devtools.devcluster.DevCluster` is given, never reaching into the cluster."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from devtools.devhost import DebianHostView
from devtools.devnetns import NodeNetworks


@dataclass(frozen=True)
class ClusterPaths:
    """The files of one dev cluster under `base` (the workdir, or a short alias of it: Unix socket paths must fit in
    108 bytes, and slurmstepd puts sockets in SlurmdSpoolDir)."""

    base: Path
    node_names: tuple[str, ...]

    @property
    def etc(self) -> Path:
        return self.base / "etc"

    @property
    def conf_path(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def munge_dir(self) -> Path:
        return self.base / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def ctld_dir(self) -> Path:
        return self.base / "ctld"

    @property
    def jobs_dir(self) -> Path:
        return self.base / "jobs"

    def node_dir(self, node: str) -> Path:
        return self.base / node

    def gpu_device(self, node: str, index: int) -> Path:
        return self.node_dir(node) / "dev" / f"nvidia{index}"

    def logs(self) -> dict[str, Path]:
        """Log file of every daemon: {"munged": ..., "slurmctld": ..., "node1": ..., ...}."""
        # munged in the foreground logs to stderr, which the daemons' spawn captures.
        paths = {"munged": self.munge_dir / "munged.stderr", "slurmctld": self.ctld_dir / "slurmctld.log"}
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

    def prepare(self, gpus_per_node: int) -> None:
        """The directories (munged's socket directory not writable by others, the jobs directory like /tmp) and
        every node's fake GPUs."""
        for sub in (self.etc, self.munge_dir, self.ctld_dir / "state", self.jobs_dir):
            sub.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o755)
        self.jobs_dir.chmod(0o1777)  # jobs may run as other users, like /tmp
        for node in self.node_names:
            (self.node_dir(node) / "spool").mkdir(parents=True, exist_ok=True)
            (self.node_dir(node) / "dev").mkdir(exist_ok=True)
            for index in range(gpus_per_node):
                make_gpu_device(self.gpu_device(node, index), index)


def make_gpu_device(path: Path, index: int) -> None:
    # Major 195 is NVIDIA's; Slurm reads the device numbers for cgroup confinement (not used here), and the
    # numbering makes SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES come out as on a real node.
    if not path.exists():
        os.mknod(path, 0o666 | 0o020000, os.makedev(195, index))


@dataclass(frozen=True)
class NodePlacement:
    """Where the cluster's processes run and at which names and addresses. `view` None: on this host as it is,
    every node at 127.0.0.1 (the default). A DebianHostView: in private namespaces laid out like a stock Debian
    node, each node at its own address. A NodeNetworks: each node's slurmd in network/UTS/mount namespaces of its
    own, on a bridge (devnetns)."""

    node_names: tuple[str, ...]
    view: Optional[DebianHostView | NodeNetworks] = None

    @property
    def hostname(self) -> str:
        """slurmctld's host name."""
        return self.view.hostname if self.view else socket.gethostname().split(".")[0]

    def index(self, node: str) -> int:
        """The node's 1-based index, as the host views number nodes."""
        return self.node_names.index(node) + 1

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as it must run to see this cluster (inside the host view's namespaces, if any)."""
        return self.view.wrap(argv) if self.view else list(argv)

    def node_command(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` as it runs on `node` (as slurmd and its hooks and jobs do there)."""
        return self.view.wrap_node(self.index(node), argv) if self.view else list(argv)

    def node_hostname(self, node: str) -> str:
        """The node's NodeHostname: the host name its processes see."""
        return self.view.node_hostname(self.index(node)) if self.view else self.hostname

    @property
    def controller_addr(self) -> str:
        return self.view.controller_addr if self.view else "127.0.0.1"

    def node_addr(self, node: str) -> str:
        """The node's NodeAddr in slurm.conf."""
        return self.view.node_addr(self.index(node)) if self.view else "127.0.0.1"

